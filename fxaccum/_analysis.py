"""Does a loss keep its examples apart? A conservative analysis of the loss's jaxpr.

fxaccum's fast in-step path runs the loss *per device* on that device's rows and adds the
devices' results up. That equals running the loss on the global micro-batch only when the
loss is a sum (or mean) of per-example terms. This module proves that from the jaxpr of
the loss traced on the global micro-batch, following the batch axis (axis 0 of every batch
leaf) through every equation. Each value gets a kind:

* :class:`Rows` — a value with a batch-major dimension, each block of which depends on one
  example only (``mixed is None``), e.g. activations of a per-example model;
* :class:`Stat` — a value reduced over the batch axis: a linear sum of per-example terms;
* :class:`Const` — batch-independent (params, constants), with the dimensions along which
  it is known not to vary;
* :class:`Top` — batch-dependent with no structure the analysis can follow.

Every kind also carries ``exp``: how the value scales with the number ``n`` of examples in
the micro-batch, as a power ``n ** exp`` (a mean is a sum times ``n ** -1``). The per-device
view runs the loss on ``n / D`` examples, so this decides whether per-device results add up
to the global one (:func:`fxaccum._view.classify`). Exponents come from pairing the jaxpr
with a second trace at ``2 n`` examples: a literal that doubles (``jnp.mean``'s divisor,
``x.shape[0]``) scales as ``n``, one that stays (``/ 256.0``) is a constant, whatever its
value. Without a second trace every literal counts as a constant.

Anything the rules do not recognize is treated as mixing examples; each value keeps the
first reason it mixes (with its source line) for diagnostics. The same walk finds the
params used only as a matmul operand against batch rows: those can be typed ``reduced``
on an Explicit mesh so their gradients stay unreduced across the micro-batch loop.

Custom derivative rules: ``custom_jvp`` functions are analyzed through their primal
(their JVP rule is assumed to be its derivative); ``custom_vjp`` functions are opaque and
count as mixing examples, since their backward pass is arbitrary code.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from jax.extend import core as jcore

__all__ = ["Const", "Rows", "Stat", "Top", "Analysis", "analyze", "depends_on", "mixing"]

Exp = float | None  # the value scales as n ** exp; None: some other dependence on n


@dataclasses.dataclass(frozen=True)
class Const:
  """Batch-independent. ``uniform``: dims along which it is constant; ``value``: the one
  scalar value of every element, when known (literals and their broadcasts)."""

  uniform: frozenset[int] = frozenset()
  value: float | None = None
  exp: Exp = 0.0


@dataclasses.dataclass(frozen=True)
class Rows:
  """Has batch-major dimension ``dim``; ``mixed`` says why its blocks mix examples."""

  dim: int
  mixed: str | None = None
  exp: Exp = 0.0


@dataclasses.dataclass(frozen=True)
class Stat:
  """Reduced over the batch axis; ``mixed`` says why it is no linear sum of per-example
  terms (times ``n ** exp``); ``ratio``: it divides by another batch statistic (e.g. a
  token mean of this micro-batch)."""

  mixed: str | None = None
  exp: Exp = 0.0
  ratio: bool = False


@dataclasses.dataclass(frozen=True)
class Top:
  """Batch-dependent, structure unknown; always mixes examples."""

  mixed: str
  exp: Exp = None


Kind = Const | Rows | Stat | Top


def mixing(kind: Kind) -> str | None:
  """Why ``kind`` mixes examples, or None."""
  return None if isinstance(kind, Const) else kind.mixed


@dataclasses.dataclass(frozen=True)
class Analysis:
  """Result of :func:`analyze`.

  Attributes:
    outputs: the kind of each output of the jaxpr.
    blockers: why the loss cannot run inside a region manual over the data axes (a
      nested ``shard_map``, which JAX 0.10 cannot lower there), empty if it can.
    reducible: indices of the param inputs used only as a matmul operand against batch
      rows (through casts and transposes).
  """

  outputs: tuple[Kind, ...]
  blockers: tuple[str, ...]
  reducible: frozenset[int]


def analyze(
    closed_jaxpr: Any,
    *,
    rows: int,
    batch_inputs: Sequence[int],
    param_inputs: Sequence[int],
    twice: Any = None,
) -> Analysis:
  """Walks ``closed_jaxpr`` whose inputs at ``batch_inputs`` have ``rows`` examples on
  axis 0; ``param_inputs`` are followed for :attr:`Analysis.reducible`. ``twice`` is the
  same loss traced with ``2 * rows`` examples, for the exponents (see the module doc)."""
  jaxpr = closed_jaxpr.jaxpr
  walker = _Walker(rows)
  if twice is not None:
    try:
      walker.pair(jaxpr, twice.jaxpr)
    except _Unpaired:
      reason = "the loss's operations change with the micro-batch size"
      return Analysis(tuple(Top(reason) for _ in jaxpr.outvars), (), frozenset())
  kinds = [Rows(0) if i in set(batch_inputs) else Const() for i in range(len(jaxpr.invars))]
  partner_consts = twice.consts if twice is not None else closed_jaxpr.consts
  if len(partner_consts) != len(closed_jaxpr.consts):
    partner_consts = [None] * len(closed_jaxpr.consts)
  consts = [walker.const_kind(c, d) for c, d in zip(closed_jaxpr.consts, partner_consts,
                                                     strict=True)]
  origins = {i: p for p, i in enumerate(param_inputs)}
  outputs = walker.run(jaxpr, consts, kinds, origins)
  used_params = set(range(len(param_inputs)))
  return Analysis(tuple(outputs), tuple(dict.fromkeys(walker.blockers)),
                  frozenset(used_params - walker.not_reducible))


def depends_on(closed_jaxpr: Any, values: Sequence[Any]) -> list[bool]:
  """For each output of ``closed_jaxpr``: whether it depends on one of ``values`` (outer
  tracers the traced function closed over, which appear as its constants)."""
  wanted = {id(v) for v in values}
  jaxpr = closed_jaxpr.jaxpr
  reached = {var for var, const in zip(jaxpr.constvars, closed_jaxpr.consts, strict=True)
             if id(const) in wanted}
  for eqn in jaxpr.eqns:
    if any(not isinstance(v, jcore.Literal) and v in reached for v in eqn.invars):
      reached.update(eqn.outvars)
  return [not isinstance(v, jcore.Literal) and v in reached for v in jaxpr.outvars]


class _Unpaired(Exception):
  """The two traces differ in structure."""


# ---------------------------------------------------------------------------------------
# The walker


class _Walker:

  def __init__(self, rows: int):
    self.rows = rows
    self.blockers: list[str] = []
    self.not_reducible: set[int] = set()
    # id(eqn) -> the same equation at 2 * rows; id(jaxpr) -> the same jaxpr
    self.partners: dict[int, Any] = {}

  # -- pairing with the trace at twice the rows ----------------------------------------

  def pair(self, a, b) -> None:
    if len(a.eqns) != len(b.eqns) or len(a.outvars) != len(b.outvars):
      raise _Unpaired
    self.partners[id(a)] = b
    for ea, eb in zip(a.eqns, b.eqns, strict=True):
      if ea.primitive is not eb.primitive or len(ea.invars) != len(eb.invars):
        raise _Unpaired
      self.partners[id(ea)] = eb
      for key, value in ea.params.items():
        subs_a, subs_b = _subjaxprs(value), _subjaxprs(eb.params.get(key))
        if len(subs_a) != len(subs_b):
          raise _Unpaired
        for sa, sb in zip(subs_a, subs_b, strict=True):
          self.pair(sa, sb)

  def scaled_dims(self, eqn, position: int) -> set[int]:
    """Dims of input ``position`` whose size changes with the micro-batch size."""
    partner = self.partners.get(id(eqn))
    if partner is None:
      return set()
    a, b = _shape(eqn.invars[position]), _shape(partner.invars[position])
    return {d for d, (x, y) in enumerate(zip(a, b, strict=False)) if x != y}

  def const_kind(self, value, twice) -> Const:
    if value is twice:
      return Const()
    if twice is None:
      return Const(exp=None)
    a, b = np.asarray(value), np.asarray(twice)
    if a.shape == b.shape and np.array_equal(a, b):
      return Const()
    return Const(exp=_ratio_exp(a, b))

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
      if sources and eqn.primitive.name in _TRANSPARENT:
        origin[eqn.outvars[0]] = sources[0]
    partner = self.partners.get(id(jaxpr))
    return [env[v] if not isinstance(v, jcore.Literal) else _literal(
        v, partner.outvars[i] if partner is not None else None)
            for i, v in enumerate(jaxpr.outvars)]

  def _read(self, env, eqn, position: int) -> Kind:
    var = eqn.invars[position]
    if not isinstance(var, jcore.Literal):
      return env[var]
    partner = self.partners.get(id(eqn))
    return _literal(var, partner.invars[position] if partner is not None else None)

  def _eqn(self, eqn, kinds: list[Kind], sources: dict[int, int]) -> list[Kind]:
    name = eqn.primitive.name
    subcall = _SUBCALLS.get(name)
    if subcall is not None:
      return subcall(self, eqn, kinds, sources)
    self._use_params(eqn, kinds, sources)
    tops = [k for k in kinds if isinstance(k, Top)]
    if tops and name == "div" and isinstance(kinds[1], Stat):
      return [Stat(tops[0].mixed, None, ratio=True)]  # e.g. a total over a token count
    if tops:  # unknown structure in, unknown structure out
      return [tops[0]] * len(eqn.outvars)
    rule = _RULES.get(name)
    if rule is None:
      if name in _ELEMENTWISE:
        rule = _elementwise
      elif all(isinstance(k, Const) for k in kinds):
        return [Const(exp=_common_exp(kinds))] * len(eqn.outvars)
      else:
        return [Top(_where(eqn, f"{name} is not known to keep examples apart"))] * len(
            eqn.outvars)
    out = rule(self, eqn, kinds)
    return out if isinstance(out, list) else [out] * len(eqn.outvars)

  def _use_params(self, eqn, kinds, sources: dict[int, int]) -> None:
    """Marks params used other than through casts into a matmul against batch rows."""
    name = eqn.primitive.name
    for pos, param in sources.items():
      if name in _TRANSPARENT:
        continue
      if name == "dot_general" and isinstance(kinds[1 - pos], Rows):
        continue
      self.not_reducible.add(param)

  def loop(self, body: Callable[[list[Kind]], list[Kind]], carry: list[Kind]) -> list[Kind]:
    """Fixpoint of ``carry -> join(carry, body(carry))``."""
    for _ in range(8):
      new = [_join(a, b) for a, b in zip(carry, body(carry), strict=True)]
      if new == carry:
        return carry
      carry = new
    return [c if isinstance(c, Const) else Top("a loop carry that does not settle")
            for c in carry]


def _subjaxprs(value: Any) -> list[Any]:
  """The (open) jaxprs held by an equation parameter."""
  if isinstance(value, jcore.ClosedJaxpr):
    return [value.jaxpr]
  if isinstance(value, jcore.Jaxpr):
    return [value]
  if isinstance(value, (tuple, list)):
    return [j for v in value for j in _subjaxprs(v)]
  return []


def _ratio_exp(a: np.ndarray, b: np.ndarray) -> Exp:
  """``log2(b / a)`` when the scalar ``b`` is ``a`` times a power of two, else None."""
  if a.shape != b.shape or a.size != 1 or a.dtype.kind not in "biuf":
    return None
  x, y = float(a.reshape(())), float(b.reshape(()))
  if x == y or (math.isnan(x) and math.isnan(y)):
    return 0.0
  if x == 0 or y == 0 or (x > 0) != (y > 0) or not math.isfinite(x / y):
    return None
  exp = math.log2(y / x)
  return float(round(exp)) if math.isclose(exp, round(exp), abs_tol=1e-9) else None


def _literal(var, partner) -> Const:
  value = np.asarray(var.val)
  scalar = float(value) if value.size == 1 and value.dtype.kind in "biuf" else None
  exp: float | None
  if partner is None:
    exp = 0.0
  else:  # the same operand in the trace at twice the rows: a number there too?
    exp = _ratio_exp(value, np.asarray(partner.val)) if isinstance(
        partner, jcore.Literal) else None
  return Const(frozenset(range(value.ndim)) if scalar is not None else frozenset(), scalar,
               exp)


# ---------------------------------------------------------------------------------------
# Rules


def _where(eqn, what: str) -> str:
  try:  # source line of the user's code, for diagnostics
    from jax._src import source_info_util
    place = source_info_util.summarize(eqn.source_info)
  except Exception:  # noqa: BLE001 - a private helper; the reason stands without it
    place = ""
  return f"{what} at {place}" if place else what


def _shape(var) -> tuple[int, ...]:
  return tuple(getattr(var.aval, "shape", ()))


def _uniform_at(kind: Const, var, out_shape: tuple[int, ...], dim: int) -> bool:
  """Whether Const operand ``var`` is constant along output dimension ``dim``."""
  shape = _shape(var)
  if not shape or kind.value is not None or dim in kind.uniform:
    return True
  return len(shape) == len(out_shape) and shape[dim] == 1 and out_shape[dim] != 1


def _const_uniform(kinds, eqn) -> frozenset[int]:
  out_shape = _shape(eqn.outvars[0])
  return frozenset(d for d in range(len(out_shape)) if all(
      _uniform_at(k, v, out_shape, d) for k, v in zip(kinds, eqn.invars, strict=True)
      if isinstance(k, Const)))


def _common_exp(kinds) -> Exp:
  """The exponent of a result that scales like each of its operands (all must agree)."""
  exps = {k.exp for k in kinds}
  return exps.pop() if len(exps) == 1 else None


def _add_exps(kinds) -> Exp:
  exps = [k.exp for k in kinds]
  return None if None in exps else float(sum(exps))


_FOLD: dict[str, Callable[..., Any]] = {
    "neg": lambda a: -a, "convert_element_type": lambda a: a, "copy": lambda a: a,
    "reduce_precision": lambda a: a, "add": lambda a, b: a + b, "sub": lambda a, b: a - b,
    "mul": lambda a, b: a * b, "div": lambda a, b: a / b if b else None,
}
# How an elementwise op's result scales with n, from its operands' exponents.
_SAME = frozenset({"neg", "convert_element_type", "copy", "copy_p", "reduce_precision",
                   "stop_gradient", "real", "imag", "conj", "abs", "add", "sub", "max", "min",
                   "select_n", "clamp", "complex"})
_SCALE_FREE = frozenset({"sign", "eq", "ne", "lt", "le", "gt", "ge", "is_finite"})


def _exp_of(eqn, kinds) -> Exp:
  """The exponent of an elementwise op's result; None if it is no power of n."""
  name = eqn.primitive.name
  operands = kinds[1:] if name == "select_n" else kinds
  if name == "mul":
    return _add_exps(kinds)
  if name == "div":
    a, b = kinds
    return None if a.exp is None or b.exp is None else a.exp - b.exp
  if name == "integer_pow":
    return None if kinds[0].exp is None else kinds[0].exp * eqn.params["y"]
  if name in _SAME:
    return _common_exp(operands)
  if name in _SCALE_FREE:  # positive factors of n do not change the outcome
    return 0.0 if _common_exp(operands) is not None else None
  return 0.0 if all(k.exp == 0 for k in kinds) else None


