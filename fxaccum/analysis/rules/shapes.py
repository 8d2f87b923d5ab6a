"""Rules of ops that move values between dimensions: broadcasts, reshapes, transposes,
squeezes, concatenations, and sizes as values (``iota``, ``dim_as_value``).

They keep examples apart as long as the batch axis stays one dimension whose blocks are
the examples. May import :mod:`fxaccum.analysis.registry`, :mod:`fxaccum.analysis.kinds`,
:mod:`fxaccum.analysis.eqns` and :mod:`.common`.
"""

from __future__ import annotations

import dataclasses
import math

from fxaccum.analysis.eqns import is_constant, shape_of, with_place
from fxaccum.analysis.kinds import Blocked, Const, Kind, Rows, Stat, Top, common_exp, plain
from fxaccum.analysis.registry import Context, Operands, Out, register, register_facts
from fxaccum.analysis.rules.common import first_mixed, map_uniform, misaligned, uniform_at

__all__ = ["broadcast_in_dim", "concatenate", "dim_as_value", "iota", "reshape", "squeeze",
           "stack", "tile", "transpose", "unstack"]


# Broadcasts and reshapes move or copy elements (they keep a bound), and JAX leaves them
# out where they change nothing (to a dim of size 1 per device); their shapes may follow
# the rows. ``expand_dims`` has no rule: older JAX's spelling of a broadcast.
register_facts("broadcast_in_dim", bound="keeps", noop_reshape=True,
               shape_params={"shape", "sharding"})
register_facts("reshape", bound="keeps", noop_reshape=True,
               shape_params={"new_sizes", "sharding"})
register_facts("squeeze", "expand_dims", bound="keeps", noop_reshape=True)


@register("broadcast_in_dim")
def broadcast_in_dim(ctx: Context, kinds: Operands) -> Out:
  """A broadcast keeps each kind; a constant is uniform along the new dims."""
  eqn = ctx.eqn
  kind = kinds[0]
  dims = eqn.params["broadcast_dimensions"]
  out_shape, in_shape = shape_of(eqn.outvars[0]), shape_of(eqn.invars[0])
  if isinstance(kind, Rows):
    return dataclasses.replace(kind, dim=dims[kind.dim])
  if isinstance(kind, Stat):
    return kind
  uniform = {d for d in range(len(out_shape)) if d not in dims}
  uniform |= {dims[i] for i in kind.uniform}
  uniform |= {dims[i] for i, size in enumerate(in_shape) if size == 1}
  return Const(frozenset(uniform), kind.value, kind.exp)


@register("reshape", reads_blocks=True)
def reshape(ctx: Context, kinds: Operands) -> Out:
  """A reshape keeps examples apart where each example stays a block of one dimension
  (in both traces), or splits the batch axis into blocks of consecutive examples (as
  ``lax.map(..., batch_size=b)`` does: :class:`Blocked`), or merges such blocks again."""
  eqn = ctx.eqn
  kind = kinds[0]
  if isinstance(kind, Blocked):
    return _unblocked(ctx, kind)
  if isinstance(kind, Top):
    return kind
  if isinstance(kind, Stat):
    return kind
  if isinstance(kind, Const):  # one value everywhere stays so
    out_ndim = len(shape_of(eqn.outvars[0]))
    same = kind.value is not None or set(range(len(shape_of(eqn.invars[0])))) <= kind.uniform
    return Const(frozenset(range(out_ndim)) if same else frozenset(), kind.value, kind.exp)
  if eqn.params.get("dimensions") is not None:
    return Top(with_place(eqn, "a reshape that transposes the batch axis"))
  dim = _reshaped_dim(shape_of(eqn.invars[0]), shape_of(eqn.outvars[0]), kind.dim, ctx.rows)
  theirs = (ctx.partner_shape(0), ctx.partner_shape(0, out=True))
  if dim is not None and theirs[0] is not None and theirs[1] is not None and ctx.base:
    if _reshaped_dim(*theirs, kind.dim, round(ctx.rows / ctx.base)) != dim:
      dim = None
  what = with_place(eqn, "a reshape that splits the batch axis across examples")
  if dim is None:
    block = _block(ctx, kind.dim) if kind.mixed is None else None
    return Top(what) if block is None else Blocked(what, kind.exp, kind.dim, block, kind.order)
  return dataclasses.replace(kind, dim=dim)


