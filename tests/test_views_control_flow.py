"""Per-example losses with control flow take the device view, exactly (issue 34): a linen
``nn.RNN(nn.LSTMCell)`` (its scan carry starts invariant and becomes varying per device),
``lax.map`` with ``batch_size=`` and a ``while_loop`` under ``jax.vmap``; their mixing
variants stay global, and exact."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import AXIS_TYPES, assert_tree_close, global_micro_batch_reference, mesh_of
from jax import lax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import fxaccum
from fxaccum import diagnostics

ROWS = 64  # k = 2: 32 rows per micro-batch, 4 per device (lax.map's batch_size)


class LSTMRegressor(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = nn.RNN(nn.LSTMCell(8))(x)
    return nn.Dense(1)(h[:, -1])[..., 0]


@functools.cache
def lstm_setup(mixing=False):
  """A linen LSTM over each example's sequence, a mean squared error; mixing: the inputs
  centred by the batch mean first. Built once (its init compiles a QR) and shared by
  two tests: nothing writes to it (the batch's arrays are read-only)."""
  rng = np.random.default_rng(0)
  batch = {"x": rng.normal(size=(ROWS, 5, 3)).astype(np.float32),
           "y": rng.normal(size=(ROWS,)).astype(np.float32)}
  for a in batch.values():
    a.flags.writeable = False
  model = LSTMRegressor()
  # jitted: flax's init op by op compiles each op on its own (seconds, for an LSTM)
  params = jax.jit(model.init)(jax.random.key(0), batch["x"][:1])["params"]

  def loss(params, batch):
    x = batch["x"] - batch["x"].mean(0) if mixing else batch["x"]
    return jnp.mean((model.apply({"params": params}, x) - batch["y"]) ** 2)

  return loss, params, batch


def map_setup(mixing=False):
  """lax.map of a per-example term in blocks of 4; mixing: each term reads the batch mean."""
  rng = np.random.default_rng(1)
  batch = {"x": rng.normal(size=(ROWS, 4)).astype(np.float32)}
  w = rng.normal(size=(4, 4)).astype(np.float32)

  def loss(w, batch):
    x = batch["x"]
    centre = x.mean(0) if mixing else 0.0
    return jnp.mean(lax.map(lambda r: jnp.sum(jnp.tanh((r - centre) @ w) ** 2), x,
                            batch_size=4))

  return loss, w, batch


def while_setup(mixing=False):
  """Each example halved until its norm is at most 1 (a while_loop under vmap); mixing:
  until it is at most the batch's mean squared norm."""
  rng = np.random.default_rng(2)
  batch = {"x": (4 * rng.normal(size=(ROWS, 4))).astype(np.float32)}
  w = rng.normal(size=(4, 4)).astype(np.float32)

  def loss(w, batch):
    x = batch["x"]
    bound = jnp.mean(jnp.sum(x ** 2, -1)) / 8 if mixing else 1.0
    shrunk = jax.vmap(lambda r: lax.while_loop(lambda c: jnp.sum(c ** 2) > bound,
                                               lambda c: c * 0.5, r))(x)
    return jnp.mean(jnp.sum(jnp.tanh(shrunk @ w) ** 2, -1))

  return loss, w, batch


SETUPS = {"lstm": lstm_setup, "map": map_setup, "while": while_setup}


def _run(loss, params, batch, k, axis_type=AxisType.Auto, **options):
  mesh = mesh_of((8,), ("data",), axis_type)
  with jax.set_mesh(mesh):
    sharded = jax.tree.map(lambda a: jax.device_put(a, NamedSharding(mesh, P("data"))), batch)
    step = jax.jit(fxaccum.value_and_grad(loss, micro_batches=k, **options))
    got = step(params, sharded)
    (path,) = diagnostics.paths(step, params, sharded)
  return got, path


@pytest.mark.parametrize("name", SETUPS)
def test_per_example_control_flow_takes_the_device_view(name):
  loss, params, batch = SETUPS[name]()
  got, path = _run(loss, params, batch, k=2)
  assert path.view == "device", path
  assert_tree_close(got, global_micro_batch_reference(loss, params, batch, 2))


def test_lstm_on_an_explicit_mesh_with_four_micro_batches():
  loss, params, batch = lstm_setup()
  got, path = _run(loss, params, batch, k=4, axis_type=AXIS_TYPES[1])
  assert path.view == "device", path
  assert_tree_close(got, global_micro_batch_reference(loss, params, batch, 4))


def test_lstm_with_the_device_view_forced():
  """view='device' forced on the LSTM, whose loss names the data axes in no collective,
  runs like the default view's choice: exact (it raised JAX's carry-type error)."""
  loss, params, batch = lstm_setup()
  got, path = _run(loss, params, batch, k=2, view="device")
  assert path.view == "device" and path.reason == "view='device'", path
  assert_tree_close(got, global_micro_batch_reference(loss, params, batch, 2))


@pytest.mark.parametrize("name", ["map", "while"])
def test_mixing_control_flow_stays_global_and_exact(name):
  loss, params, batch = SETUPS[name](mixing=True)
  got, path = _run(loss, params, batch, k=2)
  assert path.view == "global" and "mixes examples" in path.reason, path
  assert_tree_close(got, global_micro_batch_reference(loss, params, batch, 2))
