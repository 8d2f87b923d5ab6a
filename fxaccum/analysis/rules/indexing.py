"""Rules of ops that select or place elements: slices, padding, reversals, ``top_k``,
``dynamic_update_slice``, ``gather``, ``scatter`` and ``sort``.

They keep examples apart when they act along other dimensions than the batch axis, at
positions that do not follow the number of rows (each such position operand is reported
as ``Result.sized_positions``), or when each example's indices pick within that example
(an embedding lookup, a batched gather). May import :mod:`fxaccum.analysis.registry`,
:mod:`fxaccum.analysis.kinds`, :mod:`fxaccum.analysis.eqns` and :mod:`.common`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

from fxaccum.analysis.eqns import shape_of, whole_dim, with_place
from fxaccum.analysis.kinds import Const, Kind, Rows, Stat, Top, add_exps, common_exp
from fxaccum.analysis.registry import (
    Context,
    Operands,
    Out,
    Result,
    Rule,
    register,
    register_facts,
)
from fxaccum.analysis.rules.common import (
    first_mixed,
    index_changes,
    index_exp,
    misaligned,
    uniform_at,
)

__all__ = ["dynamic_update_slice", "gather", "scatter", "sort"]


_TOP_K = ("top_k", "approx_top_k")  # the values, and their positions


def _rows_problem(what: str, eqn: Any, kind: Rows, dims: set[int], rest: Operands,
                  moves: bool) -> str:
  """Why an op of :func:`_along_batch` on rows does not keep examples apart."""
  if kind.dim in dims:
    return f"{what} along the batch axis"
  if eqn.primitive.name == "pad" and not (isinstance(rest[0], Const) and (
      rest[0].value == 0 or rest[0].exp == kind.exp)):
    return f"{what} with a value that is not a constant scaled like the rows"
  if not all(isinstance(k, Const) for k in rest):
    return f"{what} at a position computed from the batch"
  if moves:
    return f"{what} at positions that follow the number of rows"
  return f"{what} along a dimension whose size follows the number of rows"


def _along_batch(what: str, acted: Callable[[Any], set[int]]) -> Rule:
  """Ops on one operand (plus positions) that keep examples apart unless they act along
  the batch axis. ``acted(eqn)``: the dimensions the op moves or selects elements along."""
  linear_ops = ("slice", "dynamic_slice", "pad", "rev", "split")

  def rule(ctx: Context, kinds: Operands) -> Out:
    moves = index_changes(kinds[1:] if ctx.eqn.primitive.name != "pad" else [])
    return Result(kinds_of(ctx, kinds, moves), sized_positions=moves)

  def kinds_of(ctx: Context, kinds: Operands, moves: bool) -> list[Kind]:
    eqn = ctx.eqn
    kind, rest = kinds[0], kinds[1:]
    outs = len(eqn.outvars)
    name = eqn.primitive.name
    dims = acted(eqn)
    scaled = ctx.scaled_dims(0) & dims
    if isinstance(kind, Rows):
      ok = all(isinstance(k, Const) for k in rest) and not moves
      if name == "pad":  # the padding is part of every example
        ok = ok and (rest[0].value == 0 or rest[0].exp == kind.exp)
      order = kind.order
      if kind.dim in dims:
        if name == "rev" and ok:  # the same examples, in another order
          order, dims = (id(eqn), kind.order), dims - {kind.dim}
        else:
          ok = False
      if scaled - {kind.dim}:
        ok = False
      mixed = kind.mixed or (None if ok else with_place(eqn, _rows_problem(
          what, eqn, kind, dims, rest, moves)))
      if name in _TOP_K:  # the values, and their positions
        return [Rows(kind.dim, mixed, kind.exp, order),
                Rows(kind.dim, mixed, index_exp(kind), order)]
      return [Rows(kind.dim, mixed, kind.exp, order)] * outs
    if isinstance(kind, Stat):
      ok = (name in linear_ops and all(isinstance(k, Const) for k in rest)
            and not moves and not scaled)
      if name == "pad":  # the padding must add up over devices like the statistic
        ok = ok and (rest[0].value == 0 or (
            kind.exp is not None and rest[0].exp == kind.exp + 1))
      return [Stat(kind.mixed or (None if ok else with_place(eqn, f"{what} of a statistic")),
                   kind.exp)] * outs
    if all(isinstance(k, Const) for k in kinds):
      exp = None if moves or not scaled <= kind.uniform else kind.exp
      uniform, value = kind.uniform, kind.value
      if name == "pad":
        exp = common_exp(kinds) if exp is not None else None
        if value is None or rest[0].value != value:
          uniform, value = uniform - dims, None
      elif name in _TOP_K:  # the values, and their positions (no known value)
        uniform = uniform - dims
        return [Const(uniform, value, exp),
                Const(uniform, None, None if exp is None else 0.0)]
      return [Const(uniform, value, exp)] * outs
    return [Top(with_place(eqn, f"{what} indexed by batch values"))] * outs
  return rule


def _sliced_dims(eqn) -> set[int]:
  shape = shape_of(eqn.invars[0])
  return {d for d in range(len(shape)) if not whole_dim(eqn, d)}


def _padded_dims(eqn) -> set[int]:
  return {d for d, cfg in enumerate(eqn.params["padding_config"]) if tuple(cfg) != (0, 0, 0)}


# A slice's bounds may follow the rows where it takes the dims that follow them whole.
register_facts("slice", slice_params={"start_indices", "limit_indices", "strides"})
register_facts("dynamic_slice", slice_params={"slice_sizes"})
register("rev")(_along_batch("a reversal", lambda e: set(e.params["dimensions"])))
register("slice")(_along_batch("a slice", _sliced_dims))
register("dynamic_slice")(_along_batch("a dynamic slice", _sliced_dims))
register("pad")(_along_batch("padding", _padded_dims))
register("split")(_along_batch("a split", lambda e: {e.params["axis"]}))
register("top_k")(_along_batch("top_k", lambda e: {  # JAX before 0.10: the last axis
    e.params.get("axis", -1) % len(shape_of(e.invars[0]))}))
register("approx_top_k")(_along_batch("approx_top_k", lambda e: {
    e.params["reduction_dimension"] % len(shape_of(e.invars[0]))}))


@register("dynamic_update_slice")
def dynamic_update_slice(ctx: Context, kinds: Operands) -> Out:
  """An update that writes whole examples' rows keeps them apart."""
  eqn = ctx.eqn
  operand, update = kinds[:2]
  if index_changes(kinds[2:]):
    return Result(Top(with_place(
        eqn, "an update at a position that follows the number of rows")) if any(
            not isinstance(k, Const) for k in kinds) else Const(exp=None), sized_positions=True)
  if all(isinstance(k, Const) for k in kinds):
    scaled = ctx.scaled_dims(0)
    return Const(exp=None if scaled else common_exp(kinds[:2]))
  rows = [k for k in (operand, update) if isinstance(k, Rows)]
  if rows and all(isinstance(k, Const) for k in kinds[2:]):
    dim = rows[0].dim
    full = shape_of(eqn.invars[1])[dim] == shape_of(eqn.invars[0])[dim]
    exp = common_exp(kinds[:2])
    ok = full and exp is not None and not (ctx.scaled_dims(0) - {dim}) and all(
        (isinstance(k, Rows) and k.dim == dim) or
        (isinstance(k, Const) and uniform_at(k, v, shape_of(eqn.outvars[0]), dim))
        for k, v in zip((operand, update), eqn.invars[:2], strict=True))
    mixed = first_mixed(rows) or misaligned(eqn, rows)
    return Rows(dim, mixed or (None if ok else with_place(eqn, "an update of some examples")), exp,
                rows[0].order)
  return Top(with_place(eqn, "dynamic_update_slice of batch values"))


