"""How each output of the loss is summed over the micro-batches.

One protocol serves the loss total, its weight, every aux output and the gradients (as
``optax.microbatching``'s accumulators do): the micro-batch loop carries
``init()``; ``update(carry, value, index, weight)`` adds micro-batch ``index`` whose loss
weight is ``weight``; after the loop ``finalize(carry, weight)`` gives the result, where
``weight`` is the loss weight summed over every micro-batch and device.

Inside the per-device view's ``shard_map`` a carry varies over the manual axes its values
vary over, and ``finalize`` reduces it over them: that is the one data-axis reduction.
Both views' gradient sums are here too: :func:`local_gradients` (per device, reduced once
after the loop) and :func:`global_gradients` (on the global micro-batch, ``unreduced``
where the params are typed ``reduced``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from fxaccum import meshes, reductions
from fxaccum.markers import (
  Concat,
  Max,
  Min,
  State,
  Sum,
  Weighted,
  highest,
  lowest,
  safe_divide,
  weight_dtype,
)
from fxaccum.statistics import Statistics


@dataclasses.dataclass(frozen=True)
class Accumulator:
  """A running sum over micro-batches: ``init``, ``update`` and ``finalize`` (see above;
  ``finalize``'s weight is None for the loss weight's own accumulator)."""

  init: Callable[[], Any]
  update: Callable[[Any, Any, jax.Array, jax.Array], Any]
  finalize: Callable[[Any, jax.Array | None], Any]


def summed(aval: Any, axes: tuple[str, ...], dtype: Any = None) -> Accumulator:
  """The sum over micro-batches in ``dtype`` (default: the value's), then over ``axes``."""

  def init():
    return meshes.vary(jnp.zeros(aval.shape, dtype or aval.dtype), axes)

  return Accumulator(init, lambda carry, value, index, weight: carry + value.astype(carry.dtype),
                     lambda carry, weight: reductions.reduce(carry, axes))


def weighted_mean(aval: Any, axes: tuple[str, ...]) -> Accumulator:
  """The mean over micro-batches weighted by the loss weight, in float32."""
  total = summed(aval, axes, jnp.float32)

  def update(carry, value, index, weight):
    # A zero-weight micro-batch adds nothing, even a NaN metric (0/0).
    return carry + jnp.where(weight != 0, value.astype(carry.dtype) * weight.astype(carry.dtype),
                             0)

  return Accumulator(total.init, update,
                     lambda carry, weight: safe_divide(total.finalize(carry, weight), weight))


def ratio(marker: Weighted, axes: Weighted) -> Accumulator:
  """``Weighted`` aux: its totals summed over its weights (not the loss's)."""
  total = summed(marker.total, axes.total, jnp.float32)
  count = summed(marker.weight, axes.weight, weight_dtype(marker.weight.dtype))

  def update(carry, value, index, weight):
    return Weighted(total.update(carry.total, value.total, index, weight),
                    count.update(carry.weight, value.weight, index, weight))

  def finalize(carry, weight):
    return safe_divide(total.finalize(carry.total, weight), count.finalize(carry.weight, weight))

  return Accumulator(lambda: Weighted(total.init(), count.init()), update, finalize)


def concatenated(aval: Any, micro_batches: int) -> Accumulator:
  """``Concat`` aux: each micro-batch's rows, put back in the batch's order (the split
  gives micro-batch ``i`` rows ``i::k``) and typed like the batch."""
  axes = tuple(sorted(meshes.varying_axes(aval)))
  spec = getattr(getattr(aval, "sharding", None), "spec", None)

  def init():
    sharding = {} if spec is None or not any(spec) else {"out_sharding": jax.P(None, *spec)}
    return meshes.vary(jnp.zeros((micro_batches, *aval.shape), aval.dtype, **sharding), axes)

  def finalize(carry, weight):  # (k, rows / k, ...) -> rows, row j * k + i from (i, j)
    return jnp.swapaxes(carry, 0, 1).reshape(-1, *carry.shape[2:])

  return Accumulator(init, lambda carry, value, index, weight: carry.at[index].set(value),
                     finalize)


def extremum(marker: Max | Min, axes: Any) -> Accumulator:
  """``Max`` / ``Min`` aux: the elementwise maximum (minimum) over micro-batches, in the
  value's dtype, then over ``axes``; weights play no part (as for ``Sum``)."""
  kind = type(marker)
  aval, axes = marker.value, axes.value
  largest = kind is Max
  identity = lowest(aval.dtype) if largest else highest(aval.dtype)
  combine = jnp.maximum if largest else jnp.minimum
  across = lax.pmax if largest else lax.pmin

  def init():
    return kind(meshes.vary(jnp.full(aval.shape, identity, aval.dtype), axes))

  def finalize(carry, weight):
    return across(carry.value, axes) if axes else carry.value

  return Accumulator(init, lambda carry, value, index, weight: kind(
      combine(carry.value, value.value.astype(aval.dtype))), finalize)


def for_aux(marker: Any, axes: Any, micro_batches: int) -> Accumulator:
  """The accumulator of one aux output, by its marker type (a plain leaf: weighted mean)."""
  if isinstance(marker, Weighted):
    return ratio(marker, axes)
  if isinstance(marker, Sum):
    dtype = (jnp.float32 if jnp.issubdtype(marker.value.dtype, jnp.floating)
             else weight_dtype(marker.value.dtype))
    total = summed(marker.value, axes.value, dtype)
    return Accumulator(lambda: Sum(total.init()),
                       lambda carry, value, index, weight: Sum(
                           total.update(carry.value, value.value, index, weight)),
                       lambda carry, weight: total.finalize(carry.value, weight))
  if isinstance(marker, (Max, Min)):
    return extremum(marker, axes)
  if isinstance(marker, State):  # the last micro-batch's value
    return Accumulator(lambda: jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), marker.value),
                       lambda carry, value, index, weight: value.value,
                       lambda carry, weight: carry)
  if isinstance(marker, Concat):
    rows = concatenated(marker.value, micro_batches)
    return dataclasses.replace(rows, update=lambda carry, value, index, weight: rows.update(
        carry, value.value, index, weight))
  if isinstance(marker, Statistics):  # carries nothing: the step's statistics replace it
    return Accumulator(lambda: marker, lambda carry, value, index, weight: carry,
                       lambda carry, weight: carry)
  return weighted_mean(marker, axes)


