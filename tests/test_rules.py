"""Each rule of the view analysis on `jax.make_jaxpr` of a tiny function, no mesh: a case
it must accept (no output mixes examples) and one it must refuse (an output mixes them,
with a reason), for every rule the registry holds, among them the ops of per-example
losses users write (focal losses, linear solves, searchsorted, gamma draws); the kinds the
rules give (rows, statistics, extremes); and the guard on the `_DimExpr` watch. The harness
(`Case`, `check_case`) is in helpers.py."""

from __future__ import annotations

import types
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    IDS,
    JAX_VERSION,
    ROWS,
    Case,
    analyze_case,
    case_id,
    check_case,
    kinds_of,
    no,
    ok,
)
from jax import lax
from jax.sharding import PartitionSpec as P

from fxaccum.analysis import Const, Rows, Stat, Top, analyze, mixing, symbolic
from fxaccum.analysis.registry import CALL_RULES, RULES

KEYS = jax.ShapeDtypeStruct((ROWS, 2), jnp.uint32)  # per-example PRNG keys (raw)
MATS = jax.ShapeDtypeStruct((ROWS, 3, 3), jnp.float32)  # one small matrix per example
SQUARE = jax.ShapeDtypeStruct((ROWS, ROWS), jnp.float32)  # one matrix over the examples


@jax.custom_jvp
def _centered(x):  # a custom_jvp call whose primal mixes examples
  return x - x.mean(0)


_centered.defjvp(lambda primals, tangents: (_centered(*primals), tangents[0]))
_ONE_DEVICE = jax.sharding.AbstractMesh((1,), ("i",))


def _window(x, dims):
  return lax.reduce_window(x, -jnp.inf, lax.max, dims, (1, 1), "VALID")


def _conv(lhs, w):  # lhs (N, C, W), kernel (O, I, W)
  return lax.conv_general_dilated(lhs, w[:, :, None], (1,), "VALID")


def _count(c):
  return c[0] < 3


def _gamma(keys, a):
  return jax.vmap(lambda k, s: jax.random.gamma(jax.random.wrap_key_data(k), s))(keys, a)


def _nudged_sums(x):  # a symbolic number of rows spells these slices as gathers
  marks = jnp.zeros((x.shape[0], 4)).at[:, 0].set(1.0)
  return x[:, :2] + marks[:, 1:3]


def _by_position(x):
  return x[:, :2] + (jnp.arange(x.shape[0])[:, None] * jnp.ones((1, 4)))[:, 1:3]


def _segments(x, ids):
  return jax.ops.segment_sum(x[:, 0], ids, num_segments=3)


