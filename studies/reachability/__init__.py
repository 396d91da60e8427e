"""Fixed-point reachability: issue 17's recall variants and the 64-input study (30.3).

``run.py`` trains the 64-input runs (``reach_runs.csv``); ``analysis.py`` judges issue 17's
``reachability_study.csv``, ``analysis64.py`` the 64-input runs; ``figures.py`` draws both.
Pre-registration: docs/studies/reachability.md.
"""
