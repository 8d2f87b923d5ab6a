"""Options that are gone from fxaccum's entry points, and what says the same now.

One table for every entry point (``value_and_grad`` and its siblings, ``accumulate``): a
removed keyword raises a ``TypeError`` that names its new spelling, and the entry points'
signatures leave out the catch-all that receives it.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

__all__ = ["REMOVED", "check_removed", "public"]

_F = TypeVar("_F", bound=Callable[..., Any])

REMOVED = {
    "micro_batch_size": "micro_batches=fxaccum.MicroBatchSize(m)",
    "fsdp_reduce": "fsdp='zero1' (fsdp_reduce='per_step'), or leave fsdp='auto' to choose",
    "fsdp_gather": "fsdp='zero3' (fsdp_gather='per_micro_batch'), or leave fsdp='auto' to "
                   "choose",
    "bucket_bytes": "nothing: gradient reductions are bucketed at 2 MiB, the size measured "
                    "best (docs/performance.md)",
    "reduce": "fxaccum.value_and_unreduced_grad(...) for reduce=False (its gradients are "
              "fxaccum.Unreduced)",
    "noise_scale": "has_aux=True with fxaccum.Statistics() in the loss's aux: the step's "
                   "statistics replace it, the noise scale in .noise_scale",
    "loss_reduction": "a loss returned as fxaccum.Sum(loss) for loss_reduction='sum' (the "
                      "value and gradients are then its sums over the micro-batches)",
    "accum_dtype": "accumulator_dtype= (optax's spelling, as in optax.MultiSteps)",
}


def check_removed(entry: str, given: Iterable[str]) -> None:
  """Raises a ``TypeError`` naming the new spelling of the first removed option in
  ``given`` (keyword names passed to ``fxaccum.<entry>``)."""
  for name in given:
    if name in REMOVED:
      raise TypeError(f"fxaccum.{entry} no longer takes {name}=; use {REMOVED[name]}.")


def public(fn: _F) -> _F:
  """``fn`` whose signature (``inspect.signature``, ``help``) leaves out ``**removed``, the
  catch-all that names a removed option's new spelling."""
  signature = inspect.signature(fn)
  fn.__signature__ = signature.replace(  # type: ignore[attr-defined]
      parameters=[p for p in signature.parameters.values() if p.name != "removed"])
  return fn
