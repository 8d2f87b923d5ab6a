"""Splitting a batch into micro-batches without resharding it.

Micro-batch ``i`` holds rows ``i, i + k, i + 2k, ...`` of the (per-device) batch. The
split is a free reshape ``(b, ...) -> (b // k, k, ...)`` plus one strided slice per loop
iteration: it never copies the whole batch and, unlike a contiguous split, never moves
rows between devices of a data-sharded batch.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

__all__ = [
    "MicroBatchSize", "as_argnums", "check_micro_batches", "fold", "leading_size",
    "micro_batch", "put", "rows_per_device", "stacked", "take", "unstacked",
]


@dataclasses.dataclass(frozen=True)
class MicroBatchSize:
  """``micro_batches=MicroBatchSize(m)``: micro-batches of ``m`` rows (over all data
  devices together), so their number ``k = B // m`` follows the batch size ``B`` at trace
  time: a batch-size ramp-up keeps the micro-batch, and its activation memory, fixed (one
  program per batch size). ``m`` must divide ``B`` and be a multiple of the number of data
  devices.

  Attributes:
    rows: the rows ``m`` of one micro-batch, a positive int.

  Example:
    >>> import jax.numpy as jnp, fxaccum
    >>> loss = lambda w, x: jnp.mean(x * w)
    >>> g = fxaccum.grad(loss, micro_batches=fxaccum.MicroBatchSize(2))
    >>> g(jnp.ones(1), jnp.arange(8.0).reshape(8, 1))   # 4 micro-batches of 2 rows
    Array([3.5], dtype=float32)
  """

  rows: int

  def __post_init__(self):
    check_micro_batches(self.rows, "MicroBatchSize's rows")


def check_micro_batches(micro_batches: Any, name: str = "micro_batches") -> int:
  """Returns ``micro_batches`` as an int, or raises if it is not a positive int."""
  if isinstance(micro_batches, bool):
    raise TypeError(f"{name} must be a positive int, got the bool {micro_batches!r}.")
  try:
    value = operator.index(micro_batches)
  except TypeError:
    raise TypeError(
        f"{name} must be a positive int (a Python int known at trace time), got "
        f"{micro_batches!r} of type {type(micro_batches).__name__}."
    ) from None
  if value <= 0:
    raise ValueError(f"{name} must be a positive int, got {value}. Use 1 for no accumulation.")
  return value


def leading_size(batch: Any, micro_batches: int, devices: int = 1) -> int:
  """Checks that every leaf of ``batch`` splits into equal micro-batches.

  Args:
    batch: the pytree of batch arguments.
    micro_batches: number of micro-batches ``k``.
    devices: number of devices the batch's leading axis is split over.

  Returns:
    The common leading size ``B`` of all leaves.

  Raises:
    ValueError: naming the leaf and sizes, if leaves disagree on ``B``, if ``B`` is not
      divisible by ``k`` or by ``devices * k``, or if a leaf is a scalar.
  """
  paths_and_leaves = jax.tree_util.tree_flatten_with_path(batch)[0]
  if not paths_and_leaves:
    raise ValueError(
        "The batch arguments (batch_argnums) hold no arrays; pass the batch as the argument "
        "at batch_argnums, or set batch_argnums to where it is."
    )
  sizes: dict[int, str] = {}
  for path, leaf in paths_and_leaves:
    shape = jnp.shape(leaf)
    where = jax.tree_util.keystr(path) or "<batch>"
    if not shape:
      raise ValueError(
          f"Batch leaf {where} is a scalar; every batch leaf needs a leading batch axis to "
          "split into micro-batches. Move constants out of the batch argument."
      )
    sizes.setdefault(shape[0], where)
  if len(sizes) > 1:
    listing = ", ".join(f"{where}: {size}" for size, where in sizes.items())
    raise ValueError(
        f"Batch leaves have different leading sizes ({listing}); all leaves of the batch "
        "arguments must share the batch axis 0."
    )
  (size,) = sizes
  if size % micro_batches:
    raise ValueError(
        f"The batch's leading size {size} is not divisible by micro_batches={micro_batches}. "
        f"Use a global batch that is a multiple of {micro_batches} or a micro_batches that "
        f"divides {size}."
    )
  if devices > 1 and size % (devices * micro_batches):
    per_device = size / (devices * micro_batches)
    raise ValueError(
        f"The batch's leading size {size} over {devices} data-parallel devices and "
        f"micro_batches={micro_batches} gives a per-device micro-batch of {per_device:g} "
        f"examples; it must be a whole number >= 1. Use a batch that is a multiple of "
        f"{devices * micro_batches}, fewer micro-batches, or name fewer data_axes."
    )
  return size


def micro_batch(batch: Any, index: jax.Array | int, micro_batches: int) -> Any:
  """Micro-batch ``index`` of ``batch``: rows ``index::micro_batches`` of every leaf."""

  def leaf_micro_batch(leaf):
    leaf = jnp.asarray(leaf)
    if micro_batches == 1:  # the whole batch, as jax.value_and_grad would see it
      return leaf
    return take(leaf, index, micro_batches)

  return jax.tree.map(leaf_micro_batch, batch)


def take(leaf: jax.Array, m: Any, k: int) -> jax.Array:
  """Micro-batch ``m`` of one leaf, rows ``m::k``, read without a ``k``-sized copy (the
  leaf viewed as ``(rows / k, k, ...)``)."""
  view = leaf.reshape(leaf.shape[0] // k, k, *leaf.shape[1:])
  return lax.dynamic_index_in_dim(view, m, axis=1, keepdims=False)


def put(leaf: jax.Array, m: Any, k: int, value: jax.Array, keep: Any) -> jax.Array:
  """``leaf`` with micro-batch ``m`` (rows ``m::k``) replaced by ``value`` where
  ``keep``, written in place: the inverse of :func:`take`."""
  view = leaf.reshape(leaf.shape[0] // k, k, *leaf.shape[1:])
  value = jnp.where(keep, value, take(leaf, m, k))
  return lax.dynamic_update_index_in_dim(view, value, m, axis=1).reshape(leaf.shape)


def stacked(leaf: jax.Array, k: int) -> jax.Array:
  """``(n, ...) -> (k, n / k, ...)``: entry ``i`` is micro-batch ``i``, rows ``i::k``."""
  return leaf.reshape(leaf.shape[0] // k, k, *leaf.shape[1:]).swapaxes(0, 1)


def unstacked(leaf: jax.Array) -> jax.Array:
  """``(k, n / k, ...) -> (n, ...)``: the micro-batches back in their rows; the inverse
  of :func:`stacked`."""
  return leaf.swapaxes(0, 1).reshape(leaf.shape[0] * leaf.shape[1], *leaf.shape[2:])


def fold(keys: Any, index: jax.Array) -> Any:
  """``jax.random.fold_in`` of every PRNG key leaf in ``keys`` with ``index``."""

  def fold_leaf(key):
    dtype = jnp.result_type(key)
    typed = jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)
    if not typed and not (dtype == jnp.uint32 and jnp.shape(key)[-1:] == (2,)):
      raise TypeError(
          f"rng_argnums leaves must be PRNG keys (jax.random.key(...) or a raw uint32[2] "
          f"key), got {dtype}{list(jnp.shape(key))}. Pass only keys at rng_argnums."
      )
    return jax.random.fold_in(key, index)

  return jax.tree.map(fold_leaf, keys)


def as_argnums(value: int | Sequence[int], name: str, count: int | None = None
               ) -> tuple[int, ...]:
  """Normalizes an ``argnums``-style int or sequence of ints to a tuple; with ``count``
  (the number of arguments) negative entries count from the end, as in Python."""
  values = (value,) if isinstance(value, int) else tuple(value)
  for v in values:
    if not isinstance(v, int) or isinstance(v, bool) or (v < 0 and count is None):
      raise TypeError(f"{name} must be a non-negative int or a tuple of them, got {value!r}.")
    if count is not None and not -count <= v < count:
      raise ValueError(
          f"{name}={value!r} names argument {v}, but {count} argument(s) were given.")
  if count is not None:
    values = tuple(v % count for v in values)
  if len(set(values)) != len(values):
    raise ValueError(f"{name} has repeated entries: {value!r}.")
  return values


def rows_per_device(batch: Sequence[Any], argnums: Sequence[int]) -> int:
  """The rows of the batch's leading dimension each device holds.

  Each leaf's leading dimension divided by the devices it is sharded over, read from its
  sharding (``jax.Array`` or ``jax.ShapeDtypeStruct``; none: one device). All leaves must
  agree.
  """
  found: dict[int, str] = {}
  for i, arg in zip(argnums, batch, strict=True):
    for path, leaf in jax.tree_util.tree_flatten_with_path(arg)[0]:
      name = f"argument {i}{jax.tree_util.keystr(path)}"
      shape = tuple(getattr(leaf, "shape", ()))
      if not shape:
        raise ValueError(
            f"The batch leaf {name} has no leading dimension (shape {shape}): "
            f"batch_argnums (the step's argument(s) holding the batch, {tuple(argnums)} "
            "here) must name the batch, e.g. batch_argnums=2 for a step "
            "(params, opt_state, batch).")
      sharding = getattr(leaf, "sharding", None)
      rows = shape[0] if sharding is None else int(sharding.shard_shape(shape)[0])
      found.setdefault(rows, name)
  if not found:
    raise ValueError("The batch argument(s) (batch_argnums) hold no arrays.")
  if len(found) > 1:
    raise ValueError(
        "The batch leaves hold different numbers of rows per device: "
        + ", ".join(f"{name}: {rows}" for rows, name in found.items()))
  return next(iter(found))
