"""Can the loop run the view analysis's symbolic-size jaxpr instead of tracing the loss again?

Issue 43 asks for trace + lower of the 12-block LM step within 1.7x plain scan's; two traces
of the loss (the analysis's, with a symbolic number of rows, and the loop's) hold it near
2.5x (docs/performance.md, "Trace + lower time"). A study, JAX private APIs included: the
value-and-grad jaxpr of the LM's loss traced with a symbolic batch size, evaluated equation
by equation at a concrete size (shape parameters, ``dim_as_value`` and nested jaxprs
specialized), against tracing the loss at that size:

1. On the mesh as traced (outside any ``shard_map``), as the global view runs it.
2. Inside a ``shard_map`` manual over ``data``, as the per-device view runs it, with the
   gradients summed over ``data`` after it. The jaxpr traced outside the region carries
   the outer mesh (in each equation's context, its sharding parameters and its nested
   jaxprs' types): the evaluation retargets them to the region's mesh. With
   ``check_vma=True`` binding also needs the varying casts that JAX's own tracing inserts
   (none are in a jaxpr traced outside the region); with ``check_vma=False`` it needs none.

Each prints whether the compiled program equals the one from tracing (XLA's HLO, names,
numbering and source locations aside; else the lines that differ) and the seconds to
lower.

  python benchmarks/symbolic_specialization.py
"""
from __future__ import annotations

import contextlib
import difflib
import re
import time
from typing import Any

import common  # noqa: F401 - first: sets XLA_FLAGS before JAX starts
import jax
import jax.numpy as jnp
from jax._src import mesh as mesh_lib
from jax._src.export import shape_poly
from jax.extend import core as jcore
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from tracing import FULL, lm_problem


def _retargeted(mesh: Any) -> Any:
  """``mesh`` (the outer mesh, or a variant of it with other axis types) as the current
  region's: its manual axes kept, the other axes typed as in ``mesh``."""
  current = mesh_lib.get_abstract_mesh()
  manual = {a for a, t in zip(current.axis_names, current.axis_types, strict=True)
            if t == AxisType.Manual}
  if not manual or mesh is None or mesh.empty:
    return mesh
  return current.update_axis_types({a: t for a, t in zip(
      mesh.axis_names, mesh.axis_types, strict=True) if a not in manual})


def _concrete(value: Any, sizes: dict[str, int]) -> Any:
  """``value`` (an equation parameter) with symbolic sizes evaluated, meshes retargeted
  (:func:`_retargeted`) and nested jaxprs specialized."""
  if isinstance(value, shape_poly._DimExpr):
    return value._evaluate(sizes)
  if isinstance(value, NamedSharding):
    return NamedSharding(_retargeted(value.mesh), value.spec)
  if isinstance(value, mesh_lib.AbstractMesh):
    return _retargeted(value)
  if isinstance(value, tuple):
    items = [_concrete(v, sizes) for v in value]
    return type(value)(*items) if hasattr(value, "_fields") else tuple(items)
  if isinstance(value, jcore.ClosedJaxpr):
    return jax.make_jaxpr(lambda *a: evaluate(value, sizes, *a))(*[
        jax.ShapeDtypeStruct(_concrete(v.aval.shape, sizes), v.aval.dtype,
                             sharding=_concrete(v.aval.sharding, sizes))
        for v in value.jaxpr.invars])
  return value


def evaluate(closed: jcore.ClosedJaxpr, sizes: dict[str, int], *args: Any) -> list[Any]:
  """``closed`` (traced with symbolic sizes) run on ``args`` of the sizes ``sizes``."""
  values: dict[Any, Any] = dict(zip(closed.jaxpr.constvars, closed.consts, strict=True))
  values.update(zip(closed.jaxpr.invars, args, strict=True))

  def read(v):
    return v.val if isinstance(v, jcore.Literal) else values[v]

  for eqn in closed.jaxpr.eqns:
    if eqn.primitive is shape_poly.dim_as_value_p:
      outs = [jnp.asarray(_concrete(eqn.params["dim"], sizes), eqn.outvars[0].aval.dtype)]
    else:
      mesh = eqn.ctx.cur_abstract_mesh
      with (mesh_lib.use_abstract_mesh(_retargeted(mesh)) if not mesh.empty
            else contextlib.nullcontext()):
        params = {k: _concrete(p, sizes) for k, p in eqn.params.items()}
        outs = eqn.primitive.bind(*map(read, eqn.invars),
                                  **eqn.primitive.get_bind_params(params))
      outs = outs if eqn.primitive.multiple_results else [outs]
    values.update(zip(eqn.outvars, outs, strict=True))
  return [read(v) for v in closed.jaxpr.outvars]


