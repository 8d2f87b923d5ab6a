"""Orbax checkpoints: bit-exact mid-window resume, re-sharding, mismatches, atomicity."""

import subprocess
import sys
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx
from flax.training import dynamic_scale as dynamic_scale_lib
from helpers import (
    DATA,
    example_mean_loss,
    make_data,
    make_params,
    mesh_of,
    put,
    weighted_loss,
)
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import fxaccum
from fxaccum.checkpoint import CheckpointMismatchError

K, CALLS = 4, 8
WORKER = Path(__file__).with_name("checkpoint_worker.py")


def micro_batch(call):
  return make_data(seed=call, k=1)


def linen_state(every_k=K, params=None):
  tx = optax.chain(fxaccum.accumulate(every_k), optax.adam(1e-2))
  return fxaccum.TrainState.create(apply_fn=None, params=params or make_params(), tx=tx)


@jax.jit
def linen_step(state, batch):
  return state.apply_gradients(grads=jax.grad(example_mean_loss)(state.params, batch))


def deferred_setup(mesh):
  """A fresh deferred-sync TrainState on ``mesh`` and its jitted train step."""
  tx = optax.chain(fxaccum.accumulate(K, data_axes="data"), optax.adam(1e-2))
  state = fxaccum.TrainState.create(apply_fn=None, params=put(make_params(), mesh, {}), tx=tx)
  grad_fn = fxaccum.value_and_unreduced_grad(weighted_loss, micro_batches=1)

  @jax.jit
  def train_step(state, batch):
    return state.apply_gradients(grads=grad_fn(state.params, batch)[1])

  return state, train_step


def assert_trees_equal(a, b):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def manager(path):
  return ocp.CheckpointManager(Path(path).absolute())


@pytest.mark.parametrize("at_call", [2, 4])  # mid-window, and right at a boundary
def test_linen_mid_window_resume_is_bit_exact(tmp_path, at_call):
  full = linen_state()
  for call in range(CALLS):
    full = linen_step(full, micro_batch(call))

  part = linen_state()
  for call in range(at_call):
    part = linen_step(part, micro_batch(call))
  mgr = manager(tmp_path)
  assert fxaccum.checkpoint.save(mgr, at_call, part)
  mgr.wait_until_finished()
  resumed = fxaccum.checkpoint.restore(mgr, at_call, linen_state(params=jax.tree.map(
      np.zeros_like, make_params())))
  assert int(resumed.micro_step) == at_call % K and int(resumed.step) == at_call // K
  assert type(resumed.opt_state[0]) is fxaccum.AccumulateState  # NamedTuples survive
  for call in range(at_call, CALLS):
    resumed = linen_step(resumed, micro_batch(call))
  assert_trees_equal((resumed.step, resumed.params, resumed.opt_state),
                     (full.step, full.params, full.opt_state))


class Net(nnx.Module):
  def __init__(self, rngs):
    self.a, self.b = nnx.Linear(8, 16, rngs=rngs), nnx.Linear(16, 1, rngs=rngs)

  def __call__(self, x):
    return self.b(nnx.tanh(self.a(x)))[..., 0]


def nnx_loss(model, batch):
  return np.float32(1) * ((model(batch["x"]) - batch["y"]) ** 2).mean()


@nnx.jit
def nnx_step(model, opt, batch):
  opt.update(model, nnx.grad(nnx_loss)(model, batch))


def nnx_fresh(seed=0):
  model = Net(nnx.Rngs(seed))
  tx = optax.chain(fxaccum.accumulate(K), optax.adam(1e-2))
  return model, fxaccum.Optimizer(model, tx, wrt=nnx.Param)


@pytest.mark.parametrize("at_call", [2, 4])
def test_nnx_mid_window_resume_is_bit_exact(tmp_path, at_call):
  model, opt = nnx_fresh()
  for call in range(CALLS):
    nnx_step(model, opt, micro_batch(call))

  part_model, part_opt = nnx_fresh()
  for call in range(at_call):
    nnx_step(part_model, part_opt, micro_batch(call))
  mgr = manager(tmp_path)
  fxaccum.checkpoint.save(mgr, at_call, part_opt, model=part_model)
  res_model, res_opt = nnx_fresh(seed=1)  # different init: everything must come from disk
  fxaccum.checkpoint.restore(mgr, at_call, res_opt, model=res_model)
  assert int(res_opt.micro_step) == at_call % K
  for call in range(at_call, CALLS):
    nnx_step(res_model, res_opt, micro_batch(call))
  assert_trees_equal(nnx.state(res_model), nnx.state(model))
  assert_trees_equal(nnx.state(res_opt), nnx.state(opt))