register_facts("gather", slice_params={"slice_sizes"})  # as a slice's (see above)


@register("gather")
def gather(ctx: Context, kinds: Operands) -> Out:
  """A gather: an embedding lookup per example, a batched gather within each example, or
  a slice taking the batch axis whole."""
  moves = index_changes([kinds[1]])
  return Result(_gather_kind(ctx, kinds, moves), sized_positions=moves)


def _gather_kind(ctx: Context, kinds: Operands, moves: bool) -> Kind:
  """The kind of a gather's result (``moves``: its indices follow the number of rows)."""
  eqn = ctx.eqn
  operand, indices = kinds
  dn = eqn.params["dimension_numbers"]
  slice_sizes = eqn.params["slice_sizes"]
  op_shape, idx_shape = shape_of(eqn.invars[0]), shape_of(eqn.invars[1])
  out_ndim = len(shape_of(eqn.outvars[0]))
  batch_out = [d for d in range(out_ndim) if d not in dn.offset_dims]
  selected = {d for d in range(len(op_shape)) if slice_sizes[d] != op_shape[d]} | set(
      dn.start_index_map)
  scaled_selected = ctx.scaled_dims(0) & selected
  if isinstance(operand, Const) and isinstance(indices, Const):
    changes = moves or not scaled_selected <= operand.uniform
    # Uniform along each dim the gather takes whole from 0 (a slice, as a symbolic size
    # spells ``x[:, :1]``): ctc_loss's recursion starts from such a slice of constants.
    taken = _offsets(dn, len(op_shape))
    uniform = {out: d for d, out in taken.items() if d in operand.uniform
               and d not in selected}
    return Const(frozenset(uniform), exp=None if changes else operand.exp)
  if isinstance(operand, Stat) or isinstance(indices, Stat):
    return Top(with_place(eqn, "a gather that involves a batch statistic"))
  rows = [k for k in kinds if isinstance(k, Rows)]
  mixed = first_mixed(rows) or misaligned(eqn, rows)
  idx_dims = list(range(len(idx_shape) - 1))  # the last is the index vector
  if isinstance(indices, Rows):
    if indices.dim == len(idx_shape) - 1:
      return Top(with_place(eqn, "a gather whose index vectors run along the batch axis"))
    if indices.exp != 0:
      mixed = mixed or with_place(eqn, "a gather at positions that follow the number of rows")
    dim = batch_out[idx_dims.index(indices.dim)]
    if isinstance(operand, Const):  # a lookup (embedding) per example
      if scaled_selected - operand.uniform:
        mixed = mixed or with_place(eqn, "a lookup in a table whose size follows the rows")
      return Rows(dim, mixed, operand.exp, indices.order)
    paired = (operand.dim in dn.operand_batching_dims and dn.start_indices_batching_dims[
        list(dn.operand_batching_dims).index(operand.dim)] == indices.dim)
    if scaled_selected - {operand.dim}:
      paired = False
    return Rows(dim, mixed or (None if paired else with_place(
        eqn, "a gather of other examples' values")), operand.exp, indices.order)
  # Rows operand, batch-independent indices: the batch axis must be sliced whole, or be a
  # batching dim whose indices are the same for every example (searchsorted under vmap).
  dim = operand.dim
  if dim in dn.operand_batching_dims:
    idx_dim = dn.start_indices_batching_dims[list(dn.operand_batching_dims).index(dim)]
    same = uniform_at(indices, eqn.invars[1], idx_shape, idx_dim)
    ok = same and not moves and not (scaled_selected - {dim})
    return Rows(batch_out[idx_dims.index(idx_dim)], mixed or (None if ok else with_place(
        eqn, "a gather at positions that differ from example to example")), operand.exp,
        operand.order)
  whole = (dim not in dn.start_index_map and dim not in dn.collapsed_slice_dims
           and dim not in dn.operand_batching_dims and slice_sizes[dim] == op_shape[dim])
  if not whole or moves or scaled_selected:
    return Top(with_place(eqn, "a gather that selects examples"))
  return Rows(_offsets(dn, len(op_shape))[dim], mixed, operand.exp, operand.order)