CASES = [
    # elementwise
    ok("mul", lambda x, w: x * 2.0),
    no("sub", lambda x, w: x - x.mean(0), reason="statistic of the whole batch"),
    ok("tanh", lambda x, w: jnp.tanh(x) + w[0]),
    no("add", lambda x, w: x + jnp.ones_like(x).cumsum(0), reason="position in the batch"),
    # a statistic scaled by a non-finite constant is no sum of the devices' shares
    ok("mul", lambda x, w: jnp.sum(x) * 3.0),
    no("mul", lambda x, w: jnp.sum(x) * jnp.inf, reason="to a non-finite value"),
    no("div", lambda x, w: jnp.sum(x) / 0.0, reason="to a non-finite value"),
    # a statistic masked by select_n against exact zeros (jnp.trace)
    ok("select_n", lambda x, w: jnp.trace(jnp.einsum("bi,bj->ij", x, x))),
    no("select_n", lambda x, w: jnp.trace(x @ x.T), reason="pairs different examples"),
    # random bits from keys
    ok("random_bits", lambda k, w: jax.vmap(lambda key: jax.random.uniform(key, (3,)))(k),
       batch=KEYS),
    no("random_bits", lambda x, w: jax.random.normal(jax.random.PRNGKey(
        jnp.sum(x).astype(jnp.int32)), (2,)), reason="random numbers from a batch statistic"),
    # random_gamma from per-example keys; one shared key draws by position
    ok("random_gamma", lambda k, w: _gamma(k, jnp.ones((ROWS, 3))), batch=KEYS),
    no("random_gamma", lambda x, w: jax.random.gamma(jax.random.key(0), jnp.abs(x) + 1.0),
       reason="gamma draws from one key for several examples"),
    # reductions
    ok("reduce_sum", lambda x, w: jnp.sum(x * x)),
    no("reduce_sum", lambda x, w: jnp.sum(jnp.ones((x.shape[0],)) * jnp.sum(x)),
       symbolic=True, reason="size follows the number of rows"),
    ok("reduce_max", lambda x, w: jnp.max(x, axis=1)),
    no("reduce_max", lambda x, w: jnp.max(x), reason="not a sum over examples"),
    ok("argmax", lambda x, w: jnp.argmax(x, axis=1)),
    no("argmax", lambda x, w: jnp.argmax(x, axis=0)),
    ok("cumsum", lambda x, w: jnp.cumsum(x, axis=1)),
    no("cumsum", lambda x, w: jnp.cumsum(x, axis=0), reason="cumulative op along the batch"),
    ok("reduce_window_max", lambda x, w: _window(x, (1, 2))),
    no("reduce_window_max", lambda x, w: _window(x, (2, 1)), reason="window op along the batch"),
    # shapes
    ok("broadcast_in_dim", lambda x, w: jnp.broadcast_to(x[:, None, :], (ROWS, 2, 4))),
    no("broadcast_in_dim", lambda x, w: jnp.broadcast_to(
        x[:, None, :], (x.shape[0], x.shape[0], 4)), symbolic=True,
       reason="a dimension whose size follows the number of rows"),
    ok("reshape", lambda x, w: x.reshape(ROWS, 2, 2)),
    no("reshape", lambda x, w: x.reshape(4, ROWS), reason="splits the batch axis"),
    ok("transpose", lambda x, w: x.T),
    no("transpose", lambda x, w: (x - x.mean(0)).T),
    ok("squeeze", lambda x, w: jnp.squeeze(x[:, :1], 1)),
    no("squeeze", lambda x, w: jnp.squeeze(x, 0), batch=jax.ShapeDtypeStruct((1, 4), jnp.float32),
       reason="a squeeze of the batch axis"),
    ok("concatenate", lambda x, w: jnp.concatenate([x, 2 * x], axis=1)),
    no("concatenate", lambda x, w: jnp.concatenate([x, x], axis=0), reason="concatenation"),
    # stack (optax.sigmoid_focal_loss), its transpose unstack, tile
    ok("stack", lambda x, w: jnp.stack([x, 2 * x], axis=1)),
    no("stack", lambda x, w: jnp.stack([x, jnp.ones_like(x).cumsum(0)], axis=1),
       reason="a stack of values batched in different ways"),
    ok("unstack", lambda x, w: jnp.unstack(x, axis=1)),
    no("unstack", lambda x, w: jnp.unstack(x, axis=0), reason="an unstack along the batch axis"),
    ok("tile", lambda x, w: jnp.tile(x, (1, 2))),
    no("tile", lambda x, w: jnp.tile(x, (2, 1)), reason="a tile along the batch axis"),
    ok("iota", lambda x, w: x + jnp.arange(4.0)),
    no("iota", lambda x, w: x + jnp.arange(float(ROWS))[:, None], reason="an iota"),
    ok("dim_as_value", lambda x, w: jnp.mean(x), symbolic=True),
    no("dim_as_value", lambda x, w: jnp.sum(x) / (x.shape[0] + 1), symbolic=True,
       reason="no power of the micro-batch size"),
    # indexing
    ok("rev", lambda x, w: x[:, ::-1]),
    no("rev", lambda x, w: x + x[::-1], reason="different orders"),
    ok("slice", lambda x, w: x[:, 1:3]),
    no("slice", lambda x, w: x[1:], reason="a slice along the batch axis"),
    ok("dynamic_slice", lambda x, w: lax.dynamic_slice_in_dim(x, 1, 2, axis=1)),
    no("dynamic_slice", lambda x, w: lax.dynamic_slice_in_dim(x, 1, 4, axis=0),
       reason="a dynamic slice along the batch axis"),
    no("dynamic_slice", lambda x, w: lax.dynamic_slice_in_dim(  # at a statistic's offset
        x, jnp.argmax(jnp.sum(x, 0)), 1, axis=1),
       reason="a dynamic slice at a position computed from the batch"),
    ok("pad", lambda x, w: jnp.pad(x, ((0, 0), (1, 1)))),
    no("pad", lambda x, w: jnp.pad(x, ((1, 0), (0, 0))), reason="padding along the batch"),
    no("pad", lambda x, w: jnp.pad(x, ((0, 0), (1, 1)), constant_values=jnp.sum(x)),
       reason="padding with a value that is not a constant scaled like the rows"),
    ok("split", lambda x, w: jnp.split(x, 2, axis=1)),
    no("split", lambda x, w: jnp.split(x, 2, axis=0), reason="a split along the batch"),
    ok("top_k", lambda x, w: lax.top_k(x, 2)),
    no("top_k", lambda x, w: lax.top_k(x.T, 2), reason="top_k along the batch"),
    ok("top_k", lambda x, w: lax.top_k(x, 2, axis=1)[0]),
    no("top_k", lambda x, w: lax.top_k(x, 2, axis=0)[0], reason="top_k along the batch axis"),
    ok("approx_top_k", lambda x, w: lax.approx_max_k(x, 2)),
    no("approx_top_k", lambda x, w: lax.approx_max_k(x.T, 2),
       reason="approx_top_k along the batch axis"),
    ok("dynamic_update_slice",
       lambda x, w: lax.dynamic_update_slice(x, jnp.zeros((ROWS, 1)), (0, 1))),
    no("dynamic_update_slice",
       lambda x, w: lax.dynamic_update_slice(x, jnp.zeros((1, 4)), (0, 0)),
       reason="an update of some examples"),
    ok("gather", lambda ids, w: w[ids], batch=IDS),
    no("gather", lambda x, w: x[jnp.array([0, 2])], reason="a gather that selects examples"),
    ok("gather", lambda x, w: jax.vmap(lambda row, i: row[i])(x, jnp.zeros(ROWS, int))),
    no("gather", lambda x, w: jax.vmap(lambda row, i: row[i])(x, jnp.arange(ROWS) % 4),
       reason="positions that differ from example to example"),
    ok("gather", lambda x, w: _nudged_sums(x), symbolic=True),
    no("gather", lambda x, w: _by_position(x), symbolic=True, reason="position in the batch"),
    # the batched gathers of searchsorted, and the same as a hijax primitive, which JAX 0.12
    # makes of searchsorted: its expansion's
    ok("le_to", lambda x, w: jax.vmap(jnp.searchsorted)(jnp.sort(x, axis=1), x)),
    no("le_to", lambda x, w: jnp.searchsorted(jnp.sort(x[:, 0]), x[:, 1])),
    ok("call_hi_primitive", lambda x, w: jax.vmap(jnp.searchsorted)(jnp.sort(x, axis=1), x)),
    no("call_hi_primitive", lambda x, w: jnp.searchsorted(jnp.sort(x[:, 0]), x[:, 1])),
    ok("scatter-add", lambda ids, w: jnp.zeros((4,)).at[ids % 4].add(ids * 0.5), batch=IDS),
    no("scatter", lambda x, w: x.at[jnp.array([0, 1])].set(0.0), reason="across examples"),
    # a scatter-add into a batch-independent zero: each example's own index, or one index
    # for every example; an index that follows the example's position is the device's
    ok("scatter-add", lambda x, w: _segments(x, (jnp.abs(x[:, 1]) * 3).astype(jnp.int32) % 3)),
    ok("scatter-add", lambda x, w: _segments(x, jnp.zeros(x.shape[0], jnp.int32))),
    no("scatter-add", lambda x, w: _segments(lax.stop_gradient(x), jnp.arange(x.shape[0]) % 3),
       reason="scatter-add across examples"),
    no("scatter-add", lambda x, w: _segments(x, jnp.argmax(x.sum(1)) + jnp.zeros(
        x.shape[0], jnp.int32)), reason="a scatter-add"),
    ok("sort", lambda x, w: jnp.sort(x, axis=1)),
    no("sort", lambda x, w: jnp.sort(x, axis=0), reason="a sort along the batch axis"),
    # contractions
    ok("dot_general", lambda x, w: x @ w),
    no("dot_general", lambda x, w: x @ x.T, reason="pairs different examples"),
    ok("conv_general_dilated", lambda x, w: _conv(x[:, :, None], w)),
    no("conv_general_dilated", lambda x, w: _conv(x.T[None], w),
       reason="a convolution across examples"),
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
    # placements and collectives
    ok("optimization_barrier", lambda x, w: lax.optimization_barrier(x)),
    no("optimization_barrier", lambda x, w: lax.optimization_barrier(x - x.mean(0))),
    no("psum", lambda x, w: lax.psum(x, "i"), axis_env=(("i", 2),), reason="the collective psum"),
    # control flow
    ok("jit", lambda x, w: jax.jit(lambda y: 2 * y)(x)),
    no("jit", lambda x, w: jax.jit(lambda y: y - y.mean(0))(x), reason="statistic"),
    ok("custom_jvp_call", lambda x, w: jax.nn.relu(x)),
    no("custom_jvp_call", lambda x, w: _centered(x), reason="statistic"),
    ok("shard_map", lambda x, w: jax.shard_map(lambda v: 2 * v, mesh=_ONE_DEVICE, in_specs=P(),
                                               out_specs=P())(w)),
    no("shard_map", lambda x, w: jax.shard_map(lambda v: 2 * v, mesh=_ONE_DEVICE, in_specs=P(),
                                               out_specs=P())(x), reason="shard_map"),
    ok("scan", lambda x, w: lax.scan(lambda h, layer: (h @ layer, None), x,
                                     jnp.stack([w, w]))[0]),
    ok("scan", lambda x, w: lax.map(lambda row: 2 * row, x)),
    no("scan", lambda x, w: lax.scan(lambda c, row: (c + row, c * row), jnp.zeros(4), x)[1],
       reason="running total"),
    ok("while", lambda x, w: lax.while_loop(_count, lambda c: (c[0] + 1, c[1] * 2), (0, x))[1]),
    no("while", lambda x, w: lax.while_loop(lambda c: jnp.sum(c) < 100.0, lambda c: c * 2, x),
       reason="trip count depends on the batch"),
    ok("cond", lambda x, w: lax.cond(w[0, 0] > 0, lambda v: 2 * v, lambda v: 3 * v, x)),
    no("cond", lambda x, w: lax.cond(jnp.sum(x) > 0, lambda v: 2 * v, lambda v: 3 * v, x),
       reason="a conditional on batch values"),
]

