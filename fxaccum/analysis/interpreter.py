"""Does a loss keep its examples apart? A conservative analysis of a micro-step's jaxpr.

fxaccum's fast in-step path runs the loss *per device* on that device's rows and adds the
devices' results up. That equals running the loss on the global micro-batch only when the
loss and its gradients are sums (or means) of per-example terms. This module proves that
from the jaxpr of one micro-step, **value and gradients together** (so custom derivative
rules, ``custom_jvp`` and ``custom_vjp`` alike, are analyzed as the code they are), traced
on the global micro-batch, following the batch axis (axis 0 of every batch leaf) through
every equation. Each value gets a kind:

* :class:`Rows` — a value with a batch-major dimension, each block of which depends on one
  example only (``mixed is None``), e.g. activations of a per-example model;
* :class:`Stat` — a value reduced over the batch axis: a linear sum of per-example terms;
* :class:`Const` — batch-independent (params, constants), with the dimensions along which
  it is known not to vary;
* :class:`Top` — batch-dependent with no structure the analysis can follow.

Every kind also carries ``exp``: how the value scales from one device's rows to the global
micro-batch, as a power of the number ``D`` of data-parallel devices (a mean over the
examples is a sum times ``n ** -1``, so ``D ** -1``). It comes from pairing the global
jaxpr with the jaxpr of the program that really runs per device, traced on ``n / D``
rows: every equation must match, a parameter may differ only where it is a shape that
follows the batch (a slice of the whole batch, a broadcast to the batch's rows), and a
literal or constant that differs scales by the ratio of its two values (``jnp.mean``'s
divisor ``n`` against ``n / D``: ``D ** 1``; ``max(n, 8)`` gives a ratio that is no power
of ``D`` unless the two programs really divide alike). The proof is therefore about the
two programs that run, not about a rule guessed from one size: a loss whose operations
change with the number of rows (a Python branch on ``x.shape[0]``, a loop of ``n`` steps,
a shape ``(n, n)``) is either found to combine exactly or takes the global view. Without
a partner trace every literal counts as a constant.

Anything the rules do not recognize is treated as mixing examples; each value keeps the
first reason it mixes (with its source line) for diagnostics. The same walk finds the
params used only as a matmul operand against batch rows: those can be typed ``reduced``
on an Explicit mesh so their gradients stay unreduced across the micro-batch loop.

This module holds the walker and the pairing of two traces; the kinds are in
:mod:`fxaccum.analysis.kinds`, the rule of each primitive in :mod:`fxaccum.analysis.rules`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.extend import core as jcore
from jax.sharding import Mesh, PartitionSpec, Sharding

from fxaccum.analysis.kinds import (
  Const,
  Exp,
  Kind,
  Rows,
  Stat,
  Top,
  Unpaired,
  join,
  mixing,
)
from fxaccum.analysis.rules import (
  ELEMENTWISE,
  RULES,
  SUBCALLS,
  TRANSPARENT,
  elementwise,
  shape_of,
  slice_at,
  whole_dim,
  with_place,
)
from fxaccum.jaxprs import subjaxprs

__all__ = ["Const", "Rows", "Stat", "Top", "Analysis", "analyze", "depends_on", "mixing"]


@dataclasses.dataclass(frozen=True)
class Analysis:
  """Result of :func:`analyze`.

  Attributes:
    outputs: the kind of each output of the jaxpr.
    blockers: why the loss cannot run inside a region manual over the data axes (a
      nested ``shard_map``, which JAX 0.10 cannot lower there), empty if it can.
    reducible: indices of the param inputs used only as a matmul operand against batch
      rows (through casts and transposes).
    sized_positions: an index or position operand followed the number of rows (with a
      symbolic one, JAX spells some operations so, e.g. a reversal as a gather): a trace
      on concrete sizes may prove more.
  """

  outputs: tuple[Kind, ...]
  blockers: tuple[str, ...]
  reducible: frozenset[int]
  sized_positions: bool = False


def analyze(
    closed_jaxpr: Any,
    *,
    rows: int,
    batch_inputs: Sequence[int],
    param_inputs: Sequence[int],
    partner: Any = None,
    partner_rows: int | None = None,
) -> Analysis:
  """Walks ``closed_jaxpr`` whose inputs at ``batch_inputs`` have ``rows`` examples on
  axis 0; ``param_inputs`` are followed for :attr:`Analysis.reducible`. ``partner`` is the
  same computation traced with ``partner_rows`` examples (the per-device program), for
  the exponents (see the module doc)."""
  jaxpr = closed_jaxpr.jaxpr
  base = rows / partner_rows if partner is not None and partner_rows else None
  walker = _Walker(rows, base)
  if walker.symbol is not None:
    walker.mark_symbolic(jaxpr)
  unpaired = None
  if partner is not None:
    try:
      walker.pair(jaxpr, partner.jaxpr)
    except Unpaired as err:
      unpaired = ("the loss's operations change with the number of rows (the per-device "
                  f"program differs from the global one{err.where})")
      walker, partner = _Walker(rows), None
  kinds = [Rows(0) if i in set(batch_inputs) else Const() for i in range(len(jaxpr.invars))]
  partner_consts = partner.consts if partner is not None else [None] * len(
      closed_jaxpr.consts)
  consts = [walker.const_kind(c, d) for c, d in zip(closed_jaxpr.consts, partner_consts,
                                                     strict=True)]
  origins = {i: p for p, i in enumerate(param_inputs)}
  outputs = walker.run(jaxpr, consts, kinds, origins)
  if unpaired is not None:  # a reason it mixes examples says more, where there is one
    outputs = [k if mixing(k) else Top(unpaired) for k in outputs]
  used_params = set(range(len(param_inputs)))
  return Analysis(tuple(outputs), tuple(dict.fromkeys(walker.blockers)),
                  frozenset(used_params - walker.not_reducible), walker.sized_positions)


def depends_on(closed_jaxpr: Any, values: Sequence[Any],
               collectives: frozenset[str] = frozenset()) -> list[bool]:
  """For each output of ``closed_jaxpr``: whether it depends on one of ``values`` (outer
  tracers the traced function closed over, which appear as its constants), or on the
  result of a primitive in ``collectives`` (at any depth: inside a ``jit`` too)."""
  wanted = {id(v) for v in values}
  jaxpr = closed_jaxpr.jaxpr
  reached = {var for var, const in zip(jaxpr.constvars, closed_jaxpr.consts, strict=True)
             if id(const) in wanted}
  for eqn in jaxpr.eqns:
    if any(not isinstance(v, jcore.Literal) and v in reached for v in eqn.invars) or (
        collectives and _calls(eqn, collectives)):
      reached.update(eqn.outvars)
  return [not isinstance(v, jcore.Literal) and v in reached for v in jaxpr.outvars]


def _calls(eqn: Any, names: frozenset[str]) -> bool:
  """Whether ``eqn`` is, or holds in a sub-jaxpr, a primitive named in ``names``."""
  return eqn.primitive.name in names or any(
      _calls(inner, names) for value in eqn.params.values()
      for sub in subjaxprs(value) for inner in sub.eqns)


# ---------------------------------------------------------------------------------------
# The walker


class _Walker:

  def __init__(self, rows: Any, base: float | None = None):
    self.rows = rows
    self.base = base  # D: rows over the partner's rows; None without a partner
    # Symbolic mode: ``rows`` is a symbolic dimension (jax.export), every size that
    # follows it is an expression in it, and no partner trace is needed.
    self.symbol = None if _is_constant(rows) else rows
    self.blockers: list[str] = []
    self.not_reducible: set[int] = set()
    # id(eqn) -> the same equation in the partner trace; id(jaxpr) -> the same jaxpr
    self.partners: dict[Any, Any] = {}
    # id(eqn) -> the names of its parameters that differ in the partner trace
    self.changed: dict[int, tuple[str, ...]] = {}
    # var -> its shape in the partner trace, where no partner equation gives it (a sum
    # over a dimension of size 1 there, which JAX left out or kept as a dimension)
    self.virtual: dict[Any, tuple[int, ...]] = {}
    # whether a position or index operand followed the number of rows
    self.sized_positions = False

  # -- pairing with the per-device trace -----------------------------------------------

  def pair(self, a, b) -> None:
    """Matches jaxpr ``a`` (the global program) with ``b`` (the per-device one) equation
    by equation, following the data flow: equal primitives applied to corresponding
    values. An equation of ``a`` that is the identity at ``b``'s sizes (a sum over a
    dimension that has one row per device, a broadcast to it: JAX leaves those out) may
    have no partner; where both readings fit, the match is tried first and the other on
    failure. Anything else that differs raises :class:`Unpaired`."""
    if (len(a.invars) != len(b.invars) or len(a.outvars) != len(b.outvars)
        or len(a.constvars) != len(b.constvars)):
      raise Unpaired
    env = dict(zip([*a.constvars, *a.invars], [*b.constvars, *b.invars], strict=True))
    trail: list[Any] = []  # the keys added to env, in order (undone on backtracking)
    matched: list[tuple[Any, Any]] = []
    choices: list[tuple[int, int, int, int, Any]] = []  # where a skip was possible too
    i = j = furthest = 0
    budget = 4 * len(a.eqns) + 16
    while True:
      if i == len(a.eqns):
        if j == len(b.eqns) and _corresponds(a.outvars, b.outvars, env):
          break
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
    self.partners[id(a)] = b
    paired = {id(ea) for ea, _ in matched}
    for ea in a.eqns:  # left out in the partner: its result has the partner's shape there
      if id(ea) not in paired:
        self.virtual[ea.outvars[0]] = _reduced_shape(ea, shape_of(env[ea.invars[0]]))
    for ea, eb in matched:
      self._pair_eqn(ea, eb)

  def _pair_eqn(self, ea, eb) -> None:
    self.partners[id(ea)] = eb
    changed = []
    for key in sorted(set(ea.params) | set(eb.params)):
      va, vb = ea.params.get(key), eb.params.get(key)
      subs_a, subs_b = subjaxprs(va), subjaxprs(vb)
      if subs_a or subs_b:
        if len(subs_a) != len(subs_b):
          raise Unpaired(with_place(ea, f": {ea.primitive.name}"))
        for sa, sb in zip(subs_a, subs_b, strict=True):
          self.pair(sa, sb)
        for ca, cb in zip(_closed(va), _closed(vb), strict=False):
          self.partners[("closed", id(ca))] = cb
      elif not _same_param(va, vb):
        changed.append(key)
    if changed:
      self.changed[id(ea)] = tuple(changed)
    if "axes" in changed and ea.primitive.name in _NOOP_REDUCTIONS:
      # Reduced over a dimension that has one row per device: as if the partner had too.
      self.virtual[ea.outvars[0]] = _reduced_shape(ea, shape_of(eb.invars[0]))

  def _identity_at_partner(self, eqn, env) -> Any:
    """The partner's value that ``eqn``'s result is, if ``eqn`` is the identity at the
    partner's sizes, else None."""
    name = eqn.primitive.name
    source = eqn.invars[0] if eqn.invars else None
    if (self.base is None or isinstance(source, jcore.Literal) or source not in env
        or len(eqn.outvars) != 1):
      return None
    theirs = env[source]
    shape = shape_of(theirs)
    if name in _NOOP_REDUCTIONS:
      axes = eqn.params["axes"]
      ok = len(shape) == len(shape_of(source)) and all(shape[d] == 1 for d in axes)
    elif name in _NOOP_RESHAPES and len(eqn.invars) == 1:
      out = shape_of(eqn.outvars[0])
      ok = len(out) == len(shape) and all(
          x == y or x == y * self.base for x, y in zip(out, shape, strict=True))
    else:
      ok = False
    return theirs if ok else None

  def partner_shape(self, eqn, position: int, out: bool = False) -> tuple[int, ...] | None:
    var = (eqn.outvars if out else eqn.invars)[position]
    if not isinstance(var, jcore.Literal) and var in self.virtual:
      return self.virtual[var]
    partner = self.partners.get(id(eqn))
    if partner is None:
      return None
    return shape_of((partner.outvars if out else partner.invars)[position])

  def mark_symbolic(self, jaxpr) -> None:
    """Symbolic mode's counterpart of :meth:`pair`: the parameters that hold sizes
    following the rows (expressions in the symbol) count as changed."""
    for eqn in jaxpr.eqns:
      changed = []
      for key, value in eqn.params.items():
        subs = subjaxprs(value)
        for sub in subs:
          self.mark_symbolic(sub)
        if not subs and _holds_symbol(value):
          changed.append(key)
      if changed:
        self.changed[id(eqn)] = tuple(changed)

  def degree(self, size: Any) -> Exp:
    """``e`` with ``size == c * rows ** e`` (symbolic mode), else None."""
    if _is_constant(size):
      return 0.0
    exp = 0
    while not _is_constant(size):
      if size % self.symbol != 0:
        return None
      size, exp = size // self.symbol, exp + 1
    return float(exp) if size != 0 else None

  def scaled_dims(self, eqn, position: int, out: bool = False) -> set[int]:
    """Dims of input (or output) ``position`` whose size follows the rows: symbolic
    ones, or (paired) ones that differ in the partner trace."""
    if self.symbol is not None:
      var = (eqn.outvars if out else eqn.invars)[position]
      return {d for d, s in enumerate(shape_of(var)) if not _is_constant(s)}
    theirs = self.partner_shape(eqn, position, out)
    if theirs is None:
      return set()
    mine = shape_of((eqn.outvars if out else eqn.invars)[position])
    return {d for d, (x, y) in enumerate(zip(mine, theirs, strict=False)) if x != y}

  def size_exp(self, eqn, position: int, dims: set[int]) -> Exp:
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

  def const_kind(self, value, partner) -> Const:
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

  def literal(self, var, partner) -> Const:
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

  # -- the walk ------------------------------------------------------------------------

  def run(self, jaxpr, const_kinds, in_kinds, origins: dict[int, int]) -> list[Kind]:
    """Kinds of ``jaxpr``'s outputs. ``origins`` maps input positions to param indices."""
    env: dict[Any, Kind] = {}
    origin: dict[Any, int] = {}
    for var, kind in zip(jaxpr.constvars, const_kinds, strict=True):
      env[var] = kind
    for pos, (var, kind) in enumerate(zip(jaxpr.invars, in_kinds, strict=True)):
      env[var] = kind
      if pos in origins:
        origin[var] = origins[pos]
    for eqn in jaxpr.eqns:
      kinds = [self._read(env, eqn, i) for i in range(len(eqn.invars))]
      sources = {pos: origin[v] for pos, v in enumerate(eqn.invars)
                 if not isinstance(v, jcore.Literal) and v in origin}
      outs = self._eqn(eqn, kinds, sources)
      for var, kind in zip(eqn.outvars, outs, strict=True):
        env[var] = kind
      if sources and eqn.primitive.name in TRANSPARENT:
        origin[eqn.outvars[0]] = sources[0]
    partner = self.partners.get(id(jaxpr))
    return [env[v] if not isinstance(v, jcore.Literal) else self.literal(
        v, partner.outvars[i] if partner is not None else None)
            for i, v in enumerate(jaxpr.outvars)]

  def _read(self, env, eqn, position: int) -> Kind:
    var = eqn.invars[position]
    if not isinstance(var, jcore.Literal):
      return env[var]
    partner = self.partners.get(id(eqn))
    return self.literal(var, partner.invars[position] if partner is not None else None)

  def _eqn(self, eqn, kinds: list[Kind], sources: dict[int, int]) -> list[Kind]:
    try:
      return self._eqn_kinds(eqn, kinds, sources)
    except Unpaired:
      raise
    except Exception as err:  # noqa: BLE001 - a rule that does not fit this JAX's equation
      self.not_reducible.update(sources.values())
      return [Top(with_place(eqn, (
          f"fxaccum could not read {eqn.primitive.name} as JAX {jax.__version__} writes it "
          f"({type(err).__name__}: {err}); please report it")))] * len(eqn.outvars)

  def _eqn_kinds(self, eqn, kinds: list[Kind], sources: dict[int, int]) -> list[Kind]:
    name = eqn.primitive.name
    subcall = SUBCALLS.get(name)
    if subcall is not None:
      return subcall(self, eqn, kinds, sources)
    self._use_params(eqn, kinds, sources)
    tops = [k for k in kinds if isinstance(k, Top)]
    if tops and name == "div" and isinstance(kinds[1], Stat):
      return [Stat(tops[0].mixed, None, ratio=True)]  # e.g. a total over a token count
    if tops:  # unknown structure in, unknown structure out
      return [tops[0]] * len(eqn.outvars)
    unexplained = _unexplained_change(self, eqn)
    if unexplained:
      reason = with_place(eqn, f"{name}'s parameter {unexplained} depends on the number of rows")
      if all(isinstance(k, Const) for k in kinds):
        return [Const(exp=None)] * len(eqn.outvars)
      return [Top(reason)] * len(eqn.outvars)
    rule = RULES.get(name)
    if rule is None:
      if name in ELEMENTWISE:
        rule = elementwise
      elif all(isinstance(k, Const) for k in kinds):
        # An op with no rule keeps batch-independent values batch-independent, but how
        # its result scales with the number of rows is known only where nothing scales.
        scaled = any(self.scaled_dims(eqn, i) for i in range(len(kinds)))
        exp = 0.0 if not scaled and all(k.exp == 0 for k in kinds) else None
        return [Const(exp=exp)] * len(eqn.outvars)
      else:
        return [Top(with_place(eqn, f"{name} is not known to keep examples apart"))] * len(
            eqn.outvars)
    out = rule(self, eqn, kinds)
    outs = out if isinstance(out, list) else [out] * len(eqn.outvars)
    return [self._checked(eqn, i, kind) for i, kind in enumerate(outs)]

  def _checked(self, eqn, position: int, kind: Kind) -> Kind:
    """A batch-dependent result whose other dimensions follow the number of rows: each
    example's block would differ between the per-device and the global program. And a
    scaled value in an integer type narrow enough to wrap (a uint8 sum of ``n`` tens) no
    longer scales as a power of the rows."""
    dtype = getattr(eqn.outvars[position].aval, "dtype", None)
    if kind.exp not in (0.0, None) and dtype is not None and np.issubdtype(
        dtype, np.integer) and np.dtype(dtype).itemsize < 4:
      kind = dataclasses.replace(kind, exp=None)
    if isinstance(kind, (Const, Top)) or kind.mixed:
      return kind
    scaled = self.scaled_dims(eqn, position, out=True) - (
        {kind.dim} if isinstance(kind, Rows) else set())
    if not scaled:
      return kind
    return dataclasses.replace(kind, mixed=with_place(
        eqn, "a batch-dependent value with a dimension whose size follows the number of rows"))

  def _use_params(self, eqn, kinds, sources: dict[int, int]) -> None:
    """Marks params used other than through casts into a matmul against batch rows."""
    name = eqn.primitive.name
    for pos, param in sources.items():
      if name in TRANSPARENT:
        continue
      if name == "dot_general" and isinstance(kinds[1 - pos], Rows):
        continue
      self.not_reducible.add(param)

  def loop(self, body: Callable[[list[Kind]], list[Kind]], carry: list[Kind]) -> list[Kind]:
    """Fixpoint of ``carry -> join(carry, body(carry))``."""
    for _ in range(8):
      new = [join(a, b) for a, b in zip(carry, body(carry), strict=True)]
      if new == carry:
        return carry
      carry = new
    return [c if isinstance(c, Const) else Top("a loop carry that does not settle")
            for c in carry]


