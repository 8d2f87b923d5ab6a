"""The rules of :mod:`fxaccum.analysis`: the kinds of an equation's results from its
operands' kinds, one rule per primitive (``RULES``), the elementwise ones together, and
sub-jaxprs (calls, loops, conditionals) walked by the same walker."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jcore

from fxaccum.analysis.kinds import (
    Const,
    Exp,
    Kind,
    Rows,
    Stat,
    Top,
    Unpaired,
    add_exps,
    common_exp,
    join,
)
from fxaccum.jaxprs import scan_counts

if TYPE_CHECKING:
  from fxaccum.analysis.interpreter import _Walker

__all__ = ["ELEMENTWISE", "RULES", "SUBCALLS", "TRANSPARENT", "elementwise", "shape_of",
           "slice_at", "whole_dim", "with_place"]


def slice_at(eqn, d: int) -> Any:
  """What a ``slice`` (start, limit, stride) or a ``dynamic_slice`` / ``gather`` (its size)
  takes along dimension ``d``."""
  p = eqn.params
  if eqn.primitive.name == "slice":
    strides = p.get("strides") or (1,) * len(p["start_indices"])
    return p["start_indices"][d], p["limit_indices"][d], strides[d]
  return p["slice_sizes"][d]


def whole_dim(eqn, d: int) -> bool:
  """Whether ``eqn`` (see :func:`slice_at`) takes all of its operand's dimension ``d``."""
  size = shape_of(eqn.invars[0])[d]
  if eqn.primitive.name == "slice":
    return slice_at(eqn, d) == (0, size, 1)
  return eqn.params["slice_sizes"][d] == size


def with_place(eqn, what: str) -> str:
  """``what``, followed by the line of the user's code that made ``eqn``."""
  place = _place(eqn)
  return f"{what}{place}" if place else what


def _place(eqn) -> str:
  try:  # source line of the user's code, for diagnostics
    from jax._src import source_info_util
    place = source_info_util.summarize(eqn.source_info)
  except Exception:  # noqa: BLE001 - a private helper; the reason stands without it
    place = ""
  return f" at {place}" if place else ""


def shape_of(var) -> tuple[int, ...]:
  """A jaxpr variable's shape (``()`` for tokens and other non-arrays)."""
  return tuple(getattr(var.aval, "shape", ()))


def _uniform_at(kind: Const, var, out_shape: tuple[int, ...], dim: int) -> bool:
  """Whether Const operand ``var`` is constant along output dimension ``dim``."""
  shape = shape_of(var)
  if not shape or kind.value is not None or dim in kind.uniform:
    return True
  return len(shape) == len(out_shape) and shape[dim] == 1 and out_shape[dim] != 1


def _const_uniform(kinds, eqn) -> frozenset[int]:
  out_shape = shape_of(eqn.outvars[0])
  return frozenset(d for d in range(len(out_shape)) if all(
      _uniform_at(k, v, out_shape, d) for k, v in zip(kinds, eqn.invars, strict=True)
      if isinstance(k, Const)))


def _first_mixed(kinds) -> str | None:
  return next((k.mixed for k in kinds if isinstance(k, (Rows, Stat)) and k.mixed), None)


def _misaligned(eqn, rows: Sequence[Rows]) -> str | None:
  """Why batch values in different example orders (e.g. one reversed) may not be combined
  position by position, or None when they share one order."""
  if len({r.order for r in rows}) <= 1:
    return None
  return with_place(eqn, f"{eqn.primitive.name} pairs examples taken in different orders "
                "(e.g. the batch and the batch reversed)")


def _index_changes(w: _Walker, kinds) -> bool:
  """Whether a batch-independent index or position operand follows the number of rows
  (e.g. ``n - 1``): per device it would pick other elements than globally. (Recorded: with
  a symbolic number of rows JAX computes some positions from it, e.g. a reversal.)"""
  changes = any(isinstance(k, Const) and k.exp != 0 for k in kinds)
  w.sized_positions = w.sized_positions or changes
  return changes


_FOLD: dict[str, Callable[..., Any]] = {
    "neg": lambda a: -a, "convert_element_type": lambda a: a, "copy": lambda a: a,
    "add": lambda a, b: a + b, "sub": lambda a, b: a - b,
    "mul": lambda a, b: a * b, "div": lambda a, b: a / b if b else None,
    "add_any": lambda a, b: a + b,
}
# How an elementwise op's result scales with D, from its operands' exponents.
_SAME = frozenset({"neg", "convert_element_type", "copy", "copy_p", "reduce_precision",
                   "stop_gradient", "real", "imag", "conj", "abs", "add", "add_any", "sub",
                   "max", "min", "select_n", "clamp", "complex"})
_SCALE_FREE = frozenset({"sign", "eq", "ne", "lt", "le", "gt", "ge", "is_finite"})
# Integer ops for which a common factor of the operands does not factor out of the result.
_INEXACT_INT = frozenset({"div", "rem", "and", "or", "xor", "not", "shift_left",
                          "shift_right_logical", "shift_right_arithmetic", "population_count",
                          "clz", "pow"})


def _exp_of(eqn, kinds) -> Exp:
  """The exponent of an elementwise op's result; None if it is no power of D."""
  name = eqn.primitive.name
  if name == "select_n":  # which operand is picked must not follow the rows
    return common_exp(kinds[1:]) if kinds[0].exp == 0 else None
  dtype = getattr(eqn.outvars[0].aval, "dtype", None)
  if dtype is not None and jax.dtypes.issubdtype(dtype, np.integer) and name in _INEXACT_INT:
    return 0.0 if all(k.exp == 0 for k in kinds) else None  # e.g. floor division
  if name == "mul":
    return add_exps(kinds)
  if name == "div":
    a, b = kinds
    return None if a.exp is None or b.exp is None else a.exp - b.exp
  if name == "integer_pow":
    return None if kinds[0].exp is None else kinds[0].exp * eqn.params["y"]
  if name == "convert_element_type" and _lossy_cast(eqn):
    if eqn.params["new_dtype"] == jnp.bool_:  # x != 0: positive factors keep it
      return 0.0 if kinds[0].exp is not None else None
    return 0.0 if kinds[0].exp == 0 else None  # truncation: int(0.3 * n) is no power of n
  if name in _SAME:
    return common_exp(kinds)
  if name in _SCALE_FREE:  # positive factors of D do not change the outcome
    return 0.0 if common_exp(kinds) is not None else None
  return 0.0 if all(k.exp == 0 for k in kinds) else None