def combined(accumulators: list[Accumulator]) -> Accumulator:
  """One accumulator for a list of them, over lists of values."""

  def update(carry, values, index, weight):
    return [acc.update(c, v, index, weight)
            for acc, c, v in zip(accumulators, carry, values, strict=True)]

  def finalize(carry, weight):
    return [acc.finalize(c, weight) for acc, c in zip(accumulators, carry, strict=True)]

  return Accumulator(lambda: [acc.init() for acc in accumulators], update, finalize)


def local_gradients(leaves: Sequence[Any], whole: Sequence[Any],
                    param_dims: Sequence[meshes.DataDims],
                    gather_in_loop: Sequence[meshes.DataDims], axes: tuple[str, ...], dtype: Any, *,
                    reduced: bool) -> Accumulator:
  """The per-device view's gradient sums: each device's, in ``dtype``, over the leaves
  ``whole`` it holds; after the loop reduced over ``axes`` in buckets (leaves gathered in
  the loop, ``gather_in_loop``, were reduce-scattered each micro-batch already) and
  divided by the loss weight, in the dtypes of ``leaves``. Without ``reduced`` (deferred
  sync) the local sums themselves."""

  def finalize(sums, weight):
    if not reduced:  # deferred: packaged by the caller, with this device's weight
      return sums
    plans = []
    for dims, loop_dims in zip(param_dims, gather_in_loop, strict=True):
      # In-loop gathers already reduce-scattered over their axes each micro-batch.
      scattered = {a for _, dim_axes in (loop_dims or dims) for a in dim_axes}
      plans.append(((() if loop_dims else dims), tuple(a for a in axes if a not in scattered)))
    means = safe_divide(reductions.reduce_leaves(sums, plans, reductions.BUCKET_BYTES), weight)
    return [mean.astype(jnp.result_type(leaf))
            for mean, leaf in zip(means, leaves, strict=True)]

  return Accumulator(
      lambda: [meshes.vary(jnp.zeros_like(leaf, dtype), axes) for leaf in whole],
      lambda sums, grads, index, weight: [
          total + g.astype(total.dtype) for total, g in zip(sums, grads, strict=True)],
      finalize)


def global_gradients(leaves: Sequence[Any], specs: Sequence[Any],
                     reduced: Sequence[frozenset[str]], hints: Sequence[Any] | None, dtype: Any, *,
                     reduced_result: bool) -> Accumulator:
  """The global view's gradient sums, in ``dtype``: a leaf with ``reduced`` axes (typed
  ``reduced`` on an Explicit mesh) is summed ``unreduced`` over them and resharded once
  after the loop; the others are constrained to ``hints`` (their params' NamedSharding on
  an Auto mesh; None: nothing to constrain). After the loop the sums divided by the loss
  weight, in the dtypes of ``leaves``; without ``reduced_result``, the resharded sums."""

  def constrain(i: int, x: jax.Array) -> jax.Array:
    if reduced[i] or hints is None or hints[i] is None:
      return x
    return lax.with_sharding_constraint(x, hints[i])

  def init():
    return [jnp.zeros(jnp.shape(leaf), dtype, out_sharding=P(*spec, unreduced=r))
            if r else constrain(i, jnp.zeros_like(leaf, dtype))
            for i, (leaf, spec, r) in enumerate(zip(leaves, specs, reduced, strict=True))]

  def update(sums, grads, index, weight):
    return [constrain(i, total + g.astype(total.dtype))
            for i, (total, g) in enumerate(zip(sums, grads, strict=True))]

  def finalize(sums, weight):
    sums = [jax.sharding.reshard(total, P(*spec)) if r else total
            for total, spec, r in zip(sums, specs, reduced, strict=True)]
    if not reduced_result:
      return sums
    return [constrain(i, mean.astype(jnp.result_type(leaf))) for i, (mean, leaf) in
            enumerate(zip(safe_divide(sums, weight), leaves, strict=True))]

  return Accumulator(init, update, finalize)