def _elementwise(w: _Walker, eqn, kinds: list[Kind]) -> list[Kind]:
  out_shape = _shape(eqn.outvars[0])
  rows = [k for k in kinds if isinstance(k, Rows)]
  stats = [k for k in kinds if isinstance(k, Stat)]
  exp = _exp_of(eqn, kinds)
  if rows:
    dims = {r.dim for r in rows}
    if len(dims) > 1:
      return [Top(_where(eqn, "combines values batched along different axes"))]
    (dim,) = dims
    mixed = next((r.mixed for r in rows if r.mixed), None)
    if not mixed and stats:
      mixed = _where(eqn, f"{eqn.primitive.name} combines each example with a statistic of "
                     "the whole batch")
    if not mixed and not all(_uniform_at(k, v, out_shape, dim)
                             for k, v in zip(kinds, eqn.invars, strict=True)
                             if isinstance(k, Const)):
      mixed = _where(eqn, f"{eqn.primitive.name} combines examples with values that depend "
                     "on their position in the batch (e.g. random numbers from one shared "
                     "key, or an iota)")
    if not mixed and exp is None:
      mixed = _where(eqn, f"{eqn.primitive.name} of values that scale differently with the "
                     "micro-batch size")
    return [Rows(dim, mixed, exp)] * len(eqn.outvars)
  if stats:
    return [_linear(eqn, kinds, exp)] * len(eqn.outvars)
  fold = _FOLD.get(eqn.primitive.name)
  values = [getattr(k, "value", None) for k in kinds]  # Const kinds here
  value = fold(*values) if fold and None not in values else None
  return [Const(_const_uniform(kinds, eqn), value, exp)] * len(eqn.outvars)


