"""fxaccum: exact, communication-optimal, memory-flat gradient accumulation for JAX."""

from fxaccum import checkpoint, diagnostics
from fxaccum._dynamic_scale import DynamicScale
from fxaccum._flax import Optimizer, TrainState
from fxaccum._instep import grad, value_and_grad, value_and_unreduced_grad
from fxaccum._noise import NoiseScale
from fxaccum._pipeline import pipeline
from fxaccum._plan import Plan, PlanRow, plan_micro_batches
from fxaccum._split import MicroBatchSize
from fxaccum._statistics import Statistics
from fxaccum._sync import Unreduced
from fxaccum._transform import AccumulateState, accumulate, apply_gradients, is_boundary
from fxaccum._weighted import Concat, Max, Min, State, Sum, Weighted

__version__ = "0.1.0"

__all__ = [
    "AccumulateState",
    "Concat",
    "DynamicScale",
    "Max",
    "MicroBatchSize",
    "Min",
    "NoiseScale",
    "Optimizer",
    "Plan",
    "PlanRow",
    "State",
    "Statistics",
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
    "plan_micro_batches",
    "value_and_grad",
    "value_and_unreduced_grad",
]