@pytest.mark.slow
def test_deferred_sync_resume_same_mesh_bit_exact_and_on_4_devices(tmp_path):
  mesh = mesh_of((8,), ("data",), AxisType.Explicit)
  with jax.set_mesh(mesh):
    full, train_step = deferred_setup(mesh)
    for call in range(CALLS):
      full = jax.block_until_ready(train_step(full, put(micro_batch(call), mesh, DATA)))
    part, _ = deferred_setup(mesh)
    for call in range(2):
      part = jax.block_until_ready(train_step(part, put(micro_batch(call), mesh, DATA)))
    mgr = manager(tmp_path)
    fxaccum.checkpoint.save(mgr, 2, part)
    resumed = fxaccum.checkpoint.restore(mgr, 2, deferred_setup(mesh)[0])
    for call in range(2, CALLS):
      resumed = jax.block_until_ready(train_step(resumed, put(micro_batch(call), mesh, DATA)))
  assert_trees_equal((resumed.params, resumed.opt_state), (full.params, full.opt_state))

  # The same checkpoint resumed on 4 devices: the canonical (summed) accumulator.
  out = tmp_path / "four.npz"
  subprocess.run([sys.executable, str(WORKER), "resume", str(tmp_path.absolute()), "2", "4",
                  str(CALLS), str(out)], check=True, timeout=300, capture_output=True)
  four = np.load(out)
  assert int(four["step"]) == CALLS // K
  for i, leaf in enumerate(jax.tree.leaves(full.params)):
    np.testing.assert_allclose(four[str(i)], np.asarray(leaf), rtol=1e-5, atol=1e-6)


def test_restored_accumulators_carry_the_params_shardings(tmp_path):
  """Saved on an 8-way data mesh, restored onto data x model with tensor-parallel params."""
  data_mesh = mesh_of((8,), ("data",), AxisType.Explicit)
  state = linen_state(params=put(make_params(), data_mesh, {}))
  state = linen_step(state, make_data(k=1))
  mgr = manager(tmp_path)
  fxaccum.checkpoint.save(mgr, 1, state)

  tp_mesh = mesh_of((4, 2), ("data", "model"), AxisType.Explicit)
  specs = {"w1": P(None, "model"), "b1": P("model"), "w2": P("model", None)}
  like = linen_state(params=put(make_params(), tp_mesh, specs))
  restored = fxaccum.checkpoint.restore(mgr, 1, like)
  for name, acc in restored.opt_state[0].accumulator.items():
    assert acc.sharding.is_equivalent_to(like.params[name].sharding, acc.ndim), name
    np.testing.assert_array_equal(acc, state.opt_state[0].accumulator[name])


def test_mismatched_every_k_tree_or_foreign_checkpoint(tmp_path):
  state = linen_step(linen_state(), make_data(k=1))
  mgr = manager(tmp_path / "a")
  fxaccum.checkpoint.save(mgr, 1, state)
  with pytest.raises(CheckpointMismatchError, match=r"every_k=4.*every_k=2"):
    fxaccum.checkpoint.restore(mgr, 1, linen_state(every_k=2))
  other = make_params()
  other["extra"] = np.zeros(3, np.float32)
  with pytest.raises(CheckpointMismatchError, match="only in the target.*extra"):
    fxaccum.checkpoint.restore(mgr, 1, linen_state(params=other))

  plain = manager(tmp_path / "b")
  plain.save(1, args=ocp.args.StandardSave({"params": make_params()}))
  plain.wait_until_finished()
  with pytest.raises(CheckpointMismatchError, match="no fxaccum metadata"):
    fxaccum.checkpoint.restore(plain, 1, linen_state())


