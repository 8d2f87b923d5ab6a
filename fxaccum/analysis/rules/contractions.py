"""Rules of contractions: ``dot_general`` and convolutions.

A matmul of batch rows with batch-independent values keeps examples apart; one that
contracts the batch axis of two row values (a gradient's ``x.T @ dy``) is a sum over
examples; one that pairs different examples (``x @ x.T``) mixes them. May import
:mod:`fxaccum.analysis.registry`, :mod:`fxaccum.analysis.kinds`,
:mod:`fxaccum.analysis.eqns` and :mod:`.common`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from fxaccum.analysis.eqns import shape_of, with_place
from fxaccum.analysis.kinds import Const, Exp, Kind, Rows, Stat, Top, add_exps
from fxaccum.analysis.registry import Context, Operands, Out, register
from fxaccum.analysis.rules.common import first_mixed, misaligned

__all__ = ["conv", "dot_general"]


class _Dims(NamedTuple):
  """A ``dot_general``'s dimension numbers, and its operands' free dims."""

  contract: tuple[Sequence[int], Sequence[int]]
  batch: tuple[Sequence[int], Sequence[int]]
  free: tuple[list[int], list[int]]

  @staticmethod
  def of(eqn: Any) -> _Dims:
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    lhs_ndim, rhs_ndim = (len(shape_of(v)) for v in eqn.invars)
    return _Dims((lc, rc), (lb, rb),
                 ([d for d in range(lhs_ndim) if d not in lc and d not in lb],
                  [d for d in range(rhs_ndim) if d not in rc and d not in rb]))

  def out_dim(self, side: int, dim: int) -> int:
    """Where dim ``dim`` of operand ``side`` lands in the result."""
    if dim in self.batch[side]:
      return list(self.batch[side]).index(dim)
    offset = len(self.batch[0]) + (0 if side == 0 else len(self.free[0]))
    return offset + self.free[side].index(dim)


@register("dot_general")
def dot_general(ctx: Context, kinds: Operands) -> Out:
  """A matmul: see the module doc."""
  eqn = ctx.eqn
  lhs, rhs = kinds
  dims = _Dims.of(eqn)
  (lc, rc), (lb, rb) = dims.contract, dims.batch
  exp = add_exps(kinds)
  scaled_contract = [ctx.scaled_dims(0) & set(lc), ctx.scaled_dims(1) & set(rc)]
  if isinstance(lhs, Const) and isinstance(rhs, Const):
    along = [d in lhs.uniform and rd in rhs.uniform for d, rd in zip(lb, rb, strict=True)]
    along += [d in lhs.uniform for d in dims.free[0]] + [d in rhs.uniform for d in dims.free[1]]
    return Const(frozenset(i for i, u in enumerate(along) if u),
                 exp=exp if not scaled_contract[0] else None)
  stats = [k for k in kinds if isinstance(k, Stat)]
  if stats:
    mixed = first_mixed(stats)
    if len(stats) == 2 or any(isinstance(k, Rows) for k in kinds) or exp is None:
      mixed = mixed or with_place(eqn, "a matmul of a batch statistic with batch values")
    return Stat(mixed, exp)
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
      return Rows(dims.out_dim(0, lhs.dim), mixed, exp, lhs.order)
    if pair_contract:
      return Stat(mixed, exp)
    # e.g. x @ x.T over the batch: every pair of examples (in-batch negatives).
    where = lhs.dim if lhs.dim in dims.free[0] else None
    reason = with_place(eqn, "a matmul that pairs different examples")
    return Rows(dims.out_dim(0, where), reason, exp) if where is not None else Top(reason)
  return _rows_with_const(eqn, kinds, dims, mixed, exp, scaled_contract)


def _rows_with_const(eqn: Any, kinds: Operands, dims: _Dims, mixed: str | None,
                     exp: Exp, scaled_contract: list[set[int]]) -> Kind:
  """A matmul of batch rows with a batch-independent operand (a layer's weights)."""
  side = 0 if isinstance(kinds[0], Rows) else 1
  row, const = kinds[side], kinds[1 - side]
  assert isinstance(row, Rows) and isinstance(const, Const)
  const_var = eqn.invars[1 - side]
  mine, theirs = dims.contract[side], dims.contract[1 - side]
  partner = None
  if row.dim in mine or row.dim in dims.batch[side]:
    partner = (theirs[list(mine).index(row.dim)] if row.dim in mine
               else dims.batch[1 - side][list(dims.batch[side]).index(row.dim)])
    if not (const.value is not None or partner in const.uniform
            or shape_of(const_var)[partner] == 1):
      mixed = mixed or with_place(eqn, "a matmul of examples with position-dependent values")
  if (scaled_contract[side] - {row.dim}) or (scaled_contract[1 - side] - {partner}):
    mixed = mixed or with_place(eqn, "a matmul over a dimension whose size follows the rows")
  if row.dim in mine:
    return Stat(mixed, exp)
  return Rows(dims.out_dim(side, row.dim), mixed, exp, row.order)


@register("conv_general_dilated")
def conv(ctx: Context, kinds: Operands) -> Out:
  """A convolution over each example (batch on the lhs batch dim), or a kernel's gradient
  (examples contracted as features); any other mixes examples."""
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


