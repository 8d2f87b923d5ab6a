"""The rules (and finer rules) for per-example losses that once took the global view
(issue 34, item 2), on `jax.make_jaxpr` of tiny functions, no mesh, with the harness of
`test_rules.py`: for each, a case it must accept and a mixing variant it must refuse.
`test_rules.py`'s coverage test counts these cases too."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from helpers import JAX_VERSION
from jax import lax
from test_rules import ROWS, Case, _analysis, no, ok
from test_rules import test_rule as check_case

from fxaccum.analysis import Stat

MATS = jax.ShapeDtypeStruct((ROWS, 3, 3), jnp.float32)  # one small matrix per example
SQUARE = jax.ShapeDtypeStruct((ROWS, ROWS), jnp.float32)  # one matrix over the examples
KEYS = jax.ShapeDtypeStruct((ROWS, 2), jnp.uint32)  # per-example PRNG keys (raw)


def _gamma(keys, a):
  return jax.vmap(lambda k, s: jax.random.gamma(jax.random.wrap_key_data(k), s))(keys, a)


def _nudged_sums(x):  # a symbolic number of rows spells these slices as gathers
  marks = jnp.zeros((x.shape[0], 4)).at[:, 0].set(1.0)
  return x[:, :2] + marks[:, 1:3]


def _by_position(x):
  return x[:, :2] + (jnp.arange(x.shape[0])[:, None] * jnp.ones((1, 4)))[:, 1:3]


CASES = [
    # shapes: stack (optax.sigmoid_focal_loss), its transpose unstack, tile
    ok("stack", lambda x, w: jnp.stack([x, 2 * x], axis=1)),
    no("stack", lambda x, w: jnp.stack([x, jnp.ones_like(x).cumsum(0)], axis=1),
       reason="a stack of values batched in different ways"),
    ok("unstack", lambda x, w: jnp.unstack(x, axis=1)),
    no("unstack", lambda x, w: jnp.unstack(x, axis=0), reason="an unstack along the batch axis"),
    ok("tile", lambda x, w: jnp.tile(x, (1, 2))),
    no("tile", lambda x, w: jnp.tile(x, (2, 1)), reason="a tile along the batch axis"),
    # linalg: fft, lu, triangular_solve, and jnp.linalg.solve's custom_linear_solve
    ok("fft", lambda x, w: jnp.fft.fft(x, axis=1)),
    no("fft", lambda x, w: jnp.fft.fft(x, axis=0), reason="an fft along the batch axis"),
    ok("lu", lambda m, w: lax.linalg.lu(m), batch=MATS),
    no("lu", lambda a, w: lax.linalg.lu(a), batch=SQUARE, reason="matrices that span examples"),
    ok("triangular_solve", lambda m, w: lax.linalg.triangular_solve(m, m, left_side=True),
       batch=MATS),
    no("triangular_solve", lambda a, w: lax.linalg.triangular_solve(
        a, jnp.ones((ROWS, 1)), left_side=True, lower=True), batch=SQUARE,
       reason="a triangular solve across examples"),
    ok("custom_linear_solve", lambda m, w: jnp.linalg.solve(m, m[..., :1]), batch=MATS),
    no("custom_linear_solve", lambda a, w: jnp.linalg.solve(a, jnp.ones((ROWS, 1))),
       batch=SQUARE, reason="matrices that span examples"),
    # indexing: approx_top_k (lax.approx_max_k), the batched gathers of searchsorted
    ok("approx_top_k", lambda x, w: lax.approx_max_k(x, 2)),
    no("approx_top_k", lambda x, w: lax.approx_max_k(x.T, 2),
       reason="approx_top_k along the batch axis"),
    ok("le_to", lambda x, w: jax.vmap(jnp.searchsorted)(jnp.sort(x, axis=1), x)),
    no("le_to", lambda x, w: jnp.searchsorted(jnp.sort(x[:, 0]), x[:, 1])),
    # the same as a hijax primitive, which JAX 0.12 makes of searchsorted: its expansion's
    ok("call_hi_primitive", lambda x, w: jax.vmap(jnp.searchsorted)(jnp.sort(x, axis=1), x)),
    no("call_hi_primitive", lambda x, w: jnp.searchsorted(jnp.sort(x[:, 0]), x[:, 1])),
    ok("gather", lambda x, w: jax.vmap(lambda row, i: row[i])(x, jnp.zeros(ROWS, int))),
    no("gather", lambda x, w: jax.vmap(lambda row, i: row[i])(x, jnp.arange(ROWS) % 4),
       reason="positions that differ from example to example"),
    ok("gather", lambda x, w: _nudged_sums(x), symbolic=True),
    no("gather", lambda x, w: _by_position(x), symbolic=True, reason="position in the batch"),
    # random_gamma from per-example keys; one shared key draws by position
    ok("random_gamma", lambda k, w: _gamma(k, jnp.ones((ROWS, 3))), batch=KEYS),
    no("random_gamma", lambda x, w: jax.random.gamma(jax.random.key(0), jnp.abs(x) + 1.0),
       reason="gamma draws from one key for several examples"),
    # a statistic masked by select_n against exact zeros (jnp.trace)
    ok("select_n", lambda x, w: jnp.trace(jnp.einsum("bi,bj->ij", x, x))),
    no("select_n", lambda x, w: jnp.trace(x @ x.T), reason="pairs different examples"),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c.primitive}-{'ok' if c.accept else 'no'}")
def test_rule(case: Case):
  if case.primitive == "call_hi_primitive" and JAX_VERSION < (0, 12):
    pytest.skip("JAX < 0.12 writes jnp.searchsorted in ordinary primitives (the le_to cases)")
  check_case(case)


def _extreme(fun, symbolic=False):
  (kind,) = _analysis(Case("", True, fun, symbolic=symbolic))[1].outputs
  assert isinstance(kind, Stat), kind
  return kind.extreme


def test_an_extremum_scaled_by_a_known_constant():
  """fp8's ``amax / 448``: a maximum over the examples divided (or multiplied) by a
  positive constant is one still, by a negative one a minimum; by anything that depends
  on the batch or on the number of rows, or in integers, it is no extremum."""
  assert _extreme(lambda x, w: jnp.max(jnp.abs(x)) / 448.0) == "max"
  assert _extreme(lambda x, w: 0.5 * jnp.min(x)) == "min"
  assert _extreme(lambda x, w: jnp.max(x) / -448.0) == "min"
  assert _extreme(lambda x, w: jnp.max(x) / x.shape[0], symbolic=True) is None
  assert _extreme(lambda x, w: jnp.max(x) / w[0, 0]) is None  # a param: value unknown
  assert _extreme(lambda x, w: jnp.max(x) / jnp.sum(x)) is None
  assert _extreme(lambda x, w: jnp.max(x) * 0.0) is None
  assert _extreme(lambda x, w: jnp.max(x.astype(jnp.int32)) * 2) is None
