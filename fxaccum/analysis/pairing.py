"""Pairing the global program with the per-device one: the facts rules read about sizes.

The view analysis proves how each value scales from one device's rows to the global
micro-batch by matching the jaxpr traced on the global micro-batch with the jaxpr of the
program that really runs per device, equation by equation (see
:mod:`fxaccum.analysis.interpreter`). :class:`Pairing` runs that match once, before the
interpretation, and keeps what it found per equation: its partner equation, the names of
its parameters that differ, the partner's shape of values JAX left out there. It then
answers the rules' questions from those facts: which dimensions follow the rows, how a
size or a constant scales. In symbolic mode (a symbolic number of rows, no partner) the
same questions are answered from the symbolic sizes. What it knows of a primitive (JAX
leaves it out where it changes nothing, which parameters may follow the rows) is its
:class:`~fxaccum.analysis.registry.Facts`, registered by the rule modules.

May import ``fxaccum.jaxprs``, :mod:`.kinds`, :mod:`.eqns`, :mod:`.registry` (its facts
table) and JAX.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.extend import core as jcore
from jax.sharding import Mesh, PartitionSpec, Sharding

from fxaccum.analysis.eqns import (
    holds_symbol,
    is_constant,
    shape_of,
    slice_at,
    whole_dim,
    with_place,
)
from fxaccum.analysis.kinds import Const, Exp, Unpaired
from fxaccum.analysis.registry import facts_of
from fxaccum.jaxprs import held_jaxprs, subjaxprs

__all__ = ["Pairing"]


class Pairing:
  """What two traces of one computation say about sizes.

  Args:
    rows: the global number of rows (a symbolic dimension in symbolic mode).
    base: ``D``, the global rows over the partner's rows; None without a partner.
  """

  def __init__(self, rows: Any, base: float | None = None):
    self.rows = rows
    self.base = base
    # Symbolic mode: ``rows`` is a symbolic dimension (jax.export), every size that
    # follows it is an expression in it, and no partner trace is needed.
    self.symbol = None if is_constant(rows) else rows
    # id(eqn) -> the same equation in the partner trace; id(jaxpr) -> the same jaxpr;
    # ("closed", id(closed jaxpr)) -> the partner's closed jaxpr (its constants)
    self.partners: dict[Any, Any] = {}
    # id(eqn) -> the names of its parameters that differ in the partner trace
    self.changed: dict[int, tuple[str, ...]] = {}
    # var -> its shape in the partner trace, where no partner equation gives it (a sum
    # over a dimension of size 1 there, which JAX left out or kept as a dimension)
    self.virtual: dict[Any, tuple[int, ...]] = {}

  # -- the pass ------------------------------------------------------------------------

  def pair(self, a: Any, b: Any) -> None:
    """Matches jaxpr ``a`` (the global program) with ``b`` (the per-device one) equation
    by equation, following the data flow: equal primitives applied to corresponding
    values. An equation of ``a`` that is the identity at ``b``'s sizes (a sum over a
    dimension that has one row per device, a broadcast to it: JAX leaves those out) may
    have no partner; where both readings fit, the match is tried first and the other on
    failure. Anything else that differs raises :class:`Unpaired`."""
    if (len(a.invars) != len(b.invars) or len(a.outvars) != len(b.outvars)
        or len(a.constvars) != len(b.constvars)):
      raise Unpaired
    env, matched = self._match(a, b)
    self.partners[id(a)] = b
    paired = {id(ea) for ea, _ in matched}
    for ea in a.eqns:  # left out in the partner: its result has the partner's shape there
      if id(ea) not in paired:
        self.virtual[ea.outvars[0]] = _reduced_shape(ea, shape_of(env[ea.invars[0]]))
    for ea, eb in matched:
      self._pair_eqn(ea, eb)

  def _match(self, a: Any, b: Any) -> tuple[dict[Any, Any], list[tuple[Any, Any]]]:
    """The correspondence of ``a``'s values to ``b``'s, and the matched equations (a
    depth-first search over the equations that may be left out, see :meth:`pair`)."""
    env = dict(zip([*a.constvars, *a.invars], [*b.constvars, *b.invars], strict=True))
    trail: list[Any] = []  # the keys added to env, in order (undone on backtracking)
    matched: list[tuple[Any, Any]] = []
    choices: list[tuple[int, int, int, int, Any]] = []  # where a skip was possible too
    i = j = furthest = 0
    budget = 4 * len(a.eqns) + 16
    while True:
      if i == len(a.eqns):
        if j == len(b.eqns) and _corresponds(a.outvars, b.outvars, env):
          return env, matched
        ok = False
      else:
        ea, eb = a.eqns[i], b.eqns[j] if j < len(b.eqns) else None
        skip = self._identity_at_partner(ea, env)
        ok = True
        if eb is not None and ea.primitive is eb.primitive and len(ea.outvars) == len(
            eb.outvars) and _corresponds(ea.invars, eb.invars, env):
          if skip is not None:
            choices.append((i, j, len(trail), len(matched), skip))
          env.update(zip(ea.outvars, eb.outvars, strict=True))
          trail.extend(ea.outvars)
          matched.append((ea, eb))
          i, j = i + 1, j + 1
        elif skip is not None:
          env[ea.outvars[0]] = skip
          trail.append(ea.outvars[0])
          i += 1
        else:
          ok = False
        furthest = max(furthest, i)
      if ok:
        continue
      budget -= 1
      if not choices or budget < 0:
        where = a.eqns[min(furthest, len(a.eqns) - 1)] if a.eqns else None
        raise Unpaired(with_place(where, f": {where.primitive.name}") if where else "")
      i, j, mark, n_matched, skip = choices.pop()
      for key in trail[mark:]:
        del env[key]
      del trail[mark:], matched[n_matched:]
      env[a.eqns[i].outvars[0]] = skip
      trail.append(a.eqns[i].outvars[0])
      i += 1

  def _pair_eqn(self, ea: Any, eb: Any) -> None:
    self.partners[id(ea)] = eb
    changed = []
    for key in sorted(set(ea.params) | set(eb.params)):
      va, vb = ea.params.get(key), eb.params.get(key)
      held_a, held_b = held_jaxprs(va), held_jaxprs(vb)
      if held_a or held_b:
        if len(held_a) != len(held_b):
          raise Unpaired(with_place(ea, f": {ea.primitive.name}"))
        for ja, jb in zip(held_a, held_b, strict=True):
          self.pair(*subjaxprs(ja), *subjaxprs(jb))
          if isinstance(ja, jcore.ClosedJaxpr):  # its constants are paired too
            self.partners[("closed", id(ja))] = jb
      elif not _same_param(va, vb):
        changed.append(key)
    if changed:
      self.changed[id(ea)] = tuple(changed)
    if "axes" in changed and facts_of(ea.primitive.name).noop_reduction:
      # Reduced over a dimension that has one row per device: as if the partner had too.
      self.virtual[ea.outvars[0]] = _reduced_shape(ea, shape_of(eb.invars[0]))

  def _identity_at_partner(self, eqn: Any, env: dict[Any, Any]) -> Any:
    """The partner's value that ``eqn``'s result is, if ``eqn`` is the identity at the
    partner's sizes, else None."""
    facts = facts_of(eqn.primitive.name)
    source = eqn.invars[0] if eqn.invars else None
    if (self.base is None or isinstance(source, jcore.Literal) or source not in env
        or len(eqn.outvars) != 1):
      return None
    theirs = env[source]
    shape = shape_of(theirs)
    if facts.noop_reduction:
      axes = eqn.params["axes"]
      ok = len(shape) == len(shape_of(source)) and all(shape[d] == 1 for d in axes)
    elif facts.noop_reshape and len(eqn.invars) == 1:
      out = shape_of(eqn.outvars[0])
      ok = len(out) == len(shape) and all(
          x == y or x == y * self.base for x, y in zip(out, shape, strict=True))
    else:
      ok = False
    return theirs if ok else None

  def mark_symbolic(self, jaxpr: Any) -> None:
    """Symbolic mode's counterpart of :meth:`pair`: the parameters that hold sizes
    following the rows (expressions in the symbol) count as changed."""
    for eqn in jaxpr.eqns:
      changed = []
      for key, value in eqn.params.items():
        subs = subjaxprs(value)
        for sub in subs:
          self.mark_symbolic(sub)
        if not subs and holds_symbol(value):
          changed.append(key)
      if changed:
        self.changed[id(eqn)] = tuple(changed)

  # -- the facts -----------------------------------------------------------------------

  def partner_shape(self, eqn: Any, position: int,
                    out: bool = False) -> tuple[int, ...] | None:
    """The partner trace's shape of input (or output) ``position`` of ``eqn``."""
    var = (eqn.outvars if out else eqn.invars)[position]
    if not isinstance(var, jcore.Literal) and var in self.virtual:
      return self.virtual[var]
    partner = self.partners.get(id(eqn))
    if partner is None:
      return None
    return shape_of((partner.outvars if out else partner.invars)[position])

  def degree(self, size: Any) -> Exp:
    """``e`` with ``size == c * rows ** e`` (symbolic mode), else None."""
    if is_constant(size):
      return 0.0
    exp = 0
    while not is_constant(size):
      if size % self.symbol != 0:
        return None
      size, exp = size // self.symbol, exp + 1
    return float(exp) if size != 0 else None

  def scaled_dims(self, eqn: Any, position: int, out: bool = False) -> set[int]:
    """Dims of input (or output) ``position`` whose size follows the rows: symbolic
    ones, or (paired) ones that differ in the partner trace."""
    if self.symbol is not None:
      var = (eqn.outvars if out else eqn.invars)[position]
      return {d for d, s in enumerate(shape_of(var)) if not is_constant(s)}
    theirs = self.partner_shape(eqn, position, out)
    if theirs is None:
      return set()
    mine = shape_of((eqn.outvars if out else eqn.invars)[position])
    return {d for d, (x, y) in enumerate(zip(mine, theirs, strict=False)) if x != y}

  def size_exp(self, eqn: Any, position: int, dims: set[int]) -> Exp:
    """How the number of elements along ``dims`` of input ``position`` scales."""
    if self.symbol is not None:
      return self.degree(math.prod(shape_of(eqn.invars[position])[d] for d in dims))
    theirs = self.partner_shape(eqn, position)
    if not dims or theirs is None:
      return 0.0
    mine = shape_of(eqn.invars[position])
    return self.ratio_exp(math.prod(mine[d] for d in dims), math.prod(theirs[d] for d in dims))

  def ratio_exp(self, mine: float, theirs: float) -> Exp:
    """``e`` with ``mine == theirs * D ** e`` for an integer ``e``, else None."""
    if mine == theirs or (math.isnan(mine) and math.isnan(theirs)):
      return 0.0
    if (self.base is None or mine == 0 or theirs == 0 or (mine > 0) != (theirs > 0)
        or not math.isfinite(mine / theirs)):
      return None
    exp = math.log(mine / theirs) / math.log(self.base)
    return float(round(exp)) if math.isclose(exp, round(exp), abs_tol=1e-9) else None

  def const_kind(self, value: Any, partner: Any) -> Const:
    """The kind of a constant of the jaxpr (``partner``: the same in the partner trace)."""
    mine = _array(value)
    scalar = _uniform_value(mine) if mine is not None else None
    same = Const(_all_dims(mine) if scalar is not None else frozenset(), scalar)
    if partner is None or value is partner:  # no partner trace, or a closed-over value
      return same
    theirs = _array(partner)
    if mine is None or theirs is None:
      return Const(exp=None)
    if mine.shape == theirs.shape and np.array_equal(mine, theirs, equal_nan=True):
      return same
    other = _uniform_value(theirs)
    if scalar is None or other is None or mine.ndim != theirs.ndim:
      return Const(exp=None)
    # Its value differs between the two programs: known in neither (0 in one is no zero).
    return Const(_all_dims(mine), None, self.ratio_exp(scalar, other))

  def literal(self, var: Any, partner: Any) -> Const:
    """The kind of a literal operand (``partner``: the partner equation's operand)."""
    value = np.asarray(var.val)
    scalar = _uniform_value(value)
    exp: Exp = 0.0
    known = scalar
    if partner is not None and self.base is not None:
      other = _uniform_value(np.asarray(partner.val)) if isinstance(
          partner, jcore.Literal) else None
      exp = None if scalar is None or other is None else self.ratio_exp(scalar, other)
      if other != scalar:  # a value the two programs differ in is known in neither
        known = None
    return Const(_all_dims(value) if scalar is not None else frozenset(), known, exp)

  def unexplained_change(self, eqn: Any) -> str | None:
    """The first parameter of ``eqn`` that differs in the partner trace for a reason the
    rules do not account for, or None."""
    changed = self.changed.get(id(eqn), ())
    if not changed:
      return None
    facts = facts_of(eqn.primitive.name)
    allowed = set(facts.shape_params)
    if facts.slice_params and self._slices_follow_rows(eqn):
      allowed |= facts.slice_params
    if facts.noop_reduction and self._axes_follow_rows(eqn):
      allowed.add("axes")
    return next((key for key in changed if key not in allowed), None)

  def _slices_follow_rows(self, eqn: Any) -> bool:
    """Whether a slice differs from its partner (symbolic mode: depends on the symbol)
    only along dimensions whose size follows the rows, and takes those whole."""
    scaled = self.scaled_dims(eqn, 0)
    partner = self.partners.get(id(eqn))
    for d in range(len(shape_of(eqn.invars[0]))):
      differs = (holds_symbol(slice_at(eqn, d)) if partner is None
                 else slice_at(eqn, d) != slice_at(partner, d))
      if differs and not (d in scaled and whole_dim(eqn, d) and (
          partner is None or whole_dim(partner, d))):
        return False
    return True

  def _axes_follow_rows(self, eqn: Any) -> bool:
    """Whether a reduction's axes differ from its partner's only by dimensions that have
    size 1 in the partner (reducing over those changes no value)."""
    partner = self.partners[id(eqn)]
    theirs = shape_of(partner.invars[0])
    differ = set(eqn.params["axes"]) ^ set(partner.params["axes"])
    return all(theirs[d] == 1 and d in self.scaled_dims(eqn, 0) for d in differ)


