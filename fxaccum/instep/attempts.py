"""Tracing the user's loss where it may not trace: the one place the in-step path catches
any error.

fxaccum traces the loss under the types each way of running it gives: a symbolic number
of rows, the global micro-batch, one device's rows, params typed ``reduced``, a
per-device region. The loss is the user's code, and it may raise anything there (Python
that computes with the number of rows, code valid only per device, an operation JAX has
no rule for under those types): such a failure is a fact about the loss, which the caller
records as the reason it takes another way. :func:`attempt` returns it.

A failure that no code of the loss's raised (only fxaccum and JAX in its traceback) is
not a fact about the loss but fxaccum's bug, which would otherwise turn silently into a
slower path, unless it is one of JAX's own known gaps (:data:`JAX_GAPS`, matched by type
and message). Under ``FXACCUM_RULE_ERRORS=raise`` (the test suite sets it) it raises;
otherwise it warns once per place, asking for a report, and the caller goes on as for
any failure.
"""

from __future__ import annotations

import os
import sys
import sysconfig
import traceback
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jaxlib

from fxaccum.analysis.interpreter import RULE_ERRORS

__all__ = ["JAX_GAPS", "Attempt", "attempt"]

# fxaccum's, JAX's and jaxlib's folders (with the separator: not jax_plugins, jaxtyping)
_OURS = tuple(os.path.join(os.path.dirname(os.path.abspath(str(m.__file__))), "")
              for m in (sys.modules["fxaccum"], jax, jaxlib))
_STDLIB = os.path.abspath(sysconfig.get_paths()["stdlib"])  # (site-packages aside: below)
_WARNED: set[tuple[str, int]] = set()

# JAX's own errors for what it cannot do yet, which fxaccum's code meets too (e.g. the
# noise scale's squares of gradients typed ``unreduced``): facts, not fxaccum's bugs.
JAX_GAPS: tuple[tuple[type[Exception], str], ...] = (
    (NotImplementedError, "reduced rule for"),  # no reduced/unreduced typing rule
)


class Attempt(NamedTuple):
  """What :func:`attempt` returns: ``value``, the function's result (None where it
  raised), and ``error``, what it raised (None where it returned)."""

  value: Any
  error: Exception | None


def attempt(fn: Callable[..., Any], *args: Any,
            expected: tuple[type[Exception], ...] = ()) -> Attempt:
  """``fn(*args)``, or the error it raised, where ``fn`` traces the user's loss.

  Args:
    fn: a function that traces the loss (e.g. ``jax.make_jaxpr(step)``).
    *args: its arguments.
    expected: errors fxaccum raises on purpose to steer the caller: returned as they are.

  Returns:
    An :class:`Attempt`.

  Raises:
    Exception: an error that does not come from the loss's code, under
      ``FXACCUM_RULE_ERRORS=raise``.
  """
  try:
    return Attempt(fn(*args), None)
  except Exception as err:  # noqa: BLE001 - the user's loss, traced: any error is a fact
    if not isinstance(err, expected) and not _known(err):  # about it, see above
      _internal(err)
    return Attempt(None, err)


def _known(err: Exception) -> bool:
  """Whether ``err`` comes from the loss's code or is one of :data:`JAX_GAPS`."""
  return _from_the_loss(err) or any(
      isinstance(err, kind) and text in str(err) for kind, text in JAX_GAPS)


def _from_the_loss(err: BaseException) -> bool:
  """Whether code outside fxaccum, JAX and Python's standard library (the loss, its model,
  its libraries) ran in the traceback of ``err`` or of the errors it came from."""
  seen: set[int] = set()
  while err is not None and id(err) not in seen:
    seen.add(id(err))
    for frame in traceback.extract_tb(err.__traceback__):
      path = os.path.abspath(frame.filename)
      if not (path.startswith(_OURS) or _standard(path)):
        return True
    err = err.__cause__ or err.__context__  # type: ignore[assignment]
  return False


def _standard(path: str) -> bool:
  """Whether ``path`` is a module of Python's standard library (not an installed one)."""
  return ((path.startswith(_STDLIB) and "site-packages" not in path)
          or os.path.basename(path).startswith("<frozen"))


def _internal(err: Exception) -> None:
  """An error fxaccum raised without the loss: raises under the test suite, else warns once
  per place it was raised."""
  if os.environ.get(RULE_ERRORS) == "raise":
    raise err
  frames = traceback.extract_tb(err.__traceback__)
  place = (frames[-1].filename, frames[-1].lineno or 0) if frames else ("", 0)
  if place not in _WARNED:
    _WARNED.add(place)
    warnings.warn(
        f"fxaccum: an internal error ({type(err).__name__}: {err}) made this step take "
        "another way to run the loss (exact, maybe slower). Please report it at "
        "fxaccum's issue tracker with the step that raised it.", RuntimeWarning,
        stacklevel=3)