# Rules with no case to accept: a collective always reads other devices' values.
REFUSE_ONLY = {"psum"}


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_rule(case: Case):
  if case.primitive == "call_hi_primitive" and JAX_VERSION < (0, 12):
    pytest.skip("JAX < 0.12 writes jnp.searchsorted in ordinary primitives (the le_to cases)")
  check_case(case)


def test_every_rule_has_a_case_to_accept_and_one_to_refuse():
  """Every rule the registry holds (a rule serves one primitive or a family of them)."""
  def rule_of(name):
    return RULES.get(name) or CALL_RULES[name]

  assert not set(RULES) & set(CALL_RULES)
  rules = {id(r): name for name, r in {**RULES, **CALL_RULES}.items()}
  accepted = {id(rule_of(c.primitive)) for c in CASES if c.accept}
  refused = {id(rule_of(c.primitive)) for c in CASES if not c.accept}
  refuse_only = {id(rule_of(name)) for name in REFUSE_ONLY}
  assert set(rules) - accepted - refuse_only == set(), sorted(
      rules[r] for r in set(rules) - accepted - refuse_only)
  assert set(rules) - refused == set(), sorted(rules[r] for r in set(rules) - refused)


def test_kinds_of_accepted_cases():
  """What the rules give, beyond not mixing: rows stay rows, sums are statistics, maxima
  over the examples are extremes, means scale as D ** -1 (symbolic rows)."""
  assert kinds_of(lambda x, w: x @ w) == (Rows(0),)
  assert kinds_of(lambda x, w: (x @ w).T) == (Rows(1),)
  assert kinds_of(lambda x, w: jnp.sum(x)) == (Stat(),)
  (extreme,) = kinds_of(lambda x, w: jnp.max(jnp.max(x, axis=1)))
  assert isinstance(extreme, Stat) and extreme.extreme == "max" and extreme.exp == 0
  assert kinds_of(lambda x, w: jnp.mean(x), symbolic=True) == (Stat(exp=-1.0),)
  (const,) = kinds_of(lambda x, w: w * 2)
  assert isinstance(const, Const) and const.exp == 0
  (top,) = kinds_of(lambda x, w: x.reshape(4, ROWS))
  assert isinstance(top, Top)


