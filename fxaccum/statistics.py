"""A step's statistics, and the gradient noise scale from its micro-batch gradients.

``fxaccum.value_and_grad`` returns what ``jax.value_and_grad`` returns, whatever it is
asked for. What it measures about a step beyond the loss and the gradient (micro-batches
skipped as non-finite, the gradient noise scale) comes back through one channel: a
:class:`Statistics` the loss puts in its aux, which the step's statistics replace.

The noise scale:
McCandlish et al. 2018 ("An Empirical Model of Large-Batch Training", App. A.1) estimate
the true gradient's squared norm |𝒢|² and the trace of the per-example gradient
covariance tr Σ from the squared norms of two gradients over batches of different sizes:
``E|G_B|² = |𝒢|² + tr Σ / B``. With gradient accumulation the small batches are the
micro-batches (each device's share of one, per device) and the big one is the step.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

__all__ = ["NOISE_TERMS", "NoiseScale", "NoiseScaleEMA", "Statistics", "asks_statistics",
           "noise_scale_of", "noise_terms", "sq_norm", "takes_noise_scale",
           "unavailable_noise_scale", "with_statistics"]


def _grad_sq(small_sq, big_sq, small_batch, big_batch):
  """|𝒢|² = (B_big |G_big|² - B_small |G_small|²) / (B_big - B_small); NaN for B_big = B_small."""
  gap = big_batch - small_batch
  safe = jnp.where(gap != 0, gap, 1)
  return jnp.where(gap != 0, (big_batch * big_sq - small_batch * small_sq) / safe, jnp.nan)


def _trace_sigma(small_sq, big_sq, small_batch, big_batch):
  """tr Σ = (|G_small|² - |G_big|²) / (1 / B_small - 1 / B_big); NaN for B_big = B_small."""
  gap = big_batch - small_batch
  scale = small_batch * big_batch / jnp.where(gap != 0, gap, 1)
  return jnp.where(gap != 0, (small_sq - big_sq) * scale, jnp.nan)


class NoiseScale(NamedTuple):
  """One step's gradient noise statistics (:class:`fxaccum.Statistics` ``.noise_scale``).

  The two-batch estimator of McCandlish et al. 2018, App. A.1: micro-batch gradients
  ``g_i`` (each the gradient of one micro-batch's mean loss; per device in the per-device
  view) are the small batches, the step's gradient ``G`` the big one. The estimates are
  unbiased but noisy: smooth them over steps with
  :class:`fxaccum.diagnostics.NoiseScaleEMA` before taking their ratio. Where the two
  batch sizes coincide (one micro-batch on one device) the estimates are NaN.

  Attributes:
    small_sq_norm: the mean of ``|g_i|²`` over the micro-batches of nonzero weight.
    big_sq_norm: ``|G|²``.
    small_batch: the batch size the small batches stand for: the harmonic mean of the
      micro-batches' sizes (examples for a scalar loss, the ``Weighted`` weights, e.g.
      tokens, otherwise), since ``E|g_i|² = |𝒢|² + tr Σ / b_i``.
    big_batch: the step's size (all examples, or the summed weight).

  Example:
    >>> import jax.numpy as jnp, fxaccum
    >>> noise = fxaccum.NoiseScale(small_sq_norm=jnp.float32(5.0), big_sq_norm=jnp.float32(2.0),
    ...                            small_batch=jnp.float32(1.0), big_batch=jnp.float32(4.0))
    >>> float(noise.grad_sq), float(noise.trace_sigma), float(noise.b_simple)
    (1.0, 4.0, 4.0)
  """

  small_sq_norm: jax.Array
  big_sq_norm: jax.Array
  small_batch: jax.Array
  big_batch: jax.Array

  @property
  def grad_sq(self) -> jax.Array:
    """The estimate of ``|𝒢|²``, the true gradient's squared norm."""
    return _grad_sq(*self)

  @property
  def trace_sigma(self) -> jax.Array:
    """The estimate of ``tr Σ``, the trace of the per-example gradient covariance (per
    unit of batch size: example or weight)."""
    return _trace_sigma(*self)

  @property
  def b_simple(self) -> jax.Array:
    """The simple noise scale ``tr Σ / |𝒢|²`` from this step alone (noisy)."""
    return self.trace_sigma / self.grad_sq


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class NoiseScaleEMA:
  """Exponential moving averages of ``|𝒢|²`` and ``tr Σ`` over steps, as McCandlish et al.
  advise, with their ratio ``b_simple``: a small pytree for ``jit`` and train states.

  Each estimate is smoothed separately (bias-corrected, as Adam's moments), then divided:
  the ratio of the averages, not the average of the noisy per-step ratios. A step whose
  estimates are not finite (NaN: one micro-batch on one device) leaves the averages as
  they are.

  Attributes:
    decay: the averages' decay per step (static).
    grad_sq_sum: the decayed sum of ``|𝒢|²`` estimates.
    trace_sigma_sum: the decayed sum of ``tr Σ`` estimates.
    weight: the decayed count of steps taken in (``1 - decay ** steps``).

  Example:
    >>> import jax.numpy as jnp, fxaccum
    >>> ema = fxaccum.diagnostics.NoiseScaleEMA(decay=0.9)
    >>> noise = fxaccum.NoiseScale(jnp.float32(5.0), jnp.float32(2.0), jnp.float32(1.0),
    ...                            jnp.float32(4.0))
    >>> ema = ema.update(noise)
    >>> float(ema.grad_sq), float(ema.trace_sigma), float(ema.b_simple)
    (1.0, 4.0, 4.0)
  """

  decay: float = dataclasses.field(default=0.95, metadata={"static": True})
  grad_sq_sum: ArrayLike = dataclasses.field(default_factory=lambda: np.float32(0.0))
  trace_sigma_sum: ArrayLike = dataclasses.field(default_factory=lambda: np.float32(0.0))
  weight: ArrayLike = dataclasses.field(default_factory=lambda: np.float32(0.0))

  def __post_init__(self):
    if isinstance(self.decay, (int, float)) and not 0 <= self.decay < 1:
      raise ValueError(f"NoiseScaleEMA's decay must be in [0, 1), got {self.decay}.")

  def update(self, noise: NoiseScale) -> NoiseScaleEMA:
    """The averages with one more step's :class:`fxaccum.NoiseScale` taken in."""
    grad_sq, trace_sigma = noise.grad_sq, noise.trace_sigma
    finite = jnp.isfinite(grad_sq) & jnp.isfinite(trace_sigma)

    def step(total, value):
      new = self.decay * total + (1 - self.decay) * jnp.where(finite, value, 0)
      return jnp.where(finite, new, total).astype(jnp.float32)

    return dataclasses.replace(self, grad_sq_sum=step(self.grad_sq_sum, grad_sq),
                               trace_sigma_sum=step(self.trace_sigma_sum, trace_sigma),
                               weight=step(self.weight, 1.0))

  def _average(self, total: ArrayLike) -> jax.Array:
    weight = jnp.asarray(self.weight)  # bias-corrected: divided by 1 - decay ** steps
    return jnp.asarray(total) / jnp.where(weight > 0, weight, jnp.nan)

  @property
  def grad_sq(self) -> jax.Array:
    """The smoothed ``|𝒢|²`` (NaN before a finite step)."""
    return self._average(self.grad_sq_sum)

  @property
  def trace_sigma(self) -> jax.Array:
    """The smoothed ``tr Σ`` (NaN before a finite step)."""
    return self._average(self.trace_sigma_sum)

  @property
  def b_simple(self) -> jax.Array:
    """``tr Σ / |𝒢|²`` of the smoothed estimates: the critical batch size estimate, in the
    units of the batch sizes (examples, or the weights, e.g. tokens)."""
    return self.trace_sigma / self.grad_sq


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


