"""Integer arithmetic on a batch statistic (issue 34, item 1), rule by rule on
`jax.make_jaxpr` of tiny functions, no mesh: ops that do not add up over devices (integer
division and remainder, shifts, bitwise ops, powers, clamps) make a statistic no sum over
examples; narrow integer sums that may wrap at the rows seen are no sums either. Linear
ops (float and integer) and float rounding (float8, `reduce_precision`) stay linear."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from helpers import IDS, ROWS, Case, analyze_case, case_id, no, ok, primitives_of
from jax import lax

from fxaccum.analysis import Stat

UIDS = jax.ShapeDtypeStruct((ROWS,), jnp.uint32)
WIDE = jax.ShapeDtypeStruct((256,), jnp.int32)  # more rows than a uint8 can count


def _n(c):
  return jnp.sum(c)


def _u8_count(c):  # a count of the examples with c > 0, summed in uint8
  return jnp.sum((c > 0).astype(jnp.uint8), dtype=jnp.uint8)


NOT_ADDITIVE = "not additive"
CASES = [
    # integer division and remainder of a count: floor(a) + floor(b) is not floor(a + b)
    no("div", lambda c, w: lax.div(_n(c), 2), batch=IDS, reason=NOT_ADDITIVE),
    no("div", lambda c, w: _n(c) // 2, batch=UIDS, reason=NOT_ADDITIVE),
    no("div", lambda c, w: jnp.floor_divide(_n(c), 3), batch=IDS),  # signed: sign, rem too
    no("div", lambda c, w: lax.div(_n(c).astype(jnp.int8), jnp.int8(2)), batch=IDS),
    no("rem", lambda c, w: lax.rem(_n(c), 3), batch=IDS, reason=NOT_ADDITIVE),
    no("rem", lambda c, w: _n(c) % 3, batch=UIDS, reason=NOT_ADDITIVE),
    # shifts, bitwise ops, powers, clamps
    no("shift_right_arithmetic", lambda c, w: jnp.right_shift(_n(c), 1), batch=IDS,
       reason=NOT_ADDITIVE),
    no("shift_right_logical", lambda c, w: jnp.right_shift(_n(c), 1), batch=UIDS,
       reason=NOT_ADDITIVE),
    no("shift_left", lambda c, w: jnp.left_shift(_n(c), 1), batch=IDS, reason=NOT_ADDITIVE),
    no("and", lambda c, w: _n(c) & 1, batch=IDS, reason=NOT_ADDITIVE),
    no("or", lambda c, w: _n(c) | 1, batch=UIDS, reason=NOT_ADDITIVE),
    no("xor", lambda c, w: _n(c) ^ 3, batch=IDS, reason=NOT_ADDITIVE),
    no("not", lambda c, w: ~_n(c), batch=UIDS, reason=NOT_ADDITIVE),
    no("population_count", lambda c, w: lax.population_count(_n(c)), batch=IDS),
    no("integer_pow", lambda c, w: _n(c) ** 2, batch=IDS),
    no("max", lambda c, w: jnp.maximum(_n(c), 1), batch=IDS),
    no("min", lambda c, w: jnp.minimum(_n(c), 5), batch=UIDS),
    no("clamp", lambda c, w: lax.clamp(1, _n(c), 5), batch=IDS),
    # a float weight made from an integer division of a count (probe1's weight)
    no("div", lambda c, w: lax.div(_n(c), 2).astype(jnp.float32), batch=IDS,
       reason=NOT_ADDITIVE),
    # narrow sums: a uint8 sum of uint8 values may wrap at any number of rows; a count of
    # flags only once the rows seen outnumber what the dtype holds
    no("reduce_sum", lambda c, w: jnp.sum(c.astype(jnp.uint8), dtype=jnp.uint8), batch=IDS,
       reason="may wrap"),
    no("reduce_sum", lambda c, w: _u8_count(c), batch=WIDE, reason="may wrap"),
    no("reduce_sum", lambda c, w: _u8_count(c).astype(jnp.float32), batch=WIDE,
       reason="may wrap"),
    no("mul", lambda c, w: _u8_count(c) * jnp.uint8(3), reason="may wrap", batch=IDS),
    no("reduce_sum", lambda c, w: jnp.sum((c > 0).astype(jnp.int8), dtype=jnp.int8),
       batch=jax.ShapeDtypeStruct((128,), jnp.int32), reason="may wrap"),
    ok("reduce_sum", lambda c, w: _u8_count(c), batch=IDS),
    ok("reduce_sum", lambda c, w: jnp.sum((c > 0).astype(jnp.int8), dtype=jnp.int8),
       batch=jax.ShapeDtypeStruct((127,), jnp.int32)),
    ok("reduce_sum", lambda c, w: _u8_count(c), batch=jax.ShapeDtypeStruct((255,), jnp.int32)),
    # what stays linear: integer ops per example, sums and scalings of counts, float ops
    ok("div", lambda c, w: jnp.sum(c // 2), batch=IDS),
    ok("rem", lambda c, w: jnp.sum(c % 3), batch=UIDS),
    ok("shift_right_arithmetic", lambda c, w: jnp.sum(c >> 1), batch=IDS),
    ok("mul", lambda c, w: _n(c) * 3 + _n(c), batch=IDS),
    ok("div", lambda c, w: _n(c).astype(jnp.float32) / 2.0, batch=IDS),
    ok("mul", lambda x, w: jnp.sum(x) * 0.5),
    ok("div", lambda x, w: jnp.sum(x) / 3.0),
    ok("convert_element_type", lambda x, w: jnp.sum(x).astype(jnp.float8_e4m3fn)),
    ok("reduce_precision", lambda x, w: lax.reduce_precision(jnp.sum(x), 4, 3)),
    ok("convert_element_type", lambda x, w: jnp.sum(x, dtype=jnp.bfloat16).astype(jnp.float16)),
]


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_integer_rule(case: Case):
  closed, analysis = analyze_case(case)
  assert case.primitive in primitives_of(closed), closed
  (kind,) = analysis.outputs
  if case.accept:
    assert isinstance(kind, Stat) and kind.mixed is None, kind
  else:
    assert isinstance(kind, Stat) and kind.mixed, kind
    assert case.reason in kind.mixed, kind.mixed
