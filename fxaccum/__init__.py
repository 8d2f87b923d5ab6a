"""fxaccum: exact, communication-optimal, memory-flat gradient accumulation for JAX."""

from fxaccum import checkpoint, diagnostics
from fxaccum._pipeline import pipeline
from fxaccum.flax import Optimizer, TrainState
from fxaccum.grad import grad, value_and_grad
from fxaccum.sync import Unreduced
from fxaccum.transform import AccumulateState, accumulate, apply_gradients, is_boundary
from fxaccum.weighted import Concat, Sum, Weighted

__version__ = "0.1.0"

__all__ = [
    "AccumulateState",
    "Concat",
    "Optimizer",
    "Sum",
    "TrainState",
    "Unreduced",
    "Weighted",
    "__version__",
    "accumulate",
    "apply_gradients",
    "checkpoint",
    "diagnostics",
    "grad",
    "is_boundary",
    "pipeline",
    "value_and_grad",
]
