"""Watching a trace with symbolic sizes for the comparisons JAX answers without deciding.

``jax.export`` answers ``==`` / ``!=`` between a symbolic size and a number it cannot
decide with "not equal", silently (its documented unsoundness; ``<`` and ``>`` raise
instead). The view analysis traces a loss with a symbolic number of rows so that its proof
holds for every number of rows; a loss that branches on ``x.shape[0] == 2`` breaks that
silently, and :func:`undecided_equalities` lets the analysis see it and trust the trace no
further.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import types
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np

__all__ = ["undecided_equalities"]


@contextlib.contextmanager
def undecided_equalities() -> Iterator[list[str]]:
  """Records, in the yielded list, each ``==`` / ``!=`` on a symbolic size that code
  outside JAX makes in this thread during the block and that JAX cannot decide.

  JAX answers such a comparison "not equal" without raising (jax.export's documented
  unsoundness): ``if x.shape[0] == 2: ...`` in a loss traced with a symbolic number of
  rows takes the other branch, so that trace is not the program that runs on 2 rows, and
  a proof on it proves nothing there. JAX's own comparisons (shape checks, broadcasting)
  are left out: they are written for symbolic sizes. Where JAX's shape module is not the
  one this was written for, every block records one entry (the caller then trusts no
  symbolic trace).
  """
  found: list[str] = []
  dim_expr = _dim_expr_class()
  if dim_expr is None:
    found.append("jax.export's symbolic sizes could not be watched")
    yield found
    return
  with _EQUALITY_LOCK:
    if not _RECORDERS:
      _ORIGINAL_EQ.setdefault("eq", dim_expr.__eq__)
      dim_expr.__eq__ = _recording_eq
    _RECORDERS[threading.get_ident()] = found
  try:
    yield found
  finally:
    with _EQUALITY_LOCK:
      del _RECORDERS[threading.get_ident()]
      if not _RECORDERS:
        dim_expr.__eq__ = _ORIGINAL_EQ["eq"]


_EQUALITY_LOCK = threading.Lock()
_RECORDERS: dict[int, list[str]] = {}  # thread -> its block's findings
_ORIGINAL_EQ: dict[str, Callable[..., bool]] = {}  # JAX's own, kept once
_CHECKING = threading.local()  # inside _recording_eq's own check (no recursion)
_JAX_DIR = os.path.dirname(jax.__file__) + os.sep


def _dim_expr_class() -> Any:
  try:
    from jax._src.export import shape_poly
  except ImportError:
    return None
  cls = getattr(shape_poly, "_DimExpr", None)
  return cls if cls is not None and "__eq__" in vars(cls) else None


def _recording_eq(self: Any, other: Any) -> bool:
  equal = _ORIGINAL_EQ["eq"](self, other)
  found = _RECORDERS.get(threading.get_ident())
  if equal or found is None or getattr(_CHECKING, "active", False):
    return equal
  _CHECKING.active = True
  try:
    undecided = _undecided(self, other)
  finally:
    _CHECKING.active = False
  if not undecided:
    return equal
  caller: types.FrameType | None = sys._getframe(1)
  while caller is not None and caller.f_code.co_name == "__ne__" and (
      caller.f_code.co_filename.startswith(_JAX_DIR)):  # x != n calls x == n
    caller = caller.f_back
  if caller is not None and not caller.f_code.co_filename.startswith(_JAX_DIR):
    found.append(f"{caller.f_code.co_filename}:{caller.f_lineno}: {self} == {other}")
  return equal


def _undecided(expr: Any, other: Any) -> bool:
  """Whether ``expr == other`` (answered "not equal") is really undecidable."""
  if jax.export.is_symbolic_dim(other):
    if getattr(expr, "scope", None) is not getattr(other, "scope", None):
      return False
  elif not isinstance(other, (int, np.integer)):
    return False
  return jax.export.is_symbolic_dim(expr - other)
