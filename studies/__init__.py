"""The pre-registered training studies of the seeds' claims (run from a clone; not installed).

The library (``loopprobe``) is the instrument; these studies use it. One folder per study:

    studies/<name>/run.py        its driver: the designs (STUDY, PILOT), the cell function,
                                 ``main(argv)`` (train with ``--cache DIR``; ``--analyze``)
    studies/<name>/analysis.py   its estimator and pre-stated criteria (tested on planted cells)
    studies/<name>/*.csv         its committed cells (and pilots)
    docs/studies/<name>.md       its pre-registration, committed before its results

Shared once: :mod:`studies._common` (paths, command line, held-out batches, the seed-major
cached loop), :mod:`studies.optimum` (the learning-rate optimum and its bootstrap drift),
:mod:`studies.judges` (each study's verdicts) and :mod:`studies.verdicts` (the committed table
``studies/verdicts.csv`` that ``loopprobe report`` shows). ``python -m studies`` regenerates
every table and figure and the verdict table from the committed cells.

Nothing in ``loopprobe`` imports this package.
"""