def _program(lowered: Any) -> list[str]:
  """The compiled HLO's lines, names, numbering and source locations left out."""
  text = re.sub(r"metadata=\{[^}]*\}|%[\w.\-]+", "", lowered.compile().as_text())
  text = re.sub(r"\b(region|fused_computation|wrapped_\w+|jit_\w+|_\w+?)(_\d+)?\b", "N", text)
  return [line for line in text.splitlines() if not re.match(r"^\s*\d+ ", line)]


def _compared(traced: Any, evaluated: Any) -> str:
  a, b = _program(traced), _program(evaluated)
  if a == b:
    return "the same compiled program"
  diff = [line.strip() for line in difflib.unified_diff(a, b, lineterm="", n=0)
          if line[:1] in "+-" and line[:3] not in ("+++", "---")]
  return "differs: " + " | ".join(diff[:4])


def main() -> None:
  mesh = jax.make_mesh((8,), ("data",), (AxisType.Explicit,))
  with jax.set_mesh(mesh):
    loss, params, batch = lm_problem(**FULL, mesh=mesh)
    step = jax.value_and_grad(loss)
    (rows,) = jax.export.symbolic_shape("rows")
    whole = NamedSharding(mesh, P())
    symbolic = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct((rows, *x.shape[1:]), x.dtype, sharding=whole), batch)
    start = time.perf_counter()
    closed, shapes = jax.make_jaxpr(step, return_shape=True)(params, symbolic)
    print(f"symbolic trace: {time.perf_counter() - start:.2f} s")

    def specialized(p, b):
      outs = evaluate(closed, {"rows": b["inputs"].shape[0]}, *jax.tree.leaves((p, b)))
      return jax.tree.unflatten(jax.tree.structure(shapes), outs)

    local = jax.tree.map(  # one device's rows
        lambda x: jax.ShapeDtypeStruct((8, *x.shape[1:]), x.dtype, sharding=whole), batch)
    lowered, seconds = {}, {}
    for name, fn in (("traced", step), ("evaluated", specialized)):
      start = time.perf_counter()
      lowered[name] = jax.jit(fn).lower(params, local)
      seconds[name] = time.perf_counter() - start
    print(f"1. outside a region: {_compared(lowered['traced'], lowered['evaluated'])}; "
          f"lower {seconds['evaluated']:.2f} s (traced: {seconds['traced']:.2f} s)")

    def region(fn, check_vma):
      def local(p, b):
        if check_vma:  # as the per-device view: varying params, local gradients
          p = jax.tree.map(lambda x: jax.lax.pcast(x, ("data",), to="varying"), p)
        value, grads = fn(p, b)
        return value[None], jax.tree.map(lambda g: jax.lax.psum(g, "data"), grads)
      return jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P(), P("data")),
                                   out_specs=(P("data"), P()), axis_names={"data"},
                                   check_vma=check_vma))

    start = time.perf_counter()
    traced = region(step, True).lower(params, batch)
    print(f"2. in a region, traced (check_vma=True): lower {time.perf_counter() - start:.2f} s")
    for check_vma in (True, False):
      start = time.perf_counter()
      try:
        evaluated = region(specialized, check_vma).lower(params, batch)
      except ValueError as err:  # what JAX raises binding it
        print(f"2. in a region, evaluated (check_vma={check_vma}): ValueError: "
              f"{str(err).splitlines()[0][:150]}")
        continue
      print(f"2. in a region, evaluated (check_vma={check_vma}): lower "
            f"{time.perf_counter() - start:.2f} s; {_compared(traced, evaluated)}")


if __name__ == "__main__":
  main()
