"""A step's statistics, returned where the loss's aux asks for them.

``fxaccum.value_and_grad`` returns what ``jax.value_and_grad`` returns, whatever it is
asked for. What it measures about a step beyond the loss and the gradient (micro-batches
skipped as non-finite, the gradient noise scale) comes back through one channel: a
:class:`Statistics` the loss puts in its aux, which the step's statistics replace.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from fxaccum._noise import NoiseScale

__all__ = ["Statistics", "unavailable_noise_scale"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Statistics:
  """One step's statistics, in the aux where the loss put ``fxaccum.Statistics()``.

  Put ``fxaccum.Statistics()`` anywhere in the aux (``has_aux=True``); each
  micro-batch's loss returns it empty, and the result holds the step's statistics in its
  place. The value, the gradients and the rest of the aux are as without it.

  Attributes:
    skipped: int32, micro-batches dropped as non-finite (``skip_nonfinite=True``; per
      device in the per-device view, summed over the devices); 0 without it.
    noise_scale: the step's :class:`fxaccum.NoiseScale`, from its micro-batch gradients
      (docs/diagnostics.md, "Gradient noise scale"). Its estimates are NaN where the step
      holds none: one micro-batch on one device, a loss returned as ``fxaccum.Sum`` (no
      micro-batch mean), ``fsdp="zero3"`` (each micro-batch's gradient is reduced as the
      backward pass makes it) and ``value_and_unreduced_grad`` (no reduced gradient).

  Example:
    >>> import jax.numpy as jnp, fxaccum
    >>> def loss(w, x):
    ...   return jnp.mean((x * w) ** 2), {"stats": fxaccum.Statistics()}
    >>> x = jnp.array([[1.0], [jnp.nan], [3.0], [2.0]])
    >>> (value, aux), g = fxaccum.value_and_grad(
    ...     loss, has_aux=True, micro_batches=4, skip_nonfinite=True)(jnp.ones(1), x)
    >>> int(aux["stats"].skipped), float(value)   # the NaN row dropped: mean of 1, 9, 4
    (1, 4.666...)
  """

  skipped: Any = None
  noise_scale: Any = None

  @property
  def requested(self) -> bool:
    """Whether this is the loss's request (empty), not a step's statistics."""
    return self.skipped is None and self.noise_scale is None


def unavailable_noise_scale() -> NoiseScale:
  """A :class:`fxaccum.NoiseScale` whose estimates are NaN (no estimate for this step)."""
  nan = jnp.float32(jnp.nan)
  return NoiseScale(nan, nan, nan, nan)
