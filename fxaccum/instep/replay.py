"""The loop runs the analysis's jaxpr: one trace of the loss serves the decision and the loop.

The view analysis traces one micro-step with a *symbolic* number of rows
(:func:`fxaccum.instep.analysed.analyses`); :func:`evaluate` runs that jaxpr at the loop's
concrete number of rows, equation by equation, instead of tracing the loss's Python code
again (its flax modules, its autodiff) where the loop runs. What JAX's own tracing does at
a concrete size, the evaluation does for each equation:

- symbolic sizes in an equation's parameters (shapes, slice sizes) become the concrete
  ones, and ``dim_as_value`` (a size used as a number, e.g. ``jnp.mean``'s divisor) the
  concrete number;
- the mesh in its context, sharding parameters and types is retargeted to the mesh where
  the loop runs (the per-device region's, its data axes manual);
- operands that vary over different manual axes are cast to their union first, as JAX's
  operation wrappers do (``auto_insert_reshard``); the jaxpr was traced outside the
  region, where nothing varies;
- a nested ``jit``, ``custom_jvp`` or ``custom_vjp`` call is run inline (what XLA does with
  it: the compiled program is the same).

:func:`blocker` says, before anything runs, why a jaxpr is not replayed (an equation the
evaluation does not cover: collectives, control flow, effects, a sharding over the data
axes); then the loop traces the loss again, as it always could. This module reads JAX's
equation API (``jax._src``): docs/notes/view_analysis.md, "One trace".
"""

from __future__ import annotations

import contextlib
import enum
import functools
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax._src import core as jax_core
from jax._src import sharding_impls, source_info_util
from jax._src.export import shape_poly
from jax.extend import core as jcore
from jax.sharding import AbstractMesh, AxisType, NamedSharding, PartitionSpec

from fxaccum import jaxprs, meshes

# The symbolic number of rows the view analysis traces the micro-step with.
ROWS = "rows"

__all__ = ["ROWS", "Replayable", "blocker", "data_sharding", "evaluate", "out_types",
           "replayable"]


class Replayable(NamedTuple):
  """A micro-step the loop may run by :func:`evaluate`.

  Attributes:
    closed: its jaxpr, ``(leaves, micro-batch, index, state) -> outputs``, traced with a
      symbolic number of rows named :data:`ROWS`.
    shapes: its outputs' shapes, ``((total, (weight, aux, state, sown, kind)), grads)``.
    arguments: per constant of ``closed``, its position among the call's argument leaves
      (``Call.argument_leaves``) where the trace closed over one of them, else None:
      where the loop runs, the argument as it sees it takes its place.
  """

  closed: Any
  shapes: Any
  arguments: tuple[int | None, ...]

  def consts(self, arguments: Sequence[Any]) -> list[Any]:
    """The constants of :attr:`closed`, the call's argument leaves ``arguments`` as the
    loop sees them (``Call.argument_leaves``) in place of those it closed over."""
    return [c if i is None else arguments[i]
            for c, i in zip(self.closed.consts, self.arguments, strict=True)]


def replayable(closed: Any, shapes: Any, arguments: Sequence[Any]) -> Replayable:
  """``closed`` (outputs ``shapes``) as a :class:`Replayable`, its constants found
  among the argument leaves ``arguments`` by identity."""
  position = {id(x): i for i, x in enumerate(arguments)}
  return Replayable(closed, shapes, tuple(position.get(id(c)) for c in closed.consts))


# Nested calls run inline: their lowering is their jaxpr's, inlined by XLA.
_INLINED = {"jit": "jaxpr", "custom_jvp_call": "call_jaxpr", "custom_vjp_call": "call_jaxpr"}


def blocker(closed: Any, data_axes: Sequence[str]) -> str | None:
  """Why :func:`evaluate` does not run ``closed`` where ``data_axes`` are manual (the
  first equation it does not cover), or None."""
  for eqn in _equations(closed):
    name = eqn.primitive.name
    if _names(eqn, data_axes):
      return f"its {name} names the data axes in a sharding"
    if name not in _INLINED and any(map(_opaque, eqn.params.values())):
      return f"its {name} holds the number of rows in a parameter the evaluation cannot read"
    if name == "jit" and not _unconstrained(eqn.params):
      return "a nested jit names shardings or donates"
    if (name not in _INLINED and name not in _COMBINERS
        and any(map(jaxprs.subjaxprs, eqn.params.values()))):
      return f"it holds a {name}"
    if name in _NAMED_AXES:
      return f"it names mesh axes in {name}"
    if eqn.effects:
      return f"its {name} has effects"
  return None