def _extreme(fun, symbolic=False):
  (kind,) = kinds_of(fun, symbolic=symbolic)
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


def test_negation_swaps_extremes_only_where_it_cannot_wrap():
  assert _extreme(lambda x, w: -jnp.max(x)) == "min"
  assert _extreme(lambda x, w: -jnp.max(x.astype(jnp.int8))) is None  # -(-128) == -128


def test_casts_keep_an_extreme_only_to_floats_with_infinities():
  assert _extreme(lambda x, w: jnp.max(x).astype(jnp.float8_e5m2)) == "max"
  assert _extreme(lambda x, w: jnp.max(x).astype(jnp.float8_e4m3fn)) is None  # 1e3 -> NaN


def test_findings_reducible_params_and_blockers():
  """Rules report findings, the interpreter merges them: a param used only as a matmul
  operand against rows is reducible; one a scan carries, or added to rows, is not; a
  shard_map is a blocker."""
  x = jnp.ones((ROWS, 4))
  w = jnp.ones((4, 4))

  def run(fun):
    closed = jax.make_jaxpr(fun)(x, w, w)
    return analyze(closed, rows=ROWS, batch_inputs=[0], param_inputs=[1, 2])

  assert run(lambda x, a, b: x @ a.T.astype(jnp.float32) + b[0]).reducible == {0}
  assert run(lambda x, a, b: x @ lax.scan(lambda h, _: (h * 2, None), a, None, length=2)[0]
             + lax.scan(lambda h, _: (h @ b, None), x, None, length=2)[0]).reducible == {1}
  found = run(lambda x, a, b: jax.shard_map(lambda v: v, mesh=_ONE_DEVICE, in_specs=P(),
                                            out_specs=P())(x @ a))
  assert len(found.blockers) == 1 and "shard_map" in found.blockers[0]