def elementwise(w: _Walker, eqn, kinds: list[Kind]) -> list[Kind]:
  out_shape = shape_of(eqn.outvars[0])
  rows = [k for k in kinds if isinstance(k, Rows)]
  stats = [k for k in kinds if isinstance(k, Stat)]
  exp = _exp_of(eqn, kinds)
  if rows:
    dims = {r.dim for r in rows}
    if len(dims) > 1:
      return [Top(with_place(eqn, "combines values batched along different axes"))]
    (dim,) = dims
    mixed = _first_mixed(rows) or _misaligned(eqn, rows)
    if not mixed and stats:
      mixed = with_place(eqn, f"{eqn.primitive.name} combines each example with a statistic of "
                     "the whole batch")
    if not mixed and not all(_uniform_at(k, v, out_shape, dim)
                             for k, v in zip(kinds, eqn.invars, strict=True)
                             if isinstance(k, Const)):
      mixed = with_place(eqn, f"{eqn.primitive.name} combines examples with values that depend "
                     "on their position in the batch (e.g. random numbers from one shared "
                     "key, or an iota)")
    if not mixed and exp is None:
      mixed = with_place(eqn, f"{eqn.primitive.name} of values that scale differently with the "
                     "micro-batch size")
    return [Rows(dim, mixed, exp, rows[0].order)] * len(eqn.outvars)
  if stats:
    return [_linear(eqn, kinds, exp)] * len(eqn.outvars)
  fold = _FOLD.get(eqn.primitive.name)
  values = [getattr(k, "value", None) for k in kinds]  # Const kinds here
  value = _folded(eqn, fold, values) if fold and None not in values else None
  return [Const(_const_uniform(kinds, eqn), value, exp)] * len(eqn.outvars)


def _folded(eqn, fold: Callable[..., Any], values: list[Any]) -> float | None:
  """``fold`` of known values computed in the equation's dtypes, as XLA computes it
  (rounding, wrapping, ``int(2.4)`` is 2); None where that is not known exactly."""
  out = eqn.outvars[0].aval.dtype
  try:
    with np.errstate(all="ignore"):
      args = [np.asarray(v).astype(var.aval.dtype)
              for v, var in zip(values, eqn.invars, strict=True)]
      if eqn.primitive.name == "div" and not jnp.issubdtype(out, jnp.inexact):
        return None  # integer division rounds toward zero: not folded
      result = fold(*args)
      return None if result is None else float(np.asarray(result).astype(out))
  except (TypeError, ValueError, OverflowError):
    return None


def _linear(eqn, kinds: list[Kind], exp: Exp) -> Stat:
  """Batch statistics through an elementwise op: linear ones stay sums of examples.

  Per device a sum over examples times ``n ** p`` adds up to ``D ** -p`` times the global
  one, and a batch-independent ``c * n ** r`` to ``D ** (1 - r)`` times it: a statistic
  plus a constant stays a consistent whole only when ``r == p + 1`` (``mean + c``,
  ``sum + n * c``), or when the constant is 0.
  """
  name = eqn.primitive.name
  stats = [k for k in kinds if isinstance(k, Stat)]
  inherited = _first_mixed(stats)

  def nonlinear(what):
    return Stat(inherited or with_place(eqn, what), exp)

  if name == "convert_element_type" and _lossy_cast(eqn):
    return nonlinear(f"casts a batch statistic to {jnp.dtype(eqn.params['new_dtype'])}")
  if name in ("convert_element_type", "copy", "reduce_precision", "stop_gradient",
              "real", "imag", "conj"):
    monotone = name in ("copy", "reduce_precision", "stop_gradient") or (
        name == "convert_element_type" and _to_real_float(eqn))
    return stats[0] if monotone else dataclasses.replace(stats[0], extreme=None)
  if name == "neg":  # swaps a maximum and a minimum, unless it wraps (unsigned)
    negated = {"max": "min", "min": "max"}
    extreme = stats[0].extreme
    if jnp.issubdtype(eqn.outvars[0].aval.dtype, jnp.unsignedinteger):
      extreme = None
    return dataclasses.replace(stats[0], extreme=negated[extreme] if extreme else None)
  if name in ("add", "add_any", "sub"):
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


def _lossy_cast(eqn) -> bool:
  """Whether a cast is no scaling-preserving map: to a bool, or to an integer type that
  does not hold every value of the source (truncation, wrapping)."""
  source, target = eqn.invars[0].aval.dtype, jnp.dtype(eqn.params["new_dtype"])
  return target == jnp.bool_ or (jnp.issubdtype(target, jnp.integer)
                                 and not np.can_cast(source, target, "safe"))


def _to_real_float(eqn) -> bool:
  """Whether a cast is monotone (keeps a maximum one): from a real number to a float (not
  to a bool or an integer, which wrap or saturate)."""
  source, target = eqn.invars[0].aval.dtype, eqn.params["new_dtype"]
  return (jnp.issubdtype(target, jnp.floating)
          and not jnp.issubdtype(source, jnp.complexfloating))


def _shift(dim: int, removed: Sequence[int]) -> int:
  return dim - sum(1 for r in removed if r < dim)


def _map_uniform(uniform: frozenset[int], mapping: dict[int, int]) -> frozenset[int]:
  return frozenset(mapping[d] for d in uniform if d in mapping)


_EXTREMES = {"reduce_max": "max", "reduce_min": "min"}
_SIZE_FREE_REDUCTIONS = frozenset({"reduce_max", "reduce_min", "reduce_and", "reduce_or"})


# Ops whose result is no power-of-D rescaling of a scaled operand (a product of n factors,
# a log-sum-exp): such an operand's exponent becomes None.
_NOT_SCALING = frozenset({"reduce_prod", "reduce_xor", "cumprod", "cumlogsumexp",
                          "reduce_window"})


def _rescaled(eqn, kind: Kind) -> Kind:
  """``kind`` as an operand of ``eqn``: with no exponent where ``eqn`` does not rescale."""
  if eqn.primitive.name in _NOT_SCALING and kind.exp != 0 and kind.exp is not None:
    return dataclasses.replace(kind, exp=None)
  return kind


def _index_exp(kind: Kind) -> Exp:
  """The exponent of an index into ``kind`` (argmax, top_k's positions): a positive factor
  picks the same one, any other dependence on the rows may not."""
  return 0.0 if kind.exp is not None else None


