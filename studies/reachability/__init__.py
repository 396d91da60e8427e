"""Fixed-point reachability: issue 17's recall variants, the 64-input study (30.3) and its
redesign (39.4).

``run.py`` trains the 64-input runs (``reach_runs.csv``) and, with ``--design redesign``, the
redesign's (``redesign.py`` -> ``reach_redesign.csv``, appended cell by cell); ``analysis.py``
judges issue 17's ``reachability_study.csv``, ``analysis64.py`` the 64-input runs,
``analysis_redesign.py`` the redesign's; ``figures.py`` draws them.
Pre-registration: docs/studies/reachability.md.
"""
