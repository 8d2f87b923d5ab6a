"""Cross-step accumulation: ``accumulate``, its state, and the gate that applies it.

Owns :func:`accumulate`, :class:`AccumulateState` and the ``lax.cond`` gate
(:mod:`.accumulation`). May import the shared modules (``fxaccum.markers``, ``options``,
``split``, ``meshes``, ``reductions``). Imported by ``fxaccum`` and the integrations (the flax train
states, Orbax checkpoints).
"""

from fxaccum.crossstep.accumulation import (
    AccumulateState,
    accumulate,
    apply_gradients,
    is_boundary,
)

__all__ = ["AccumulateState", "accumulate", "apply_gradients", "is_boundary"]
