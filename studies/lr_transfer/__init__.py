"""LR transfer across loop count (issue 17): the optimal lr's drift from N = 1 to 8.

``run.py`` trains the cells (runs 1 and 2), ``analysis.py`` judges them, ``figures.py`` draws
them; criteria and results: docs/results/reproductions.md.
"""