# Ops JAX leaves out where they would change nothing: sums over, and broadcasts to, a
# dimension of size 1 (e.g. a gradient's reduction over the batch when it has one row).
_NOOP_REDUCTIONS = frozenset({"reduce_sum", "reduce_max", "reduce_min", "reduce_and",
                              "reduce_or", "reduce_prod"})
_NOOP_RESHAPES = frozenset({"reshape", "broadcast_in_dim", "squeeze", "expand_dims"})


def _reduced_shape(eqn, shape: tuple[int, ...]) -> tuple[int, ...]:
  """The partner's shape of ``eqn``'s result, from the partner's shape of its operand:
  reduced over ``eqn``'s axes (the identity there), or the operand itself."""
  if eqn.primitive.name in _NOOP_REDUCTIONS:
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


def _is_constant(size: Any) -> bool:
  """Whether a size is a number, not an expression in a symbolic dimension."""
  return not jax.export.is_symbolic_dim(size)


def _holds_symbol(value: Any) -> bool:
  if isinstance(value, (tuple, list)):
    return any(_holds_symbol(v) for v in value)
  return jax.export.is_symbolic_dim(value)


def _closed(value: Any) -> list[Any]:
  """The closed jaxprs held by an equation parameter (their constants are paired too)."""
  if isinstance(value, jcore.ClosedJaxpr):
    return [value]
  if isinstance(value, (tuple, list)):
    return [j for v in value for j in _closed(v)]
  return []


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
  except Exception:  # noqa: BLE001 - incomparable values: count them as different
    return False


