"""Per-example losses users write with ops the view analysis once had no rule for (or too
coarse a rule): each must take the device view on an 8-device mesh and equal
``jax.value_and_grad`` over the global micro-batches (rows ``i::k``), value, gradients and,
for ``fxaccum.Max``, the aux (issue 34, item 2)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_tree_close, mesh_of
from jax import lax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import fxaccum
from fxaccum import diagnostics

ROWS, DIM, WIDTH, K = 32, 6, 4, 2
T, CLASSES, LABELS = 4, 3, 2  # ctc: frames, classes (blank 0), label length


def _data(seed, **shapes):
  rng = np.random.default_rng(seed)
  return {name: rng.normal(size=shape).astype(np.float32) for name, shape in shapes.items()}


def _params(seed, width=WIDTH):
  return {"w": (np.random.default_rng(seed).normal(size=(DIM, width)) / 2).astype(np.float32)}


def focal():
  batch = _data(0, x=(ROWS, DIM))
  batch["y"] = (np.arange(ROWS * WIDTH).reshape(ROWS, WIDTH) % 3 == 0).astype(np.float32)

  def loss(p, b):
    return optax.sigmoid_focal_loss(b["x"] @ p["w"], b["y"]).mean()
  return loss, _params(1), batch


def tile():
  weights = jnp.arange(1.0, 2 * WIDTH + 1)

  def loss(p, b):
    h = jnp.tile(b["x"] @ p["w"], (1, 2))  # each example's row twice, side by side
    return jnp.mean(h ** 2 * weights)
  return loss, _params(2), _data(2, x=(ROWS, DIM))


def fft():
  def loss(p, b):
    return jnp.mean(jnp.abs(jnp.fft.fft(b["x"] @ p["w"], axis=1)) ** 2)
  return loss, _params(3), _data(3, x=(ROWS, DIM))


def solve():
  batch = _data(4, x=(ROWS, DIM), a=(ROWS, WIDTH, WIDTH))
  batch["a"] = batch["a"] + 4 * np.eye(WIDTH, dtype=np.float32)  # well conditioned

  def loss(p, b):  # one small system per example
    return jnp.mean(jnp.linalg.solve(b["a"], (b["x"] @ p["w"])[..., None]) ** 2)
  return loss, _params(5), batch


def approx_max_k():
  def loss(p, b):
    return jnp.mean(lax.approx_max_k(b["x"] @ p["w"], 2)[0] ** 2)
  return loss, _params(6), _data(6, x=(ROWS, DIM))


def searchsorted():
  batch = _data(7, x=(ROWS, DIM), edges=(ROWS, 5))
  batch["edges"] = np.sort(batch["edges"], axis=1)  # each example's own sorted edges

  def loss(p, b):
    h = b["x"] @ p["w"]
    bins = jax.vmap(jnp.searchsorted)(b["edges"], h)
    return jnp.mean(h ** 2 * bins)
  return loss, _params(8), batch


def gamma():
  keys = jax.random.key_data(jax.random.split(jax.random.key(9), ROWS))

  def loss(p, b):  # per-example weights drawn from per-example keys (batch data)
    draws = jax.vmap(lambda key, a: jax.random.gamma(jax.random.wrap_key_data(key), a))(
        b["keys"], jnp.abs(b["a"]) + 1.0)
    return jnp.mean(draws * (b["x"] @ p["w"]) ** 2)
  batch = _data(9, x=(ROWS, DIM), a=(ROWS, WIDTH))
  return loss, _params(10), {**batch, "keys": np.asarray(keys)}


def ctc():
  rng = np.random.default_rng(11)
  batch = {"x": rng.normal(size=(ROWS, T, DIM)).astype(np.float32),
           "labels": rng.integers(1, CLASSES, size=(ROWS, LABELS)).astype(np.int32),
           "frames": (np.arange(T) >= rng.integers(2, T + 1, size=(ROWS, 1))).astype(np.float32)}

  def loss(p, b):
    logits = b["x"] @ p["w"]
    return optax.ctc_loss(logits, b["frames"], b["labels"], jnp.zeros(b["labels"].shape)).mean()
  return loss, _params(12, CLASSES), batch


def trace():
  def loss(p, b):  # the trace of the summed outer products: a sum of squared norms
    h = b["x"] @ p["w"]
    return jnp.trace(jnp.einsum("bi,bj->ij", h, h)) / h.shape[0]
  return loss, _params(13), _data(13, x=(ROWS, DIM))


LOSSES = {f.__name__: f for f in (focal, tile, fft, solve, approx_max_k, searchsorted, gamma,
                                  trace, ctc)}


def _run(loss, params, batch, axis_type, has_aux=False):
  mesh = mesh_of((8,), ("data",), axis_type)
  step = jax.jit(fxaccum.value_and_grad(loss, has_aux=has_aux, micro_batches=K))
  with jax.set_mesh(mesh):
    args = (jax.device_put(params, NamedSharding(mesh, P())),
            jax.device_put(batch, NamedSharding(mesh, P("data"))))
    (path,) = diagnostics.paths(step, *args)
    return step(*args), path


def _micro_batches(batch):
  return [jax.tree.map(lambda a, i=i: a[i::K], batch) for i in range(K)]


@functools.cache
def _reference(name, has_aux=False):
  """jax.value_and_grad on each global micro-batch of LOSSES[name] (or the loss of the
  maximum test), jitted once (the micro-batches share a shape; op-by-op dispatch would
  compile every op on its own) and computed once for both mesh axis types."""
  loss, params, batch = LOSSES[name]() if name in LOSSES else _maximum_setup()
  step = jax.jit(jax.value_and_grad(loss, has_aux=has_aux))
  return [step(params, b) for b in _micro_batches(batch)]


# Every loss on an Auto mesh; on an Explicit one those that compile fast (optax's ctc_loss
# does not trace on an Explicit mesh: its own concatenate's sharding).
CASES = [(name, AxisType.Auto) for name in LOSSES] + [
    (name, AxisType.Explicit) for name in ("tile", "fft", "searchsorted", "trace")]


@pytest.mark.parametrize(("name", "axis_type"), CASES,
                         ids=[f"{n}-{t.name.lower()}" for n, t in CASES])
def test_a_per_example_loss_takes_the_device_view_exactly(name, axis_type):
  loss, params, batch = LOSSES[name]()
  got, path = _run(loss, params, batch, axis_type)
  assert path.view == "device", path.reason
  results = _reference(name)
  assert_tree_close(got, jax.tree.map(lambda *xs: sum(xs) / K, *results))


def _maximum_setup():
  def loss(p, b):
    h = b["x"] @ p["w"]
    return jnp.mean(h ** 2), fxaccum.Max(jnp.max(jnp.abs(h)) / 448.0)

  return loss, _params(14), _data(14, x=(ROWS, DIM))


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit], ids=["auto",
                                                                               "explicit"])
def test_a_maximum_over_examples_divided_by_a_positive_constant_stays_one(axis_type):
  """fp8's scale: amax / 448 is the maximum over the examples of |x| / 448."""
  loss, params, batch = _maximum_setup()
  ((value, amax), grads), path = _run(loss, params, batch, axis_type, has_aux=True)
  assert path.view == "device", path.reason
  results = _reference("maximum", has_aux=True)
  assert_tree_close((value, grads), jax.tree.map(
      lambda *xs: sum(xs) / K, *[(v, g) for (v, _), g in results]))
  np.testing.assert_allclose(amax, max(float(m.value) for (_, m), _ in results), rtol=1e-6)