def _block(ctx: Context, d: int) -> int | None:
  """The size of the blocks, where a reshape splits batch axis ``d`` (and nothing else)
  into blocks of the same number of consecutive examples in both traces."""
  def split(shape, new_shape) -> int | None:
    if (len(new_shape) != len(shape) + 1 or tuple(new_shape[:d]) != tuple(shape[:d])
        or tuple(new_shape[d + 2:]) != tuple(shape[d + 1:])):
      return None
    block = new_shape[d + 1]
    ok = is_constant(block) and block > 0 and new_shape[d] * block == shape[d]
    return block if ok else None

  block = split(shape_of(ctx.eqn.invars[0]), shape_of(ctx.eqn.outvars[0]))
  theirs = (ctx.partner_shape(0), ctx.partner_shape(0, out=True))
  if block is not None and None not in theirs and split(*theirs) != block:
    return None
  return block


def _unblocked(ctx: Context, kind: Blocked) -> Kind:
  """A reshape of blocked examples: merging the blocks (in both traces) gives the rows
  back; any other reshape mixes them."""
  d = kind.dim

  def merges(shape, new_shape) -> bool:
    return (len(new_shape) == len(shape) - 1 and tuple(new_shape[:d]) == tuple(shape[:d])
            and tuple(new_shape[d + 1:]) == tuple(shape[d + 2:]) and shape[d + 1] == kind.block
            and new_shape[d] == shape[d] * shape[d + 1])

  theirs = (ctx.partner_shape(0), ctx.partner_shape(0, out=True))
  if ctx.eqn.params.get("dimensions") is None and merges(
      shape_of(ctx.eqn.invars[0]), shape_of(ctx.eqn.outvars[0])) and (
          None in theirs or merges(*theirs)):
    return Rows(d, None, kind.exp, kind.order)
  return plain(kind)


def _reshaped_dim(shape, new_shape, dim: int, rows: int) -> int | None:
  """Where batch-major dim ``dim`` of ``shape`` lands in ``new_shape`` (row-major), if the
  examples stay contiguous blocks of one dimension."""
  outer = math.prod(shape[:dim])
  prefix = 1
  for new_dim, size in enumerate(new_shape):
    if prefix == outer and size != 0 and size % rows == 0:
      return new_dim
    prefix *= size
  return None


register_facts("transpose", transparent=True, bound="keeps")


@register("transpose")
def transpose(ctx: Context, kinds: Operands) -> Out:
  """A transpose moves the batch axis."""
  perm = tuple(ctx.eqn.params["permutation"])
  return _renamed(kinds[0], {d: perm.index(d) for d in perm})


@register("squeeze")
def squeeze(ctx: Context, kinds: Operands) -> Out:
  """A squeeze of other dims than the batch axis."""
  eqn = ctx.eqn
  removed = tuple(eqn.params["dimensions"])
  if isinstance(kinds[0], Rows) and kinds[0].dim in removed:  # not for two or more examples
    return Top(with_place(eqn, "a squeeze of the batch axis"))
  keep = [d for d in range(len(shape_of(eqn.invars[0]))) if d not in removed]
  return _renamed(kinds[0], {d: i for i, d in enumerate(keep)})


def _renamed(kind: Kind, dims: dict[int, int]) -> Kind:
  """``kind`` with its dims renamed (old -> new; a dim left out is gone)."""
  if isinstance(kind, Rows):
    return dataclasses.replace(kind, dim=dims[kind.dim])
  if isinstance(kind, Const):
    return Const(map_uniform(kind.uniform, dims), kind.value, kind.exp)
  return kind


@register("concatenate")
def concatenate(ctx: Context, kinds: Operands) -> Out:
  """A concatenation along another axis than the batch's, of values batched alike."""
  eqn = ctx.eqn
  axis = eqn.params["dimension"]
  out_shape = shape_of(eqn.outvars[0])
  exp = common_exp(kinds)
  scaled = axis in ctx.scaled_dims(0, out=True)
  rows = [k for k in kinds if isinstance(k, Rows)]
  if rows:
    dim = rows[0].dim
    ok = axis != dim and not scaled and exp is not None and all(
        (isinstance(k, Rows) and k.dim == dim) or
        (isinstance(k, Const) and uniform_at(k, v, out_shape, dim))
        for k, v in zip(kinds, eqn.invars, strict=True))
    mixed = first_mixed(rows) or misaligned(eqn, rows)
    return Rows(dim, mixed or (None if ok else with_place(eqn, "a concatenation along or across "
                                                       "the batch axis")), exp, rows[0].order)
  stats = [k for k in kinds if isinstance(k, Stat)]
  if stats:
    ok = all(isinstance(k, Stat) for k in kinds) and exp is not None and not scaled
    return Stat(first_mixed(stats) or (None if ok else with_place(
        eqn, "a concatenation of statistics and constants")), exp)
  return Const(exp=None if scaled else exp)