def _reduction(linear: bool):
  def rule(w: _Walker, eqn, kinds):
    kind = _rescaled(eqn, kinds[0])
    name = eqn.primitive.name
    if name in ("argmax", "argmin") and kind.exp != _index_exp(kind):
      kind = dataclasses.replace(kind, exp=_index_exp(kind))
    axes = set(eqn.params["axes"])
    scaled = w.scaled_dims(eqn, 0) & axes
    if isinstance(kind, Const):
      keep = [d for d in range(len(shape_of(eqn.invars[0]))) if d not in axes]
      uniform = _map_uniform(kind.uniform, {d: i for i, d in enumerate(keep)})
      exp: Exp = kind.exp
      if scaled and not scaled <= kind.uniform:
        exp = None  # e.g. the sum of an iota over the rows
      elif scaled and name == "reduce_sum":  # a sum of equal elements: their number times one
        exp = add_exps([kind, Const(exp=w.size_exp(eqn, 0, scaled))])
      elif scaled and name in ("argmax", "argmin"):
        exp = 0.0
      elif scaled and name not in _SIZE_FREE_REDUCTIONS:
        exp = None
      return Const(uniform, exp=exp)
    extra = scaled - ({kind.dim} if isinstance(kind, Rows) else set())
    mixed = kind.mixed or (with_place(eqn, "a reduction over a dimension whose size follows the "
                                  "number of rows") if extra else None)
    extreme = _EXTREMES.get(name)
    if isinstance(kind, Rows):
      if kind.dim not in axes:
        return Rows(_shift(kind.dim, tuple(axes)), mixed, kind.exp, kind.order)
      if linear:
        return Stat(mixed, kind.exp)
      return Stat(mixed or with_place(
          eqn, f"{name} over the batch axis (not a sum over examples)"), kind.exp,
          extreme=extreme if mixed is None else None)
    if linear:
      return Stat(mixed, kind.exp)
    if isinstance(kind, Stat) and kind.extreme is not None and kind.extreme == extreme and (
        not extra):
      return kind  # e.g. the maximum over the other dims of a maximum over the examples
    return Stat(mixed or with_place(eqn, f"{name} of a batch statistic"), kind.exp)
  return rule


def _cumulative(w: _Walker, eqn, kinds):
  kind = _rescaled(eqn, kinds[0])
  axis = eqn.params["axis"]
  scaled = axis in w.scaled_dims(eqn, 0)
  if isinstance(kind, Const):
    return Const(kind.uniform - {axis}, exp=None if scaled else kind.exp)
  if isinstance(kind, Rows):
    if kind.dim == axis or scaled:
      return dataclasses.replace(kind, mixed=kind.mixed or with_place(
          eqn, "a cumulative op along the batch axis"))
    return kind
  if isinstance(kind, Stat) and eqn.primitive.name == "cumsum":  # sums, no extreme
    return dataclasses.replace(kind, extreme=None)
  return Stat(kind.mixed or with_place(eqn, "a cumulative op of a statistic"), kind.exp)


def _broadcast_in_dim(w: _Walker, eqn, kinds):
  kind = kinds[0]
  dims = eqn.params["broadcast_dimensions"]
  out_shape, in_shape = shape_of(eqn.outvars[0]), shape_of(eqn.invars[0])
  if isinstance(kind, Rows):
    return dataclasses.replace(kind, dim=dims[kind.dim])
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
    out_ndim = len(shape_of(eqn.outvars[0]))
    return Const(frozenset(range(out_ndim)) if kind.value is not None else frozenset(),
                 kind.value, kind.exp)
  if eqn.params.get("dimensions") is not None:
    return Top(with_place(eqn, "a reshape that transposes the batch axis"))
  dim = _reshaped_dim(shape_of(eqn.invars[0]), shape_of(eqn.outvars[0]), kind.dim, w.rows)
  theirs = (w.partner_shape(eqn, 0), w.partner_shape(eqn, 0, out=True))
  if dim is not None and theirs[0] is not None and theirs[1] is not None and w.base:
    if _reshaped_dim(*theirs, kind.dim, round(w.rows / w.base)) != dim:
      dim = None
  if dim is None:
    return Top(with_place(eqn, "a reshape that splits the batch axis across examples"))
  return dataclasses.replace(kind, dim=dim)


def _reshaped_dim(shape, new_shape, dim: int, rows: int) -> int | None:
  """Where batch-major dim ``dim`` of ``shape`` lands in ``new_shape`` (row-major), if the
  examples stay contiguous blocks of one dimension."""
  outer = math.prod(shape[:dim])
  prefix = 1
  for new_dim, size in enumerate(new_shape):
    if prefix == outer and size != 0 and size % rows == 0:
      return new_dim
    prefix *= size
  return None


def _transpose(w: _Walker, eqn, kinds):
  kind = kinds[0]
  perm = tuple(eqn.params["permutation"])
  if isinstance(kind, Rows):
    return dataclasses.replace(kind, dim=perm.index(kind.dim))
  if isinstance(kind, Const):
    return Const(_map_uniform(kind.uniform, {d: perm.index(d) for d in perm}), kind.value,
                 kind.exp)
  return kind


def _squeeze(w: _Walker, eqn, kinds):
  kind = kinds[0]
  removed = tuple(eqn.params["dimensions"])
  if isinstance(kind, Rows):
    if kind.dim in removed:  # cannot happen for two or more examples
      return Top(with_place(eqn, "a squeeze of the batch axis"))
    return dataclasses.replace(kind, dim=_shift(kind.dim, removed))
  if isinstance(kind, Const):
    keep = [d for d in range(len(shape_of(eqn.invars[0]))) if d not in removed]
    return Const(_map_uniform(kind.uniform, {d: i for i, d in enumerate(keep)}), kind.value,
                 kind.exp)
  return kind


def _along_batch(what: str, acted: Callable[[Any], set[int]]):
  """Ops on one operand (plus positions) that keep examples apart unless they act along
  the batch axis. ``acted(eqn)``: the dimensions the op moves or selects elements along."""
  linear_ops = ("slice", "dynamic_slice", "pad", "rev", "split")

  def rule(w: _Walker, eqn, kinds):
    kind, rest = kinds[0], kinds[1:]
    outs = len(eqn.outvars)
    name = eqn.primitive.name
    dims = acted(eqn)
    scaled = w.scaled_dims(eqn, 0) & dims
    moves = _index_changes(w, rest if name != "pad" else [])
    if isinstance(kind, Rows):
      ok = all(isinstance(k, Const) for k in rest) and not moves
      if name == "pad":  # the padding is part of every example
        ok = ok and (rest[0].value == 0 or rest[0].exp == kind.exp)
      order = kind.order
      if kind.dim in dims:
        if name == "rev" and ok:  # the same examples, in another order
          order, dims = (id(eqn), kind.order), dims - {kind.dim}
        else:
          ok = False
      if scaled - {kind.dim}:
        ok = False
      mixed = kind.mixed or (None if ok else with_place(eqn, f"{what} along the batch axis"))
      if name == "top_k":  # the values, and their positions
        return [Rows(kind.dim, mixed, kind.exp, order),
                Rows(kind.dim, mixed, _index_exp(kind), order)]
      return [Rows(kind.dim, mixed, kind.exp, order)] * outs
    if isinstance(kind, Stat):
      ok = (name in linear_ops and all(isinstance(k, Const) for k in rest)
            and not moves and not scaled)
      if name == "pad":  # the padding must add up over devices like the statistic
        ok = ok and (rest[0].value == 0 or (
            kind.exp is not None and rest[0].exp == kind.exp + 1))
      return [Stat(kind.mixed or (None if ok else with_place(eqn, f"{what} of a statistic")),
                   kind.exp)] * outs
    if all(isinstance(k, Const) for k in kinds):
      exp = None if moves or not scaled <= kind.uniform else kind.exp
      uniform, value = kind.uniform, kind.value
      if name == "pad":
        exp = common_exp(kinds) if exp is not None else None
        if value is None or rest[0].value != value:
          uniform, value = uniform - dims, None
      elif name == "top_k":  # the values, and their positions (no known value)
        uniform = uniform - dims
        return [Const(uniform, value, exp),
                Const(uniform, None, None if exp is None else 0.0)]
      return [Const(uniform, value, exp)] * outs
    return [Top(with_place(eqn, f"{what} indexed by batch values"))] * outs
  return rule


