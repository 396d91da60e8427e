"""Layer 2, differentiate: a model as pure functions that torch.func can transform.

:mod:`.jacobian` (F of per-visit offsets, with batched JVPs/VJPs for many operators),
:mod:`.visitfn` (its public face, ``lp.visit_function``) and :mod:`.roundmap` (one round
``T(h, x)`` of a looped model). Every forward runs inside
:func:`loopprobe.autodiff.transform_safe` (fused attention, checkpointing, ops without
forward-mode rules). No dense Jacobian is built anywhere in the package.
"""