@register("stack")
def stack(ctx: Context, kinds: Operands) -> Out:
  """A stack (``jnp.stack``) along a new axis of values batched alike: each example's
  values side by side, the batch axis moved past the new one if it was at or after it."""
  eqn = ctx.eqn
  axis = eqn.params["axis"]
  out_shape = shape_of(eqn.outvars[0])
  exp = common_exp(kinds)
  new = {d: d if d < axis else d + 1 for d in range(len(out_shape) - 1)}
  rows = [k for k in kinds if isinstance(k, Rows)]
  if rows:
    dim = new[rows[0].dim]
    ok = exp is not None and all(
        (isinstance(k, Rows) and new[k.dim] == dim) or (isinstance(k, Const) and (
            k.value is not None or rows[0].dim in k.uniform))
        for k in kinds)
    mixed = first_mixed(rows) or misaligned(eqn, rows)
    return Rows(dim, mixed or (None if ok else with_place(
        eqn, "a stack of values batched in different ways")), exp, rows[0].order)
  stats = [k for k in kinds if isinstance(k, Stat)]
  if stats:
    ok = all(isinstance(k, Stat) for k in kinds) and exp is not None
    return Stat(first_mixed(stats) or (None if ok else with_place(
        eqn, "a stack of statistics and constants")), exp)
  values = {k.value for k in kinds}
  uniform = frozenset.intersection(*(map_uniform(k.uniform, new) for k in kinds))
  value = values.pop() if len(values) == 1 else None
  return Const(uniform | ({axis} if value is not None else frozenset()), value, exp)


@register("unstack")
def unstack(ctx: Context, kinds: Operands) -> Out:
  """An unstack (a stack's transpose) along another axis than the batch's: each result
  holds every example's slice. Along the batch axis each result is one example."""
  eqn = ctx.eqn
  axis = eqn.params["axis"]
  kind = kinds[0]
  outs = len(eqn.outvars)
  if isinstance(kind, Rows) and kind.dim == axis:
    return [Top(with_place(eqn, "an unstack along the batch axis"))] * outs
  scaled = axis in ctx.scaled_dims(0)
  kept = {d: d if d < axis else d - 1 for d in range(len(shape_of(eqn.invars[0]))) if d != axis}
  if isinstance(kind, Rows):
    return [dataclasses.replace(kind, dim=kept[kind.dim])] * outs
  if isinstance(kind, Const):
    return [Const(map_uniform(kind.uniform, kept), kind.value,
                  None if scaled else kind.exp)] * outs
  return [kind] * outs  # a statistic's slices: sums still


@register("tile")
def tile(ctx: Context, kinds: Operands) -> Out:
  """A tile (``jnp.tile``) repeating along other dims than the batch axis: each example
  repeated within its block. Repeating along the batch axis puts other examples into a
  block."""
  eqn = ctx.eqn
  kind = kinds[0]
  reps = tuple(eqn.params["reps"])
  repeated = {d for d, r in enumerate(reps) if r != 1}
  if isinstance(kind, Rows):
    if kind.dim in repeated:
      return dataclasses.replace(kind, mixed=kind.mixed or with_place(
          eqn, "a tile along the batch axis (other examples within a block)"))
    return kind
  if isinstance(kind, Stat):
    return kind  # copies of a sum are sums
  return Const(kind.uniform, kind.value, kind.exp if not (
      ctx.scaled_dims(0) & repeated) else None)


register_facts("iota", shape_params={"shape", "sharding"})
register_facts("dim_as_value", shape_params={"dim"})


@register("iota")
def iota(ctx: Context, kinds: Operands) -> Out:
  """Positions: constant along every dim but the counted one."""
  eqn = ctx.eqn
  ndim = len(eqn.params["shape"])
  return Const(frozenset(range(ndim)) - {eqn.params["dimension"]})


@register("dim_as_value")
def dim_as_value(ctx: Context, kinds: Operands) -> Out:
  """A size as a value (symbolic mode: e.g. ``jnp.mean``'s divisor ``n``)."""
  eqn = ctx.eqn
  return Const(exp=ctx.pairing.degree(eqn.params["dim"]) if ctx.symbol is not None else None)


