"""What the view analysis reads off one equation: operand shapes, what a slice takes,
whether a size is symbolic, and the user's source line for a reason.

Shared by the pairing of two traces (:mod:`.pairing`), the interpreter and the rules. May
import JAX only.
"""

from __future__ import annotations

from typing import Any

import jax

__all__ = ["holds_symbol", "is_constant", "shape_of", "slice_at", "whole_dim", "with_place"]


def shape_of(var: Any) -> tuple[Any, ...]:
  """A jaxpr variable's shape (``()`` for tokens and other non-arrays)."""
  return tuple(getattr(var.aval, "shape", ()))


def slice_at(eqn: Any, d: int) -> Any:
  """What a ``slice`` (start, limit, stride) or a ``dynamic_slice`` / ``gather`` (its size)
  takes along dimension ``d``."""
  p = eqn.params
  if eqn.primitive.name == "slice":
    strides = p.get("strides") or (1,) * len(p["start_indices"])
    return p["start_indices"][d], p["limit_indices"][d], strides[d]
  return p["slice_sizes"][d]


def whole_dim(eqn: Any, d: int) -> bool:
  """Whether ``eqn`` (see :func:`slice_at`) takes all of its operand's dimension ``d``."""
  size = shape_of(eqn.invars[0])[d]
  if eqn.primitive.name == "slice":
    return slice_at(eqn, d) == (0, size, 1)
  return eqn.params["slice_sizes"][d] == size


def with_place(eqn: Any, what: str) -> str:
  """``what``, followed by the line of the user's code that made ``eqn``."""
  place = _place(eqn)
  return f"{what}{place}" if place else what


def _place(eqn: Any) -> str:
  try:  # source line of the user's code, for diagnostics
    from jax._src import source_info_util
    place = source_info_util.summarize(eqn.source_info)
  except (ImportError, AttributeError, TypeError, ValueError):  # a private helper; the
    place = ""  # reason stands without it
  return f" at {place}" if place else ""


def is_constant(size: Any) -> bool:
  """Whether a size is a number, not an expression in a symbolic dimension."""
  return not jax.export.is_symbolic_dim(size)


def holds_symbol(value: Any) -> bool:
  """Whether an equation parameter is, or holds, a symbolic size."""
  if isinstance(value, (tuple, list)):
    return any(holds_symbol(v) for v in value)
  return jax.export.is_symbolic_dim(value)
