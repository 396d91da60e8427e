"""DeepLoop vs post-norm and DeepNorm across R, and the p-sweep (issue 30.1).

``run.py`` trains the cells, ``analysis.py`` judges them, ``deeploop_study.csv`` (and the
pilot) are the committed cells; pre-registration: docs/studies/deeploop.md.
"""
