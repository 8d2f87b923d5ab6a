"""Weighted losses and the one zero-safe global normalization.

A loss that is a *sum* over valid items together with the *count* of valid items can be
averaged exactly over any number of micro-batches and devices: add up the totals, add up
the weights, divide once. Averaging per-micro-batch means instead weights every
micro-batch equally, which is wrong whenever they hold different numbers of valid tokens.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from fxaccum.statistics import Statistics

__all__ = ["Concat", "Max", "Min", "State", "Sum", "Weighted", "all_finite", "highest",
           "is_marker", "lowest", "safe_divide", "weight_dtype"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Weighted:
  """A loss (or metric) given as a sum over items and the number of items.

  Return it from a loss function instead of a mean, e.g.
  ``Weighted(total=jnp.sum(mask * token_loss), weight=jnp.sum(mask))``. fxaccum then
  reports ``sum(total) / sum(weight)`` over all micro-batches and devices, and an
  all-padding step gives 0 (never NaN).

  It is a pytree (not a tuple), so it passes through ``jax.jit`` and ``lax.scan`` and
  cannot be confused with a ``(loss, aux)`` pair.

  Attributes:
    total: scalar sum of the per-item values (differentiated).
    weight: scalar number (or total weight) of the items in ``total``; never
      differentiated. Integer weights are summed in int32, float weights in float32.

  Example:
    >>> import jax.numpy as jnp
    >>> import fxaccum
    >>> w = fxaccum.Weighted(total=jnp.array(6.0), weight=jnp.array(4))
    >>> float(w.value())
    1.5
    >>> float(fxaccum.Weighted(jnp.array(0.0), jnp.array(0)).value())
    0.0
  """

  total: Any
  weight: Any

  def value(self) -> jax.Array:
    """``total / weight``, or 0 when the weight is 0."""
    return safe_divide(self.total, self.weight)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Sum:
  """An aux output summed over all micro-batches and devices, e.g. a count of correct
  tokens: ``fxaccum.Sum(jnp.sum(mask * correct))``.

  Plain aux leaves are averaged with the loss's weights; a ``Sum`` leaf is added up
  instead, in float32 (int32 for integer values), and comes back unwrapped.

  Attributes:
    value: the micro-batch's value (any shape).

  Example:
    >>> import jax.numpy as jnp, fxaccum
    >>> def loss(w, x):
    ...   return jnp.mean(x * w), {"nonzero": fxaccum.Sum(jnp.sum(x != 0))}
    >>> x = jnp.array([[1.0], [0.0], [3.0], [2.0]])
    >>> (value, aux), _ = fxaccum.value_and_grad(loss, has_aux=True, micro_batches=2)(
    ...     jnp.ones(1), x)
    >>> aux["nonzero"]   # over the whole batch, not per micro-batch
    Array(3, dtype=int32)
  """

  value: Any


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Max:
  """An aux output combined by its maximum over all micro-batches and devices, e.g. an
  fp8 scaling's ``amax``: ``fxaccum.Max(jnp.max(jnp.abs(x)))``.

  The result is the elementwise maximum of the micro-batches' values (in the value's
  dtype), so for a maximum over the micro-batch's examples it is the maximum over the
  whole batch. On a mesh the loss runs per device only where the value provably is such
  a maximum (a ``jnp.max`` over the examples, or batch-independent); then each device's
  maximum is combined with one ``pmax``. Integer and boolean values work too; a step whose
  micro-batches are all skipped (``skip_nonfinite``) gives the dtype's lowest value.

  Attributes:
    value: the micro-batch's value (any shape).

  Example:
    >>> import jax.numpy as jnp, fxaccum
    >>> def loss(w, x):
    ...   return jnp.mean(x * w), fxaccum.Max(jnp.max(jnp.abs(x)))
    >>> x = jnp.array([[1.0], [-5.0], [3.0], [2.0]])
    >>> (value, amax), _ = fxaccum.value_and_grad(loss, has_aux=True, micro_batches=2)(
    ...     jnp.ones(1), x)
    >>> amax   # over the whole batch, not the last micro-batch
    Array(5., dtype=float32)
  """

  value: Any


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Min:
  """An aux output combined by its minimum over all micro-batches and devices; see
  :class:`fxaccum.Max` (a step whose micro-batches are all skipped gives the dtype's
  highest value).

  Attributes:
    value: the micro-batch's value (any shape).

  Example:
    >>> import jax.numpy as jnp, fxaccum
    >>> def loss(w, x):
    ...   return jnp.mean(x * w), fxaccum.Min(jnp.min(x))
    >>> x = jnp.array([[1.0], [-5.0], [3.0], [2.0]])
    >>> (value, low), _ = fxaccum.value_and_grad(loss, has_aux=True, micro_batches=2)(
    ...     jnp.ones(1), x)
    >>> low
    Array(-5., dtype=float32)
  """

  value: Any


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Concat:
  """A per-example aux output (batch on axis 0), returned for the whole batch in the
  original row order: e.g. ``fxaccum.Concat(logits)`` or per-example losses.

  Each micro-batch's rows are put back where the split took them from, so the result has
  the batch's leading size and row order (sharded like the batch on a mesh).

  Attributes:
    value: the micro-batch's per-example values, batch on axis 0.

  Example:
    >>> import jax.numpy as jnp, fxaccum
    >>> def loss(w, x):
    ...   per_example = (x * w)[:, 0]
    ...   return jnp.mean(per_example), fxaccum.Concat(per_example)
    >>> x = jnp.arange(6.0).reshape(6, 1)
    >>> (value, rows), _ = fxaccum.value_and_grad(loss, has_aux=True, micro_batches=3)(
    ...     jnp.ones(1), x)
    >>> rows   # all 6 rows, in the batch's order
    Array([0., 1., 2., 3., 4., 5.], dtype=float32)
  """

  value: Any


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class State:
  """The new value of a threaded argument (``state_argnums``), returned in the aux: e.g.
  flax linen's updated ``batch_stats``. Micro-batch ``i + 1`` receives what micro-batch
  ``i`` returned, as calling the loss on the micro-batches one after another would, and
  the aux holds the last micro-batch's value (unwrapped) in the marker's place.

  Attributes:
    value: the argument's new value (same tree, shapes and dtypes as the argument).

  Example:
    >>> import jax.numpy as jnp, fxaccum
    >>> def loss(w, count, x):   # count: how many examples the loss has seen
    ...   return jnp.mean(x * w), fxaccum.State(count + x.shape[0])
    >>> (value, count), _ = fxaccum.value_and_grad(
    ...     loss, has_aux=True, micro_batches=4, batch_argnums=2, state_argnums=1)(
    ...     jnp.ones(1), jnp.int32(0), jnp.ones((8, 1)))
    >>> count   # threaded through 4 micro-batches of 2 rows
    Array(8, dtype=int32)
  """

  value: Any


def lowest(dtype: Any) -> Any:
  """The identity of a maximum in ``dtype``: -inf, the lowest integer, or False."""
  dtype = jnp.dtype(dtype)
  if jnp.issubdtype(dtype, jnp.inexact):
    return -jnp.inf if _has_inf(dtype) else jnp.finfo(dtype).min
  if dtype == jnp.bool_:
    return False
  return jnp.iinfo(dtype).min


def highest(dtype: Any) -> Any:
  """The identity of a minimum in ``dtype``: inf, the highest integer, or True."""
  dtype = jnp.dtype(dtype)
  if jnp.issubdtype(dtype, jnp.inexact):
    return jnp.inf if _has_inf(dtype) else jnp.finfo(dtype).max
  if dtype == jnp.bool_:
    return True
  return jnp.iinfo(dtype).max


def _has_inf(dtype: Any) -> bool:
  """Whether ``dtype`` holds infinities (float8 ``e4m3fn`` and its kin do not: inf is NaN)."""
  return bool(np.isinf(np.array(np.inf).astype(dtype)))


def weight_dtype(weight: Any) -> jnp.dtype:
  """The dtype weights are counted in: int32 for integer weights, float32 otherwise.

  Never bf16/f16: a bf16 counter stops counting exactly at 256.
  """
  dtype = jnp.result_type(weight)
  if jnp.issubdtype(dtype, jnp.integer) or jnp.issubdtype(dtype, jnp.bool_):
    return jnp.dtype(jnp.int32)
  return jnp.dtype(jnp.float32)


def all_finite(tree: Any) -> jax.Array:
  """Whether every element of every leaf of ``tree`` is finite (one boolean scalar)."""
  finite = jnp.array(True)
  for leaf in jax.tree.leaves(tree):
    finite &= jnp.all(jnp.isfinite(leaf))
  return finite


def safe_divide(numerator: Any, denominator: Any) -> Any:
  """``numerator / denominator`` for each leaf of ``numerator`` (an array or a pytree), in
  at least float32, with 0 where ``denominator`` is 0.

  For integer token counts this is ``numerator / max(denominator, 1)``; unlike ``max``
  it stays correct for fractional float weights (e.g. a total weight of 0.25). The
  denominator is prepared once per dtype, not once per leaf.
  """
  prepared: dict[Any, tuple[jax.Array, jax.Array]] = {}

  def divide(leaf: Any) -> jax.Array:
    leaf = jnp.asarray(leaf)
    dtype = jnp.promote_types(leaf.dtype, jnp.float32)
    if dtype not in prepared:
      cast = jnp.asarray(denominator).astype(dtype)
      nonzero = cast != 0
      prepared[dtype] = nonzero, jnp.where(nonzero, cast, 1)
    nonzero, safe = prepared[dtype]
    return jnp.where(nonzero, leaf.astype(dtype) / safe, 0)

  return jax.tree.map(divide, numerator)


def is_marker(x: Any) -> bool:
  """Whether ``x`` is one of the kinds a loss marks its outputs with (``Weighted``,
  ``Sum``, ``Max``, ``Min``, ``Concat``, ``State``, ``Statistics``): a leaf of the aux
  tree as fxaccum reads it."""
  return isinstance(x, (Weighted, Sum, Max, Min, Concat, State, Statistics))