def _linear(eqn, kinds: list[Kind], exp: Exp) -> Stat:
  """Batch statistics through an elementwise op: linear ones stay sums of examples.

  Per device a sum over examples times ``n ** p`` adds up to ``D ** -p`` times the global
  one, and a batch-independent ``c * n ** r`` to ``D ** (1 - r)`` times it: a statistic
  plus a constant stays a consistent whole only when ``r == p + 1`` (``mean + c``,
  ``sum + n * c``), or when the constant is 0.
  """
  name = eqn.primitive.name
  stats = [k for k in kinds if isinstance(k, Stat)]
  inherited = next((s.mixed for s in stats if s.mixed), None)

  def nonlinear(what):
    return Stat(inherited or _where(eqn, what), exp)

  if name in ("neg", "convert_element_type", "copy", "reduce_precision", "stop_gradient",
              "real", "imag", "conj"):
    return stats[0]
  if name in ("add", "sub"):
    if len(stats) == 2:
      if stats[0].exp != stats[1].exp:
        return nonlinear("adds batch statistics that scale differently with the micro-batch "
                         "size (e.g. a sum and a mean over examples)")
      return Stat(inherited, exp)
    stat = stats[0]
    const = next(k for k in kinds if isinstance(k, Const))
    if const.value == 0 or (stat.exp is not None and const.exp == stat.exp + 1):
      return Stat(inherited, stat.exp)
    return nonlinear("adds a batch-independent term to a sum over examples (per device, "
                     "the term would be added once per device)")
  if name in ("mul", "div"):
    if len(stats) == 2 or (name == "div" and isinstance(kinds[1], Stat)):
      return dataclasses.replace(nonlinear(
          "divides by or multiplies two batch statistics (e.g. a ratio to this "
          "micro-batch's token count): not a sum over examples"), ratio=name == "div")
    return Stat(inherited, exp) if exp is not None else nonlinear(
        "scales a batch statistic by a value that is no power of the micro-batch size")
  if name == "select_n" and isinstance(kinds[0], Const):
    if all(isinstance(c, Stat) for c in kinds[1:]) and exp is not None:
      return Stat(inherited, exp)
  return nonlinear(f"applies {name} to a batch statistic")


