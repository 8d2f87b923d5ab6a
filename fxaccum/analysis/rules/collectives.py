"""Rules of collectives and of ops that only place values (sharding constraints,
reshards, ``device_put``, optimization barriers).

A collective inside the loss reads other devices' values, so its results mix examples;
placing a value changes none. May import :mod:`fxaccum.analysis.registry`,
:mod:`fxaccum.analysis.kinds` and :mod:`fxaccum.analysis.eqns`.
"""

from __future__ import annotations

from fxaccum.analysis.eqns import with_place
from fxaccum.analysis.kinds import Top
from fxaccum.analysis.registry import Context, Operands, Out, register, register_facts

__all__ = ["COLLECTIVES", "PLACEMENTS", "collective", "placement"]

COLLECTIVES = ("psum", "pmax", "pmin", "all_gather", "all_to_all", "ppermute", "psum_scatter",
               "reduce_scatter", "axis_index", "pbroadcast", "pcast", "psum_invariant",
               "unreduced_pmax", "unreduced_pmin", "pbroadcast_dynamic")
PLACEMENTS = ("sharding_constraint", "reshard", "mesh_cast", "device_put",
              "optimization_barrier", "relayout")
# A param stays itself through these placements, and they keep a bound.
register_facts("sharding_constraint", "optimization_barrier", transparent=True, bound="keeps")


@register(*PLACEMENTS)
def placement(ctx: Context, kinds: Operands) -> Out:
  """Each result is its operand, placed elsewhere."""
  return list(kinds)


@register(*COLLECTIVES)
def collective(ctx: Context, kinds: Operands) -> Out:
  """A collective reads other devices' values: every result mixes examples."""
  eqn = ctx.eqn
  return [Top(with_place(eqn, f"the collective {eqn.primitive.name}"))] * len(eqn.outvars)