def test_other_schema_version_is_refused(tmp_path, monkeypatch):
  mgr = manager(tmp_path)
  from fxaccum.integrations import orbax  # where save reads the schema version
  monkeypatch.setattr(orbax, "SCHEMA_VERSION", 99)
  fxaccum.checkpoint.save(mgr, 1, linen_state())
  monkeypatch.undo()
  with pytest.raises(CheckpointMismatchError, match="schema 99"):
    fxaccum.checkpoint.restore(mgr, 1, linen_state())


@pytest.mark.slow
def test_interrupted_save_leaves_the_previous_checkpoint(tmp_path):
  proc = subprocess.run([sys.executable, str(WORKER), "interrupted-save", str(tmp_path)],
                        capture_output=True, text=True, timeout=300)
  assert proc.returncode == -9 and "killing" in proc.stdout, proc.stderr[-2000:]
  mgr = manager(tmp_path)
  like = {"w": jax.ShapeDtypeStruct((64, 1024, 1024), np.float32)}
  restored = fxaccum.checkpoint.restore(mgr, None, like)  # the latest complete step: 1
  assert not np.asarray(restored["w"]).any()
  with pytest.raises(FileNotFoundError, match="2"):  # the half-written step is named
    fxaccum.checkpoint.restore(mgr, 2, like)


def test_in_step_state_round_trips_and_saves_are_async(tmp_path):
  """A state without AccumulateState (in-step mode) goes through the same helpers."""
  params, tx = make_params(), optax.adam(1e-2)
  opt_state = tx.init(params)
  grads = fxaccum.grad(weighted_loss, micro_batches=4)(params, make_data(k=4))
  updates, opt_state = tx.update(grads, opt_state, params)
  state = {"params": optax.apply_updates(params, updates), "opt_state": opt_state}
  mgr = manager(tmp_path)
  assert fxaccum.checkpoint.save(mgr, 7, state)  # returns while writing
  mgr.wait_until_finished()  # Orbax is asynchronous: wait before reading or exiting
  assert mgr.latest_step() == 7
  like = {"params": make_params(), "opt_state": tx.init(make_params())}
  restored = fxaccum.checkpoint.restore(mgr, None, like)
  assert_trees_equal(restored, state)
  assert type(restored["opt_state"][0]) is type(opt_state[0])


def test_restore_onto_an_eval_shape_target(tmp_path):
  state = linen_step(linen_step(linen_state(), micro_batch(0)), micro_batch(1))
  mgr = manager(tmp_path)
  fxaccum.checkpoint.save(mgr, 2, state)
  restored = fxaccum.checkpoint.restore(mgr, 2, jax.eval_shape(linen_state))
  assert int(restored.micro_step) == 2
  assert_trees_equal((restored.params, restored.opt_state), (state.params, state.opt_state))


class BatchNormNet(nn.Module):
  """imagenet's pattern in small: BatchNorm statistics in a mutable collection."""

  @nn.compact
  def __call__(self, x, train: bool = True):
    x = nn.Dense(16, use_bias=False)(x)
    x = nn.relu(nn.BatchNorm(use_running_average=not train, momentum=0.9)(x))
    return nn.Dense(1)(x)[..., 0]


class ImagenetState(fxaccum.TrainState):
  """flax's imagenet TrainState, built on fxaccum's: extra pytree fields."""

  batch_stats: Any
  dynamic_scale: dynamic_scale_lib.DynamicScale


def imagenet_state(seed=0):
  model = BatchNormNet()
  variables = model.init(jax.random.key(seed), np.ones((4, 8), np.float32))
  tx = optax.chain(fxaccum.accumulate(K), optax.adam(1e-2))
  return model, ImagenetState.create(
      apply_fn=model.apply, params=variables["params"], tx=tx,
      batch_stats=variables["batch_stats"], dynamic_scale=dynamic_scale_lib.DynamicScale())


