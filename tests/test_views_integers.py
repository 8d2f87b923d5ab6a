"""Integer arithmetic on a batch statistic (issue 34, item 1), end to end on 8 devices:
a weight, a loss or an aux leaf made by integer division, remainder or shift of a count,
or by a narrow integer sum that wraps over the global micro-batch where no device's does,
takes the global view and matches `jax.value_and_grad` over the global micro-batches
(rows ``i::k``); a narrow count that cannot wrap at the rows seen keeps the device view."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import AXIS_TYPES, assert_tree_close, mesh_of
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import fxaccum
from fxaccum import diagnostics

# Each mesh axis type with one k > 1 (k = 2 and k = 4 run the same accumulation path; the
# axis types differ): every loss runs on both axis types and at both k.
MESH_KS = [(AXIS_TYPES[0], 2), (AXIS_TYPES[1], 4)]
MESH_K_IDS = [f"{t.name}-{k}" for t, k in MESH_KS]


def _data(rows, ones=False):
  rng = np.random.default_rng(0)
  x = rng.normal(size=(rows, 4)).astype(np.float32)
  m = np.ones(rows, np.int32) if ones else (rng.random(rows) < 0.6).astype(np.int32)
  return x, m


def _u8_count(m):
  return jnp.sum((m > 0).astype(jnp.uint8), dtype=jnp.uint8)


def _total(w, x, m):
  return jnp.sum(jnp.tanh(x @ w) * m)


def weight_by_div(w, b):  # the probe's: a weight of half the token count, signed
  x, m = b
  return fxaccum.Weighted(_total(w, x, m), lax.div(jnp.sum(m), 2).astype(jnp.float32)), {}


def sum_aux_by_floordiv(w, b):  # "an aux Sum came back 0 where the contract gives 8"
  x, m = b
  return fxaccum.Weighted(_total(w, x, m), jnp.sum(m)), {
      "half": fxaccum.Sum(jnp.sum(m.astype(jnp.uint32)) // 2),  # unsigned //
      "third": fxaccum.Weighted(lax.div(jnp.sum(m), 3), jnp.sum(m))}  # signed


def loss_by_div(w, b):  # a scalar mean plus an integer term of the count
  x, m = b
  n = x.shape[0]
  return jnp.mean(jnp.tanh(x @ w)) + lax.div(jnp.sum(m), 3).astype(jnp.float32) / n, {}


def wrapping_count(w, b):  # a uint8 count over more rows than it holds
  x, m = b
  return fxaccum.Weighted(_total(w, x, m), jnp.sum(m)), {"n": fxaccum.Sum(_u8_count(m))}


def per_example_integer_ops(w, b):  # integer ops within each example: no statistic
  x, m = b
  ids = (jnp.abs(x[:, 0]) * 10).astype(jnp.int32)
  return fxaccum.Weighted(_total(w, x, m), jnp.sum(m)), {
      "sum": fxaccum.Sum(jnp.sum(ids // 3 + (ids % 4) + (ids >> 1))),
      "max": fxaccum.Max(jnp.max(lax.div(ids, 2))), "min": fxaccum.Min(jnp.min(ids & 6)),
      "rows": fxaccum.Concat(ids // 2)}


def _reference(loss, w, batch, k):
  """The contract over the global micro-batches: Weighted totals over weights (a scalar
  loss: the mean), Sum aux added, Weighted aux totals over weights."""
  # One jit for the k micro-batches (one shape); op-by-op dispatch compiles every op.
  step = jax.jit(jax.grad(lambda w, b: (_loss_total(loss(w, b)[0]), loss(w, b)), has_aux=True))
  grads, outs = zip(*[step(w, jax.tree.map(lambda a, i=i: a[i::k], batch)) for i in range(k)],
                    strict=True)
  first = outs[0][0]
  if isinstance(first, fxaccum.Weighted):
    weight = sum(float(o[0].weight) for o in outs)
    value = sum(float(o[0].total) for o in outs) / weight
    grad = sum(grads) / weight
  else:
    value, grad = sum(float(o[0]) for o in outs) / k, sum(grads) / k
  aux = {}
  for name, leaf in outs[0][1].items():
    if isinstance(leaf, fxaccum.Sum):
      aux[name] = sum(np.int64(o[1][name].value) for o in outs)
    elif isinstance(leaf, (fxaccum.Max, fxaccum.Min)):
      pick = max if isinstance(leaf, fxaccum.Max) else min
      aux[name] = pick(int(o[1][name].value) for o in outs)
    elif isinstance(leaf, fxaccum.Concat):  # the rows put back in the batch's order
      rows = np.zeros(len(batch[0]), np.int64)
      for i, o in enumerate(outs):
        rows[i::k] = o[1][name].value
      aux[name] = rows
    else:
      aux[name] = sum(float(o[1][name].total) for o in outs) / sum(
          float(o[1][name].weight) for o in outs)
  return (value, aux), grad


def _loss_total(out):
  return out.total if isinstance(out, fxaccum.Weighted) else out


def _run(loss, rows, k, axis_type, ones=False):
  x, m = _data(rows, ones)
  w = np.full(4, 0.3, np.float32)
  mesh = mesh_of((8,), ("data",), axis_type)
  fn = jax.jit(fxaccum.value_and_grad(loss, micro_batches=k, has_aux=True))
  with jax.set_mesh(mesh):
    batch = tuple(jax.device_put(a, NamedSharding(mesh, P("data"))) for a in (x, m))
    view = diagnostics.paths(fn, w, batch)[0].view
    got = fn(w, batch)
  return view, got, _reference(loss, w, (x, m), k)


@pytest.mark.parametrize(("axis_type", "k"), MESH_KS, ids=MESH_K_IDS)
@pytest.mark.parametrize("loss", [weight_by_div, sum_aux_by_floordiv, loss_by_div],
                         ids=lambda f: f.__name__)
def test_integer_division_of_a_count_takes_the_global_view(loss, axis_type, k):
  one_row = loss is sum_aux_by_floordiv  # one row per device and micro-batch, all flags 1
  view, got, expected = _run(loss, 8 * k if one_row else 64, k, axis_type, ones=one_row)
  if one_row:  # per device 1 // 2 == 0; the contract: k times 8 // 2
    assert int(got[0][1]["half"]) == int(expected[0][1]["half"]) == 4 * k
  assert_tree_close(got, expected)
  assert view == "global"


@pytest.mark.parametrize(("axis_type", "k"), MESH_KS, ids=MESH_K_IDS)
def test_a_narrow_count_that_wraps_takes_the_global_view(axis_type, k):
  """1024 flags in uint8: each global micro-batch's count wraps (512, 256 -> 0), no
  device's does (64, 32)."""
  view, got, expected = _run(wrapping_count, 1024, k, axis_type, ones=True)
  assert int(got[0][1]["n"]) == int(expected[0][1]["n"]) == 0
  assert_tree_close(got, expected)
  assert view == "global"


def test_a_narrow_count_that_cannot_wrap_keeps_the_device_view():
  """64 flags in uint8 cannot wrap at the 32 rows of a global micro-batch."""
  view, got, expected = _run(wrapping_count, 64, 2, AXIS_TYPES[1])
  assert view == "device"
  assert_tree_close(got, expected)


def test_integer_ops_within_each_example_keep_the_device_view():
  """`ids // 3`, `ids % 4`, shifts, `lax.div`, `&` per example, then summed, maximized or
  concatenated: per-example terms, the device view, exact."""
  view, got, expected = _run(per_example_integer_ops, 64, 2, AXIS_TYPES[1])
  assert view == "device"
  assert_tree_close(got, expected)