def _shift(dim: int, removed: Sequence[int]) -> int:
  return dim - sum(1 for r in removed if r < dim)


def _map_uniform(uniform: frozenset[int], mapping: dict[int, int]) -> frozenset[int]:
  return frozenset(mapping[d] for d in uniform if d in mapping)


def _reduction(linear: bool):
  def rule(w: _Walker, eqn, kinds):
    (kind,) = kinds[:1]
    axes = tuple(eqn.params.get("axes", ()))
    shape = _shape(eqn.invars[0])
    if isinstance(kind, Const):
      keep = [d for d in range(len(shape)) if d not in axes]
      # Summing over a dimension whose size follows n changes how the result scales.
      exp = kind.exp if not w.scaled_dims(eqn, 0) & set(axes) else None
      return Const(_map_uniform(kind.uniform, {d: i for i, d in enumerate(keep)}), exp=exp)
    if isinstance(kind, Rows):
      if kind.dim not in axes:
        return Rows(_shift(kind.dim, axes), kind.mixed, kind.exp)
      if linear:
        return Stat(kind.mixed, kind.exp)
      return Stat(kind.mixed or _where(
          eqn, f"{eqn.primitive.name} over the batch axis (not a sum over examples)"), kind.exp)
    if linear:
      return kind
    return Stat(kind.mixed or _where(eqn, f"{eqn.primitive.name} of a batch statistic"),
                kind.exp)
  return rule


def _cumulative(w: _Walker, eqn, kinds):
  (kind,) = kinds
  axis = eqn.params["axis"]
  if isinstance(kind, Const):
    return Const(kind.uniform - {axis}, exp=kind.exp if axis not in w.scaled_dims(eqn, 0)
                 else None)
  if isinstance(kind, Rows):
    if kind.dim == axis:
      return Rows(kind.dim, kind.mixed or _where(eqn, "a cumulative op along the batch axis"),
                  kind.exp)
    return kind
  if eqn.primitive.name == "cumsum":
    return kind
  return Stat(kind.mixed or _where(eqn, "a cumulative op of a statistic"), kind.exp)


def _broadcast_in_dim(w: _Walker, eqn, kinds):
  kind = kinds[0]
  dims = eqn.params["broadcast_dimensions"]
  out_shape, in_shape = _shape(eqn.outvars[0]), _shape(eqn.invars[0])
  if isinstance(kind, Rows):
    return Rows(dims[kind.dim], kind.mixed, kind.exp)
  if isinstance(kind, Stat):
    return kind
  uniform = {d for d in range(len(out_shape)) if d not in dims}
  uniform |= {dims[i] for i in kind.uniform}
  uniform |= {dims[i] for i, size in enumerate(in_shape) if size == 1}
  return Const(frozenset(uniform), kind.value, kind.exp)


def _reshape(w: _Walker, eqn, kinds):
  kind = kinds[0]
  if isinstance(kind, Stat):
    return kind
  if isinstance(kind, Const):
    out_ndim = len(_shape(eqn.outvars[0]))
    return Const(frozenset(range(out_ndim)) if kind.value is not None else frozenset(),
                 kind.value, kind.exp)
  if eqn.params.get("dimensions") is not None:
    return Top(_where(eqn, "a reshape that transposes the batch axis"))
  dim = _reshaped_dim(_shape(eqn.invars[0]), _shape(eqn.outvars[0]), kind.dim, w.rows)
  if dim is None:
    return Top(_where(eqn, "a reshape that splits the batch axis across examples"))
  return Rows(dim, kind.mixed, kind.exp)


