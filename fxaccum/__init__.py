"""fxaccum: exact, communication-optimal, memory-flat gradient accumulation for JAX.

The flax and Orbax integrations (``TrainState``, ``Optimizer``, ``DynamicScale``,
``fxaccum.checkpoint``), the pipeline, the planner and ``fxaccum.diagnostics`` load on
first use: ``import fxaccum`` loads neither flax nor Orbax.
"""

import importlib
from typing import TYPE_CHECKING, Any

from fxaccum.crossstep import AccumulateState, accumulate, apply_gradients, is_boundary
from fxaccum.instep import grad, micro_batched, value_and_grad, value_and_unreduced_grad
from fxaccum.markers import Concat, Max, Min, State, Sum, Weighted
from fxaccum.reductions import Unreduced
from fxaccum.split import MicroBatchSize
from fxaccum.statistics import NoiseScale, Statistics

if TYPE_CHECKING:
  from fxaccum import checkpoint, diagnostics
  from fxaccum.integrations.dynamic_scale import DynamicScale
  from fxaccum.integrations.train_states import Optimizer, TrainState
  from fxaccum.pipelining import pipeline
  from fxaccum.planner import Plan, PlanRow, plan_micro_batches

__version__ = "0.1.0"

# Public names loaded when first asked for: those whose module imports flax or Orbax, and
# those a training step does not need (the pipeline, the planner, the diagnostics).
_LAZY = {"checkpoint": ("fxaccum.checkpoint", None),
         "diagnostics": ("fxaccum.diagnostics", None),
         "DynamicScale": ("fxaccum.integrations.dynamic_scale", "DynamicScale"),
         "Optimizer": ("fxaccum.integrations.train_states", "Optimizer"),
         "TrainState": ("fxaccum.integrations.train_states", "TrainState"),
         "pipeline": ("fxaccum.pipelining", "pipeline"),
         "Plan": ("fxaccum.planner", "Plan"),
         "PlanRow": ("fxaccum.planner", "PlanRow"),
         "plan_micro_batches": ("fxaccum.planner", "plan_micro_batches")}


def __getattr__(name: str) -> Any:
  if name not in _LAZY:
    raise AttributeError(f"module 'fxaccum' has no attribute {name!r}")
  module_name, attribute = _LAZY[name]
  module = importlib.import_module(module_name)
  value = module if attribute is None else getattr(module, attribute)
  globals()[name] = value
  return value


def __dir__() -> list[str]:
  return sorted(__all__)


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
    "micro_batched",
    "pipeline",
    "plan_micro_batches",
    "value_and_grad",
    "value_and_unreduced_grad",
]
