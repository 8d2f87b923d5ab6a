"""Reading jaxprs: the sub-jaxprs an equation holds, and the equation parameters that JAX
versions write differently.

fxaccum reads jaxprs (the view analysis, ZeRO-3 gathering); where a JAX release changes
how a primitive records its parameters, the difference is bridged here. Every walk that
enters sub-jaxprs (the analysis's interpreter and its pairing of two traces,
``depends_on``, the ZeRO-3 evaluator) finds them with :func:`held_jaxprs`, so a new way
of holding one is taught to all of them at once.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from jax.extend import core as jcore

__all__ = ["eqns_within", "held_jaxprs", "scan_counts", "subjaxprs"]


def scan_counts(params: Mapping[str, Any]) -> tuple[int, int]:
  """The numbers of constants and carries of a ``scan`` equation (its other inputs are
  the sliced ``xs``): JAX 0.10 names them ``num_consts`` and ``num_carry``; JAX 0.11 packs
  the inputs as one flat tree ``ft_in`` of (consts, carry, xs)."""
  if "num_consts" in params:
    return params["num_consts"], params["num_carry"]
  consts, carry, _ = params["ft_in"].unpack()
  return len(consts), len(carry)


def held_jaxprs(value: Any) -> list[Any]:
  """The jaxprs held by an equation parameter, as it holds them (a ``ClosedJaxpr`` with
  its constants, or an open ``Jaxpr``), in order; ``[]`` for any other value."""
  if isinstance(value, (jcore.ClosedJaxpr, jcore.Jaxpr)):
    return [value]
  if isinstance(value, (tuple, list)):
    return [j for v in value for j in held_jaxprs(v)]
  return []


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