def test_a_rule_that_raises_fails_tests_and_warns_users(monkeypatch):
  """A rule bug raises under the test suite (``FXACCUM_RULE_ERRORS=raise``, set by
  conftest), so the test that meets it fails; for users the equation counts as mixing
  examples (the global view, exact) with one warning per primitive asking for a report."""
  from fxaccum.analysis import interpreter

  def broken(ctx, kinds):
    raise IndexError("a rule bug")

  monkeypatch.setitem(RULES, "sin", broken)
  case = Case("sin", True, lambda x, w: jnp.sin(x @ w))
  with pytest.raises(interpreter.RuleError, match="rule for sin raised") as raised:
    analyze_case(case)
  assert isinstance(raised.value.__cause__, IndexError)
  monkeypatch.delenv(interpreter.RULE_ERRORS)
  monkeypatch.setattr(interpreter, "_WARNED", set())
  with pytest.warns(RuntimeWarning, match="failed on sin .*IndexError.*report") as caught:
    _, analysis = analyze_case(case)
    analyze_case(case)  # once per primitive
  assert len([w for w in caught if "failed on sin" in str(w.message)]) == 1
  assert "please report" in mixing(analysis.outputs[0])


def test_a_changed_dim_expr_is_refused_loudly(monkeypatch):
  """Where a JAX release changes the private class the watch patches, the watch patches
  nothing, warns once, and every block records why (the analysis then trusts no symbolic
  trace)."""
  class Changed:  # `_DimExpr` without `__int__`, `__eq__` taking another operand count
    def __eq__(self, other, third):
      return False

    __hash__ = None  # type: ignore[assignment]

  monkeypatch.setattr(symbolic, "_shape_module", lambda: types.SimpleNamespace(
      _DimExpr=Changed))
  monkeypatch.setattr(symbolic, "_WARNED", set())
  with pytest.warns(RuntimeWarning, match="cannot watch"):
    with symbolic.undecided_uses() as found:
      pass
  assert len(found) == 1 and "could not be watched" in found[0], found
  assert "__eq__" in found[0] and jax.__version__ in found[0], found
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # warned once only
    with symbolic.undecided_uses() as again:
      pass
  assert again == found
  assert vars(Changed)["__eq__"].__name__ == "__eq__"  # not patched

  monkeypatch.setattr(symbolic, "_shape_module", lambda: types.SimpleNamespace())
  with pytest.warns(RuntimeWarning):
    with symbolic.undecided_uses() as gone:
      pass
  assert "_DimExpr" in gone[0], gone


def test_the_watch_accepts_this_jax():
  cls, problem = symbolic._guarded_class()
  assert problem is None and cls.__name__ == "_DimExpr"
  assert np.all([name in vars(cls) or name in symbolic._DEFAULTS for name in symbolic._CHECKS])


def test_no_rule_module_imports_the_interpreter():
  """Rules are pure functions of their operands' kinds (module and function sizes:
  tests/test_house.py)."""
  import pathlib

  import fxaccum.analysis
  root = pathlib.Path(fxaccum.analysis.__file__).parent / "rules"
  for path in root.rglob("*.py"):
    assert "analysis.interpreter" not in path.read_text(), path
