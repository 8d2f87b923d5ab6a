"""The kinds :mod:`fxaccum.analysis` gives values, how they scale with the number ``D`` of
data-parallel devices (``exp``), and how two kinds join (loop carries, cond branches)."""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["Blocked", "Const", "Exp", "Kind", "Rows", "Stat", "Top", "Unpaired", "add_exps",
           "common_exp", "join", "mixing", "plain"]

Exp = float | None  # the value scales as D ** exp; None: some other dependence on n


@dataclasses.dataclass(frozen=True)
class Const:
  """Batch-independent. ``uniform``: dims along which it is constant; ``value``: the one
  scalar value of every element, when known (literals and their broadcasts)."""

  uniform: frozenset[int] = frozenset()
  value: float | None = None
  exp: Exp = 0.0


@dataclasses.dataclass(frozen=True)
class Rows:
  """Has batch-major dimension ``dim``; ``mixed`` says why its blocks mix examples.
  ``order`` names the permutation of the examples along ``dim`` (0: the batch's own
  order; a reversal gives another), so values in different orders are never paired."""

  dim: int
  mixed: str | None = None
  exp: Exp = 0.0
  order: Any = 0


@dataclasses.dataclass(frozen=True)
class Stat:
  """Reduced over the batch axis; ``mixed`` says why it is no linear sum of per-example
  terms (times ``D ** exp``); ``ratio``: it divides by another batch statistic (e.g. a
  token mean of this micro-batch); ``extreme``: ``"max"`` (``"min"``) where it is the
  maximum (minimum) over the examples of per-example values (then ``mixed`` says it is no
  sum), through ops that keep it so (casts, reshapes, a negation swaps the two)."""

  mixed: str | None = None
  exp: Exp = 0.0
  ratio: bool = False
  extreme: str | None = None


@dataclasses.dataclass(frozen=True)
class Top:
  """Batch-dependent, structure unknown; always mixes examples."""

  mixed: str
  exp: Exp = None


@dataclasses.dataclass(frozen=True)
class Blocked(Top):
  """The batch axis split into blocks of consecutive examples: dims ``dim`` (the blocks)
  and ``dim + 1`` (``block`` examples each, in ``order``), as ``lax.map(f, x,
  batch_size=block)`` reshapes it. Every rule but the two that know it (the reshape that
  makes or undoes it, a scan over the blocks) reads it as the :class:`Top` it is (see
  :func:`plain`); ``mixed`` says so."""

  dim: int = 0
  block: int = 1
  order: Any = 0


Kind = Const | Rows | Stat | Top


def plain(kind: Kind) -> Kind:
  """``kind``, a :class:`Blocked` value as the plain :class:`Top` it is to other rules."""
  return Top(kind.mixed) if isinstance(kind, Blocked) else kind


def mixing(kind: Kind) -> str | None:
  """Why ``kind`` mixes examples, or None."""
  return None if isinstance(kind, Const) else kind.mixed


class Unpaired(Exception):
  """The two traces differ in structure (``where``: the first equation that differs)."""

  def __init__(self, where: str = ""):
    super().__init__(where)
    self.where = where


def common_exp(kinds) -> Exp:
  """The exponent of a result that scales like each of its operands (all must agree; a
  zero scales like anything)."""
  exps = {k.exp for k in kinds if not (isinstance(k, Const) and k.value == 0)}
  return 0.0 if not exps else exps.pop() if len(exps) == 1 else None


def add_exps(kinds) -> Exp:
  """The exponent of a product: its operands' exponents added (None if one is unknown)."""
  exps = [k.exp for k in kinds]
  return None if None in exps else float(sum(exps))


def join(a: Kind, b: Kind) -> Kind:
  """The kind of a value that may be ``a`` or ``b`` (loop carries, cond branches)."""
  if a == b:
    return a
  a, b = plain(a), plain(b)
  if isinstance(a, Top):
    return a
  if isinstance(b, Top):
    return b
  exp = a.exp if a.exp == b.exp else None
  if isinstance(a, Const) and isinstance(b, Const):
    return Const(a.uniform & b.uniform, a.value if a.value == b.value else None, exp)
  if isinstance(b, Const):
    a, b = b, a
  if isinstance(a, Const):  # b is batch-dependent
    if isinstance(b, Rows) and (a.value is not None or b.dim in a.uniform) and (
        a.value == 0 or exp is not None):
      return b
    if isinstance(b, Stat) and (a.value == 0 or (b.exp is not None and a.exp == b.exp + 1)):
      return b
    return Top(mixing(b) or "a loop carry that starts batch-independent and becomes "
               "position-dependent")
  if (isinstance(a, Rows) and isinstance(b, Rows) and a.dim == b.dim and exp is not None
      and a.order == b.order):
    return Rows(a.dim, a.mixed or b.mixed, exp, a.order)
  if isinstance(a, Stat) and isinstance(b, Stat):
    return Stat(a.mixed or b.mixed or (None if exp is not None else
                                       "a loop mixes sums and means over examples"), exp)
  return Top(mixing(a) or mixing(b) or "a value that is batched in different ways")
