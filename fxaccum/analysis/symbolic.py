"""Watching a trace with symbolic sizes for the answers it gives Python without deciding.

The view analysis traces a loss with a symbolic number of rows so that its proof holds for
every number of rows. That holds only where the loss's Python code takes the same path for
the symbolic size as for every concrete one, and a symbolic size answers some questions
silently where a number would answer otherwise: ``==`` / ``!=`` that ``jax.export`` cannot
decide is "not equal" (its documented unsoundness), every size is true (``if n % 2:``), a
dict or set finds no int key for it (``{4: 2.0}.get(n)``), and its text is a formula. A
comparison JAX cannot decide (``<``) and ``int(n)`` raise instead, which a ``try`` may
catch. :func:`undecided_uses` lets the analysis see each of these and trust the trace no
further. What it cannot see is a type test (``isinstance(n, int)``): docs/instep.md says so.

This is the one place fxaccum patches JAX (methods of its private ``_DimExpr``, while a
block runs). A guard checks first that the class and each method are there and take the
operands they are watched with; where a JAX release changed them, it warns once and every
block records why, so the symbolic trace is trusted nowhere and the analysis pairs two
concrete traces instead. May import JAX only.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import sys
import threading
import types
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np

__all__ = ["undecided_uses"]


@contextlib.contextmanager
def undecided_uses() -> Iterator[list[str]]:
  """Records, in the yielded list, each use of a symbolic size by code outside JAX in this
  thread during the block whose answer may differ from a number's: an undecided ``==`` /
  ``!=``, truth value, hash, text, and a comparison or ``int()`` that raised.

  JAX's own uses (shape checks, broadcasting, caches) are left out: they are written for
  symbolic sizes. Where JAX's shape module is not the one this was written for, every
  block records one entry (the caller then trusts no symbolic trace).
  """
  found: list[str] = []
  dim_expr, problem = _guarded_class()
  if dim_expr is None:
    found.append(f"jax.export's symbolic sizes could not be watched: {problem}")
    yield found
    return
  with _LOCK:
    if not _RECORDERS:
      for name, check in _CHECKS.items():
        original = vars(dim_expr).get(name, _DEFAULTS.get(name))
        _ORIGINALS[name] = vars(dim_expr).get(name)
        setattr(dim_expr, name, _watched(name, original, check))
    _RECORDERS[threading.get_ident()] = found
  try:
    yield found
  finally:
    with _LOCK:
      del _RECORDERS[threading.get_ident()]
      if not _RECORDERS:
        for name, original in _ORIGINALS.items():
          if original is None:
            delattr(dim_expr, name)
          else:
            setattr(dim_expr, name, original)


def _undecided_equality(expr: Any, args: tuple[Any, ...], result: Any) -> bool:
  """Whether ``expr == other`` answered "not equal" without deciding."""
  (other,) = args
  if result:
    return False
  if jax.export.is_symbolic_dim(other):
    if getattr(expr, "scope", None) is not getattr(other, "scope", None):
      return False
  elif not isinstance(other, (int, np.integer)):
    return False
  return jax.export.is_symbolic_dim(expr - other)


def _always(expr: Any, args: tuple[Any, ...], result: Any) -> bool:
  return True


def _never(expr: Any, args: tuple[Any, ...], result: Any) -> bool:
  return False  # decided answers are sound; only a raise (caught by the caller) is recorded


# Watched methods: which answers to record (a raise always is).
_CHECKS: dict[str, Callable[[Any, tuple[Any, ...], Any], bool]] = {
    "__eq__": _undecided_equality, "__bool__": _always, "__hash__": _always,
    "__str__": _always, "__repr__": _always, "__int__": _never, "__lt__": _never,
    "__le__": _never, "__gt__": _never, "__ge__": _never}
_DEFAULTS: dict[str, Callable[..., Any]] = {"__bool__": lambda self: True}  # object's own
# How many operands (self included) each watched method takes.
_ARITY = {name: 2 if name in ("__eq__", "__lt__", "__le__", "__gt__", "__ge__") else 1
          for name in _CHECKS}
_WARNED: set[str] = set()  # the problems warned about (once each)
_LOCK = threading.Lock()
_RECORDERS: dict[int, list[str]] = {}  # thread -> its block's findings
_ORIGINALS: dict[str, Any] = {}  # JAX's own methods (None: inherited), while watched
_CHECKING = threading.local()  # inside a check (JAX's arithmetic): no recursion
_JAX_DIR = os.path.dirname(jax.__file__) + os.sep


def _shape_module() -> Any:
  """JAX's private module that defines symbolic sizes (``jax.export``'s ``_DimExpr``)."""
  from jax._src.export import shape_poly
  return shape_poly


def _guarded_class() -> tuple[Any, str | None]:
  """``_DimExpr``, if it is the class this module was written for (JAX 0.10 to 0.12): every
  watched method there, taking the operands it is watched with; else None and what
  differs. A JAX release that changes it makes every block record that one reason (the
  symbolic trace is then trusted nowhere) and warns once, instead of patching methods
  that are not there or read their answers wrongly."""
  try:
    cls = getattr(_shape_module(), "_DimExpr", None)
  except ImportError as err:
    return _refused(f"jax._src.export.shape_poly does not import ({err})")
  if not isinstance(cls, type) or not callable(getattr(jax.export, "is_symbolic_dim", None)):
    return _refused("jax._src.export.shape_poly._DimExpr or jax.export.is_symbolic_dim is "
                    "gone")
  for name, arity in _ARITY.items():
    method = vars(cls).get(name)
    if method is None and name not in _DEFAULTS:
      return _refused(f"_DimExpr.{name} is gone")
    if method is not None and not _takes(method, arity):
      return _refused(f"_DimExpr.{name} no longer takes {arity} operand(s)")
  return cls, None


def _takes(method: Any, arity: int) -> bool:
  """Whether ``method`` can be called with ``arity`` positional operands (self included)."""
  try:
    inspect.signature(method).bind(*range(arity))
  except (TypeError, ValueError):
    return False
  return True


def _refused(problem: str) -> tuple[None, str]:
  problem = f"{problem} in JAX {jax.__version__}"
  if problem not in _WARNED:
    _WARNED.add(problem)
    warnings.warn(f"fxaccum cannot watch jax.export's symbolic sizes ({problem}): the view "
                  "analysis proves per-example losses from two concrete traces instead",
                  RuntimeWarning, stacklevel=4)
  return None, problem


def _watched(name: str, original: Callable[..., Any],
             check: Callable[[Any, tuple[Any, ...], Any], bool]) -> Callable[..., Any]:
  def method(self: Any, *args: Any) -> Any:
    found = _RECORDERS.get(threading.get_ident())
    if found is None or getattr(_CHECKING, "active", False):
      return original(self, *args)
    caller = _caller_outside_jax(sys._getframe(1))
    if caller is None:
      return original(self, *args)
    returned = False
    try:
      result = original(self, *args)
      returned = True
    finally:  # a raise is recorded as undecided, then goes on as it was
      if not returned:
        found.append(f"{_where(caller)}: {name} of {_text(self)} raised")
    _CHECKING.active = True
    try:
      undecided = check(self, args, result)
    finally:
      _CHECKING.active = False
    if undecided:
      found.append(f"{_where(caller)}: {name} of {_text(self)}")
    return result

  return method


def _caller_outside_jax(frame: types.FrameType | None) -> types.FrameType | None:
  """The frame that used the size, or None where JAX did: seen through JAX's ``__ne__``
  (``x != n`` calls ``x == n``) and through generated dunders (a dataclass's ``__hash__``
  or ``__eq__``, whose code is ``<string>``), to the code that called them."""
  while frame is not None and frame.f_code.co_name.startswith("__") and (
      (frame.f_code.co_name == "__ne__" and frame.f_code.co_filename.startswith(_JAX_DIR))
      or frame.f_code.co_filename == "<string>"):
    frame = frame.f_back
  if frame is None or frame.f_code.co_filename.startswith(_JAX_DIR):
    return None
  return frame


def _where(frame: types.FrameType) -> str:
  return f"{frame.f_code.co_filename}:{frame.f_lineno}"


def _text(expr: Any) -> str:
  _CHECKING.active = True
  try:
    return str(expr)
  finally:
    _CHECKING.active = False
