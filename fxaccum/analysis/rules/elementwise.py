"""Rules of ops that act element by element (arithmetic, casts, comparisons,
``select_n``) and of random bits drawn from keys.

Examples stay apart through such an op unless it combines them with a statistic of the
batch or with values that depend on their position in it; how the result scales with the
number ``D`` of devices follows from the operands' exponents. May import
:mod:`fxaccum.analysis.registry`, :mod:`fxaccum.analysis.kinds`,
:mod:`fxaccum.analysis.eqns` and :mod:`.common`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from fxaccum.analysis.eqns import shape_of, with_place
from fxaccum.analysis.kinds import Const, Exp, Rows, Stat, Top, add_exps, common_exp
from fxaccum.analysis.registry import Context, Operands, Out, register, register_facts
from fxaccum.analysis.rules.common import const_uniform, first_mixed, misaligned, uniform_at

__all__ = ["ELEMENTWISE", "elementwise", "random_gamma", "random_keys"]

ELEMENTWISE = frozenset("""
    abs acos acosh add add_any and asin asinh atan atan2 atanh bessel_i0e bessel_i1e
    bitcast_convert_type cbrt ceil clamp clz complex conj convert_element_type copy
    copy_p cos cosh digamma div eq eq_to erf erf_inv erfc exp exp2 expm1 floor ge gt
    igamma igamma_grad_a igammac imag integer_pow is_finite le le_to lgamma log log1p log2
    logistic lt lt_to max min mul ne neg nextafter not one_minus_square or polygamma polynomial
    population_count pow random_fold_in random_seed random_gamma_grad real
    reduce_precision regularized_incomplete_beta rem round rsqrt select_n shift_left
    shift_right_arithmetic shift_right_logical sign sin sinh sqrt square stop_gradient
    sub tan tanh threefry2x32 xor zeta
""".split())

# Known values of constants folded through these ops (e.g. a mean's divisor).
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
_SCALE_FREE = frozenset({"sign", "eq", "ne", "lt", "le", "gt", "ge", "is_finite", "eq_to",
                         "lt_to", "le_to"})  # the last three: total orders (searchsorted)


# Integer ops for which a common factor of the operands does not factor out of the result,
# and whose results per device do not add up to the global one (they round, keep bits).
_INEXACT_INT = frozenset({"div", "rem", "and", "or", "xor", "not", "shift_left",
                          "shift_right_logical", "shift_right_arithmetic", "population_count",
                          "clz", "pow"})


def _exp_of(eqn, kinds) -> Exp:
  """The exponent of an elementwise op's result; None if it is no power of D."""
  name = eqn.primitive.name
  if name == "select_n":  # which operand is picked must not follow the rows
    return common_exp(kinds[1:]) if kinds[0].exp == 0 else None
  if name in _INEXACT_INT and _integral(eqn):
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


# Casts and copies: a param stays itself through them, and they keep a bound.
register_facts("convert_element_type", "copy", "copy_p", transparent=True, bound="keeps")
register_facts("stop_gradient", bound="keeps")
register_facts("reduce_precision", transparent=True)