# Operations holding a jaxpr of scalars only (how they combine elements): bound as traced.
_COMBINERS = frozenset({
    "scatter", "scatter-add", "scatter-mul", "scatter-min", "scatter-max", "scatter-sub",
    "reduce", "reduce_window", "select_and_scatter", "select_and_scatter_add",
    "select_and_gather_add"})

# Operations that name mesh axes: their meaning depends on where they run.
_NAMED_AXES = frozenset({
    "psum", "pmax", "pmin", "psum_invariant", "all_gather", "all_gather_invariant",
    "all_to_all", "ppermute", "psum_scatter", "reduce_scatter", "axis_index", "pvary",
    "pcast", "reduced_vary_cast", "unreduced_psum", "unreduced_psum_scatter",
    "preduced", "vary_unreduced_cast"})


def data_sharding(closed: Any, data_axes: Sequence[str]) -> str | None:
  """The first equation of ``closed`` that names ``data_axes`` in a sharding parameter
  (e.g. ``with_sharding_constraint``), or None. Where the loss runs per device those axes
  are manual: flax's logical constraints drop them there, a constraint of the loss's own
  fails; which one a jaxpr traced outside the region holds, it does not say."""
  return next((eqn.primitive.name for eqn in _equations(closed) if _names(eqn, data_axes)),
              None)


def _equations(closed: Any) -> Iterator[Any]:
  """Every equation of ``closed``, those of its sub-jaxprs too (depth first)."""
  return (inner for eqn in closed.jaxpr.eqns for inner in jaxprs.eqns_within(eqn))


def _names(eqn: Any, data_axes: Sequence[str]) -> bool:
  return any(meshes.named_axes(spec) & set(data_axes) for spec in _specs(eqn.params))


def _specs(value: Any) -> list[Any]:
  """The PartitionSpecs an equation parameter holds (of its shardings too)."""
  if isinstance(value, NamedSharding):
    return [value.spec]
  if isinstance(value, PartitionSpec):
    return [value]
  if isinstance(value, dict):
    value = list(value.values())
  if isinstance(value, (tuple, list)):
    return [spec for v in value for spec in _specs(v)]
  return []


# Parameter types :func:`_concrete` reads or passes through (no symbolic size inside).
_READ = (int, float, str, type(None), shape_poly._DimExpr, NamedSharding, PartitionSpec,
         AbstractMesh, np.integer, np.dtype, enum.Enum, jcore.Jaxpr,
         jcore.ClosedJaxpr, sharding_impls.UnspecifiedValue)


def _opaque(value: Any) -> bool:
  """Whether an equation parameter may hold a symbolic size that :func:`_concrete` does
  not reach (an object of another type whose text names :data:`ROWS`)."""
  if isinstance(value, (tuple, list)):
    return any(map(_opaque, value))
  return not isinstance(value, _READ) and ROWS in repr(value)


def _unconstrained(params: dict[str, Any]) -> bool:
  shardings = (*params.get("in_shardings", ()), *params.get("out_shardings", ()))
  return (all(isinstance(s, sharding_impls.UnspecifiedValue) for s in shardings)
          and not any(params.get("donated_invars", ())))


def evaluate(closed: Any, sizes: dict[str, Any], *args: Any,
             consts: Sequence[Any] | None = None) -> list[Any]:
  """``closed`` (traced with the symbolic sizes named in ``sizes``) run on ``args``, of
  those sizes, where the caller traces (see the module's docstring); ``consts`` in place
  of its constants."""
  values: dict[Any, Any] = dict(zip(
      closed.jaxpr.constvars, closed.consts if consts is None else consts, strict=True))
  values.update(zip(closed.jaxpr.invars, args, strict=True))

  def read(v: Any) -> Any:
    return v.val if isinstance(v, jcore.Literal) else values[v]

  for eqn in closed.jaxpr.eqns:
    operands = [read(v) for v in eqn.invars]
    name = eqn.primitive.name
    mesh = _retargeted(eqn.ctx.cur_abstract_mesh)  # before its context sets the traced one
    # Its source and name stack (flax module paths) in the compiled program's metadata.
    with source_info_util.user_context(
        eqn.source_info.traceback,
        name_stack=source_info_util.current_name_stack() + eqn.source_info.name_stack):
      if name in _INLINED:
        outs = evaluate(eqn.params[_INLINED[name]], sizes, *operands)
      elif eqn.primitive is shape_poly.dim_as_value_p:
        outs = [jnp.asarray(_concrete(eqn.params["dim"], sizes), eqn.outvars[0].aval.dtype)]
      else:
        with eqn.ctx.manager, _in_mesh(mesh):
          params = {k: _concrete(p, sizes) for k, p in eqn.params.items()}
          if len(operands) > 1:
            operands = jax_core.auto_insert_reshard(*operands)
          outs = eqn.primitive.bind(*operands, **eqn.primitive.get_bind_params(params))
        outs = outs if eqn.primitive.multiple_results else [outs]
    values.update(zip(eqn.outvars, outs, strict=True))
  return [read(v) for v in closed.jaxpr.outvars]


