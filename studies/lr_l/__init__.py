"""The optimal learning rate against L and N under Loop-muP (issue 30.2, part 2).

``run.py`` trains the cells, ``analysis.py`` judges them, ``lr_l_pilot.csv`` is the committed
task search; pre-registration: docs/studies/lr_l.md.
"""
