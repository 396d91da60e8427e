"""The looped transformer vs the Fully Looped Transformer, and instability signals (30.5).

``run.py`` trains the cells, ``analysis.py`` judges them, ``flt_study.csv`` (and the pilot)
are the committed cells; ``redesign.py`` is the redesign's pilot and study (issue 39.6;
cells ``flt_redesign_pilot.csv``); pre-registration: docs/studies/flt.md.
"""
