"""Helpers the rule families share: which constants are uniform along a dimension, the
first reason a batch value mixes examples, and positions that follow the number of rows.

May import :mod:`fxaccum.analysis.kinds` and :mod:`fxaccum.analysis.eqns`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from fxaccum.analysis.eqns import shape_of, with_place
from fxaccum.analysis.kinds import Const, Exp, Kind, Rows, Stat

__all__ = ["NOT_SCALING", "const_uniform", "first_mixed", "index_changes", "index_exp",
           "map_uniform", "misaligned", "rescaled", "shift", "uniform_at"]


def uniform_at(kind: Const, var: Any, out_shape: tuple[int, ...], dim: int) -> bool:
  """Whether Const operand ``var`` is constant along output dimension ``dim``."""
  shape = shape_of(var)
  if not shape or kind.value is not None or dim in kind.uniform:
    return True
  return len(shape) == len(out_shape) and shape[dim] == 1 and out_shape[dim] != 1


def const_uniform(kinds: Sequence[Kind], eqn: Any) -> frozenset[int]:
  """The output dims along which every Const operand of ``eqn`` is constant."""
  out_shape = shape_of(eqn.outvars[0])
  return frozenset(d for d in range(len(out_shape)) if all(
      uniform_at(k, v, out_shape, d) for k, v in zip(kinds, eqn.invars, strict=True)
      if isinstance(k, Const)))


def first_mixed(kinds: Sequence[Kind]) -> str | None:
  """The first reason one of ``kinds`` (Rows or Stat) mixes examples, or None."""
  return next((k.mixed for k in kinds if isinstance(k, (Rows, Stat)) and k.mixed), None)


def misaligned(eqn: Any, rows: Sequence[Kind]) -> str | None:
  """Why batch values in different example orders (e.g. one reversed) may not be combined
  position by position, or None when they share one order."""
  if len({r.order for r in rows if isinstance(r, Rows)}) <= 1:
    return None
  return with_place(eqn, f"{eqn.primitive.name} pairs examples taken in different orders "
                    "(e.g. the batch and the batch reversed)")


def index_changes(kinds: Sequence[Kind]) -> bool:
  """Whether a batch-independent index or position operand follows the number of rows
  (e.g. ``n - 1``): per device it would pick other elements than globally. (A rule
  reports it as ``Result.sized_positions``: with a symbolic number of rows JAX computes
  some positions from it, e.g. a reversal.)"""
  return any(isinstance(k, Const) and k.exp != 0 for k in kinds)


def shift(dim: int, removed: Sequence[int]) -> int:
  """Where ``dim`` lands once the dims ``removed`` are gone."""
  return dim - sum(1 for r in removed if r < dim)


def map_uniform(uniform: frozenset[int], mapping: dict[int, int]) -> frozenset[int]:
  return frozenset(mapping[d] for d in uniform if d in mapping)


# Ops whose result is no power-of-D rescaling of a scaled operand (a product of n factors,
# a log-sum-exp): such an operand's exponent becomes None.
NOT_SCALING = frozenset({"reduce_prod", "reduce_xor", "cumprod", "cumlogsumexp",
                         "reduce_window"})


def rescaled(eqn: Any, kind: Kind) -> Kind:
  """``kind`` as an operand of ``eqn``: with no exponent where ``eqn`` does not rescale."""
  if eqn.primitive.name in NOT_SCALING and kind.exp != 0 and kind.exp is not None:
    return dataclasses.replace(kind, exp=None)
  return kind


def index_exp(kind: Kind) -> Exp:
  """The exponent of an index into ``kind`` (argmax, top_k's positions): a positive factor
  picks the same one, any other dependence on the rows may not."""
  return 0.0 if kind.exp is not None else None
