"""Rules of ops that act on trailing dimensions as a whole: Fourier transforms (``fft``,
along its last ``len(fft_lengths)`` dims), the LU decomposition (``lu``, of the matrices
held by its last two dims) and triangular solves (``triangular_solve``), as
``jnp.linalg.solve`` calls them.

Each keeps examples apart when the batch axis is a leading dimension: every example's
rows are transformed (or decomposed) on their own. One along the batch axis mixes them.
May import :mod:`fxaccum.analysis.registry`, :mod:`fxaccum.analysis.kinds`,
:mod:`fxaccum.analysis.eqns` and :mod:`.common`.
"""

from __future__ import annotations

import dataclasses

from fxaccum.analysis.eqns import shape_of, with_place
from fxaccum.analysis.kinds import Const, Rows, Stat, Top
from fxaccum.analysis.registry import Context, Operands, Out, register
from fxaccum.analysis.rules.common import first_mixed, misaligned, uniform_at

__all__ = ["fft", "lu", "triangular_solve"]


def _trailing(ctx: Context, count: int) -> set[int]:
  """The last ``count`` dims of the equation's operand."""
  ndim = len(shape_of(ctx.eqn.invars[0]))
  return set(range(ndim - count, ndim))


@register("fft")
def fft(ctx: Context, kinds: Operands) -> Out:
  """A Fourier transform is linear: along other dims than the batch axis it keeps each
  example's rows apart, and it keeps a sum over examples one."""
  eqn = ctx.eqn
  kind = kinds[0]
  acted = _trailing(ctx, len(eqn.params["fft_lengths"]))
  scaled = ctx.scaled_dims(0) & acted
  if isinstance(kind, Const):
    return Const(kind.uniform - acted, exp=None if scaled else kind.exp)
  if isinstance(kind, Rows):
    if kind.dim in acted or scaled:
      return dataclasses.replace(kind, mixed=kind.mixed or with_place(
          eqn, "an fft along the batch axis"))
    return kind
  if scaled:
    return Stat(kind.mixed or with_place(eqn, "an fft of a statistic along a dimension whose "
                                         "size follows the number of rows"), kind.exp)
  return dataclasses.replace(kind, extreme=None)


@register("lu")
def lu(ctx: Context, kinds: Operands) -> Out:
  """The LU decomposition of each matrix of the last two dims (and its pivots and
  permutation): one matrix per example where the batch axis is a leading dim. It is no
  linear map: the operand must not scale with the number of rows."""
  eqn = ctx.eqn
  kind = kinds[0]
  acted = _trailing(ctx, 2)
  outs = len(eqn.outvars)
  scaled = ctx.scaled_dims(0) & acted
  if isinstance(kind, Const):
    return [Const(kind.uniform - acted, exp=0.0 if kind.exp == 0 and not scaled
                  else None)] * outs
  if isinstance(kind, Rows):
    reason = kind.mixed
    if kind.dim in acted or scaled:
      reason = reason or with_place(eqn, "an lu of matrices that span examples")
    elif kind.exp != 0:
      reason = reason or with_place(eqn, "an lu of values that scale with the micro-batch size")
    return [Rows(kind.dim, reason, 0.0 if reason is None else None, kind.order)] * outs
  return [Top(with_place(eqn, "an lu of a batch statistic"))] * outs


@register("triangular_solve")
def triangular_solve(ctx: Context, kinds: Operands) -> Out:
  """``a x = b`` (or ``x a = b``) for each triangular matrix ``a`` of the last two dims:
  one system per example where the batch axis is a leading dim of both (or of one, the
  other the same for every example). Linear in ``b``, so ``x`` scales as ``b / a``."""
  eqn = ctx.eqn
  a, b = kinds
  exp = None if a.exp is None or b.exp is None else b.exp - a.exp
  if isinstance(a, Const) and isinstance(b, Const):
    scaled = ctx.scaled_dims(0) | ctx.scaled_dims(1)
    return Const(exp=None if scaled & _trailing(ctx, 2) else exp)
  rows = [k for k in kinds if isinstance(k, Rows)]
  if len(rows) != len([k for k in kinds if not isinstance(k, Const)]):
    return Top(with_place(eqn, "a triangular solve with a batch statistic"))
  dim = rows[0].dim
  out_shape = shape_of(eqn.outvars[0])
  extra = (ctx.scaled_dims(0) | ctx.scaled_dims(1)) - {dim}
  ok = exp is not None and dim not in _trailing(ctx, 2) and not extra and all(
      (isinstance(k, Rows) and k.dim == dim) or (
          isinstance(k, Const) and uniform_at(k, v, out_shape, dim))
      for k, v in zip(kinds, eqn.invars, strict=True))
  mixed = first_mixed(rows) or misaligned(eqn, rows)
  return Rows(dim, mixed or (None if ok else with_place(
      eqn, "a triangular solve across examples")), exp, rows[0].order)
