"""Rules of contractions: ``dot_general`` and convolutions.

A matmul of batch rows with batch-independent values keeps examples apart; one that
contracts the batch axis of two row values (a gradient's ``x.T @ dy``) is a sum over
examples; one that pairs different examples (``x @ x.T``) mixes them. May import
:mod:`fxaccum.analysis.registry`, :mod:`fxaccum.analysis.kinds`,
:mod:`fxaccum.analysis.eqns` and :mod:`.common`.
"""

from __future__ import annotations

from collections.abc import Sequence

from fxaccum.analysis.eqns import shape_of, with_place
from fxaccum.analysis.kinds import Const, Kind, Rows, Stat, Top, add_exps
from fxaccum.analysis.registry import Context, Out, register
from fxaccum.analysis.rules.common import first_mixed, misaligned

__all__ = ["conv", "dot_general"]


@register("dot_general")
def dot_general(ctx: Context, kinds: Sequence[Kind]) -> Out:
  eqn = ctx.eqn
  lhs, rhs = kinds
  (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
  lhs_ndim, rhs_ndim = (len(shape_of(v)) for v in eqn.invars)
  lhs_free = [d for d in range(lhs_ndim) if d not in lc and d not in lb]
  rhs_free = [d for d in range(rhs_ndim) if d not in rc and d not in rb]
  exp = add_exps(kinds)
  scaled_contract = [ctx.scaled_dims(0) & set(lc), ctx.scaled_dims(1) & set(rc)]
  if isinstance(lhs, Const) and isinstance(rhs, Const):
    along = [d in lhs.uniform and rd in rhs.uniform for d, rd in zip(lb, rb, strict=True)]
    along += [d in lhs.uniform for d in lhs_free] + [d in rhs.uniform for d in rhs_free]
    return Const(frozenset(i for i, u in enumerate(along) if u),
                 exp=exp if not scaled_contract[0] else None)
  stats = [k for k in kinds if isinstance(k, Stat)]
  if stats:
    mixed = first_mixed(stats)
    if len(stats) == 2 or any(isinstance(k, Rows) for k in kinds) or exp is None:
      mixed = mixed or with_place(eqn, "a matmul of a batch statistic with batch values")
    return Stat(mixed, exp)

  def out_dim(side: int, dim: int) -> int:
    batch, free = (lb, lhs_free) if side == 0 else (rb, rhs_free)
    if dim in batch:
      return list(batch).index(dim)
    offset = len(lb) + (0 if side == 0 else len(lhs_free))
    return offset + free.index(dim)

  contract, batch = (lc, rc), (lb, rb)
  rows = [k for k in kinds if isinstance(k, Rows)]
  mixed = first_mixed(rows) or misaligned(eqn, rows)
  if exp is None:
    mixed = mixed or with_place(eqn, "a matmul of values that scale differently with the "
                            "micro-batch size")
  if isinstance(lhs, Rows) and isinstance(rhs, Rows):
    pair_batch = lhs.dim in lb and rb[list(lb).index(lhs.dim)] == rhs.dim
    pair_contract = lhs.dim in lc and rc[list(lc).index(lhs.dim)] == rhs.dim
    if (scaled_contract[0] - {lhs.dim}) or (scaled_contract[1] - {rhs.dim}):
      mixed = mixed or with_place(eqn, "a matmul over a dimension whose size follows the rows")
    if pair_batch:
      return Rows(out_dim(0, lhs.dim), mixed, exp, lhs.order)
    if pair_contract:
      return Stat(mixed, exp)
    # e.g. x @ x.T over the batch: every pair of examples (in-batch negatives).
    where = lhs.dim if lhs.dim in lhs_free else None
    reason = with_place(eqn, "a matmul that pairs different examples")
    return Rows(out_dim(0, where), reason, exp) if where is not None else Top(reason)
  side = 0 if isinstance(lhs, Rows) else 1
  row, const = (lhs, rhs) if side == 0 else (rhs, lhs)
  const_var = eqn.invars[1 - side]
  mine, theirs = contract[side], contract[1 - side]
  partner = None
  if row.dim in mine or row.dim in batch[side]:
    partner = (theirs[list(mine).index(row.dim)] if row.dim in mine
               else batch[1 - side][list(batch[side]).index(row.dim)])
    if not (const.value is not None or partner in const.uniform
            or shape_of(const_var)[partner] == 1):
      mixed = mixed or with_place(eqn, "a matmul of examples with position-dependent values")
  if (scaled_contract[side] - {row.dim}) or (scaled_contract[1 - side] - {partner}):
    mixed = mixed or with_place(eqn, "a matmul over a dimension whose size follows the rows")
  if row.dim in mine:
    return Stat(mixed, exp)
  return Rows(out_dim(side, row.dim), mixed, exp, row.order)


@register("conv_general_dilated")
def conv(ctx: Context, kinds: Sequence[Kind]) -> Out:
  eqn = ctx.eqn
  lhs, rhs = kinds
  dn = eqn.params["dimension_numbers"]
  exp = add_exps(kinds)
  single = eqn.params["batch_group_count"] == 1 and eqn.params["feature_group_count"] == 1
  extra = (ctx.scaled_dims(0) | ctx.scaled_dims(1)) - {
      k.dim for k in kinds if isinstance(k, Rows)}
  if isinstance(lhs, Const) and isinstance(rhs, Const):
    return Const(exp=None if extra else exp)
  if exp is None or extra or isinstance(lhs, (Stat, Top)) or isinstance(rhs, (Stat, Top)):
    return Top(with_place(eqn, "a convolution across examples"))
  if (isinstance(lhs, Rows) and isinstance(rhs, Const) and lhs.dim == dn.lhs_spec[0]
      and eqn.params["batch_group_count"] == 1):
    return Rows(dn.out_spec[0], lhs.mixed, exp, lhs.order)
  if (isinstance(lhs, Rows) and isinstance(rhs, Rows) and single
      and lhs.dim == dn.lhs_spec[1] and rhs.dim == dn.rhs_spec[1]):
    # A kernel's gradient: the examples are the contracted (feature) dimension.
    return Stat(first_mixed(kinds) or misaligned(eqn, kinds), exp)
  return Top(with_place(eqn, "a convolution across examples"))