def _sliced_dims(eqn) -> set[int]:
  shape = shape_of(eqn.invars[0])
  return {d for d in range(len(shape)) if not whole_dim(eqn, d)}


def _padded_dims(eqn) -> set[int]:
  return {d for d, cfg in enumerate(eqn.params["padding_config"]) if tuple(cfg) != (0, 0, 0)}


def _concatenate(w: _Walker, eqn, kinds):
  axis = eqn.params["dimension"]
  out_shape = shape_of(eqn.outvars[0])
  exp = common_exp(kinds)
  scaled = axis in w.scaled_dims(eqn, 0, out=True)
  rows = [k for k in kinds if isinstance(k, Rows)]
  if rows:
    dim = rows[0].dim
    ok = axis != dim and not scaled and exp is not None and all(
        (isinstance(k, Rows) and k.dim == dim) or
        (isinstance(k, Const) and _uniform_at(k, v, out_shape, dim))
        for k, v in zip(kinds, eqn.invars, strict=True))
    mixed = _first_mixed(rows) or _misaligned(eqn, rows)
    return Rows(dim, mixed or (None if ok else with_place(eqn, "a concatenation along or across "
                                                       "the batch axis")), exp, rows[0].order)
  stats = [k for k in kinds if isinstance(k, Stat)]
  if stats:
    ok = all(isinstance(k, Stat) for k in kinds) and exp is not None and not scaled
    return Stat(_first_mixed(stats) or (None if ok else with_place(
        eqn, "a concatenation of statistics and constants")), exp)
  return Const(exp=None if scaled else exp)


def _dynamic_update_slice(w: _Walker, eqn, kinds):
  operand, update = kinds[:2]
  if _index_changes(w, kinds[2:]):
    return Top(with_place(eqn, "an update at a position that follows the number of rows")) if (
        any(not isinstance(k, Const) for k in kinds)) else Const(exp=None)
  if all(isinstance(k, Const) for k in kinds):
    scaled = w.scaled_dims(eqn, 0)
    return Const(exp=None if scaled else common_exp(kinds[:2]))
  rows = [k for k in (operand, update) if isinstance(k, Rows)]
  if rows and all(isinstance(k, Const) for k in kinds[2:]):
    dim = rows[0].dim
    full = shape_of(eqn.invars[1])[dim] == shape_of(eqn.invars[0])[dim]
    exp = common_exp(kinds[:2])
    ok = full and exp is not None and not (w.scaled_dims(eqn, 0) - {dim}) and all(
        (isinstance(k, Rows) and k.dim == dim) or
        (isinstance(k, Const) and _uniform_at(k, v, shape_of(eqn.outvars[0]), dim))
        for k, v in zip((operand, update), eqn.invars[:2], strict=True))
    mixed = _first_mixed(rows) or _misaligned(eqn, rows)
    return Rows(dim, mixed or (None if ok else with_place(eqn, "an update of some examples")), exp,
                rows[0].order)
  return Top(with_place(eqn, "dynamic_update_slice of batch values"))


def _iota(w: _Walker, eqn, kinds):
  ndim = len(eqn.params["shape"])
  return Const(frozenset(range(ndim)) - {eqn.params["dimension"]})