@register(*ELEMENTWISE)
def elementwise(ctx: Context, kinds: Operands) -> Out:
  """Ops applied element by element: examples stay apart unless combined with a
  statistic of the batch or with values that depend on the position in it."""
  eqn = ctx.eqn
  out_shape = shape_of(eqn.outvars[0])
  rows = [k for k in kinds if isinstance(k, Rows)]
  stats = [k for k in kinds if isinstance(k, Stat)]
  exp = _exp_of(eqn, kinds)
  if rows:
    dims = {r.dim for r in rows}
    if len(dims) > 1:
      return [Top(with_place(eqn, "combines values batched along different axes"))]
    (dim,) = dims
    mixed = first_mixed(rows) or misaligned(eqn, rows)
    if not mixed and stats:
      mixed = with_place(eqn, f"{eqn.primitive.name} combines each example with a statistic of "
                     "the whole batch")
    if not mixed and not all(uniform_at(k, v, out_shape, dim)
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
  return [Const(const_uniform(kinds, eqn), value, exp)] * len(eqn.outvars)


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


def _linear(eqn: Any, kinds: Operands, exp: Exp) -> Stat:
  """Batch statistics through an elementwise op: linear ones stay sums of examples.

  Per device a sum over examples times ``n ** p`` adds up to ``D ** -p`` times the global
  one, and a batch-independent ``c * n ** r`` to ``D ** (1 - r)`` times it: a statistic
  plus a constant stays a consistent whole only when ``r == p + 1`` (``mean + c``,
  ``sum + n * c``), or when the constant is 0.
  """
  name = eqn.primitive.name
  stats = [k for k in kinds if isinstance(k, Stat)]
  inherited = first_mixed(stats)

  def nonlinear(what):
    return Stat(inherited or with_place(eqn, what), exp)

  if name in _INEXACT_INT and _integral(eqn):  # floor(a) + floor(b) is not floor(a + b)
    return nonlinear(f"integer {name} of a batch statistic is not additive (per device, "
                     "the devices' results would not add up to the global one)")
  if name == "convert_element_type" and _lossy_cast(eqn):
    return nonlinear(f"casts a batch statistic to {jnp.dtype(eqn.params['new_dtype'])}")
  if name in ("convert_element_type", "copy", "reduce_precision", "stop_gradient",
              "real", "imag", "conj"):
    monotone = name in ("copy", "reduce_precision", "stop_gradient") or (
        name == "convert_element_type" and _to_real_float(eqn))
    return stats[0] if monotone else dataclasses.replace(stats[0], extreme=None)
  if name == "neg":  # swaps a maximum and a minimum, unless it wraps (integers: -(-128))
    negated = {"max": "min", "min": "max"}
    extreme = stats[0].extreme
    if _integral(eqn):
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
    if exp is None:
      return nonlinear("scales a batch statistic by a value that is no power of the "
                       "micro-batch size")
    factor = next((k.value for k in kinds if isinstance(k, Const)), None)
    if factor is not None and (not np.isfinite(factor) or (name == "div" and factor == 0)):
      # Devices' shares of opposite signs give inf - inf = NaN where the whole gives inf.
      return nonlinear(f"scales a batch statistic by {factor!r}, to a non-finite value")
    return Stat(inherited, exp, extreme=_scaled_extreme(eqn, kinds))
  if name == "select_n" and isinstance(kinds[0], Const):
    # Each element one of the statistics, or an exact zero (``jnp.trace``'s mask): linear.
    if all(isinstance(c, Stat) or (isinstance(c, Const) and c.value == 0)
           for c in kinds[1:]) and exp is not None:
      return Stat(inherited, exp)
  return nonlinear(f"applies {name} to a batch statistic")


def _integral(eqn) -> bool:
  """Whether an op's result is of an integer type (its arithmetic rounds or wraps)."""
  dtype = getattr(eqn.outvars[0].aval, "dtype", None)
  return dtype is not None and jax.dtypes.issubdtype(dtype, np.integer)


def _scaled_extreme(eqn: Any, kinds: Operands) -> str | None:
  """The extreme a maximum (minimum) over the examples stays when multiplied or divided
  by a known, finite, batch-independent constant (fp8's ``amax / 448``): a positive one
  keeps it, a negative one swaps it; in floating point only (rounding is monotone)."""
  stat = next(k for k in kinds if isinstance(k, Stat))
  const = next((k for k in kinds if isinstance(k, Const)), None)
  if (stat.extreme is None or const is None or const.value is None or const.exp != 0
      or not np.isfinite(const.value) or const.value == 0
      or not jnp.issubdtype(eqn.outvars[0].aval.dtype, jnp.floating)):
    return None
  return stat.extreme if const.value > 0 else {"max": "min", "min": "max"}[stat.extreme]


def _lossy_cast(eqn) -> bool:
  """Whether a cast is no scaling-preserving map: to a bool, or to an integer type that
  does not hold every value of the source (truncation, wrapping)."""
  source, target = eqn.invars[0].aval.dtype, jnp.dtype(eqn.params["new_dtype"])
  return target == jnp.bool_ or (jnp.issubdtype(target, jnp.integer)
                                 and not np.can_cast(source, target, "safe"))


def _to_real_float(eqn) -> bool:
  """Whether a cast is monotone (keeps a maximum one): from a real number to a float that
  holds infinities (not to a bool or an integer, which wrap or saturate, nor to a float8
  without inf such as ``e4m3fn``, where a value out of range becomes NaN)."""
  source, target = eqn.invars[0].aval.dtype, eqn.params["new_dtype"]
  return (jnp.issubdtype(target, jnp.floating)
          and not jnp.issubdtype(source, jnp.complexfloating)
          and bool(np.isinf(np.array(np.inf).astype(target))))


register_facts("random_bits", "random_split", "rng_bit_generator", shape_params={"shape"})


@register("random_bits", "random_split", "random_wrap", "random_unwrap",
          "rng_bit_generator")
def random_keys(ctx: Context, kinds: Operands) -> Out:
  """Random bits/keys from keys: per-example keys give per-example bits; one shared key
  gives values that depend on the position in the batch."""
  eqn = ctx.eqn
  kind = kinds[0]
  outs = len(eqn.outvars)
  exp = 0.0 if kind.exp == 0 else None  # a key made from the number of rows: other bits
  if isinstance(kind, Const):
    return [Const(exp=exp)] * outs
  if isinstance(kind, Rows):
    return [Rows(kind.dim, kind.mixed, exp, kind.order)] * outs
  return [Top(with_place(eqn, "random numbers from a batch statistic"))] * outs


@register("random_gamma")
def random_gamma(ctx: Context, kinds: Operands) -> Out:
  """Gamma draws: each key (the keys' dims lead the shapes') draws the elements of its
  block of ``a``. Per-example keys, or one key broadcast to every example, keep examples
  apart; one key drawing for the whole batch gives values that depend on the position."""
  eqn = ctx.eqn
  key, shape = kinds
  out_shape = shape_of(eqn.outvars[0])
  exp = 0.0 if key.exp == 0 and shape.exp == 0 else None
  rows = [k for k in kinds if isinstance(k, Rows)]
  if not rows:
    if all(isinstance(k, Const) for k in kinds):  # draws by position: as many as the rows?
      return Const(exp=None if ctx.scaled_dims(0) | ctx.scaled_dims(1) else exp)
    return Top(with_place(eqn, "gamma draws from a batch statistic"))
  dim = rows[0].dim
  key_ndim = len(shape_of(eqn.invars[0]))
  ok = exp is not None and dim < key_ndim and all(
      (isinstance(k, Rows) and k.dim == dim) or (isinstance(k, Const) and uniform_at(
          k, v, out_shape if i == 1 else shape_of(v), dim))
      for i, (k, v) in enumerate(zip(kinds, eqn.invars, strict=True)))
  mixed = first_mixed(rows) or misaligned(eqn, rows) or (None if ok else with_place(
      eqn, "gamma draws from one key for several examples, or of values that scale with "
      "the micro-batch size"))
  return Rows(dim, mixed, exp, rows[0].order)
