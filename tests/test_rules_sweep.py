"""Rules the last adversarial sweep found wrong, on `jax.make_jaxpr` of tiny functions, no
mesh, with the harness of `test_rules.py`: each refused case was accepted before (and gave
a wrong result per device); each accepted one guards the fix against refusing too much."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax import lax
from test_rules import Case, _analysis, no, ok
from test_rules import test_rule as check_case

from fxaccum.analysis import Stat


def _segments(x, ids):
  return jax.ops.segment_sum(x[:, 0], ids, num_segments=3)


CASES = [
    # a scatter-add into a batch-independent zero: each example's own index, or one index
    # for every example; an index that follows the example's position is the device's
    ok("scatter-add", lambda x, w: _segments(x, (jnp.abs(x[:, 1]) * 3).astype(jnp.int32) % 3)),
    ok("scatter-add", lambda x, w: _segments(x, jnp.zeros(x.shape[0], jnp.int32))),
    no("scatter-add", lambda x, w: _segments(lax.stop_gradient(x), jnp.arange(x.shape[0]) % 3),
       reason="scatter-add across examples"),
    no("scatter-add", lambda x, w: _segments(x, jnp.argmax(x.sum(1)) + jnp.zeros(
        x.shape[0], jnp.int32)), reason="a scatter-add"),
    # top_k along its axis: along the features, or along the batch
    ok("top_k", lambda x, w: lax.top_k(x, 2, axis=1)[0]),
    no("top_k", lambda x, w: lax.top_k(x, 2, axis=0)[0], reason="top_k along the batch axis"),
    # a statistic scaled by a non-finite constant is no sum of the devices' shares
    ok("mul", lambda x, w: jnp.sum(x) * 3.0),
    no("mul", lambda x, w: jnp.sum(x) * jnp.inf, reason="to a non-finite value"),
    no("div", lambda x, w: jnp.sum(x) / 0.0, reason="to a non-finite value"),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c.primitive}-{'ok' if c.accept else 'no'}")
def test_rule(case: Case):
  check_case(case)


def _extreme(fun):
  (kind,) = _analysis(Case("", True, fun))[1].outputs
  assert isinstance(kind, Stat), kind
  return kind.extreme


def test_negation_swaps_extremes_only_where_it_cannot_wrap():
  assert _extreme(lambda x, w: -jnp.max(x)) == "min"
  assert _extreme(lambda x, w: -jnp.max(x.astype(jnp.int8))) is None  # -(-128) == -128


def test_casts_keep_an_extreme_only_to_floats_with_infinities():
  assert _extreme(lambda x, w: jnp.max(x).astype(jnp.float8_e5m2)) == "max"
  assert _extreme(lambda x, w: jnp.max(x).astype(jnp.float8_e4m3fn)) is None  # 1e3 -> NaN