def _dot_general(w: _Walker, eqn, kinds):
  lhs, rhs = kinds
  (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
  lhs_ndim, rhs_ndim = (len(shape_of(v)) for v in eqn.invars)
  lhs_free = [d for d in range(lhs_ndim) if d not in lc and d not in lb]
  rhs_free = [d for d in range(rhs_ndim) if d not in rc and d not in rb]
  exp = add_exps(kinds)
  scaled_contract = [w.scaled_dims(eqn, 0) & set(lc), w.scaled_dims(eqn, 1) & set(rc)]
  if isinstance(lhs, Const) and isinstance(rhs, Const):
    along = [d in lhs.uniform and rd in rhs.uniform for d, rd in zip(lb, rb, strict=True)]
    along += [d in lhs.uniform for d in lhs_free] + [d in rhs.uniform for d in rhs_free]
    return Const(frozenset(i for i, u in enumerate(along) if u),
                 exp=exp if not scaled_contract[0] else None)
  stats = [k for k in kinds if isinstance(k, Stat)]
  if stats:
    mixed = _first_mixed(stats)
    if len(stats) == 2 or any(isinstance(k, Rows) for k in kinds) or exp is None:
      mixed = mixed or with_place(eqn, "a matmul of a batch statistic with batch values")
    return Stat(mixed, exp)

  def out_dim(side: int, dim: int) -> int:
    batch, free = (lb, lhs_free) if side == 0 else (rb, rhs_free)
    if dim in batch:
      return list(batch).index(dim)
    offset = len(lb) + (0 if side == 0 else len(lhs_free))
    return offset + free.index(dim)

  contract, batch = (lc, rc), (lb, rb)
  rows = [k for k in kinds if isinstance(k, Rows)]
  mixed = _first_mixed(rows) or _misaligned(eqn, rows)
  if exp is None:
    mixed = mixed or with_place(eqn, "a matmul of values that scale differently with the "
                            "micro-batch size")
  if isinstance(lhs, Rows) and isinstance(rhs, Rows):
    pair_batch = lhs.dim in lb and rb[list(lb).index(lhs.dim)] == rhs.dim
    pair_contract = lhs.dim in lc and rc[list(lc).index(lhs.dim)] == rhs.dim
    if (scaled_contract[0] - {lhs.dim}) or (scaled_contract[1] - {rhs.dim}):
      mixed = mixed or with_place(eqn, "a matmul over a dimension whose size follows the rows")
    if pair_batch:
      return Rows(out_dim(0, lhs.dim), mixed, exp, lhs.order)
    if pair_contract:
      return Stat(mixed, exp)
    # e.g. x @ x.T over the batch: every pair of examples (in-batch negatives).
    where = lhs.dim if lhs.dim in lhs_free else None
    reason = with_place(eqn, "a matmul that pairs different examples")
    return Rows(out_dim(0, where), reason, exp) if where is not None else Top(reason)
  side = 0 if isinstance(lhs, Rows) else 1
  row, const = (lhs, rhs) if side == 0 else (rhs, lhs)
  const_var = eqn.invars[1 - side]
  mine, theirs = contract[side], contract[1 - side]
  partner = None
  if row.dim in mine or row.dim in batch[side]:
    partner = (theirs[list(mine).index(row.dim)] if row.dim in mine
               else batch[1 - side][list(batch[side]).index(row.dim)])
    if not (const.value is not None or partner in const.uniform
            or shape_of(const_var)[partner] == 1):
      mixed = mixed or with_place(eqn, "a matmul of examples with position-dependent values")
  if (scaled_contract[side] - {row.dim}) or (scaled_contract[1 - side] - {partner}):
    mixed = mixed or with_place(eqn, "a matmul over a dimension whose size follows the rows")
  if row.dim in mine:
    return Stat(mixed, exp)
  return Rows(out_dim(side, row.dim), mixed, exp, row.order)


def _gather(w: _Walker, eqn, kinds):
  operand, indices = kinds
  dn = eqn.params["dimension_numbers"]
  slice_sizes = eqn.params["slice_sizes"]
  op_shape, idx_shape = shape_of(eqn.invars[0]), shape_of(eqn.invars[1])
  out_ndim = len(shape_of(eqn.outvars[0]))
  batch_out = [d for d in range(out_ndim) if d not in dn.offset_dims]
  selected = {d for d in range(len(op_shape)) if slice_sizes[d] != op_shape[d]} | set(
      dn.start_index_map)
  scaled_selected = w.scaled_dims(eqn, 0) & selected
  moves = _index_changes(w, [indices])
  if isinstance(operand, Const) and isinstance(indices, Const):
    changes = moves or not scaled_selected <= operand.uniform
    return Const(exp=None if changes else operand.exp)
  if isinstance(operand, Stat) or isinstance(indices, Stat):
    return Top(with_place(eqn, "a gather that involves a batch statistic"))
  rows = [k for k in kinds if isinstance(k, Rows)]
  mixed = _first_mixed(rows) or _misaligned(eqn, rows)
  idx_dims = list(range(len(idx_shape) - 1))  # the last is the index vector
  if isinstance(indices, Rows):
    if indices.dim == len(idx_shape) - 1:
      return Top(with_place(eqn, "a gather whose index vectors run along the batch axis"))
    if indices.exp != 0:
      mixed = mixed or with_place(eqn, "a gather at positions that follow the number of rows")
    dim = batch_out[idx_dims.index(indices.dim)]
    if isinstance(operand, Const):  # a lookup (embedding) per example
      if scaled_selected - operand.uniform:
        mixed = mixed or with_place(eqn, "a lookup in a table whose size follows the rows")
      return Rows(dim, mixed, operand.exp, indices.order)
    paired = (operand.dim in dn.operand_batching_dims and dn.start_indices_batching_dims[
        list(dn.operand_batching_dims).index(operand.dim)] == indices.dim)
    if scaled_selected - {operand.dim}:
      paired = False
    return Rows(dim, mixed or (None if paired else with_place(
        eqn, "a gather of other examples' values")), operand.exp, indices.order)
  # Rows operand, batch-independent indices: the batch axis must be sliced whole.
  dim = operand.dim
  whole = (dim not in dn.start_index_map and dim not in dn.collapsed_slice_dims
           and dim not in dn.operand_batching_dims and slice_sizes[dim] == op_shape[dim])
  if not whole or moves or scaled_selected:
    return Top(with_place(eqn, "a gather that selects examples"))
  offset_operand_dims = [d for d in range(len(op_shape))
                         if d not in dn.collapsed_slice_dims and d not in dn.operand_batching_dims]
  return Rows(dn.offset_dims[offset_operand_dims.index(dim)], mixed, operand.exp,
              operand.order)


def _scatter(w: _Walker, eqn, kinds):
  """``scatter`` (``x.at[...].set``), ``scatter-add`` (the transpose of a gather: an
  embedding's gradient) and the other scatter combiners."""
  operand, indices, updates = kinds[:3]
  name = eqn.primitive.name
  dn = eqn.params["dimension_numbers"]
  op_shape, upd_shape = shape_of(eqn.invars[0]), shape_of(eqn.invars[2])
  idx_batch = list(range(len(shape_of(eqn.invars[1])) - 1))  # the last is the index vector
  window_op_dims = [d for d in range(len(op_shape))
                    if d not in dn.inserted_window_dims and d not in dn.operand_batching_dims]
  window = dict(zip(dn.update_window_dims, window_op_dims, strict=True))  # updates -> operand
  upd_scatter = [d for d in range(len(upd_shape)) if d not in dn.update_window_dims]
  scaled = w.scaled_dims(eqn, 0)
  moves = _index_changes(w, [indices]) or (isinstance(indices, Rows) and indices.exp != 0)
  if all(isinstance(k, Const) for k in kinds):
    # Along a dimension whose size follows the rows the window must be whole, and the
    # number of updates must not follow them (counts: segment_sum(ones(n), ids)).
    whole = {d for u, d in window.items() if upd_shape[u] == op_shape[d]}
    moved = (scaled - whole) | (w.scaled_dims(eqn, 2) & set(upd_scatter)) | (
        w.scaled_dims(eqn, 1) & set(idx_batch))
    uniform = {d for u, d in window.items()
               if d in whole and d in operand.uniform and (
                   u in updates.uniform or updates.value is not None)}
    return Const(frozenset(uniform), exp=None if moved or moves
                 else common_exp([operand, updates]))
  if (isinstance(updates, Stat) and isinstance(indices, Const) and not moves
      and name in ("scatter", "scatter-add") and not scaled and (
          (isinstance(operand, Const) and operand.value == 0)
          or (isinstance(operand, Stat) and name == "scatter-add"))):
    # A statistic placed into zeros (or added to one): still linear in the examples.
    stats = [k for k in (operand, updates) if isinstance(k, Stat)]
    exp = common_exp([operand, updates])
    return Stat(_first_mixed(stats) or (None if exp is not None else with_place(
        eqn, f"a {name} of statistics that scale differently")), exp)
  if any(isinstance(k, (Stat, Top)) for k in kinds) or moves:
    return Top(with_place(eqn, f"a {name} that involves batch statistics or moving positions"))
  rows = [k for k in kinds if isinstance(k, Rows)]
  mixed = _first_mixed(rows) or _misaligned(eqn, rows)
  exp = (add_exps([operand, updates]) if name == "scatter-mul"
         else common_exp([operand, updates]))
  order = rows[0].order
  # 1. Along each example: the batch is a window dimension of the operand taken whole (or
  #    held by the operand only), and the indices are batch-independent.
  dim = operand.dim if isinstance(operand, Rows) else (
      window.get(updates.dim) if isinstance(updates, Rows) else None)
  if isinstance(indices, Const) and dim is not None and dim in window_op_dims:
    upd_dim = next(u for u, d in window.items() if d == dim)
    ok = (upd_shape[upd_dim] == op_shape[dim] and exp is not None and not (scaled - {dim})
          and all((isinstance(k, Rows) and k.dim == d) or (
              isinstance(k, Const) and _uniform_at(k, v, shape_of(v), d))
              for k, v, d in ((operand, eqn.invars[0], dim),
                              (updates, eqn.invars[2], upd_dim))))
    return Rows(dim, mixed or (None if ok else with_place(eqn, f"a {name} that moves examples")),
                exp, order)
  # 2. Batched: the operand's batching dimension pairs each example with its indices.
  if isinstance(indices, Rows) and indices.dim in dn.scatter_indices_batching_dims:
    dim = dn.operand_batching_dims[list(dn.scatter_indices_batching_dims).index(indices.dim)]
    upd_dim = upd_scatter[idx_batch.index(indices.dim)] if indices.dim in idx_batch else None
    ok = exp is not None and upd_dim is not None and not (scaled - {dim}) and all(
        (isinstance(k, Rows) and k.dim == d) or (
            isinstance(k, Const) and _uniform_at(k, v, shape_of(v), d))
        for k, v, d in ((operand, eqn.invars[0], dim), (updates, eqn.invars[2], upd_dim)))
    return Rows(dim, mixed or (None if ok else with_place(eqn, f"a {name} across examples")), exp,
                order)
  # 3. A sum over examples: each example's update added into a batch-independent zero.
  if (name == "scatter-add" and isinstance(operand, Const) and operand.value == 0
      and isinstance(updates, Rows) and updates.dim in upd_scatter):
    idx_dim = idx_batch[upd_scatter.index(updates.dim)]
    ok = (not isinstance(indices, Rows) or indices.dim == idx_dim) and not (
        w.scaled_dims(eqn, 2) - {updates.dim})
    return Stat(mixed or (None if ok else with_place(eqn, "a scatter-add across examples")),
                updates.exp)
  return Top(with_place(eqn, f"a {name} across examples"))


def _conv(w: _Walker, eqn, kinds):
  lhs, rhs = kinds
  dn = eqn.params["dimension_numbers"]
  exp = add_exps(kinds)
  single = eqn.params["batch_group_count"] == 1 and eqn.params["feature_group_count"] == 1
  extra = (w.scaled_dims(eqn, 0) | w.scaled_dims(eqn, 1)) - {
      k.dim for k in kinds if isinstance(k, Rows)}
  if isinstance(lhs, Const) and isinstance(rhs, Const):
    return Const(exp=None if extra else exp)
  if exp is None or extra or isinstance(lhs, (Stat, Top)) or isinstance(rhs, (Stat, Top)):
    return Top(with_place(eqn, "a convolution across examples"))
  if (isinstance(lhs, Rows) and isinstance(rhs, Const) and lhs.dim == dn.lhs_spec[0]
      and eqn.params["batch_group_count"] == 1):
    return Rows(dn.out_spec[0], lhs.mixed, exp, lhs.order)
  if (isinstance(lhs, Rows) and isinstance(rhs, Rows) and single
      and lhs.dim == dn.lhs_spec[1] and rhs.dim == dn.rhs_spec[1]):
    # A kernel's gradient: the examples are the contracted (feature) dimension.
    return Stat(_first_mixed(kinds) or _misaligned(eqn, kinds), exp)
  return Top(with_place(eqn, "a convolution across examples"))


def _window(w: _Walker, eqn, kinds):
  kind = _rescaled(eqn, kinds[0])
  outs = len(eqn.outvars)
  p = eqn.params
  moving = {d for d in range(len(p["window_dimensions"]))
            if not (p["window_dimensions"][d] == 1 and p["window_strides"][d] == 1
                    and tuple(p["padding"][d]) == (0, 0)
                    and p.get("base_dilation", (1,) * (d + 1))[d] == 1)}
  scaled = w.scaled_dims(eqn, 0)
  if all(isinstance(k, Const) for k in kinds):
    return [Const(exp=kind.exp if not scaled & moving else None)] * outs
  if isinstance(kind, Rows):
    rows = [k for k in kinds if isinstance(k, Rows)]
    ok = (kind.dim not in moving and not (scaled - {kind.dim})
          and all(isinstance(k, Const) or k.dim == kind.dim for k in kinds))
    mixed = _first_mixed(rows) or _misaligned(eqn, rows)
    return [Rows(kind.dim, mixed or (None if ok else with_place(
        eqn, "a window op along the batch axis")), kind.exp, kind.order)] * outs
  return [Top(with_place(eqn, "a window op of batch values"))] * outs


def _sort(w: _Walker, eqn, kinds):
  axis = eqn.params["dimension"]
  rows = [k for k in kinds if isinstance(k, Rows)]
  outs = len(eqn.outvars)
  # Keys that follow the number of rows (other than as a common factor) reorder the rest.
  scaled = axis in w.scaled_dims(eqn, 0) or _index_changes(
      w, [k for k in kinds[:eqn.params["num_keys"]] if isinstance(k, Const)])
  if not rows:
    if all(isinstance(k, Const) for k in kinds):
      return [Const(exp=None if scaled else k.exp) for k in kinds]
    return [Top(with_place(eqn, "a sort of batch statistics"))] * outs
  dim = rows[0].dim
  out_shape = shape_of(eqn.outvars[0])
  ok = axis != dim and not scaled and all((isinstance(k, Rows) and k.dim == dim) or (
      isinstance(k, Const) and _uniform_at(k, v, out_shape, dim))
      for k, v in zip(kinds, eqn.invars, strict=True))
  mixed = _first_mixed(rows) or _misaligned(eqn, rows)
  mixed = mixed or (None if ok else with_place(
      eqn, "a sort along the batch axis, or by keys that follow the number of rows"))
  return [Rows(dim, mixed, k.exp, rows[0].order) for k in kinds]


def _random_keys(w: _Walker, eqn, kinds):
  """Random bits/keys from keys: per-example keys give per-example bits; one shared key
  gives values that depend on the position in the batch."""
  kind = kinds[0]
  outs = len(eqn.outvars)
  exp = 0.0 if kind.exp == 0 else None  # a key made from the number of rows: other bits
  if isinstance(kind, Const):
    return [Const(exp=exp)] * outs
  if isinstance(kind, Rows):
    return [Rows(kind.dim, kind.mixed, exp, kind.order)] * outs
  return [Top(with_place(eqn, "random numbers from a batch statistic"))] * outs


def _dim_as_value(w: _Walker, eqn, kinds):
  """A size as a value (symbolic mode: e.g. ``jnp.mean``'s divisor ``n``)."""
  return Const(exp=w.degree(eqn.params["dim"]) if w.symbol is not None else None)


def _identity(w: _Walker, eqn, kinds):
  return list(kinds)


def _collective(w: _Walker, eqn, kinds):
  return [Top(with_place(eqn, f"the collective {eqn.primitive.name}"))] * len(eqn.outvars)


RULES: dict[str, Callable[..., Any]] = {
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
    "rev": _along_batch("a reversal", lambda e: set(e.params["dimensions"])),
    "slice": _along_batch("a slice", _sliced_dims),
    "dynamic_slice": _along_batch("a dynamic slice", _sliced_dims),
    "pad": _along_batch("padding", _padded_dims),
    "split": _along_batch("a split", lambda e: {e.params["axis"]}),
    "top_k": _along_batch("top_k", lambda e: {len(shape_of(e.invars[0])) - 1}),
    "concatenate": _concatenate,
    "dynamic_update_slice": _dynamic_update_slice,
    "iota": _iota,
    "dot_general": _dot_general,
    "gather": _gather,
    **{name: _scatter for name in ("scatter", "scatter-add", "scatter-mul", "scatter-min",
                                   "scatter-max")},
    "conv_general_dilated": _conv,
    **{name: _window for name in ("reduce_window_sum", "reduce_window_max",
                                  "reduce_window_min", "reduce_window",
                                  "select_and_scatter_add")},
    "sort": _sort,
    "dim_as_value": _dim_as_value,
    **{name: _random_keys for name in ("random_bits", "random_split", "random_wrap",
                                       "random_unwrap", "rng_bit_generator")},
    **{name: _identity for name in ("sharding_constraint", "reshard", "mesh_cast",
                                    "device_put", "optimization_barrier", "relayout")},
    **{name: _collective for name in (
        "psum", "pmax", "pmin", "all_gather", "all_to_all", "ppermute", "psum_scatter",
        "reduce_scatter", "axis_index", "pbroadcast", "pcast", "psum_invariant",
        "unreduced_pmax", "unreduced_pmin", "pbroadcast_dynamic")},
}

ELEMENTWISE = frozenset("""
    abs acos acosh add add_any and asin asinh atan atan2 atanh bessel_i0e bessel_i1e
    bitcast_convert_type cbrt ceil clamp clz complex conj convert_element_type copy
    copy_p cos cosh digamma div eq erf erf_inv erfc exp exp2 expm1 floor ge gt igamma
    igamma_grad_a igammac imag integer_pow is_finite le lgamma log log1p log2 logistic
    lt max min mul ne neg nextafter not one_minus_square or polygamma polynomial
    population_count pow random_fold_in random_seed random_gamma_grad real
    reduce_precision regularized_incomplete_beta rem round rsqrt select_n shift_left
    shift_right_arithmetic shift_right_logical sign sin sinh sqrt square stop_gradient
    sub tan tanh threefry2x32 xor zeta
""".split())

# Ops through which a param stays "the param" for the reduced-type analysis.
TRANSPARENT = frozenset({"convert_element_type", "transpose", "copy", "copy_p",
                          "reduce_precision", "sharding_constraint", "optimization_barrier"})


# ---------------------------------------------------------------------------------------
# Sub-jaxprs: calls, loops, conditionals


def _inner(w: _Walker, closed, kinds, sources, offset: int = 0) -> list[Kind]:
  jaxpr = getattr(closed, "jaxpr", closed)
  consts = list(getattr(closed, "consts", None) or [])
  if len(consts) != len(jaxpr.constvars):
    consts = [None] * len(jaxpr.constvars)
  theirs = list(getattr(w.partners.get(("closed", id(closed))), "consts", None) or [])
  if len(theirs) != len(consts):
    theirs = [None] * len(consts)
  const_kinds = [Const() if c is None else w.const_kind(c, d)
                 for c, d in zip(consts, theirs, strict=True)]
  inner_sources = {pos - offset: p for pos, p in sources.items() if pos >= offset}
  return w.run(jaxpr, const_kinds, kinds, inner_sources)


def _call_rule(param: str):
  def rule(w: _Walker, eqn, kinds, sources):
    return _inner(w, eqn.params[param], kinds, sources)
  return rule


def _shard_map(w: _Walker, eqn, kinds, sources):
  w.not_reducible.update(sources.values())
  w.blockers.append(with_place(eqn, "the loss calls jax.shard_map"))
  if all(isinstance(k, Const) for k in kinds):
    return [Const(exp=common_exp(kinds))] * len(eqn.outvars)
  return [Top(with_place(eqn, "a shard_map inside the loss"))] * len(eqn.outvars)


def _scan(w: _Walker, eqn, kinds, sources):
  p = eqn.params
  n_consts, n_carry = scan_counts(p)
  consts, carry, xs = kinds[:n_consts], kinds[n_consts:n_consts + n_carry], kinds[
      n_consts + n_carry:]
  for pos, param in sources.items():
    if pos >= n_consts:  # a param as loop state or sliced per iteration
      w.not_reducible.add(param)
  body_sources = {pos: q for pos, q in sources.items() if pos < n_consts}
  if "length" in w.changed.get(id(eqn), ()) or any(
      isinstance(k, Rows) and k.dim == 0 for k in xs):
    return _scan_over_rows(w, eqn, kinds, body_sources)
  sliced: list[Kind] = []
  for k in xs:
    if isinstance(k, Rows):
      sliced.append(dataclasses.replace(k, dim=k.dim - 1))
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
      stacked.append(dataclasses.replace(k, dim=k.dim + 1))
    elif isinstance(k, Const):
      stacked.append(Const(frozenset(d + 1 for d in k.uniform), exp=k.exp))
    else:
      stacked.append(k)
  return [*carry, *stacked]


def _scan_over_rows(w: _Walker, eqn, kinds, body_sources):
  """A scan with one iteration per example (``lax.map`` over the batch, its transpose,
  a ``fori_loop`` of ``n`` steps): the iterations are the examples, so the body is
  analyzed as ``jax.vmap`` of it over them. Each carry must pass through unchanged or only
  add a value that does not depend on the carries (a sum over the iterations, such as
  the transposed scan's gradient accumulators); any other carry links the examples."""
  p = eqn.params
  n_consts, n_carry = scan_counts(p)
  outs = len(eqn.outvars)
  what = with_place(eqn, "a loop over the examples that carries state from one to the next")
  body = p["jaxpr"]
  if not all(_accumulates(body.jaxpr, i, n_consts, n_carry) for i in range(n_carry)):
    return [Top(what)] * outs
  if any(_read_while_it_grows(body.jaxpr, i, n_consts) for i in range(n_carry)):
    return [Top(with_place(eqn, "a loop over the examples that reads a running total (e.g. "
                           "an example counter): each example sees another value"))] * outs
  if any(isinstance(k, Rows) and k.dim != 0 for k in kinds[n_consts + n_carry:]):
    return [Top(with_place(eqn, "a scan over the batch axis"))] * outs
  partner = w.partners.get(id(eqn))
  count = (w.degree(p["length"]) if w.symbol is not None else
           w.ratio_exp(p["length"], partner.params["length"]) if partner is not None else 0.0)
  mapped = _vmapped(body, n_consts, n_carry, p["length"])
  theirs = _vmapped(partner.params["jaxpr"], n_consts, n_carry,
                    partner.params["length"]) if partner is not None else None
  if mapped is None or (partner is not None and theirs is None):
    return [Top(what)] * outs
  if theirs is not None:
    try:
      w.pair(mapped.jaxpr, theirs.jaxpr)
    except Unpaired:
      return [Top(what)] * outs
    w.partners[("closed", id(mapped))] = theirs
  # The carries, seen from one step: what it adds to them, or (passed through) their value.
  zero = Const(value=0.0)
  carried = [init if body.jaxpr.outvars[i] is body.jaxpr.invars[n_consts + i] else zero
             for i, init in enumerate(kinds[n_consts:n_consts + n_carry])]
  in_kinds = [*kinds[:n_consts], *carried, *kinds[n_consts + n_carry:]]
  got = _inner(w, mapped, in_kinds, body_sources)
  carry = []
  for init, step in zip(kinds[n_consts:n_consts + n_carry], got[:n_carry], strict=True):
    carry.append(init if isinstance(step, Const) and step.value == 0 else _plus_sum(
        eqn, init, step, count))
  return [*carry, *got[n_carry:]]


def _accumulates(jaxpr, i: int, n_consts: int, n_carry: int) -> bool:
  """Whether carry ``i`` of a scan body passes through, or only has a carry-independent
  value added to it."""
  carry_in = jaxpr.invars[n_consts + i]
  out = jaxpr.outvars[i]
  if out is carry_in:
    return True
  carries = set(jaxpr.invars[n_consts:n_consts + n_carry])
  producer = next((e for e in jaxpr.eqns if out in e.outvars), None)
  if producer is None or producer.primitive.name not in ("add", "add_any"):
    return False
  others = [v for v in producer.invars if v is not carry_in]
  if len(others) != 1:
    return False
  reached = set(carries)
  for e in jaxpr.eqns:
    if e is producer:
      break
    if any(not isinstance(v, jcore.Literal) and v in reached for v in e.invars):
      reached.update(e.outvars)
  return isinstance(others[0], jcore.Literal) or others[0] not in reached


def _read_while_it_grows(jaxpr, i: int, n_consts: int) -> bool:
  """Whether carry ``i`` of a scan body changes from step to step and is read by anything
  but the addition that grows it (an output per iteration, say: ``v * 0.9 ** count``)."""
  carry_in = jaxpr.invars[n_consts + i]
  out = jaxpr.outvars[i]
  if out is carry_in:
    return False
  reads = [e for e in jaxpr.eqns if carry_in in e.invars and out not in e.outvars]
  return bool(reads) or any(v is carry_in for v in jaxpr.outvars)


def _vmapped(body, n_consts: int, n_carry: int, length: int):
  """``body`` vmapped over its sliced inputs (one per iteration), or None."""
  avals = [v.aval for v in body.jaxpr.invars]
  args = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in avals[:n_consts + n_carry]]
  args += [jax.ShapeDtypeStruct((length, *a.shape), a.dtype)
           for a in avals[n_consts + n_carry:]]
  in_axes = [None] * (n_consts + n_carry) + [0] * (len(avals) - n_consts - n_carry)
  try:
    return jax.make_jaxpr(jax.vmap(jcore.jaxpr_as_fun(body), in_axes=in_axes, out_axes=0,
                                   axis_size=length))(*args)
  except Exception:  # noqa: BLE001 - a body JAX cannot vmap: no proof
    return None


