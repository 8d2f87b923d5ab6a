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

This module holds the interpreter: it reads each equation's operands, asks the rule the
registry holds for its primitive (:mod:`fxaccum.analysis.registry`; the rules are in
:mod:`fxaccum.analysis.rules`), and merges the rules' findings. The pairing of the two
traces is a pass of its own (:mod:`fxaccum.analysis.pairing`), run before. May import
:mod:`.kinds`, :mod:`.eqns`, :mod:`.pairing`, :mod:`.registry`, :mod:`.rules`,
``fxaccum.jaxprs`` and JAX.
"""

from __future__ import annotations

import dataclasses
import math
import os
import warnings
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.extend import core as jcore

from fxaccum.analysis import rules as _rules  # noqa: F401 - fills the registry
from fxaccum.analysis.eqns import is_constant, with_place
from fxaccum.analysis.kinds import Blocked, Const, Kind, Rows, Stat, Top, Unpaired, mixing, plain
from fxaccum.analysis.pairing import Pairing
from fxaccum.analysis.registry import (
    CALL_RULES,
    READS_BLOCKS,
    RULES,
    Context,
    Out,
    Result,
    facts_of,
)
from fxaccum.jaxprs import eqns_within

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
    rows_seen: int | None = None,
) -> Analysis:
  """Walks ``closed_jaxpr`` whose inputs at ``batch_inputs`` have ``rows`` examples on
  axis 0; ``param_inputs`` are followed for :attr:`Analysis.reducible`. ``partner`` is the
  same computation traced with ``partner_rows`` examples (the per-device program), for
  the exponents (see the module doc). ``rows_seen``: the global number of rows the step
  runs on, where ``rows`` is symbolic (the size at which a narrow integer sum must not
  wrap)."""
  jaxpr = closed_jaxpr.jaxpr
  base = rows / partner_rows if partner is not None and partner_rows else None
  pairing = Pairing(rows, base)
  if pairing.symbol is not None:
    pairing.mark_symbolic(jaxpr)
  unpaired = None
  if partner is not None:
    try:
      pairing.pair(jaxpr, partner.jaxpr)
    except Unpaired as err:
      unpaired = ("the loss's operations change with the number of rows (the per-device "
                  f"program differs from the global one{err.where})")
      pairing, partner = Pairing(rows), None
  interpreter = _Interpreter(pairing, rows if pairing.symbol is None else rows_seen)
  kinds = [Rows(0) if i in set(batch_inputs) else Const() for i in range(len(jaxpr.invars))]
  partner_consts = partner.consts if partner is not None else [None] * len(
      closed_jaxpr.consts)
  consts = [pairing.const_kind(c, d) for c, d in zip(closed_jaxpr.consts, partner_consts,
                                                      strict=True)]
  origins = {i: p for p, i in enumerate(param_inputs)}
  outputs = interpreter.run(jaxpr, consts, kinds, origins)
  if unpaired is not None:  # a reason it mixes examples says more, where there is one
    outputs = [k if mixing(k) else Top(unpaired) for k in outputs]
  used_params = set(range(len(param_inputs)))
  return Analysis(tuple(outputs), tuple(dict.fromkeys(interpreter.blockers)),
                  frozenset(used_params - interpreter.not_reducible),
                  interpreter.sized_positions)


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
  return any(inner.primitive.name in names for inner in eqns_within(eqn))


# "raise" (the test suite sets it, tests/conftest.py): a rule that raises is a bug that must
# fail the test that found it. Otherwise the equation counts as mixing examples (the global
# view, exact) and each primitive's failure is warned about once.
RULE_ERRORS = "FXACCUM_RULE_ERRORS"
_WARNED: set[str] = set()


class RuleError(RuntimeError):
  """A rule of the view analysis raised on an equation (under ``FXACCUM_RULE_ERRORS=raise``)."""


def _rule_failed(eqn: Any, err: Exception) -> None:
  name = eqn.primitive.name
  if os.environ.get(RULE_ERRORS) == "raise":
    raise RuleError(f"the view analysis's rule for {name} raised on {eqn}") from err
  if name not in _WARNED:
    _WARNED.add(name)
    warnings.warn(
        f"fxaccum's view analysis failed on {name} ({type(err).__name__}: {err}) with JAX "
        f"{jax.__version__}: the step takes the global view, which is exact but may be "
        "slower. Please report it to fxaccum with this message.", RuntimeWarning,
        stacklevel=2)


class _Interpreter:
  """Gives each value of a jaxpr its kind, equation by equation, from the registry's
  rules; collects their findings (see :class:`~fxaccum.analysis.registry.Result`)."""

  def __init__(self, pairing: Pairing, rows_seen: int | None = None):
    self.pairing = pairing
    self.rows_seen = rows_seen
    self.blockers: list[str] = []
    self.not_reducible: set[int] = set()
    self.sized_positions = False
    # var -> a bound on the magnitude of its integer elements, where one is known
    self.bounds: dict[Any, int] = {}

  def run(self, jaxpr: Any, const_kinds: Sequence[Kind], in_kinds: Sequence[Kind],
          origins: dict[int, int]) -> list[Kind]:
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
      self._bound(eqn)
      outs = self._eqn(eqn, kinds, sources)
      for var, kind in zip(eqn.outvars, outs, strict=True):
        env[var] = kind
      if sources and facts_of(eqn.primitive.name).transparent:
        origin[eqn.outvars[0]] = sources[0]
    partner = self.pairing.partners.get(id(jaxpr))
    return [env[v] if not isinstance(v, jcore.Literal) else self.pairing.literal(
        v, partner.outvars[i] if partner is not None else None)
            for i, v in enumerate(jaxpr.outvars)]

  def inner(self, closed: Any, kinds: Sequence[Kind], sources: dict[int, int],
            partner: Any = None) -> list[Kind]:
    """The kinds of the outputs of a jaxpr an equation holds (see
    :data:`~fxaccum.analysis.registry.Inner`)."""
    if partner is not None:
      self.pairing.pair(closed.jaxpr, partner.jaxpr)
      self.pairing.partners[("closed", id(closed))] = partner
    jaxpr = getattr(closed, "jaxpr", closed)
    consts = list(getattr(closed, "consts", None) or [])
    if len(consts) != len(jaxpr.constvars):
      consts = [None] * len(jaxpr.constvars)
    theirs = list(getattr(self.pairing.partners.get(("closed", id(closed))), "consts", None)
                  or [])
    if len(theirs) != len(consts):
      theirs = [None] * len(consts)
    const_kinds = [Const() if c is None else self.pairing.const_kind(c, d)
                   for c, d in zip(consts, theirs, strict=True)]
    return self.run(jaxpr, const_kinds, kinds, sources)

  def _read(self, env: dict[Any, Kind], eqn: Any, position: int) -> Kind:
    var = eqn.invars[position]
    if not isinstance(var, jcore.Literal):
      return env[var]
    partner = self.pairing.partners.get(id(eqn))
    return self.pairing.literal(var, partner.invars[position] if partner is not None else None)

  def _eqn(self, eqn: Any, kinds: list[Kind], sources: dict[int, int]) -> list[Kind]:
    try:
      return self._eqn_kinds(eqn, kinds, sources)
    except Unpaired:
      raise
    except Exception as err:  # noqa: BLE001 - a rule bug: raised in tests, else the global view
      _rule_failed(eqn, err)
      self.not_reducible.update(sources.values())
      return [Top(with_place(eqn, (
          f"fxaccum could not read {eqn.primitive.name} as JAX {jax.__version__} writes it "
          f"({type(err).__name__}: {err}); please report it")))] * len(eqn.outvars)

  def _eqn_kinds(self, eqn: Any, kinds: list[Kind], sources: dict[int, int]) -> list[Kind]:
    name = eqn.primitive.name
    ctx = Context(eqn, self.pairing, sources, self.inner)
    call_rule = CALL_RULES.get(name)
    if call_rule is not None:
      return self._merged(eqn, call_rule(ctx, kinds))
    self.not_reducible |= _used_params(eqn, kinds, sources)
    if name not in READS_BLOCKS:
      kinds = [plain(k) for k in kinds]
    tops = [k for k in kinds if isinstance(k, Top) and not isinstance(k, Blocked)]
    if tops and name == "div" and isinstance(kinds[1], Stat):
      return [Stat(tops[0].mixed, None, ratio=True)]  # e.g. a total over a token count
    if tops:  # unknown structure in, unknown structure out
      return [tops[0]] * len(eqn.outvars)
    unexplained = self.pairing.unexplained_change(eqn)
    if unexplained:
      reason = with_place(eqn, f"{name}'s parameter {unexplained} depends on the number of rows")
      if all(isinstance(k, Const) for k in kinds):
        return [Const(exp=None)] * len(eqn.outvars)
      # JAX spells some ops otherwise for a symbolic size (lax.map's batch_size splits
      # off a remainder by gathers): the two programs that run may still pair.
      self.sized_positions = self.sized_positions or self.pairing.symbol is not None
      return [Top(reason)] * len(eqn.outvars)
    rule = RULES.get(name)
    if rule is None:
      if all(isinstance(k, Const) for k in kinds):
        # An op with no rule keeps batch-independent values batch-independent, but how
        # its result scales with the number of rows is known only where nothing scales.
        scaled = any(self.pairing.scaled_dims(eqn, i) for i in range(len(kinds)))
        exp = 0.0 if not scaled and all(k.exp == 0 for k in kinds) else None
        return [Const(exp=exp)] * len(eqn.outvars)
      return [Top(with_place(eqn, f"{name} is not known to keep examples apart"))] * len(
          eqn.outvars)
    outs = self._merged(eqn, rule(ctx, kinds))
    return [self._checked(eqn, i, kind) for i, kind in enumerate(outs)]

  def _merged(self, eqn: Any, out: Out) -> list[Kind]:
    """A rule's answer as a kind per result, its findings recorded."""
    if isinstance(out, Result):
      self.not_reducible |= out.not_reducible
      self.blockers.extend(out.blockers)
      self.sized_positions = self.sized_positions or out.sized_positions
      out = out.kinds
    return list(out) if isinstance(out, list) else [out] * len(eqn.outvars)

  def _bound(self, eqn: Any) -> None:
    """Records a bound on the magnitude of the integer elements of ``eqn``'s result where
    one is known: a flag cast from a bool is 0 or 1, a sum of ``m`` bounded elements
    ``m`` times their bound, and ops that move or copy elements keep it (as their
    :class:`~fxaccum.analysis.registry.Facts` say)."""
    name = eqn.primitive.name
    carries = facts_of(name).bound
    var = eqn.invars[0] if eqn.invars else None
    if var is None or isinstance(var, jcore.Literal):
      return
    if name == "convert_element_type" and jax.dtypes.issubdtype(var.aval.dtype, np.bool_):
      bound: int | None = 1
    elif var not in self.bounds or carries is None:
      return
    elif carries == "sums":
      count = self._count(math.prod(var.aval.shape[d] for d in eqn.params["axes"]))
      bound = None if count is None else count * self.bounds[var]
    else:
      bound = self.bounds[var]
    dtype = eqn.outvars[0].aval.dtype
    integer = jax.dtypes.issubdtype(dtype, np.integer)
    if bound is not None and (not integer or bound <= np.iinfo(dtype).max):
      self.bounds[eqn.outvars[0]] = bound

  def _count(self, size: Any) -> int | None:
    """A number of elements at the rows seen (an expression in the symbolic rows)."""
    if is_constant(size):
      return int(size)
    symbol, exp = self.pairing.symbol, self.pairing.degree(size)
    if symbol is None or exp is None or self.rows_seen is None:
      return None
    factor = size // symbol ** int(exp)
    return int(factor) * self.rows_seen ** int(exp) if is_constant(factor) else None

  def _checked(self, eqn: Any, position: int, kind: Kind) -> Kind:
    """A batch-dependent result whose other dimensions follow the number of rows: each
    example's block would differ between the per-device and the global program. A scaled
    value in an integer type narrow enough to wrap (a uint8 sum of ``n`` tens) no longer
    scales as a power of the rows, and a sum over the examples in such a type may wrap
    globally where no device's sum does, unless its bound fits the type at the rows seen."""
    dtype = getattr(eqn.outvars[position].aval, "dtype", None)
    narrow = dtype is not None and jax.dtypes.issubdtype(dtype, np.integer) and np.dtype(
        dtype).itemsize < 4
    if kind.exp not in (0.0, None) and narrow:
      kind = dataclasses.replace(kind, exp=None)
    if isinstance(kind, Stat) and not kind.mixed and narrow and (
        eqn.outvars[position] not in self.bounds):
      return dataclasses.replace(kind, mixed=with_place(
          eqn, f"a sum over the examples in {np.dtype(dtype)} may wrap at "
          f"{self.rows_seen or 'some number of'} rows where no device's sum does"))
    if isinstance(kind, (Const, Top)) or kind.mixed:
      return kind
    scaled = self.pairing.scaled_dims(eqn, position, out=True) - (
        {kind.dim} if isinstance(kind, Rows) else set())
    if not scaled:
      return kind
    return dataclasses.replace(kind, mixed=with_place(
        eqn, "a batch-dependent value with a dimension whose size follows the number of rows"))


def _used_params(eqn: Any, kinds: Sequence[Kind], sources: dict[int, int]) -> set[int]:
  """The params ``eqn`` uses other than through casts into a matmul against batch rows."""
  name = eqn.primitive.name
  if facts_of(name).transparent:
    return set()
  return {param for pos, param in sources.items()
          if not (name == "dot_general" and isinstance(kinds[1 - pos], Rows))}