def _reduced_shape(eqn: Any, shape: tuple[int, ...]) -> tuple[int, ...]:
  """The partner's shape of ``eqn``'s result, from the partner's shape of its operand:
  reduced over ``eqn``'s axes (the identity there), or the operand itself."""
  if facts_of(eqn.primitive.name).noop_reduction:
    return tuple(s for d, s in enumerate(shape) if d not in eqn.params["axes"])
  return shape


def _corresponds(mine: Sequence[Any], theirs: Sequence[Any], env: dict[Any, Any]) -> bool:
  """Whether two operand lists name corresponding values (literals: any values)."""
  if len(mine) != len(theirs):
    return False
  for a, b in zip(mine, theirs, strict=True):
    if isinstance(a, jcore.Literal) or isinstance(b, jcore.Literal):
      if not (isinstance(a, jcore.Literal) and isinstance(b, jcore.Literal)):
        return False
    elif env.get(a) is not b:
      return False
  return True


def _same_param(a: Any, b: Any) -> bool:
  """Whether two values of an equation parameter (not a jaxpr) say the same thing.

  Code (derivative rules, remat policies: a new function object per trace) and shardings
  (the two traces type the data axes differently) do not change values."""
  if a is b:
    return True
  for v in (a, b):
    if callable(v) or hasattr(v, "call_wrapped") or _holds_sharding(v):
      return True
  try:
    same = a == b
    return bool(same) if not isinstance(same, np.ndarray) else bool(np.all(same))
  except (TypeError, ValueError):  # incomparable values: count them as different
    return False


def _holds_sharding(value: Any) -> bool:
  if isinstance(value, (Sharding, PartitionSpec, Mesh, jax.sharding.AbstractMesh)):
    return True
  return isinstance(value, (tuple, list)) and any(_holds_sharding(v) for v in value)


def _array(value: Any) -> np.ndarray | None:
  try:
    if jax.dtypes.issubdtype(getattr(value, "dtype", None), jax.dtypes.prng_key):
      value = jax.random.key_data(value)
    out = np.asarray(value)
  except (TypeError, ValueError):  # e.g. a closed-over tracer: no numbers to compare
    return None
  return out if out.dtype.kind in "biufc" else None


def _uniform_value(value: np.ndarray) -> float | None:
  """The one value of every element of a real numeric array, else None."""
  if value.dtype.kind not in "biuf" or value.size == 0:
    return None
  first = value.reshape(-1)[0]
  same = value == first
  if value.dtype.kind == "f":
    same |= np.isnan(value) & np.isnan(first)
  return float(first) if np.all(same) else None


def _all_dims(value: Any) -> frozenset[int]:
  return frozenset(range(np.ndim(value)))
