"""Reading jaxprs: the sub-jaxprs an equation holds, and the equation parameters that JAX
versions write differently.

fxaccum reads jaxprs (the view analysis, ZeRO-3 gathering); where a JAX release changes
how a primitive records its parameters, the difference is bridged here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from jax.extend import core as jcore

__all__ = ["scan_counts", "subjaxprs"]


def scan_counts(params: Mapping[str, Any]) -> tuple[int, int]:
  """The numbers of constants and carries of a ``scan`` equation (its other inputs are
  the sliced ``xs``): JAX 0.10 names them ``num_consts`` and ``num_carry``; JAX 0.11 packs
  the inputs as one flat tree ``ft_in`` of (consts, carry, xs)."""
  if "num_consts" in params:
    return params["num_consts"], params["num_carry"]
  consts, carry, _ = params["ft_in"].unpack()
  return len(consts), len(carry)


def subjaxprs(value: Any) -> list[Any]:
  """The (open) jaxprs held by an equation parameter."""
  if isinstance(value, jcore.ClosedJaxpr):
    return [value.jaxpr]
  if isinstance(value, jcore.Jaxpr):
    return [value]
  if isinstance(value, (tuple, list)):
    return [j for v in value for j in subjaxprs(v)]
  return []
