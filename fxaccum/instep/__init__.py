"""In-step accumulation: ``value_and_grad`` / ``grad`` / ``value_and_unreduced_grad``.

Owns the entry points (:mod:`.api`), their options checked (:mod:`.configure`), one call
of the function they return (:mod:`.invoke`), the decision, made before anything runs
(:mod:`.decision`, with :mod:`.analysed` and :mod:`.additivity`), the per-device and
global views that run it (:mod:`.views`, the per-device region in :mod:`.region`), one
micro-step (:mod:`.micro_step`), the micro-batch loop (:mod:`.loop`), what one traced
call holds
(:mod:`.call`), how each output is summed (:mod:`.accumulators`), the FSDP strategies
(:mod:`.fsdp`, :mod:`.gather`), the record of the view each call took (:mod:`.paths`),
``micro_batched`` (:mod:`.micro_batched`), a function over micro-batches whose backward
is ``value_and_grad``'s loop, the shared-key warning (:mod:`.keys`) and the one place a
trace of the user's loss may fail (:mod:`.attempts`).

May import: the shared modules (``fxaccum.markers``, ``options``, ``statistics``, ``split``,
``meshes``, ``reductions``, ``jaxprs``), ``fxaccum.analysis``, and
``fxaccum.integrations.nnx_modules`` only where flax NNX is loaded. Imported by
``fxaccum``, the integrations and ``fxaccum.diagnostics`` (the paths).
"""

from fxaccum.instep.api import Options, grad, value_and_grad, value_and_unreduced_grad
from fxaccum.instep.micro_batched import micro_batched

__all__ = ["Options", "grad", "micro_batched", "value_and_grad", "value_and_unreduced_grad"]
