"""Data-axis reductions of local gradient sums: per leaf, in buckets, and deferred.

Every data-axis reduction fxaccum issues is written here: the in-step loop's one reduction
after the loop (:func:`reduce`, :func:`reduce_leaves`), the pipeline's stage gradients
(:func:`reduce_leaves`), and deferred sync's per-device slots (:class:`Unreduced`): filled
by the in-step global view (:func:`in_first_slot`), summed by the cross-step gate
(:func:`sum_deferred`) and by checkpoints (:func:`sum_slots`). It may import
:mod:`fxaccum.meshes` only.

Inside a region manual over the data axes, each gradient leaf is reduced over those axes:
reduce-scattered over the axes its param is sharded over (FSDP), all-reduced over the rest.
Issued leaf by leaf that is one collective — one rendezvous — per leaf, and XLA:CPU combines
no reduce-scatters (XLA:GPU only below its combiner's byte threshold). So leaves that reduce
the same way are packed into buckets, as PyTorch DDP's ``bucket_cap_mb`` and FSDP's flat
parameters do: each leaf is laid out with its sharded dimension first and flattened to
``(devices, -1)``, the bucket's leaves are concatenated along the second axis, reduced by one
``psum_scatter`` (or ``psum``), and split back. Element for element the result is the
per-leaf reduction's.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from fxaccum import meshes
from fxaccum.meshes import DataDims

__all__ = [
    "BUCKET_BYTES", "LeafReduction", "Unreduced", "gather", "in_first_slot", "reduce",
    "reduce_leaves", "sum_deferred", "sum_slots",
]

#: Default bucket size, measured on 8 simulated CPU devices (docs/performance.md): 2 MiB
#: buckets beat one collective per leaf (a rendezvous each), larger buckets (more full-size
#: gradients live at once) and one bucket for all leaves (all of them, copied into it).
BUCKET_BYTES = 2 << 20

# How one leaf is reduced: (its dimensions sharded over data axes, to reduce-scatter over
# those axes; the other axes to sum it over).
LeafReduction = tuple[DataDims, tuple[str, ...]]


def reduce_leaves(leaves: Sequence[jax.Array], ways: Sequence[LeafReduction],
                  bucket_bytes: int | None = None) -> list[jax.Array]:
  """Each leaf reduced the way ``ways`` says — reduce-scattered over the axes of its sharded
  dimensions, then summed over its other axes, as :func:`reduce`
  does — with one collective per bucket of at most ``bucket_bytes`` (None: one bucket per
  kind of reduction)."""
  out: list[Any] = list(leaves)
  groups: dict[Any, list[int]] = {}
  for i, (leaf, (leaf_dims, rest)) in enumerate(zip(leaves, ways, strict=True)):
    if len(leaf_dims) > 1:  # sharded on several dimensions: on its own
      out[i] = reduce(leaf, rest + tuple(a for _, axes in leaf_dims for a in axes),
                           leaf_dims)
      continue
    scatter = leaf_dims[0][1] if leaf_dims else ()
    if scatter or rest:
      groups.setdefault((scatter, rest, jnp.result_type(leaf)), []).append(i)
  for (scatter, rest, _), members in groups.items():
    for bucket in _buckets(members, leaves, bucket_bytes):
      reduced = (_scattered(bucket, leaves, ways, scatter, rest) if scatter
                 else lax.psum([leaves[i] for i in bucket], rest))
      for i, value in zip(bucket, reduced, strict=True):
        out[i] = value
  return out


def _buckets(members: list[int], leaves: Sequence[jax.Array],
             bucket_bytes: int | None) -> list[list[int]]:
  if bucket_bytes is None:
    return [members]
  buckets: list[list[int]] = [[]]
  size = 0
  for i in members:
    nbytes = math.prod(jnp.shape(leaves[i])) * jnp.result_type(leaves[i]).itemsize
    if buckets[-1] and size + nbytes > bucket_bytes:
      buckets.append([])
      size = 0
    buckets[-1].append(i)
    size += nbytes
  return buckets


def _scattered(bucket: list[int], leaves: Sequence[jax.Array],
               ways: Sequence[LeafReduction],
               scatter: tuple[str, ...], rest: tuple[str, ...]) -> list[jax.Array]:
  """One ``psum_scatter`` over ``scatter`` (then one ``psum`` over ``rest``) for the whole
  bucket: each leaf's sharded dimension first, flattened to ``(devices, -1)``."""
  devices = math.prod(lax.axis_size(a) for a in scatter)
  flat, shapes = [], []
  for i in bucket:
    dim = ways[i][0][0][0]
    moved = jnp.moveaxis(leaves[i], dim, 0)
    shapes.append((dim, moved.shape))
    flat.append(moved.reshape(devices, -1))
  packed = lax.psum_scatter(jnp.concatenate(flat, axis=1), scatter, scatter_dimension=0,
                            tiled=True)
  if rest:
    packed = lax.psum(packed, rest)
  out, offset = [], 0
  for (dim, shape), piece in zip(shapes, flat, strict=True):
    width = piece.shape[1]
    local = packed[:, offset:offset + width].reshape(shape[0] // devices, *shape[1:])
    out.append(jnp.moveaxis(local, 0, dim))
    offset += width
  return out


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Unreduced:
  """Gradients not yet reduced over the data-parallel devices.

  Returned by ``fxaccum.value_and_unreduced_grad`` and consumed by a gate whose
  chain has ``fxaccum.accumulate(k, data_axes=...)``, which adds them up per device and
  reduces once per optimizer step (deferred sync).

  Attributes:
    total: the params' tree; each leaf has a leading axis with one entry per data-parallel
      device (sharded over the data axes): that device's sum of ``d total / d params``
      over its micro-batches, not normalized.
    weight: float32 ``(devices,)``, each device's summed weight.

  Example:
    >>> import jax, jax.numpy as jnp, fxaccum
    >>> loss = lambda w, x: fxaccum.Weighted(jnp.sum(x * w), jnp.sum(x != 0))
    >>> n = jax.device_count()
    >>> with jax.set_mesh(jax.make_mesh((n,), ("data",))):
    ...   x = jax.device_put(jnp.ones((2 * n, 1)), jax.P("data"))
    ...   _, g = jax.jit(fxaccum.value_and_unreduced_grad(loss, micro_batches=2))(
    ...       jnp.ones(1), x)
    >>> g.total.shape == (n, 1), g.total.sharding.spec[0]   # one partial sum per device
    (True, 'data')
    >>> sum(g.weight.tolist()) == 2 * n   # the devices' token counts add up to the batch's
    True
  """

  total: Any
  weight: jax.Array


def gather(x: jax.Array, dims: DataDims) -> jax.Array:
  """All-gathers a data-sharded leaf to its full value (identity for ``dims=()``).

  Its transpose is a reduce-scatter, so gradients with respect to the shard come back
  reduced and sharded.
  """
  for dim, axes in dims:
    x = lax.all_gather(x, axes, axis=dim, tiled=True)
  return x


def reduce(x: jax.Array, data_axes: tuple[str, ...], dims: DataDims = ()) -> jax.Array:
  """The data-axis reduction of a local partial sum: reduce-scatter over ``dims``'s axes,
  then all-reduce over the remaining data axes."""
  done: set[str] = set()
  for dim, axes in dims:
    x = lax.psum_scatter(x, axes, scatter_dimension=dim, tiled=True)
    done |= set(axes)
  rest = tuple(a for a in data_axes if a not in done)
  return lax.psum(x, rest) if rest else x


def sum_slots(tree: Any) -> Any:
  """Deferred sync's per-device slots (each leaf's leading axis) summed."""
  return jax.tree.map(lambda a: jnp.sum(a, axis=0), tree)


def sum_deferred(tree: Any, data_axes: tuple[str, ...]) -> Any:
  """The one reduction of deferred sync: the slots summed, and, inside the caller's
  ``shard_map`` over data axes (where each device holds its own slot), over those."""
  total = sum_slots(tree)
  manual = tuple(a for a in data_axes if a in meshes.manual_axes())
  return lax.psum(total, manual) if manual else total


def in_first_slot(tree: Any, data_axes: tuple[str, ...], mesh: Any) -> Any:
  """A tree replicated over ``data_axes`` in deferred sync's per-device form: a leading
  slot axis sharded over them, the whole value in the first device's slot, zeros in the
  others (exact, and no communication)."""
  if not data_axes:
    return jax.tree.map(lambda x: x[None], tree)

  def first_device_slot(x):
    return jnp.where(lax.axis_index(data_axes) == 0, x, jnp.zeros_like(x))[None]

  slots = meshes.shard_map_keeping_axes(
      lambda t: jax.tree.map(first_device_slot, t), mesh=mesh, in_specs=P(),
      out_specs=P(data_axes), axis_names=set(data_axes))
  return slots(tree)
