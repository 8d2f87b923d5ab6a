"""Each rule of the view analysis on `jax.make_jaxpr` of a tiny function, no mesh: a case
it must accept (no output mixes examples) and one it must refuse (an output mixes them,
with a reason), for every rule the registry holds; and the guard on the `_DimExpr` watch."""

from __future__ import annotations

import dataclasses
import types
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

from fxaccum.analysis import Const, Rows, Stat, Top, analyze, mixing, symbolic
from fxaccum.analysis.registry import CALL_RULES, RULES
from fxaccum.jaxprs import eqns_within

ROWS = 8
X = jax.ShapeDtypeStruct((ROWS, 4), jnp.float32)  # the batch: ROWS examples of 4 features
W = jax.ShapeDtypeStruct((4, 4), jnp.float32)  # a param
IDS = jax.ShapeDtypeStruct((ROWS,), jnp.int32)  # per-example indices
KEYS = jax.ShapeDtypeStruct((ROWS, 2), jnp.uint32)  # per-example PRNG keys (raw)


@dataclasses.dataclass(frozen=True)
class Case:
  """``fun(batch, param)`` must be accepted (or refused); its jaxpr holds ``primitive``."""

  primitive: str
  accept: bool
  fun: Callable[..., Any]
  batch: Any = X
  param: Any = W
  symbolic: bool = False  # traced with a symbolic number of rows
  reason: str = ""  # refused: a part of the reason
  axis_env: tuple[tuple[str, int], ...] = ()


def ok(name, fun, **kw):
  return Case(name, True, fun, **kw)


def no(name, fun, **kw):
  return Case(name, False, fun, **kw)


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


CASES = [
    # elementwise
    ok("mul", lambda x, w: x * 2.0),
    no("sub", lambda x, w: x - x.mean(0), reason="statistic of the whole batch"),
    ok("tanh", lambda x, w: jnp.tanh(x) + w[0]),
    no("add", lambda x, w: x + jnp.ones_like(x).cumsum(0), reason="position in the batch"),
    # random bits from keys
    ok("random_bits", lambda k, w: jax.vmap(lambda key: jax.random.uniform(key, (3,)))(k),
       batch=KEYS),
    no("random_bits", lambda x, w: jax.random.normal(jax.random.PRNGKey(
        jnp.sum(x).astype(jnp.int32)), (2,)), reason="random numbers from a batch statistic"),
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
    ok("dynamic_update_slice",
       lambda x, w: lax.dynamic_update_slice(x, jnp.zeros((ROWS, 1)), (0, 1))),
    no("dynamic_update_slice",
       lambda x, w: lax.dynamic_update_slice(x, jnp.zeros((1, 4)), (0, 0)),
       reason="an update of some examples"),
    ok("gather", lambda ids, w: w[ids], batch=IDS),
    no("gather", lambda x, w: x[jnp.array([0, 2])], reason="a gather that selects examples"),
    ok("scatter-add", lambda ids, w: jnp.zeros((4,)).at[ids % 4].add(ids * 0.5), batch=IDS),
    no("scatter", lambda x, w: x.at[jnp.array([0, 1])].set(0.0), reason="across examples"),
    ok("sort", lambda x, w: jnp.sort(x, axis=1)),
    no("sort", lambda x, w: jnp.sort(x, axis=0), reason="a sort along the batch axis"),
    # contractions
    ok("dot_general", lambda x, w: x @ w),
    no("dot_general", lambda x, w: x @ x.T, reason="pairs different examples"),
    ok("conv_general_dilated", lambda x, w: _conv(x[:, :, None], w)),
    no("conv_general_dilated", lambda x, w: _conv(x.T[None], w),
       reason="a convolution across examples"),
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


def _analysis(case: Case):
  batch = case.batch
  rows: Any = ROWS if batch.shape[0] == ROWS else batch.shape[0]
  if case.symbolic:
    (rows,) = jax.export.symbolic_shape("rows")
    batch = jax.ShapeDtypeStruct((rows, *batch.shape[1:]), batch.dtype)
  closed = jax.make_jaxpr(case.fun, axis_env=list(case.axis_env))(batch, case.param)
  return closed, analyze(closed, rows=rows, batch_inputs=[0], param_inputs=[1])


def _primitives(closed) -> set[str]:
  return {e.primitive.name for eqn in closed.jaxpr.eqns for e in eqns_within(eqn)}


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c.primitive}-{'ok' if c.accept else 'no'}")
def test_rule(case: Case):
  closed, analysis = _analysis(case)
  assert case.primitive in _primitives(closed), closed
  reasons = [mixing(k) for k in analysis.outputs]
  if case.accept:
    assert reasons == [None] * len(reasons), analysis.outputs
  else:
    assert any(reasons), analysis.outputs
    assert any(case.reason in r for r in reasons if r), reasons


def test_every_rule_has_a_case_to_accept_and_one_to_refuse():
  """Every rule the registry holds (a rule serves one primitive or a family of them)."""
  def rule_of(name):
    return RULES.get(name) or CALL_RULES[name]

  from test_rules_examples import CASES as EXAMPLES  # issue 34's per-example losses

  assert not set(RULES) & set(CALL_RULES)
  rules = {id(r): name for name, r in {**RULES, **CALL_RULES}.items()}
  accepted = {id(rule_of(c.primitive)) for c in CASES + EXAMPLES if c.accept}
  refused = {id(rule_of(c.primitive)) for c in CASES + EXAMPLES if not c.accept}
  refuse_only = {id(rule_of(name)) for name in REFUSE_ONLY}
  assert set(rules) - accepted - refuse_only == set(), sorted(
      rules[r] for r in set(rules) - accepted - refuse_only)
  assert set(rules) - refused == set(), sorted(rules[r] for r in set(rules) - refused)


def test_kinds_of_accepted_cases():
  """What the rules give, beyond not mixing: rows stay rows, sums are statistics, maxima
  over the examples are extremes, means scale as D ** -1 (symbolic rows)."""
  def outputs(fun, **kw):
    return _analysis(Case("", True, fun, **kw))[1].outputs

  assert outputs(lambda x, w: x @ w) == (Rows(0),)
  assert outputs(lambda x, w: (x @ w).T) == (Rows(1),)
  assert outputs(lambda x, w: jnp.sum(x)) == (Stat(),)
  (extreme,) = outputs(lambda x, w: jnp.max(jnp.max(x, axis=1)))
  assert isinstance(extreme, Stat) and extreme.extreme == "max" and extreme.exp == 0
  assert outputs(lambda x, w: jnp.mean(x), symbolic=True) == (Stat(exp=-1.0),)
  (const,) = outputs(lambda x, w: w * 2)
  assert isinstance(const, Const) and const.exp == 0
  (top,) = outputs(lambda x, w: x.reshape(4, ROWS))
  assert isinstance(top, Top)


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
    _analysis(case)
  assert isinstance(raised.value.__cause__, IndexError)
  monkeypatch.delenv(interpreter.RULE_ERRORS)
  monkeypatch.setattr(interpreter, "_WARNED", set())
  with pytest.warns(RuntimeWarning, match="failed on sin .*IndexError.*report") as caught:
    _, analysis = _analysis(case)
    _analysis(case)  # once per primitive
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