def _offsets(dn: Any, ndim: int) -> dict[int, int]:
  """A gather's operand dims that are offset dims, and where each lands in the result."""
  offset_operand_dims = [d for d in range(ndim)
                         if d not in dn.collapsed_slice_dims and d not in dn.operand_batching_dims]
  return dict(zip(offset_operand_dims, dn.offset_dims, strict=True))


class _Scatter(NamedTuple):
  """Where a scatter's dimensions go (its operand, indices and updates)."""

  op_shape: tuple[int, ...]
  upd_shape: tuple[int, ...]
  idx_batch: list[int]  # the indices' batch dims (the last one is the index vector)
  window_op_dims: list[int]
  window: dict[int, int]  # update window dim -> operand dim
  upd_scatter: list[int]  # the updates' dims that are not window dims
  scaled: set[int]  # the operand's dims whose size follows the rows

  @staticmethod
  def of(ctx: Context) -> _Scatter:
    eqn = ctx.eqn
    dn = eqn.params["dimension_numbers"]
    op_shape, upd_shape = shape_of(eqn.invars[0]), shape_of(eqn.invars[2])
    window_op_dims = [d for d in range(len(op_shape)) if d not in dn.inserted_window_dims
                      and d not in dn.operand_batching_dims]
    return _Scatter(
        op_shape, upd_shape, list(range(len(shape_of(eqn.invars[1])) - 1)), window_op_dims,
        dict(zip(dn.update_window_dims, window_op_dims, strict=True)),
        [d for d in range(len(upd_shape)) if d not in dn.update_window_dims],
        ctx.scaled_dims(0))