def _holds_sharding(value: Any) -> bool:
  if isinstance(value, (Sharding, PartitionSpec, Mesh, jax.sharding.AbstractMesh)):
    return True
  return isinstance(value, (tuple, list)) and any(_holds_sharding(v) for v in value)


# Parameters that are shapes: they may follow the batch's rows. What reads along such a
# dimension is checked by the rules (reductions, contractions, slices, scans).
_SHAPE_PARAMS = {
    "broadcast_in_dim": {"shape", "sharding"},
    "reshape": {"new_sizes", "sharding"},
    "iota": {"shape", "sharding"},
    "random_bits": {"shape"},
    "random_split": {"shape"},
    "rng_bit_generator": {"shape"},
    "scan": {"length"},  # the scan rule checks it runs over the examples
    "dim_as_value": {"dim"},
}


def _unexplained_change(w: _Walker, eqn) -> str | None:
  """The first parameter of ``eqn`` that differs in the partner trace for a reason the
  rules do not account for, or None."""
  changed = w.changed.get(id(eqn), ())
  if not changed:
    return None
  name = eqn.primitive.name
  allowed = set(_SHAPE_PARAMS.get(name, ()))
  if name in _SLICE_PARAMS and _slices_follow_rows(w, eqn):
    allowed |= _SLICE_PARAMS[name]
  if name in _NOOP_REDUCTIONS and _axes_follow_rows(w, eqn):
    allowed.add("axes")
  return next((key for key in changed if key not in allowed), None)