@jax.jit
def imagenet_step(state, batch):
  def loss_fn(params):
    out, new_model_state = state.apply_fn(
        {"params": params, "batch_stats": state.batch_stats}, batch["x"][:, 0],
        mutable=["batch_stats"])
    return jnp.mean((out - batch["y"][:, 0]) ** 2), new_model_state

  dynamic_scale, _, (_, new_model_state), grads = state.dynamic_scale.value_and_grad(
      loss_fn, has_aux=True)(state.params)
  return state.apply_gradients(grads=grads, batch_stats=new_model_state["batch_stats"],
                               dynamic_scale=dynamic_scale)


def test_train_state_subclass_fields_round_trip_bit_exact(tmp_path):
  """Every pytree field of a TrainState subclass (imagenet's batch_stats and
  dynamic_scale) is saved and restored, not filled in from the target."""
  _, full = imagenet_state()
  for call in range(CALLS):
    full = imagenet_step(full, micro_batch(call))
  _, part = imagenet_state()
  for call in range(2):
    part = imagenet_step(part, micro_batch(call))
  mgr = manager(tmp_path)
  fxaccum.checkpoint.save(mgr, 2, part)
  _, target = imagenet_state(seed=1)
  # Negative control: the target's statistics and scale counters are not the saved ones.
  assert not np.array_equal(jax.tree.leaves(target.batch_stats)[0],
                            jax.tree.leaves(part.batch_stats)[0])
  assert int(part.dynamic_scale.fin_steps) != int(target.dynamic_scale.fin_steps)
  resumed = fxaccum.checkpoint.restore(mgr, 2, target)
  assert type(resumed) is ImagenetState and resumed.apply_fn is target.apply_fn
  assert_trees_equal(resumed.batch_stats, part.batch_stats)
  assert_trees_equal(resumed.dynamic_scale, part.dynamic_scale)
  for call in range(2, CALLS):
    resumed = imagenet_step(resumed, micro_batch(call))
  assert_trees_equal(resumed, full)


class DropoutBatchNormNet(nnx.Module):
  """NNX state of every kind: params, BatchNorm statistics, RNG keys and counts."""

  def __init__(self, rngs):
    self.linear = nnx.Linear(8, 16, rngs=rngs)
    self.norm = nnx.BatchNorm(16, rngs=rngs)
    self.dropout = nnx.Dropout(0.3, rngs=rngs)
    self.out = nnx.Linear(16, 1, rngs=rngs)

  def __call__(self, x):
    return self.out(self.dropout(nnx.relu(self.norm(self.linear(x)))))[..., 0]


@nnx.jit
def nnx_dropout_step(model, opt, batch):
  def loss(model):
    return jnp.mean((model(batch["x"][:, 0]) - batch["y"][:, 0]) ** 2)
  opt.update(model, nnx.grad(loss)(model))


def test_nnx_state_of_every_kind_round_trips_bit_exact(tmp_path):
  def fresh(seed):
    model = DropoutBatchNormNet(nnx.Rngs(seed, dropout=seed + 10))
    return model, fxaccum.Optimizer(model, optax.chain(fxaccum.accumulate(K),
                                                       optax.adam(1e-2)), wrt=nnx.Param)

  model, opt = fresh(0)
  for call in range(CALLS):
    nnx_dropout_step(model, opt, micro_batch(call))
  part_model, part_opt = fresh(0)
  for call in range(3):
    nnx_dropout_step(part_model, part_opt, micro_batch(call))
  mgr = manager(tmp_path)
  fxaccum.checkpoint.save(mgr, 3, part_opt, model=part_model)
  res_model, res_opt = fresh(1)  # other params, statistics and RNG streams
  fxaccum.checkpoint.restore(mgr, 3, res_opt, model=res_model)
  for call in range(3, CALLS):  # dropout draws from the restored RNG streams
    nnx_dropout_step(res_model, res_opt, micro_batch(call))
  keys = nnx.state(res_model, nnx.RngKey)
  assert jax.tree.leaves(keys) and all(
      jax.dtypes.issubdtype(k.dtype, jax.dtypes.prng_key) for k in jax.tree.leaves(keys))
  assert_trees_equal(jax.tree.map(_raw, nnx.state(res_model)),
                     jax.tree.map(_raw, nnx.state(model)))
  assert_trees_equal(nnx.state(res_opt), nnx.state(opt))


def _raw(x):
  return jax.random.key_data(x) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x