@register("scatter", "scatter-add", "scatter-mul", "scatter-min", "scatter-max")
def scatter(ctx: Context, kinds: Operands) -> Out:
  """``scatter`` (``x.at[...].set``), ``scatter-add`` (the transpose of a gather: an
  embedding's gradient) and the other scatter combiners."""
  eqn = ctx.eqn
  operand, indices, updates = kinds[:3]
  name = eqn.primitive.name
  at = _Scatter.of(ctx)
  sized = index_changes([indices])
  moves = sized or (isinstance(indices, Rows) and indices.exp != 0)
  if all(isinstance(k, Const) for k in kinds):
    # Along a dimension whose size follows the rows the window must be whole, and the
    # number of updates must not follow them (counts: segment_sum(ones(n), ids)).
    whole = {d for u, d in at.window.items() if at.upd_shape[u] == at.op_shape[d]}
    moved = (at.scaled - whole) | (ctx.scaled_dims(2) & set(at.upd_scatter)) | (
        ctx.scaled_dims(1) & set(at.idx_batch))
    uniform = {d for u, d in at.window.items()
               if d in whole and d in operand.uniform and (
                   u in updates.uniform or updates.value is not None)}
    return Result(Const(frozenset(uniform), exp=None if moved or moves
                        else common_exp([operand, updates])), sized_positions=sized)
  if (isinstance(updates, Stat) and isinstance(indices, Const) and not moves
      and name in ("scatter", "scatter-add") and not at.scaled and (
          (isinstance(operand, Const) and operand.value == 0)
          or (isinstance(operand, Stat) and name == "scatter-add"))):
    # A statistic placed into zeros (or added to one): still linear in the examples.
    stats = [k for k in (operand, updates) if isinstance(k, Stat)]
    exp = common_exp([operand, updates])
    return Result(Stat(first_mixed(stats) or (None if exp is not None else with_place(
        eqn, f"a {name} of statistics that scale differently")), exp), sized_positions=sized)
  if any(isinstance(k, (Stat, Top)) for k in kinds) or moves:
    return Result(Top(with_place(
        eqn, f"a {name} that involves batch statistics or moving positions")),
        sized_positions=sized)
  return Result(_scatter_rows(ctx, kinds, at), sized_positions=sized)