# Per small batch i (a micro-batch, per device in the per-device view) of loss weight w_i,
# size b_i and gradient sum g_i (so g_i / w_i is its mean loss's gradient), summed over
# the small batches of nonzero weight.
NOISE_TERMS = ("|g_i / w_i|^2", "count", "1 / b_i", "b_i")


def noise_terms(sq_norm: jax.Array, weight: jax.Array, rows_per_weight: int) -> jax.Array:
  """One small batch's :data:`NOISE_TERMS`, its size its weight times ``rows_per_weight``."""
  w = weight.astype(jnp.float32)
  taken = w != 0  # skipped and all-padding micro-batches are left out
  safe = jnp.where(taken, w, 1)
  size = safe * rows_per_weight
  return jnp.where(taken, jnp.stack([sq_norm / safe**2, 1.0, 1 / size, size]), 0.0)


def sq_norm(tree: Any) -> jax.Array:
  """The squared norm of every leaf of ``tree`` together, in float32."""
  return sum((jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(tree)),
             jnp.float32(0))


def noise_scale_of(terms: jax.Array, grads: Any) -> NoiseScale:
  """The step's :class:`fxaccum.NoiseScale` from its small batches' summed
  :data:`NOISE_TERMS` and its gradient."""
  sq_sum, count, inverse_sum, size_sum = terms
  return NoiseScale(small_sq_norm=sq_sum / count, big_sq_norm=sq_norm(grads),
                    small_batch=count / inverse_sum, big_batch=size_sum)


def with_statistics(aux: Any, skipped: jax.Array, terms: jax.Array | None, grads: Any) -> Any:
  """``aux`` with each :class:`Statistics` request filled with the step's: its
  ``skipped`` count and the noise scale of its summed :data:`NOISE_TERMS` against its
  gradient ``grads`` (NaN where ``terms`` is None: no noise scale for this step)."""
  noise = noise_scale_of(terms, grads) if terms is not None else unavailable_noise_scale()
  filled = Statistics(skipped=skipped, noise_scale=noise)
  return jax.tree.map(lambda m: filled if _is_statistics(m) else m, aux,
                      is_leaf=_is_statistics)


def asks_statistics(aux: Any) -> bool:
  """Whether a loss's ``aux`` holds :class:`Statistics` to fill."""
  return any(map(_is_statistics, jax.tree.leaves(aux, is_leaf=_is_statistics)))


def takes_noise_scale(aux: Any, *, reduced: bool, summed: bool, small_batches: bool) -> bool:
  """Whether a step takes the noise scale: its ``aux`` asks for :class:`Statistics`; each
  micro-batch's gradient, as the loop sees it before any reduction, is a small batch's
  (``small_batches``: each device's share of a micro-batch, or the global micro-batch);
  the loss is a mean, not a ``Sum`` (``summed``); and the step's gradient is
  ``reduced``."""
  return asks_statistics(aux) and small_batches and reduced and not summed


def _is_statistics(x: Any) -> bool:
  return isinstance(x, Statistics)
