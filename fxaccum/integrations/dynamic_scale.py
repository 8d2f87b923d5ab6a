"""Dynamic loss scaling (flax's ``DynamicScale``, for fp16) over accumulated gradients.

A loss scale guards the gradient of one optimizer step, so it is checked once per step, on
the accumulated gradient, and updated once per step:

* in-step: :class:`DynamicScale`, flax's ``DynamicScale`` whose ``value_and_grad`` takes
  ``micro_batches`` (and fxaccum's other options): every micro-batch's loss is scaled by
  the same factor, the summed gradient is unscaled and checked once;
* cross-step: a ``fxaccum.TrainState`` with a ``dynamic_scale`` field (flax's or this
  one): the gate checks the window's mean gradient once, skips the optimizer step if it
  is not finite, and updates the scale once per window (:func:`updated`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax.training import dynamic_scale as dynamic_scale_lib
from jax import lax

from fxaccum import instep
from fxaccum.markers import Sum, Weighted, all_finite
from fxaccum.reductions import Unreduced
from fxaccum.statistics import Statistics

__all__ = ["DynamicScale", "updated"]


class DynamicScale(dynamic_scale_lib.DynamicScale):
  """flax's ``DynamicScale`` whose ``value_and_grad`` accumulates over micro-batches.

  A drop-in for ``flax.training.dynamic_scale.DynamicScale`` (same fields, same
  defaults): pass ``micro_batches`` (and any option of :func:`fxaccum.value_and_grad`)
  to :meth:`value_and_grad`. Without it, it is flax's own.

  Example:
    >>> import jax.numpy as jnp, fxaccum
    >>> scale = fxaccum.DynamicScale(scale=2.0 ** 10)
    >>> loss = lambda w, x: jnp.mean((x * w) ** 2)
    >>> scale, finite, value, grads = scale.value_and_grad(loss, micro_batches=4)(
    ...     jnp.ones(1), jnp.arange(8.0).reshape(8, 1))
    >>> bool(finite), float(value), grads   # the large batch's, unscaled
    (True, 17.5, Array([35.], dtype=float32))
  """

  def value_and_grad(  # type: ignore[override]
      self,
      fun: Callable[..., Any],
      argnums: int | Sequence[int] = 0,
      has_aux: bool = False,
      axis_name: str | None = None,
      **options: Any,
  ) -> Callable[..., dynamic_scale_lib.DynamicScaleResult]:
    """Like flax's ``DynamicScale.value_and_grad``, over ``micro_batches`` micro-batches.

    Returns a function that returns ``DynamicScaleResult(dynamic_scale, finite, value,
    grads)``: the updated scale, whether the accumulated gradient is finite, the value
    (``(loss, aux)`` with ``has_aux``) and the float32 gradient, both unscaled. With
    ``axis_name`` (a ``pmap`` axis, as in flax) the gradient is averaged over it before
    the check, as flax does.
    """
    if "micro_batches" not in options:
      return super().value_and_grad(fun, argnums, has_aux, axis_name)
    return self._accumulated(instep.value_and_grad, fun, argnums, has_aux, axis_name,
                             options)

  def value_and_unreduced_grad(
      self,
      fun: Callable[..., Any],
      argnums: int | Sequence[int] = 0,
      has_aux: bool = False,
      **options: Any,
  ) -> Callable[..., dynamic_scale_lib.DynamicScaleResult]:
    """:meth:`value_and_grad` over :func:`fxaccum.value_and_unreduced_grad`: the gradient
    comes back as :class:`fxaccum.Unreduced` per-device sums, unscaled (their weights as
    they are), for a cross-step gate with ``accumulate(k, data_axes=...)``."""
    return self._accumulated(instep.value_and_unreduced_grad, fun, argnums, has_aux, None,
                             options)

  def _accumulated(self, entry: Callable[..., Any], fun: Callable[..., Any], argnums: Any,
                   has_aux: bool, axis_name: str | None, options: dict[str, Any]
                   ) -> Callable[..., dynamic_scale_lib.DynamicScaleResult]:
    """``entry`` (an in-step entry point) of ``fun`` with its loss scaled, its results
    unscaled and checked."""
    @functools.wraps(fun)
    def scaled(*args, **kwargs):
      out = fun(*args, **kwargs)
      loss, aux = out if has_aux else (out, None)
      if isinstance(loss, Weighted):
        loss = Weighted(loss.total * self.scale, loss.weight)
      else:
        loss = Sum(loss.value * self.scale) if isinstance(loss, Sum) else loss * self.scale
      return (loss, aux) if has_aux else loss

    grad_fn = entry(scaled, argnums, has_aux, **options)

    def unscaled(value):  # the loss, or (loss, aux) whose Statistics hold scaled norms
      if not has_aux:
        return value / self.scale
      loss, aux = value
      return loss / self.scale, jax.tree.map(self._unscaled_statistics, aux,
                                             is_leaf=lambda x: isinstance(x, Statistics))

    def unscale(g):
      return jnp.asarray(g, jnp.float32) / self.scale

    def scaled_grad_fn(*args, **kwargs):
      value, grads = grad_fn(*args, **kwargs)
      value = unscaled(value)
      if isinstance(grads, Unreduced):  # per-device sums: their weights are not scaled
        grads = dataclasses.replace(grads, total=jax.tree.map(unscale, grads.total))
      else:
        grads = jax.tree.map(unscale, grads)
      if axis_name is not None:  # pmap (flax's convention): the replicas' mean, then checked
        grads = lax.pmean(grads, axis_name)
      finite = all_finite(grads)
      return dynamic_scale_lib.DynamicScaleResult(updated(self, finite), finite, value, grads)

    return scaled_grad_fn

  def _unscaled_statistics(self, x: Any) -> Any:
    """A :class:`fxaccum.Statistics`' noise scale from squared norms of gradients of the
    unscaled loss (other aux leaves as they are)."""
    if not isinstance(x, Statistics):
      return x
    noise = x.noise_scale._replace(small_sq_norm=x.noise_scale.small_sq_norm / self.scale ** 2,
                                   big_sq_norm=x.noise_scale.big_sq_norm / self.scale ** 2)
    return dataclasses.replace(x, noise_scale=noise)


def updated(scale: dynamic_scale_lib.DynamicScale, finite: jax.Array) -> Any:
  """``scale`` after one step whose gradient was ``finite`` (or not): grown after
  ``growth_interval`` finite steps, backed off after a non-finite one; flax's rule."""
  grow = scale.fin_steps == scale.growth_interval
  fin_scale = jnp.where(grow & finite,
                        jnp.minimum(scale.scale * scale.growth_factor, jnp.finfo(jnp.float32).max),
                        scale.scale)
  inf_scale = jnp.asarray(scale.scale * scale.backoff_factor)
  if scale.minimum_scale is not None:
    inf_scale = jnp.maximum(inf_scale, scale.minimum_scale)
  return scale.replace(fin_steps=jnp.where(grow | (~finite), 0, scale.fin_steps + 1),
                       scale=jnp.where(finite, fin_scale, inf_scale))
