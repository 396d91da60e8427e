"""Layer 3, estimate: the theory's quantities, measured, with ``converged`` and ``reason``.

Per visit: :mod:`.updates` (G), :mod:`.sensitivity` (‖U‖), :mod:`.alignment` (κ_j, κ_R,
Gram matrices), :mod:`.bound` (the tied-depth bound and C), :mod:`.increments` and
:mod:`.growth` (forward increment correlation, growth exponent, regime). Per round:
:mod:`.fixedpoint` (fixed point, residuals, ρ, ‖∂T/∂h‖), :mod:`.implicit` (‖dh*/dx‖),
:mod:`.finitestep` (A, Q, α̂), :mod:`.instability` (oscillation and explosion flags).
Fits: :mod:`.scaling_law` and :mod:`.scaling` (the recurrence scaling law). Loop
redundancy (FlashLoop's observations): :mod:`.redundancy`. Every module returns result objects
with tidy frames; plotting is :mod:`loopprobe.plots`, imported on call.
"""