def _plus_sum(eqn, init: Kind, step: Kind, count: Exp) -> Kind:
  """``init`` plus the sum over the iterations (examples) of ``step`` (stacked on axis 0);
  ``count``: how the number of iterations scales."""
  if isinstance(step, Rows) and step.dim == 0:
    total: Kind = Stat(step.mixed, step.exp)
  elif isinstance(step, Const) and (0 in step.uniform or step.value is not None):
    total = Const(exp=add_exps([step, Const(exp=count)]))  # equal terms, count of them
  else:
    return Top(with_place(eqn, "a loop whose number of iterations follows the number of rows "
                      "adds up values that are no per-example terms"))
  if isinstance(init, Const) and init.value == 0:
    return total
  if isinstance(total, Const) and isinstance(init, Const):
    return Const(exp=common_exp([init, total]))
  return Top(with_place(eqn, "a loop over the examples whose sum starts from a non-zero value"))


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
  if not isinstance(pred, Const) or pred.exp != 0:
    return [Top(with_place(eqn, "a while loop whose trip count depends on the batch or on "
                       "the number of rows"))] * len(carry)
  return carry


def _cond(w: _Walker, eqn, kinds, sources):
  index, operands = kinds[0], kinds[1:]
  branch_sources = {pos - 1: q for pos, q in sources.items() if pos >= 1}
  if 0 in sources:
    w.not_reducible.add(sources[0])
  outs: list[Kind] | None = None
  for branch in eqn.params["branches"]:
    got = _inner(w, branch, list(operands), branch_sources)
    outs = got if outs is None else [join(a, b) for a, b in zip(outs, got, strict=True)]
  assert outs is not None  # a conditional has at least one branch
  if not isinstance(index, Const) or index.exp != 0:
    return [Top(with_place(eqn, "a conditional on batch values or on the number of rows"))
            ] * len(outs)
  return outs


SUBCALLS: dict[str, Callable[..., list[Kind]]] = {
    "jit": _call_rule("jaxpr"),
    "pjit": _call_rule("jaxpr"),
    "closed_call": _call_rule("call_jaxpr"),
    "core_call": _call_rule("call_jaxpr"),
    "remat2": _call_rule("jaxpr"),
    "checkpoint": _call_rule("jaxpr"),
    # In the jaxpr of a micro-step's value and gradients, a custom_jvp / custom_vjp call
    # that remains is not differentiated (its rules were traced in where they are used):
    # only its primal runs.
    "custom_jvp_call": _call_rule("call_jaxpr"),
    "custom_vjp_call": _call_rule("call_jaxpr"),
    "shard_map": _shard_map,
    "scan": _scan,
    "while": _while,
    "cond": _cond,
}