def _reshaped_dim(shape, new_shape, dim: int, rows: int) -> int | None:
  """Where batch-major dim ``dim`` of ``shape`` lands in ``new_shape`` (row-major), if the
  examples stay contiguous blocks of one dimension."""
  outer = math.prod(shape[:dim])
  prefix = 1
  for new_dim, size in enumerate(new_shape):
    if prefix == outer and size % rows == 0 and size >= rows:
      return new_dim
    prefix *= size
    if prefix > outer:
      return None
  return None


def _transpose(w: _Walker, eqn, kinds):
  kind = kinds[0]
  perm = tuple(eqn.params["permutation"])
  if isinstance(kind, Rows):
    return Rows(perm.index(kind.dim), kind.mixed, kind.exp)
  if isinstance(kind, Const):
    return Const(_map_uniform(kind.uniform, {d: perm.index(d) for d in perm}), kind.value,
                 kind.exp)
  return kind


def _squeeze(w: _Walker, eqn, kinds):
  kind = kinds[0]
  removed = tuple(eqn.params["dimensions"])
  if isinstance(kind, Rows):
    if kind.dim in removed:  # cannot happen for two or more examples
      return Top(_where(eqn, "a squeeze of the batch axis"))
    return Rows(_shift(kind.dim, removed), kind.mixed, kind.exp)
  if isinstance(kind, Const):
    keep = [d for d in range(len(_shape(eqn.invars[0]))) if d not in removed]
    return Const(_map_uniform(kind.uniform, {d: i for i, d in enumerate(keep)}), kind.value,
                 kind.exp)
  return kind


def _along_batch(what: str, untouched: Callable[[Any, int], bool]):
  """Ops on one operand that keep examples apart unless they act along the batch axis."""
  linear_ops = ("slice", "dynamic_slice", "pad", "rev", "split")

  def rule(w: _Walker, eqn, kinds):
    kind, rest = kinds[0], kinds[1:]
    outs = len(eqn.outvars)
    if isinstance(kind, Rows):
      ok = untouched(eqn, kind.dim) and all(isinstance(k, Const) for k in rest)
      if eqn.primitive.name == "pad":  # the padding is part of every example
        ok = ok and (rest[0].value == 0 or rest[0].exp == kind.exp)
      mixed = kind.mixed or (None if ok else _where(eqn, f"{what} along the batch axis"))
      return [Rows(kind.dim, mixed, kind.exp)] * outs
    if isinstance(kind, Stat):
      ok = eqn.primitive.name in linear_ops and all(isinstance(k, Const) for k in rest)
      return [Stat(kind.mixed or (None if ok else _where(eqn, f"{what} of a statistic")),
                   kind.exp)] * outs
    if all(isinstance(k, Const) for k in kinds):
      return [Const(exp=kind.exp)] * outs
    return [Top(_where(eqn, f"{what} indexed by batch values"))] * outs
  return rule


def _full_slice(eqn, dim):
  shape = _shape(eqn.invars[0])
  start, limit = eqn.params["start_indices"], eqn.params["limit_indices"]
  strides = eqn.params.get("strides") or (1,) * len(shape)
  return start[dim] == 0 and limit[dim] == shape[dim] and strides[dim] == 1


def _concatenate(w: _Walker, eqn, kinds):
  axis = eqn.params["dimension"]
  out_shape = _shape(eqn.outvars[0])
  exp = _common_exp(kinds)
  rows = [k for k in kinds if isinstance(k, Rows)]
  if rows:
    dim = rows[0].dim
    ok = axis != dim and exp is not None and all(
        (isinstance(k, Rows) and k.dim == dim) or
        (isinstance(k, Const) and _uniform_at(k, v, out_shape, dim))
        for k, v in zip(kinds, eqn.invars, strict=True))
    mixed = next((r.mixed for r in rows if r.mixed), None)
    return Rows(dim, mixed or (None if ok else _where(eqn, "a concatenation along or across "
                                                       "the batch axis")), exp)
  stats = [k for k in kinds if isinstance(k, Stat)]
  if stats:
    ok = all(isinstance(k, Stat) for k in kinds) and exp is not None
    mixed = next((s.mixed for s in stats if s.mixed), None)
    return Stat(mixed or (None if ok else _where(eqn, "a concatenation of statistics and "
                                                 "constants")), exp)
  return Const(exp=exp)


def _dynamic_update_slice(w: _Walker, eqn, kinds):
  operand, update = kinds[:2]
  if all(isinstance(k, Const) for k in kinds):
    return Const(exp=_common_exp(kinds[:2]))
  rows = [k for k in (operand, update) if isinstance(k, Rows)]
  if rows and all(isinstance(k, Const) for k in kinds[2:]):
    dim = rows[0].dim
    full = _shape(eqn.invars[1])[dim] == _shape(eqn.invars[0])[dim]
    exp = _common_exp(kinds[:2])
    ok = full and exp is not None and all(
        (isinstance(k, Rows) and k.dim == dim) or
        (isinstance(k, Const) and _uniform_at(k, v, _shape(eqn.outvars[0]), dim))
        for k, v in zip((operand, update), eqn.invars[:2], strict=True))
    mixed = next((r.mixed for r in rows if r.mixed), None)
    return Rows(dim, mixed or (None if ok else _where(eqn, "an update of some examples")), exp)
  return Top(_where(eqn, "dynamic_update_slice of batch values"))


def _iota(w: _Walker, eqn, kinds):
  ndim = len(eqn.params["shape"])
  return Const(frozenset(range(ndim)) - {eqn.params["dimension"]})