def _scatter_rows(ctx: Context, kinds: Operands, at: _Scatter) -> Kind:
  """A scatter of batch rows with batch-independent or per-example indices."""
  eqn = ctx.eqn
  operand, indices, updates = kinds[:3]
  name = eqn.primitive.name
  dn = eqn.params["dimension_numbers"]
  rows = [k for k in kinds if isinstance(k, Rows)]
  mixed = first_mixed(rows) or misaligned(eqn, rows)
  exp = (add_exps([operand, updates]) if name == "scatter-mul"
         else common_exp([operand, updates]))
  order = rows[0].order

  def aligned(dim: int, upd_dim: int) -> bool:
    return all((isinstance(k, Rows) and k.dim == d) or (
        isinstance(k, Const) and uniform_at(k, v, shape_of(v), d))
        for k, v, d in ((operand, eqn.invars[0], dim), (updates, eqn.invars[2], upd_dim)))

  # 1. Along each example: the batch is a window dimension of the operand taken whole (or
  #    held by the operand only), and the indices are batch-independent.
  dim = operand.dim if isinstance(operand, Rows) else (
      at.window.get(updates.dim) if isinstance(updates, Rows) else None)
  if isinstance(indices, Const) and dim is not None and dim in at.window_op_dims:
    upd_dim = next(u for u, d in at.window.items() if d == dim)
    ok = (at.upd_shape[upd_dim] == at.op_shape[dim] and exp is not None
          and not (at.scaled - {dim}) and aligned(dim, upd_dim))
    return Rows(dim, mixed or (None if ok else with_place(eqn, f"a {name} that moves examples")),
                exp, order)
  # 2. Batched: the operand's batching dimension pairs each example with its indices.
  if isinstance(indices, Rows) and indices.dim in dn.scatter_indices_batching_dims:
    dim = dn.operand_batching_dims[list(dn.scatter_indices_batching_dims).index(indices.dim)]
    found = at.upd_scatter[at.idx_batch.index(indices.dim)] if (
        indices.dim in at.idx_batch) else None
    ok = exp is not None and found is not None and not (at.scaled - {dim}) and aligned(
        dim, found)
    return Rows(dim, mixed or (None if ok else with_place(eqn, f"a {name} across examples")), exp,
                order)
  # 3. A sum over examples: each example's update added into a batch-independent zero.
  if (name == "scatter-add" and isinstance(operand, Const) and operand.value == 0
      and isinstance(updates, Rows) and updates.dim in at.upd_scatter):
    idx_dim = at.idx_batch[at.upd_scatter.index(updates.dim)]
    # Each example's own index, or one the same for every example: an index that follows
    # the example's position (iota % 3) would place a device's rows by their local place.
    per_example = (indices.dim == idx_dim if isinstance(indices, Rows) else isinstance(
        indices, Const) and uniform_at(indices, eqn.invars[1], shape_of(eqn.invars[1]), idx_dim))
    ok = per_example and not (ctx.scaled_dims(2) - {updates.dim})
    return Stat(mixed or (None if ok else with_place(eqn, "a scatter-add across examples")),
                updates.exp)
  return Top(with_place(eqn, f"a {name} across examples"))


@register("sort")
def sort(ctx: Context, kinds: Operands) -> Out:
  """A sort along another axis than the batch's, by keys that do not follow the rows."""
  eqn = ctx.eqn
  axis = eqn.params["dimension"]
  # Keys that follow the number of rows (other than as a common factor) reorder the rest.
  moves = axis not in ctx.scaled_dims(0) and index_changes(
      [k for k in kinds[:eqn.params["num_keys"]] if isinstance(k, Const)])
  scaled = axis in ctx.scaled_dims(0) or moves
  return Result(_sort_kinds(eqn, kinds, scaled), sized_positions=moves)


def _sort_kinds(eqn: Any, kinds: Operands, scaled: bool) -> list[Kind]:
  """The kinds of a sort's results (``scaled``: its order follows the number of rows)."""
  axis = eqn.params["dimension"]
  rows = [k for k in kinds if isinstance(k, Rows)]
  outs = len(eqn.outvars)
  if not rows:
    if all(isinstance(k, Const) for k in kinds):
      return [Const(exp=None if scaled else k.exp) for k in kinds]
    return [Top(with_place(eqn, "a sort of batch statistics"))] * outs
  dim = rows[0].dim
  out_shape = shape_of(eqn.outvars[0])
  ok = axis != dim and not scaled and all((isinstance(k, Rows) and k.dim == dim) or (
      isinstance(k, Const) and uniform_at(k, v, out_shape, dim))
      for k, v in zip(kinds, eqn.invars, strict=True))
  mixed = first_mixed(rows) or misaligned(eqn, rows)
  mixed = mixed or (None if ok else with_place(
      eqn, "a sort along the batch axis, or by keys that follow the number of rows"))
  return [Rows(dim, mixed, k.exp, rows[0].order) for k in kinds]