_SLICE_PARAMS = {"slice": {"start_indices", "limit_indices", "strides"},
                 "dynamic_slice": {"slice_sizes"}, "gather": {"slice_sizes"}}


def _slices_follow_rows(w: _Walker, eqn) -> bool:
  """Whether a slice differs from its partner (symbolic mode: depends on the symbol)
  only along dimensions whose size follows the rows, and takes those whole."""
  scaled = w.scaled_dims(eqn, 0)
  partner = w.partners.get(id(eqn))
  for d in range(len(shape_of(eqn.invars[0]))):
    differs = (_holds_symbol(slice_at(eqn, d)) if partner is None
               else slice_at(eqn, d) != slice_at(partner, d))
    if differs and not (d in scaled and whole_dim(eqn, d) and (
        partner is None or whole_dim(partner, d))):
      return False
  return True


def _axes_follow_rows(w: _Walker, eqn) -> bool:
  """Whether a reduction's axes differ from its partner's only by dimensions that have
  size 1 in the partner (reducing over those changes no value)."""
  partner = w.partners[id(eqn)]
  theirs = shape_of(partner.invars[0])
  differ = set(eqn.params["axes"]) ^ set(partner.params["axes"])
  return all(theirs[d] == 1 and d in w.scaled_dims(eqn, 0) for d in differ)


def _array(value: Any) -> np.ndarray | None:
  try:
    if jax.dtypes.issubdtype(getattr(value, "dtype", None), jax.dtypes.prng_key):
      value = jax.random.key_data(value)
    out = np.asarray(value)
  except Exception:  # noqa: BLE001 - e.g. a closed-over tracer: no numbers to compare
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
