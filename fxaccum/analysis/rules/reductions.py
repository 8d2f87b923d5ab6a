"""Rules of reductions (sums, maxima, ``argmax``), cumulative ops and window ops.

A sum over the batch axis is a statistic that adds up over devices; a maximum over it is
marked ``extreme`` (the maximum of the devices' maxima); a cumulative or window op along
the batch axis mixes examples. May import :mod:`fxaccum.analysis.registry`,
:mod:`fxaccum.analysis.kinds`, :mod:`fxaccum.analysis.eqns` and :mod:`.common`.
"""

from __future__ import annotations

import dataclasses

from fxaccum.analysis.eqns import shape_of, with_place
from fxaccum.analysis.kinds import Const, Exp, Rows, Stat, Top, add_exps
from fxaccum.analysis.registry import Context, Operands, Out, Rule, register, register_facts
from fxaccum.analysis.rules.common import (
  first_mixed,
  index_exp,
  map_uniform,
  misaligned,
  rescaled,
  shift,
)

__all__ = ["cumulative", "window"]


_EXTREMES = {"reduce_max": "max", "reduce_min": "min"}
# Reductions whose result does not change with the number of equal elements reduced.
_SIZE_FREE_REDUCTIONS = frozenset({"reduce_max", "reduce_min", "reduce_and", "reduce_or"})


def _reduction(linear: bool) -> Rule:
  """The rule of a reduction over ``axes``: a sum over the batch axis (``linear``) is a
  statistic that adds up over devices; a maximum, a product, ... is not (a maximum is
  marked ``extreme``)."""
  def rule(ctx: Context, kinds: Operands) -> Out:
    eqn = ctx.eqn
    kind = rescaled(eqn, kinds[0])
    name = eqn.primitive.name
    if name in ("argmax", "argmin") and kind.exp != index_exp(kind):
      kind = dataclasses.replace(kind, exp=index_exp(kind))
    axes = set(eqn.params["axes"])
    scaled = ctx.scaled_dims(0) & axes
    if isinstance(kind, Const):
      keep = [d for d in range(len(shape_of(eqn.invars[0]))) if d not in axes]
      uniform = map_uniform(kind.uniform, {d: i for i, d in enumerate(keep)})
      exp: Exp = kind.exp
      if scaled and not scaled <= kind.uniform:
        exp = None  # e.g. the sum of an iota over the rows
      elif scaled and name == "reduce_sum":  # a sum of equal elements: their number times one
        exp = add_exps([kind, Const(exp=ctx.size_exp(0, scaled))])
      elif scaled and name in ("argmax", "argmin"):
        exp = 0.0
      elif scaled and name not in _SIZE_FREE_REDUCTIONS:
        exp = None
      return Const(uniform, exp=exp)
    extra = scaled - ({kind.dim} if isinstance(kind, Rows) else set())
    mixed = kind.mixed or (with_place(eqn, "a reduction over a dimension whose size follows the "
                                  "number of rows") if extra else None)
    extreme = _EXTREMES.get(name)
    if isinstance(kind, Rows):
      if kind.dim not in axes:
        return Rows(shift(kind.dim, tuple(axes)), mixed, kind.exp, kind.order)
      if linear:
        return Stat(mixed, kind.exp)
      return Stat(mixed or with_place(
          eqn, f"{name} over the batch axis (not a sum over examples)"), kind.exp,
          extreme=extreme if mixed is None else None)
    if linear:
      return Stat(mixed, kind.exp)
    if isinstance(kind, Stat) and kind.extreme is not None and kind.extreme == extreme and (
        not extra):
      return kind  # e.g. the maximum over the other dims of a maximum over the examples
    return Stat(mixed or with_place(eqn, f"{name} of a batch statistic"), kind.exp)
  return rule


# JAX leaves these out over dims of size 1 (a gradient's sum over the batch when there is
# one row per device). A sum's bound is its operand's times the number summed.
register_facts("reduce_sum", bound="sums", noop_reduction=True)
register_facts("reduce_max", "reduce_min", bound="keeps", noop_reduction=True)
register_facts("reduce_and", "reduce_or", "reduce_prod", noop_reduction=True)
register("reduce_sum")(_reduction(linear=True))
register("reduce_max", "reduce_min", "reduce_prod", "reduce_and", "reduce_or", "reduce_xor",
         "argmax", "argmin")(_reduction(linear=False))


@register("cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp")
def cumulative(ctx: Context, kinds: Operands) -> Out:
  """A cumulative op along another axis than the batch's keeps examples apart."""
  eqn = ctx.eqn
  kind = rescaled(eqn, kinds[0])
  axis = eqn.params["axis"]
  scaled = axis in ctx.scaled_dims(0)
  if isinstance(kind, Const):
    return Const(kind.uniform - {axis}, exp=None if scaled else kind.exp)
  if isinstance(kind, Rows):
    if kind.dim == axis or scaled:
      return dataclasses.replace(kind, mixed=kind.mixed or with_place(
          eqn, "a cumulative op along the batch axis"))
    return kind
  if isinstance(kind, Stat) and eqn.primitive.name == "cumsum":  # sums, no extreme
    return dataclasses.replace(kind, extreme=None)
  return Stat(kind.mixed or with_place(eqn, "a cumulative op of a statistic"), kind.exp)


@register("reduce_window_sum", "reduce_window_max", "reduce_window_min", "reduce_window",
          "select_and_scatter_add")
def window(ctx: Context, kinds: Operands) -> Out:
  """A window op whose windows do not move along the batch axis keeps examples apart."""
  eqn = ctx.eqn
  kind = rescaled(eqn, kinds[0])
  outs = len(eqn.outvars)
  p = eqn.params
  moving = {d for d in range(len(p["window_dimensions"]))
            if not (p["window_dimensions"][d] == 1 and p["window_strides"][d] == 1
                    and tuple(p["padding"][d]) == (0, 0)
                    and p.get("base_dilation", (1,) * (d + 1))[d] == 1)}
  scaled = ctx.scaled_dims(0)
  if all(isinstance(k, Const) for k in kinds):
    return [Const(exp=kind.exp if not scaled & moving else None)] * outs
  if isinstance(kind, Rows):
    rows = [k for k in kinds if isinstance(k, Rows)]
    ok = (kind.dim not in moving and not (scaled - {kind.dim})
          and all(isinstance(k, Const) or k.dim == kind.dim for k in kinds))
    mixed = first_mixed(rows) or misaligned(eqn, rows)
    return [Rows(kind.dim, mixed or (None if ok else with_place(
        eqn, "a window op along the batch axis")), kind.exp, kind.order)] * outs
  return [Top(with_place(eqn, "a window op of batch values"))] * outs


