"""Random draws along the batch axis from keys that every micro-batch shares.

A loss that draws per-example noise (dropout masks) from a PRNG key argument that is not
in ``rng_argnums`` gets the same noise in every micro-batch: the key is passed whole to
each of them. :func:`shared_key_draws` finds such draws in a loss traced with a symbolic
number of rows: a ``random_bits`` equation whose key derives from one of the given
inputs and whose shape depends on the number of rows. A draw whose shape does not (a
random projection every example shares) is the same on the whole batch too and is not
reported. May import ``fxaccum.jaxprs`` and JAX only.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import jax
from jax.extend import core as jcore

from fxaccum import jaxprs

__all__ = ["is_key", "shared_key_draws"]

# Primitives that turn a key into random values (the others derive keys).
_DRAWS = ("random_bits", "threefry2x32")


def is_key(leaf: Any) -> bool:
  """A typed PRNG key array, or what may be a raw one (``uint32[..., 2]``)."""
  dtype = getattr(leaf, "dtype", None)
  if dtype is None:
    return False
  if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
    return True
  return dtype == jax.numpy.uint32 and tuple(getattr(leaf, "shape", ()))[-1:] == (2,)


def shared_key_draws(closed: Any, inputs: Iterable[int]) -> list[str]:
  """The draws of ``closed`` (traced with a symbolic number of rows) whose key derives
  from the invars at ``inputs`` and whose shape depends on the number of rows, e.g.
  ``["random_bits u32[rows,4]"]``."""
  jaxpr = closed.jaxpr
  tainted = {jaxpr.invars[i] for i in inputs}
  found: list[str] = []
  _walk(jaxpr, tainted, found)
  return found


def _walk(jaxpr: Any, tainted: set[Any], found: list[str]) -> None:
  """Follows values derived from ``tainted`` through ``jaxpr`` and its sub-jaxprs."""
  for eqn in jaxpr.eqns:
    hit = [v in tainted for v in eqn.invars if not isinstance(v, jcore.Literal)]
    if not any(hit):
      continue
    if eqn.primitive.name in _DRAWS:
      for out in eqn.outvars:
        shape = tuple(getattr(out.aval, "shape", ()))
        if any(not isinstance(d, int) for d in shape):
          found.append(f"{eqn.primitive.name} {out.aval.str_short()}")
    for inner in (j for value in eqn.params.values() for j in jaxprs.subjaxprs(value)):
      _walk(inner, _inside(eqn.invars, inner.invars, tainted), found)
    tainted.update(eqn.outvars)


def _inside(outer: list[Any], inner: list[Any], tainted: set[Any]) -> set[Any]:
  """The invars of a sub-jaxpr fed by tainted operands: they line up from the end (a
  cond's predicate and a while loop's condition constants come first); where they
  cannot, every invar."""
  if len(inner) > len(outer):
    return set(inner)
  pairs = zip(outer[len(outer) - len(inner):], inner, strict=True)
  return {i for o, i in pairs if not isinstance(o, jcore.Literal) and o in tainted}