def _dot_general(w: _Walker, eqn, kinds):
  lhs, rhs = kinds
  (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
  lhs_ndim, rhs_ndim = (len(_shape(v)) for v in eqn.invars)
  lhs_free = [d for d in range(lhs_ndim) if d not in lc and d not in lb]
  rhs_free = [d for d in range(rhs_ndim) if d not in rc and d not in rb]
  exp = _add_exps(kinds)
  if isinstance(lhs, Const) and isinstance(rhs, Const):
    scaled = w.scaled_dims(eqn, 0) & set(lc)
    return Const(exp=exp if not scaled else None)
  stats = [k for k in kinds if isinstance(k, Stat)]
  if stats:
    mixed = next((s.mixed for s in stats if s.mixed), None)
    if len(stats) == 2 or any(isinstance(k, Rows) for k in kinds) or exp is None:
      mixed = mixed or _where(eqn, "a matmul of a batch statistic with batch values")
    return Stat(mixed, exp)

  def out_dim(side: int, dim: int) -> int:
    batch, free = (lb, lhs_free) if side == 0 else (rb, rhs_free)
    if dim in batch:
      return list(batch).index(dim)
    offset = len(lb) + (0 if side == 0 else len(lhs_free))
    return offset + free.index(dim)

  contract, batch = (lc, rc), (lb, rb)
  mixed = next((k.mixed for k in kinds if isinstance(k, Rows) and k.mixed), None)
  if exp is None:
    mixed = mixed or _where(eqn, "a matmul of values that scale differently with the "
                            "micro-batch size")
  if isinstance(lhs, Rows) and isinstance(rhs, Rows):
    pair_batch = lhs.dim in lb and rb[list(lb).index(lhs.dim)] == rhs.dim
    pair_contract = lhs.dim in lc and rc[list(lc).index(lhs.dim)] == rhs.dim
    if pair_batch:
      return Rows(out_dim(0, lhs.dim), mixed, exp)
    if pair_contract:
      return Stat(mixed, exp)
    # e.g. x @ x.T over the batch: every pair of examples (in-batch negatives).
    where = lhs.dim if lhs.dim in lhs_free else None
    reason = _where(eqn, "a matmul that pairs different examples")
    return Rows(out_dim(0, where), reason, exp) if where is not None else Top(reason)
  side = 0 if isinstance(lhs, Rows) else 1
  row, const = (lhs, rhs) if side == 0 else (rhs, lhs)
  const_var = eqn.invars[1 - side]
  mine, theirs = contract[side], contract[1 - side]
  if row.dim in mine or row.dim in batch[side]:
    partner = (theirs[list(mine).index(row.dim)] if row.dim in mine
               else batch[1 - side][list(batch[side]).index(row.dim)])
    uniform = (const.value is not None or partner in const.uniform
               or _shape(const_var)[partner] == 1)
    if not uniform:
      mixed = mixed or _where(eqn, "a matmul of examples with position-dependent values")
    if row.dim in mine:
      return Stat(mixed, exp)
    return Rows(out_dim(side, row.dim), mixed, exp)
  return Rows(out_dim(side, row.dim), mixed, exp)


def _gather(w: _Walker, eqn, kinds):
  operand, indices = kinds
  dn = eqn.params["dimension_numbers"]
  slice_sizes = eqn.params["slice_sizes"]
  op_shape, idx_shape = _shape(eqn.invars[0]), _shape(eqn.invars[1])
  out_ndim = len(_shape(eqn.outvars[0]))
  batch_out = [d for d in range(out_ndim) if d not in dn.offset_dims]
  if isinstance(operand, Const) and isinstance(indices, Const):
    return Const(exp=operand.exp)
  if isinstance(operand, Stat) or isinstance(indices, Stat):
    return Top(_where(eqn, "a gather that involves a batch statistic"))
  mixed = next((k.mixed for k in kinds if isinstance(k, Rows) and k.mixed), None)
  idx_dims = list(range(len(idx_shape) - 1))  # the last is the index vector
  if isinstance(indices, Rows):
    if indices.dim == len(idx_shape) - 1:
      return Top(_where(eqn, "a gather whose index vectors run along the batch axis"))
    dim = batch_out[idx_dims.index(indices.dim)]
    if isinstance(operand, Const):
      return Rows(dim, mixed, operand.exp)  # a lookup (embedding) per example
    paired = (operand.dim in dn.operand_batching_dims and dn.start_indices_batching_dims[
        list(dn.operand_batching_dims).index(operand.dim)] == indices.dim)
    return Rows(dim, mixed or (None if paired else _where(
        eqn, "a gather of other examples' values")), operand.exp)
  # Rows operand, batch-independent indices: the batch axis must be sliced whole.
  dim = operand.dim
  whole = (dim not in dn.start_index_map and dim not in dn.collapsed_slice_dims
           and dim not in dn.operand_batching_dims and slice_sizes[dim] == op_shape[dim])
  if not whole:
    return Top(_where(eqn, "a gather that selects examples"))
  offset_operand_dims = [d for d in range(len(op_shape))
                         if d not in dn.collapsed_slice_dims and d not in dn.operand_batching_dims]
  return Rows(dn.offset_dims[offset_operand_dims.index(dim)], mixed, operand.exp)


def _conv(w: _Walker, eqn, kinds):
  lhs, rhs = kinds
  dn = eqn.params["dimension_numbers"]
  exp = _add_exps(kinds)
  if isinstance(lhs, Const) and isinstance(rhs, Const):
    return Const(exp=exp)
  if (isinstance(lhs, Rows) and isinstance(rhs, Const) and lhs.dim == dn.lhs_spec[0]
      and eqn.params["batch_group_count"] == 1 and exp is not None):
    return Rows(dn.out_spec[0], lhs.mixed, exp)
  return Top(_where(eqn, "a convolution across examples"))


def _window(w: _Walker, eqn, kinds):
  kind = kinds[0]
  outs = len(eqn.outvars)
  if all(isinstance(k, Const) for k in kinds):
    return [Const(exp=kind.exp if not w.scaled_dims(eqn, 0) else None)] * outs
  if isinstance(kind, Rows):
    d = kind.dim
    p = eqn.params
    untouched = (p["window_dimensions"][d] == 1 and p["window_strides"][d] == 1
                 and tuple(p["padding"][d]) == (0, 0) and p["base_dilation"][d] == 1)
    return [Rows(d, kind.mixed or (None if untouched else _where(
        eqn, "a window op along the batch axis")), kind.exp)] * outs
  return [Top(_where(eqn, "a window op of batch values"))] * outs


def _sort(w: _Walker, eqn, kinds):
  axis = eqn.params["dimension"]
  rows = [k for k in kinds if isinstance(k, Rows)]
  outs = len(eqn.outvars)
  if not rows:
    if all(isinstance(k, Const) for k in kinds):
      return [Const(exp=k.exp) for k in kinds]
    return [Top(_where(eqn, "a sort of batch statistics"))] * outs
  dim = rows[0].dim
  out_shape = _shape(eqn.outvars[0])
  ok = axis != dim and all((isinstance(k, Rows) and k.dim == dim) or (
      isinstance(k, Const) and _uniform_at(k, v, out_shape, dim))
      for k, v in zip(kinds, eqn.invars, strict=True))
  mixed = next((r.mixed for r in rows if r.mixed), None)
  mixed = mixed or (None if ok else _where(eqn, "a sort along the batch axis"))
  return [Rows(dim, mixed, k.exp) for k in kinds]


def _random_keys(w: _Walker, eqn, kinds):
  """Random bits/keys from keys: per-example keys give per-example bits; one shared key
  gives values that depend on the position in the batch."""
  kind = kinds[0]
  outs = len(eqn.outvars)
  if isinstance(kind, Const):
    return [Const()] * outs
  if isinstance(kind, Rows):
    return [Rows(kind.dim, kind.mixed)] * outs
  return [Top(_where(eqn, "random numbers from a batch statistic"))] * outs


def _identity(w: _Walker, eqn, kinds):
  return list(kinds)


def _collective(w: _Walker, eqn, kinds):
  return [Top(_where(eqn, f"the collective {eqn.primitive.name}"))] * len(eqn.outvars)


_RULES: dict[str, Callable[..., Any]] = {
    "reduce_sum": _reduction(linear=True),
    **{name: _reduction(linear=False) for name in (
        "reduce_max", "reduce_min", "reduce_prod", "reduce_and", "reduce_or", "reduce_xor",
        "argmax", "argmin")},
    **{name: _cumulative for name in ("cumsum", "cumprod", "cummax", "cummin",
                                      "cumlogsumexp")},
    "broadcast_in_dim": _broadcast_in_dim,
    "reshape": _reshape,
    "transpose": _transpose,
    "squeeze": _squeeze,
    "rev": _along_batch("a reversal", lambda e, d: d not in e.params["dimensions"]),
    "slice": _along_batch("a slice", _full_slice),
    "dynamic_slice": _along_batch(
        "a dynamic slice", lambda e, d: e.params["slice_sizes"][d] == _shape(e.invars[0])[d]),
    "pad": _along_batch("padding", lambda e, d: tuple(e.params["padding_config"][d]) == (0, 0, 0)),
    "split": _along_batch("a split", lambda e, d: e.params["axis"] != d),
    "top_k": _along_batch("top_k", lambda e, d: d != len(_shape(e.invars[0])) - 1),
    "concatenate": _concatenate,
    "dynamic_update_slice": _dynamic_update_slice,
    "iota": _iota,
    "dot_general": _dot_general,
    "gather": _gather,
    "conv_general_dilated": _conv,
    **{name: _window for name in ("reduce_window_sum", "reduce_window_max",
                                  "reduce_window_min", "reduce_window")},
    "sort": _sort,
    **{name: _random_keys for name in ("random_bits", "random_split", "random_wrap",
                                       "random_unwrap", "rng_bit_generator")},
    **{name: _identity for name in ("sharding_constraint", "reshard", "mesh_cast",
                                    "device_put", "optimization_barrier")},
    **{name: _collective for name in (
        "psum", "pmax", "pmin", "all_gather", "all_to_all", "ppermute", "psum_scatter",
        "reduce_scatter", "axis_index", "pbroadcast", "pcast", "psum_invariant")},
}

_ELEMENTWISE = frozenset("""
    abs acos acosh add and asin asinh atan atan2 atanh bessel_i0e bessel_i1e
    bitcast_convert_type cbrt ceil clamp clz complex conj convert_element_type copy copy_p
    cos cosh digamma div eq erf erf_inv erfc exp exp2 expm1 floor ge gt igamma igamma_grad_a
    igammac imag integer_pow is_finite le lgamma log log1p logistic lt max min mul ne neg
    nextafter not or polygamma population_count pow random_fold_in random_seed
    random_gamma_grad real reduce_precision regularized_incomplete_beta rem round rsqrt
    select_n shift_left shift_right_arithmetic shift_right_logical sign sin sinh sqrt square
    stop_gradient sub tan tanh threefry2x32 xor zeta
""".split())

# Ops through which a param stays "the param" for the reduced-type analysis.
_TRANSPARENT = frozenset({"convert_element_type", "transpose", "copy", "copy_p",
                          "reduce_precision", "sharding_constraint", "optimization_barrier"})


# ---------------------------------------------------------------------------------------
# Sub-jaxprs: calls, loops, conditionals


def _inner(w: _Walker, closed, kinds, sources, offset: int = 0) -> list[Kind]:
  jaxpr = getattr(closed, "jaxpr", closed)
  consts = [Const()] * len(getattr(closed, "consts", ()) or getattr(jaxpr, "constvars", ()))
  inner_sources = {pos - offset: p for pos, p in sources.items() if pos >= offset}
  return w.run(jaxpr, consts, kinds, inner_sources)


def _call_rule(param: str):
  def rule(w: _Walker, eqn, kinds, sources):
    return _inner(w, eqn.params[param], kinds, sources)
  return rule


def _custom_vjp(w: _Walker, eqn, kinds, sources):
  w.not_reducible.update(sources.values())
  if all(isinstance(k, Const) for k in kinds):
    return [Const(exp=_common_exp(kinds))] * len(eqn.outvars)
  return [Top(_where(eqn, "a custom_vjp function (its backward rule cannot be analyzed)"))
          ] * len(eqn.outvars)


def _shard_map(w: _Walker, eqn, kinds, sources):
  w.not_reducible.update(sources.values())
  w.blockers.append(_where(eqn, "the loss calls jax.shard_map"))
  if all(isinstance(k, Const) for k in kinds):
    return [Const(exp=_common_exp(kinds))] * len(eqn.outvars)
  return [Top(_where(eqn, "a shard_map inside the loss"))] * len(eqn.outvars)


def _scan(w: _Walker, eqn, kinds, sources):
  p = eqn.params
  n_consts, n_carry = p["num_consts"], p["num_carry"]
  consts, carry, xs = kinds[:n_consts], kinds[n_consts:n_consts + n_carry], kinds[
      n_consts + n_carry:]
  for pos, param in sources.items():
    if pos >= n_consts:  # a param as loop state or sliced per iteration
      w.not_reducible.add(param)
  body_sources = {pos: q for pos, q in sources.items() if pos < n_consts}
  sliced: list[Kind] = []
  for k in xs:
    if isinstance(k, Rows):
      sliced.append(Rows(k.dim - 1, k.mixed, k.exp) if k.dim > 0 else Top(_where(
          eqn, "a scan over the batch axis")))
    elif isinstance(k, Const):
      sliced.append(Const(frozenset(d - 1 for d in k.uniform if d > 0), k.value, k.exp))
    else:
      sliced.append(k)
  body = p["jaxpr"]

  def step(carry_kinds):
    return _inner(w, body, [*consts, *carry_kinds, *sliced], body_sources)[:n_carry]

  carry = w.loop(step, list(carry))
  ys = _inner(w, body, [*consts, *carry, *sliced], body_sources)[n_carry:]
  stacked: list[Kind] = []
  for k in ys:
    if isinstance(k, Rows):
      stacked.append(Rows(k.dim + 1, k.mixed, k.exp))
    elif isinstance(k, Const):
      stacked.append(Const(frozenset(d + 1 for d in k.uniform), exp=k.exp))
    else:
      stacked.append(k)
  return [*carry, *stacked]


def _while(w: _Walker, eqn, kinds, sources):
  p = eqn.params
  nc, nb = p["cond_nconsts"], p["body_nconsts"]
  cond_consts, body_consts, carry = kinds[:nc], kinds[nc:nc + nb], kinds[nc + nb:]
  for pos, param in sources.items():
    if pos >= nc + nb:
      w.not_reducible.add(param)
  body_sources = {pos - nc: q for pos, q in sources.items() if nc <= pos < nc + nb}
  cond_sources = {pos: q for pos, q in sources.items() if pos < nc}

  def step(carry_kinds):
    return _inner(w, p["body_jaxpr"], [*body_consts, *carry_kinds], body_sources)

  carry = w.loop(step, list(carry))
  (pred,) = _inner(w, p["cond_jaxpr"], [*cond_consts, *carry], cond_sources)
  if not isinstance(pred, Const) or pred.exp is None:
    return [Top(_where(eqn, "a while loop whose trip count depends on the batch"))] * len(
        carry)
  return carry


def _cond(w: _Walker, eqn, kinds, sources):
  index, operands = kinds[0], kinds[1:]
  branch_sources = {pos - 1: q for pos, q in sources.items() if pos >= 1}
  if 0 in sources:
    w.not_reducible.add(sources[0])
  outs: list[Kind] | None = None
  for branch in eqn.params["branches"]:
    got = _inner(w, branch, list(operands), branch_sources)
    outs = got if outs is None else [_join(a, b) for a, b in zip(outs, got, strict=True)]
  assert outs is not None  # a conditional has at least one branch
  if not isinstance(index, Const) or index.exp is None:
    return [Top(_where(eqn, "a conditional on batch values"))] * len(outs)
  return outs


_SUBCALLS: dict[str, Callable[..., list[Kind]]] = {
    "jit": _call_rule("jaxpr"),
    "pjit": _call_rule("jaxpr"),
    "closed_call": _call_rule("call_jaxpr"),
    "core_call": _call_rule("call_jaxpr"),
    "remat2": _call_rule("jaxpr"),
    "checkpoint": _call_rule("jaxpr"),
    "custom_jvp_call": _call_rule("call_jaxpr"),
    "custom_vjp_call": _custom_vjp,
    "custom_vjp_call_jaxpr": _custom_vjp,
    "shard_map": _shard_map,
    "scan": _scan,
    "while": _while,
    "cond": _cond,
}


def _join(a: Kind, b: Kind) -> Kind:
  """The kind of a value that may be ``a`` or ``b`` (loop carries, cond branches)."""
  if a == b:
    return a
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
  if isinstance(a, Rows) and isinstance(b, Rows) and a.dim == b.dim and exp is not None:
    return Rows(a.dim, a.mixed or b.mixed, exp)
  if isinstance(a, Stat) and isinstance(b, Stat):
    return Stat(a.mixed or b.mixed or (None if exp is not None else
                                       "a loop mixes sums and means over examples"), exp)
  return Top(mixing(a) or mixing(b) or "a value that is batched in different ways")
