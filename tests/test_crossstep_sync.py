"""Deferred (cond-based) sync: per-device partial sums, one reduction per optimizer step."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import (
    AXIS_TYPES,
    DATA,
    assert_tree_close,
    make_data,
    make_params,
    mesh_of,
    put,
    reference_token_mean,
    weighted_loss,
)
from jax.sharding import PartitionSpec as P

import fxaccum
from fxaccum import diagnostics

K = 4


def train_step_fn(grad_fn):
  def train_step(state, batch):
    loss, grads = grad_fn(state.params, batch)
    return state.apply_gradients(grads=grads), loss
  return train_step


PARAMS = make_params()
CALLS = [make_data(seed=s, k=2) for s in range(2 * K)]  # two windows of K calls


@functools.cache
def large_batch_reference():
  """Plain JAX and Optax, no mesh: one Adam step per window on the token mean over the
  window's K calls together (what K token-weighted calls accumulate). Returns (params,
  Adam state) after the two windows; computed once for the tests below."""
  inner = optax.adam(1e-2)

  @jax.jit
  def step(params, opt_state, window):
    updates, opt_state = inner.update(jax.grad(reference_token_mean)(params, window),
                                      opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  params, opt_state = PARAMS, inner.init(PARAMS)
  for start in range(0, len(CALLS), K):
    window = jax.tree.map(lambda *a: np.concatenate(a), *CALLS[start:start + K])
    params, opt_state = step(params, opt_state, window)
  return params, opt_state


@pytest.mark.parametrize("axis_type", AXIS_TYPES, ids=["auto", "explicit"])
def test_deferred_sync_reduces_only_inside_the_boundary_branch(axis_type):
  params, calls = PARAMS, CALLS
  mesh = mesh_of((8,), ("data",), axis_type)
  tx = optax.chain(fxaccum.accumulate(K, data_axes="data"), optax.adam(1e-2))
  grad_fn = fxaccum.value_and_unreduced_grad(weighted_loss, micro_batches=2)
  step = jax.jit(train_step_fn(grad_fn))
  with jax.set_mesh(mesh):
    state = fxaccum.TrainState.create(apply_fn=None, params=put(params, mesh, {}), tx=tx)
    acc = state.opt_state[0].accumulator
    # One partial sum per device, sharded: each device holds one gradient copy.
    assert all(a.shape[0] == 8 and a.sharding.shard_shape(a.shape)[0] == 1
               for a in jax.tree.leaves(acc))
    rep = diagnostics.report(step, state, put(calls[0], mesh, DATA))
    for batch in calls:
      # Wait for each call: back-to-back dispatches of collective programs on simulated
      # CPU devices can deadlock XLA:CPU's rendezvous (reproduced without fxaccum).
      state, _ = jax.block_until_ready(step(state, put(batch, mesh, DATA)))

  grad_bytes = sum(np.asarray(p).nbytes for p in jax.tree.leaves(params))
  outside = [c for c in rep.reductions() if c.place != "conditional"]
  # Outside the branch only the per-call loss (two f32 scalars) is reduced, no gradient.
  assert all(c.bytes <= 16 for c in outside), rep.summary()
  assert rep.bytes_per_call(diagnostics.REDUCTIONS, place="conditional") >= grad_bytes
  # All leaves in one all-reduce (XLA combines all-reduces; see docs/performance.md).
  assert len(rep.reductions(place="conditional")) == 1, rep.summary()
  assert int(state.step) == 2

  ref_params, ref_opt_state = large_batch_reference()
  assert_tree_close(state.params, ref_params, rtol=1e-5)
  assert_tree_close(state.opt_state[1], ref_opt_state, rtol=1e-5)


def test_deferred_sync_on_a_one_device_explicit_mesh():
  """The degenerate mesh (data 1, one device): the per-device weight and slot types differ
  there; the window must still step like one large-batch step. (It ran in a one-device
  interpreter; a mesh of one of the 8 devices fails the same way without the fix, a
  ShardingTypeError from the zero-weight select, and takes 5 s less.)"""
  loss = lambda p, b: jnp.mean((b["x"] @ p["w"] + p["b"] - b["y"]) ** 2)  # noqa: E731
  tx = optax.chain(fxaccum.accumulate(4, data_axes="data"), optax.sgd(0.1))
  grad_fn = fxaccum.value_and_unreduced_grad(loss, micro_batches=1)
  step = jax.jit(lambda s, b: s.apply_gradients(grads=grad_fn(s.params, b)[1]))
  mesh = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1])  # Explicit, as by default
  params = {"w": np.ones((3, 1), np.float32), "b": np.zeros(1, np.float32)}  # 1-D: the case
  rng = np.random.default_rng(0)
  calls = [{"x": rng.normal(size=(2, 3)).astype(np.float32),
            "y": rng.normal(size=(2, 1)).astype(np.float32)} for _ in range(4)]
  with jax.set_mesh(mesh):
    state = fxaccum.TrainState.create(apply_fn=None, params=params, tx=tx)
    for b in calls:
      state = step(state, jax.device_put(b, jax.NamedSharding(mesh, P("data"))))
  whole = {k: np.concatenate([c[k] for c in calls]) for k in calls[0]}
  ref = jax.tree.map(lambda p, g: p - 0.1 * g, params, jax.jit(jax.grad(loss))(params, whole))
  error = max(float(np.max(np.abs(np.asarray(a) - b)))
              for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(ref), strict=True))
  assert int(state.step) == 1 and error < 1e-6, (int(state.step), error)


def test_reduced_gradients_reduce_every_call():
  """Without data_axes the reduction runs each call (the documented cost)."""
  params = make_params()
  mesh = mesh_of((8,), ("data",), AXIS_TYPES[1])
  tx = optax.chain(fxaccum.accumulate(K), optax.adam(1e-2))
  step = jax.jit(train_step_fn(fxaccum.value_and_grad(weighted_loss, micro_batches=2)))
  with jax.set_mesh(mesh):
    state = fxaccum.TrainState.create(apply_fn=None, params=put(params, mesh, {}), tx=tx)
    rep = diagnostics.report(step, state, put(make_data(k=2), mesh, DATA))
  grad_bytes = sum(np.asarray(p).nbytes for p in jax.tree.leaves(params))
  assert rep.bytes_per_call(diagnostics.REDUCTIONS, place="top") >= grad_bytes


def test_unreduced_requires_replicated_params():
  mesh = mesh_of((8,), ("data",), AXIS_TYPES[1])
  specs = {"w1": P("data", None)}
  with jax.set_mesh(mesh), pytest.raises(ValueError, match="value_and_unreduced_grad.*FSDP"):
    jax.jit(fxaccum.value_and_unreduced_grad(weighted_loss, micro_batches=2))(
        put(make_params(), mesh, specs), put(make_data(k=2), mesh, DATA))


@pytest.mark.parametrize("axis_type", AXIS_TYPES, ids=["auto", "explicit"])
def test_per_device_accumulator_layout_for_every_init_path(axis_type):
  mesh = mesh_of((8,), ("data",), axis_type)
  tx = optax.chain(fxaccum.accumulate(K, data_axes="data"), optax.adam(1e-2))
  params = put(make_params(), mesh, {})
  states = [tx.init(params)]  # eager, the mesh read from the params
  with jax.set_mesh(mesh):
    states += [tx.init(params), jax.jit(tx.init)(params)]
  for state in states:
    for leaf in jax.tree.leaves((state[0].accumulator, state[0].weight)):
      assert leaf.shape[0] == 8 and leaf.sharding.shard_shape(leaf.shape)[0] == 1
  with pytest.raises(ValueError, match="inside `with jax.set_mesh"):
    jax.jit(tx.init)(params)  # jit without a mesh context: a clear error
  with pytest.raises(ValueError, match=r"the mesh has no axes \['batch'\]"):
    optax.chain(fxaccum.accumulate(K, data_axes="batch"), optax.sgd(1.0)).init(params)


TP = {"w1": P(None, "model"), "b1": P("model"), "w2": P("model", None)}


@pytest.mark.parametrize("axis_type", AXIS_TYPES, ids=["auto", "explicit"])
def test_deferred_sync_on_data_x_model_keeps_the_accumulator_layout(axis_type):
  """Per-device slots over ``data``, each slot sharded like its param over ``model``: the
  state a step returns is laid out as the state it took (an AOT-compiled step takes it)."""
  params, calls = PARAMS, CALLS
  mesh = mesh_of((4, 2), ("data", "model"), axis_type)
  tx = optax.chain(fxaccum.accumulate(K, data_axes="data"), optax.adam(1e-2))
  grad_fn = fxaccum.value_and_unreduced_grad(weighted_loss, micro_batches=2)
  with jax.set_mesh(mesh):
    state = fxaccum.TrainState.create(apply_fn=None, params=put(params, mesh, TP), tx=tx)
    for name, acc in state.opt_state[0].accumulator.items():
      want = jax.sharding.NamedSharding(mesh, P("data", *TP[name]))
      assert acc.sharding.is_equivalent_to(want, acc.ndim), (name, acc.sharding)
    step = jax.jit(train_step_fn(grad_fn)).lower(state, put(calls[0], mesh, DATA)).compile()
    for batch in calls:
      state, _ = jax.block_until_ready(step(state, put(batch, mesh, DATA)))
  assert int(state.step) == 2
  ref_params, ref_opt_state = large_batch_reference()
  assert_tree_close(state.params, ref_params, rtol=1e-5)
  assert_tree_close(state.opt_state[1], ref_opt_state, rtol=1e-5)


def test_deferred_sync_refuses_fsdp_params_at_init():
  mesh = mesh_of((8,), ("data",), AXIS_TYPES[1])
  tx = optax.chain(fxaccum.accumulate(K, data_axes="data"), optax.adam(1e-2))
  params = put(make_params(), mesh, {"w1": P("data", None)})
  with jax.set_mesh(mesh), pytest.raises(ValueError, match=r"replicated over \('data',\).*"
                                         r"FSDP.*without data_axes"):
    tx.init(params)


@pytest.mark.parametrize("boxed", [True, False], ids=["variables", "values"])
def test_deferred_sync_through_the_nnx_optimizer(boxed):
  """fxaccum.Optimizer takes value_and_unreduced_grad's Unreduced for an nnx module
  as it comes (its total holds nnx.Param variables; before, the gate refused its tree) or
  with plain values; k calls give nnx.Optimizer's step on the k calls' batches."""
  from flax import nnx

  def loss(model, batch):
    return jnp.mean((model(batch["x"])[:, 0] - batch["y"]) ** 2)

  rng = np.random.default_rng(0)
  calls = [{"x": rng.normal(size=(16, 4)).astype(np.float32),
            "y": rng.normal(size=16).astype(np.float32)} for _ in range(2)]
  mesh = mesh_of((8,), ("data",), jax.sharding.AxisType.Explicit)
  with jax.set_mesh(mesh):
    model = nnx.Linear(4, 1, rngs=nnx.Rngs(0))
    ref_model = nnx.clone(model)
    opt = fxaccum.Optimizer(model, optax.chain(fxaccum.accumulate(2, data_axes="data"),
                                               optax.sgd(0.1)), wrt=nnx.Param)

    @nnx.jit
    def step(model, opt, batch):
      _, grads = fxaccum.value_and_unreduced_grad(loss, micro_batches=2)(model, batch)
      if not boxed:
        grads = fxaccum.Unreduced(nnx.as_pure(grads.total), grads.weight)
      opt.update(model, grads)

    for batch in calls:
      jax.block_until_ready(step(model, opt, jax.device_put(batch, P("data"))))
    ref_opt = nnx.Optimizer(ref_model, optax.sgd(0.1), wrt=nnx.Param)
    whole = jax.tree.map(lambda *a: np.concatenate(a), *calls)
    ref_opt.update(ref_model, nnx.grad(loss)(ref_model, whole))
  assert int(opt.step[...]) == 1
  assert_tree_close(nnx.state(model, nnx.Param), nnx.state(ref_model, nnx.Param), rtol=1e-5)