def out_types(closed: Any, sizes: dict[str, Any], inputs: Sequence[Any]) -> list[Any]:
  """The abstract values :func:`evaluate` gives for ``closed`` on ``inputs`` (values or
  abstract values: its constants, then its arguments) where the caller traces, read from
  the jaxpr instead of running it: each output's shape at ``sizes``, its sharding
  retargeted, and the manual axes it varies over: those of the inputs it depends on, as
  :func:`evaluate` casts an equation's operands to their union and nothing that
  :func:`blocker` lets run (no collective) changes them."""
  axes = _varying(closed.jaxpr, [meshes.varying_axes(x) for x in inputs])
  return [v.aval.update(shape=_concrete(v.aval.shape, sizes),
                        sharding=_concrete(v.aval.sharding, sizes),
                        manual_axis_type=v.aval.mat.update(varying=a))
          for v, a in zip(closed.jaxpr.outvars, axes, strict=True)]


def _varying(jaxpr: Any, inputs: list[frozenset[str]]) -> list[frozenset[str]]:
  """Per output of ``jaxpr``, the manual axes it varies over, its constants and
  arguments varying over ``inputs``; nested calls followed inside, as :func:`evaluate`
  runs them."""
  varying = dict(zip([*jaxpr.constvars, *jaxpr.invars], inputs, strict=True))

  def of(v: Any) -> frozenset[str]:
    return frozenset() if isinstance(v, jcore.Literal) else varying[v]

  for eqn in jaxpr.eqns:
    operands = list(map(of, eqn.invars))
    if eqn.primitive.name in _INLINED:  # its constants: arrays of the trace, varying over none
      inner = eqn.params[_INLINED[eqn.primitive.name]]
      outs = _varying(inner.jaxpr, [frozenset()] * len(inner.consts) + operands)
    else:
      outs = [frozenset().union(*operands)] * len(eqn.outvars)
    varying.update(zip(eqn.outvars, outs, strict=True))
  return [of(v) for v in jaxpr.outvars]


def _in_mesh(mesh: Any) -> Any:
  """The mesh context (retargeted) an equation binds in."""
  if mesh is None or mesh.empty:
    return contextlib.nullcontext()
  return jax.sharding.use_abstract_mesh(mesh)


def _retargeted(mesh: Any) -> Any:
  """``mesh`` (as traced, outside the region) as the current region's: its manual axes
  kept, the other axes typed as in ``mesh``."""
  return _retargeted_to(mesh, jax.sharding.get_abstract_mesh())


@functools.lru_cache(maxsize=64)
def _retargeted_to(mesh: Any, current: Any) -> Any:
  manual = meshes.axes_of_type(current, AxisType.Manual)
  if not manual:
    return mesh
  if mesh is None or mesh.empty:  # traced without a mesh: the region's
    return current
  return current.update_axis_types({a: t for a, t in zip(
      mesh.axis_names, mesh.axis_types, strict=True) if a not in manual})


def _concrete(value: Any, sizes: dict[str, Any]) -> Any:
  """An equation parameter with symbolic sizes evaluated and meshes retargeted."""
  if isinstance(value, (int, float, str, type(None))):  # most parameters: as they are
    return value
  if isinstance(value, shape_poly._DimExpr):
    return value._evaluate(sizes)
  if isinstance(value, NamedSharding):
    return value.update(mesh=_retargeted(value.mesh))
  if isinstance(value, AbstractMesh):
    return _retargeted(value)
  if isinstance(value, tuple):
    items = [_concrete(v, sizes) for v in value]
    return type(value)(*items) if hasattr(value, "_fields") else tuple(items)
  return value
