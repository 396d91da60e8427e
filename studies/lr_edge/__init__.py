"""The edge learning rate against N under 1/sqrt(N) and 1/N (issue 30.2).

``run.py`` trains the cells, ``analysis.py`` judges them, ``lr_edge_study.csv`` (and the
pilots) are the committed cells; pre-registration: docs/studies/lr_edge.md.
"""
