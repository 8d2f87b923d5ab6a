"""Losses the last adversarial sweep found wrong, end to end on 8 devices against
`jax.value_and_grad` over the global micro-batches (rows i::k): each took the device view
and came back wrong (or NaN) before its fix."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_tree_close, mesh_of
from jax import lax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import fxaccum

ROWS, K = 64, 4


def _data(seed=0):
  rng = np.random.default_rng(seed)
  ids = rng.integers(-30, 30, size=ROWS).astype(np.int8)
  ids[5] = -128  # the int8 whose negation wraps
  x = rng.normal(size=(ROWS, 4)).astype(np.float32)
  x[:, 3] = np.where(np.arange(ROWS) < ROWS // 8, 10.0, -1.0)  # first device's rows: +10
  return {"x": x, "ids": ids}


def _run(loss, axis_type=AxisType.Auto):
  params, batch = jnp.ones((4, 4)), _data()
  mesh = mesh_of((8,), ("data",), axis_type)
  step = jax.jit(fxaccum.value_and_grad(loss, has_aux=True, micro_batches=K))
  with jax.set_mesh(mesh):
    got = step(jax.device_put(params, NamedSharding(mesh, P())),
               jax.device_put(batch, NamedSharding(mesh, P("data"))))
  micro = [jax.tree.map(lambda a, i=i: a[i::K], batch) for i in range(K)]
  reference = jax.jit(jax.value_and_grad(loss, has_aux=True))  # one compile for the k shares
  return got, [reference(params, b) for b in micro]


def _mean(results):
  return jax.tree.map(lambda *xs: sum(xs) / K, *[(v, g) for (v, _), g in results])


def position_segments(w, b):  # rows summed by their position (iota % 3)
  x = b["x"]
  s = jax.ops.segment_sum(lax.stop_gradient(x[:, 0]), jnp.arange(x.shape[0]) % 3, 3)
  return jnp.mean((x @ w) ** 2) + jnp.sum(s * jnp.arange(1.0, 4.0)) / x.shape[0], ()


def top_k_over_the_batch(w, b):
  x = b["x"]
  return jnp.mean((x @ w) ** 2) + jnp.sum(lax.top_k(x, 2, axis=0)[0]) / x.shape[0], ()


@pytest.mark.parametrize("loss", [position_segments, top_k_over_the_batch])
def test_selections_by_position_or_over_the_batch_are_exact(loss):
  got, results = _run(loss)
  assert_tree_close(got, _mean(results))


@pytest.mark.parametrize("dtype", [jnp.float8_e4m3fn, jnp.float8_e4m3fnuz])
def test_an_extremum_in_a_float8_without_infinities_is_no_nan(dtype):
  """Such dtypes turn -inf (a maximum's identity) into NaN."""
  def loss(w, b):
    h = b["x"] @ w
    return jnp.mean(h ** 2), (fxaccum.Max(jnp.max(h).astype(dtype)),
                              fxaccum.Min(jnp.min(h).astype(dtype)))

  ((_, (top, bottom)), _), results = _run(loss)
  assert float(top) == max(float(a[0].value) for (_, a), _ in results)
  assert float(bottom) == min(float(a[1].value) for (_, a), _ in results)


def test_negated_int8_extremes_and_infinite_sums_are_exact():
  """-(-128) wraps to -128, so a negated int8 maximum is no minimum; and devices' shares
  of a sum times inf of opposite signs (the first device's +10s, the others' -1s) would
  add up to NaN where every micro-batch's sum is positive."""
  def loss(w, b):
    h = b["x"] @ w
    return jnp.mean(h ** 2), (fxaccum.Min(-jnp.max(b["ids"])),
                              fxaccum.Sum(jnp.sum(b["x"][:, 3]) * jnp.inf))

  ((_, (low, total)), _), results = _run(loss)
  assert int(low) == min(int(a[0].value) for (_, a), _ in results)
  assert float(total) == float(sum(a[1].value for (_, a), _ in results)) == np.inf
