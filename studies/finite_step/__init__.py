"""Finite-step failures and the quarter step on trained tiny looped models (issue 30.4).

``run.py`` trains, measures and judges (``--analyze``: ``finite_step_verdicts.csv`` from
``finite_step_study.csv.gz``); pre-registration: docs/studies/finite_step.md.
"""
