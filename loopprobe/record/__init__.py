"""Layer 1, record: find a model's physical sublayers and visits, and record them.

:mod:`.types` (the records: sublayers, visits, recordings; how a model is called),
:mod:`.discover` (which modules are looped, from one forward), :mod:`.session` (the one
place where a visit's parameters are swapped, by forward hooks for one call),
:mod:`.probe` (:class:`~loopprobe.record.probe.Probe` and ``attach``) and
:mod:`.increments` (the residual increment of every visit, for the increment estimators).
Nothing here imports a layer above it.
"""
