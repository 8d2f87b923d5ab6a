"""Reading jaxprs: the sub-jaxprs an equation holds, and the equation parameters that JAX
versions write differently.

fxaccum reads jaxprs (the view analysis, ZeRO-3 gathering); where a JAX release changes
how a primitive records its parameters, the difference is bridged here. Every walk that
enters sub-jaxprs (the analysis's interpreter and its pairing of two traces,
``depends_on``, the ZeRO-3 evaluator) finds them with :func:`held_jaxprs`, so a new way
of holding one is taught to all of them at once. A JAX "hijax" primitive (JAX 0.12 runs
``jnp.searchsorted`` as one: an equation ``call_hi_primitive`` whose ``_prim`` parameter
is the primitive object) holds the jaxpr of its expansion into ordinary primitives.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator, Mapping
from typing import Any

import jax
import numpy as np
from jax.extend import core as jcore

__all__ = ["eqns_within", "expansion", "forwards", "held_jaxprs", "scan_counts", "subjaxprs"]

_EXPANSIONS: dict[int, Any] = {}  # id(primitive object) -> the jaxpr of its expansion


def scan_counts(params: Mapping[str, Any]) -> tuple[int, int]:
  """The numbers of constants and carries of a ``scan`` equation (its other inputs are
  the sliced ``xs``): JAX 0.10 names them ``num_consts`` and ``num_carry``; JAX 0.11 packs
  the inputs as one flat tree ``ft_in`` of (consts, carry, xs)."""
  if "num_consts" in params:
    return params["num_consts"], params["num_carry"]
  consts, carry, _ = params["ft_in"].unpack()
  return len(consts), len(carry)


def _is_hi_primitive(value: Any) -> bool:
  """Whether ``value`` is a hijax primitive object (JAX's ``HiPrim``, read by its
  interface: JAX exports no name for it)."""
  return all(hasattr(value, name) for name in ("expand", "in_avals_flat", "in_tree",
                                               "out_tree"))


def expansion(prim: Any) -> jcore.ClosedJaxpr:
  """The jaxpr of a hijax primitive's ``expand`` (what it computes, in ordinary
  primitives) on its flat operands, as ``call_hi_primitive`` binds them. One per
  primitive object, so that every walk (the pairing of two traces, then the analysis)
  reads the same equations; it is dropped with the object."""
  key = id(prim)
  if key not in _EXPANSIONS:
    def flat(*operands: Any) -> Any:
      return prim.out_tree.flatten_up_to(prim.expand(*prim.in_tree.unflatten(operands)))
    closed = jax.make_jaxpr(flat)(*prim.in_avals_flat)
    weakref.finalize(prim, _EXPANSIONS.pop, key, None)  # first: no entry outlives prim
    _EXPANSIONS[key] = closed
  return _EXPANSIONS[key]


def held_jaxprs(value: Any) -> list[Any]:
  """The jaxprs held by an equation parameter, as it holds them (a ``ClosedJaxpr`` with
  its constants, or an open ``Jaxpr``; a hijax primitive, its :func:`expansion`), in
  order; ``[]`` for any other value."""
  if isinstance(value, _PLAIN):  # most parameters (sizes, dtypes, names): read first
    return []
  if isinstance(value, (jcore.ClosedJaxpr, jcore.Jaxpr)):
    return [value]
  if isinstance(value, (tuple, list)):
    return [j for v in value for j in held_jaxprs(v)]
  if _is_hi_primitive(value):
    try:
      return [expansion(value)]
    except Exception:  # noqa: BLE001 - not expandable: the analysis's call rule fails on it
      return []  # too, which makes the equation unknown (the global view)
  return []


# Parameter types that hold no jaxpr.
_PLAIN = (int, float, str, type(None), np.dtype, np.generic)


def subjaxprs(value: Any) -> list[Any]:
  """The (open) jaxprs held by an equation parameter."""
  return [j.jaxpr if isinstance(j, jcore.ClosedJaxpr) else j for j in held_jaxprs(value)]


def eqns_within(eqn: Any) -> Iterator[Any]:
  """``eqn``, then every equation of the sub-jaxprs it holds, depth first."""
  yield eqn
  for value in eqn.params.values():
    for sub in subjaxprs(value):
      for inner in sub.eqns:
        yield from eqns_within(inner)


# Primitives whose output is their one operand's value, whatever its type or placement:
# the varying casts of a per-device region and the gather of an FSDP shard.
_SAME_VALUE = frozenset({"pvary", "pcast", "copy", "copy_p", "all_gather"})


def forwards(jaxpr: Any, out: Any, to: Any) -> bool:
  """Whether the jaxpr's output variable ``out`` is the input variable ``to`` itself, or
  ``to`` passed through primitives that keep its value (a varying cast, an FSDP gather).
  JAX forwards a value an inner call returns unchanged (``jax.checkpoint``, ``nnx.remat``)
  to the call's input, so such a value reads as ``to`` too."""
  producers = {v: (eqn, k) for eqn in jaxpr.eqns for k, v in enumerate(eqn.outvars)}
  while out is not to:
    eqn, k = producers.get(out, (None, 0))
    if eqn is None or eqn.primitive.name not in _SAME_VALUE or (
        len(eqn.invars) != len(eqn.outvars)):
      return False
    out = eqn.invars[k]
  return True
