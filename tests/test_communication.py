"""One gradient reduction per step, read from the compiled HLO with fxaccum.diagnostics."""

import jax
import jax.numpy as jnp
import numpy as np
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
from jax import lax
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import fxaccum
from fxaccum import diagnostics, reductions

MOVES = ("all-gather", "collective-permute", "all-to-all")


def grad_bytes(params):
  return sum(np.asarray(p).nbytes for p in jax.tree.leaves(params))


def naive_scan_value_and_grad(loss, k):
  """What users write today: jit + lax.scan over micro-batches, compiler-placed sync."""

  def step(params, batch):
    micro = jax.tree.map(lambda a: a.reshape(a.shape[0] // k, k, *a.shape[1:]).swapaxes(0, 1),
                         batch)

    def body(acc, mb):
      w = loss(params, mb)
      g = jax.grad(lambda p: loss(p, mb).total)(params)
      return jax.tree.map(jnp.add, acc, (w.total, w.weight, g)), None

    zeros = (jnp.zeros(()), jnp.zeros(()), jax.tree.map(jnp.zeros_like, params))
    (total, weight, g), _ = lax.scan(body, zeros, micro)
    return total / weight, jax.tree.map(lambda x: x / weight, g)

  return step


@pytest.mark.parametrize("k", [2, 8])
@pytest.mark.parametrize("axis_type", AXIS_TYPES, ids=["auto", "explicit"])
def test_replicated_params_reduce_once_after_the_loop(axis_type, k):
  mesh = mesh_of((8,), ("data",), axis_type)
  params, data = make_params(), make_data(k=k)
  with jax.set_mesh(mesh):
    args = (put(params, mesh, {}), put(data, mesh, DATA))
    rep = diagnostics.report(
        jax.jit(fxaccum.value_and_grad(weighted_loss, micro_batches=k)), *args)
    naive = diagnostics.report(jax.jit(naive_scan_value_and_grad(weighted_loss, k)), *args)

  assert rep.reductions(place="loop") == [], rep.summary()
  top = rep.reductions(place="top", axes="data")
  assert 1 <= len(top) <= 2, rep.summary()  # XLA may or may not combine the leaves
  # Gradients once, plus the loss total and the weight (two scalars).
  assert grad_bytes(params) <= rep.bytes_per_call(fxaccum.diagnostics.REDUCTIONS) \
      <= grad_bytes(params) + 64, rep.summary()
  assert rep.count(MOVES) == 0, rep.summary()  # the micro-batch split moves no data

  # Negative control: the same step written naively reduces inside the loop, k times.
  assert naive.reductions(place="loop", axes="data"), naive.summary()
  assert naive.bytes_per_call(diagnostics.REDUCTIONS) >= k * grad_bytes(params)


@pytest.mark.parametrize("axis_type", AXIS_TYPES, ids=["auto", "explicit"])
def test_tensor_parallel_keeps_model_collectives_moves_data_ones(axis_type):
  mesh = mesh_of((4, 2), ("data", "model"), axis_type)
  specs = {"w1": P(None, "model"), "b1": P("model"), "w2": P("model", None)}
  with jax.set_mesh(mesh):
    args = put(make_params(), mesh, specs), put(make_data(k=4), mesh, DATA)
    rep = diagnostics.report(
        jax.jit(fxaccum.value_and_grad(weighted_loss, micro_batches=4)), *args)
    naive = diagnostics.report(jax.jit(naive_scan_value_and_grad(weighted_loss, 4)), *args)
    deferred = diagnostics.report(jax.jit(fxaccum.value_and_unreduced_grad(
        weighted_loss, micro_batches=1)), *args)
  assert rep.reductions(place="loop", axes="data") == [], rep.summary()
  assert rep.reductions(place="top", axes="data"), rep.summary()
  # The row-parallel matmul's model-axis all-reduce stays in the loop, where the model needs it.
  assert rep.reductions(place="loop", axes="model"), rep.summary()
  # No model-axis collective that plain scan does not have: the params and gradients keep
  # their model sharding across fxaccum's region (no gather on entry or exit), also for
  # deferred sync's per-device sums; and the temp memory stays within one accumulator.
  for report in (rep, deferred):
    assert report.count("all-gather", axes="model") == 0, report.summary()
  assert rep.count(axes="model") <= naive.count(axes="model"), (rep.summary(), naive.summary())
  accumulator = grad_bytes(make_params()) // 2 + 64  # float32, model-sharded in two
  assert rep.memory.temp_bytes <= naive.memory.temp_bytes + accumulator, (rep.memory,
                                                                          naive.memory)


@pytest.mark.parametrize("fsdp", ["zero2", "zero1"])
def test_fsdp_reduce_placement(fsdp):
  mesh = mesh_of((8,), ("data",), AxisType.Explicit)
  specs = {"w1": P("data", None), "b1": P("data"), "w2": P("data", None)}
  k = 4
  with jax.set_mesh(mesh):
    rep = diagnostics.report(
        jax.jit(fxaccum.value_and_grad(weighted_loss, micro_batches=k, fsdp=fsdp)),
        put(make_params(), mesh, specs), put(make_data(k=k), mesh, DATA))
  in_loop = rep.select("reduce-scatter", place="loop", axes="data")
  if fsdp == "zero2":
    # Memory-optimal: each micro-batch's gradient is reduce-scattered into the sharded
    # accumulator.
    assert in_loop and all(c.executions == k for c in in_loop), rep.summary()
  else:
    assert rep.reductions(place="loop") == [], rep.summary()
    assert rep.select("reduce-scatter", place="top", axes="data"), rep.summary()


def test_diagnostics_sees_conditional_and_loop_places():
  mesh = mesh_of((8,), ("data",), AxisType.Explicit)

  def per_device(x, flag):
    in_cond = lax.cond(flag, lambda v: v + lax.psum(v, "data"), lambda v: v * 0.0, x)

    def body(c, _):
      c = c + x  # depends on the carry, so XLA cannot hoist the psum out of the loop
      return c + lax.psum(c, "data"), None

    in_loop, _ = lax.scan(body, jnp.zeros_like(in_cond), None, length=3)
    return in_cond + in_loop

  fn = jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=(P("data"), P()),
                             out_specs=P("data")))
  with jax.set_mesh(mesh):
    x = jax.device_put(jnp.ones(32), jax.sharding.NamedSharding(mesh, P("data")))
    rep = diagnostics.report(fn, x, True)
  assert [c.place for c in rep.reductions(place="conditional")] == ["conditional"]
  loop = rep.reductions(place="loop")
  assert len(loop) == 1 and loop[0].executions == 3 and loop[0].axes == ("data",)
  assert loop[0].bytes == 16
  assert rep.memory is not None and rep.memory.argument_bytes > 0
  assert "conditional" in rep.summary()


@pytest.mark.parametrize("layout", ["replicated", "fsdp", "data_x_model"])
def test_one_micro_batch_compiles_jax_value_and_grads_program(layout):
  """k = 1 has nothing to accumulate: the step is jax.value_and_grad's program (no loop, no
  per-device region), with its collectives, so it costs what the large batch costs."""
  specs = {"replicated": ({}, ("data",), (8,)),
           "fsdp": ({"w1": P("data", None), "b1": P("data"), "w2": P("data", None)},
                    ("data",), (8,)),
           "data_x_model": ({"w1": P(None, "model"), "b1": P("model"),
                             "w2": P("model", None)}, ("data", "model"), (4, 2))}
  param_specs, names, shape = specs[layout]
  mesh = mesh_of(shape, names, AxisType.Auto)
  params, data = make_params(), make_data(k=1)
  large_batch = jax.jit(jax.value_and_grad(lambda p, b: weighted_loss(p, b).value()))
  step = jax.jit(fxaccum.value_and_grad(weighted_loss, micro_batches=1))
  with jax.set_mesh(mesh):
    args = (put(params, mesh, param_specs), put(data, mesh, DATA))
    lowered = step.lower(*args).as_text()
    ours, theirs = diagnostics.report(step, *args), diagnostics.report(large_batch, *args)
    (path,) = diagnostics.paths(step, *args)
  assert path.reason.startswith("one micro-batch"), path
  assert "manual_computation" not in lowered and "stablehlo.while" not in lowered
  # The same collectives (XLA may combine the loss total and weight differently).
  assert {(c.kind, c.axes, c.place) for c in ours.collectives} == {
      (c.kind, c.axes, c.place) for c in theirs.collectives}, (ours.summary(),
                                                               theirs.summary())
  kinds = (*diagnostics.REDUCTIONS, "all-gather")
  assert abs(ours.bytes_per_call(kinds) - theirs.bytes_per_call(kinds)) <= 64, (
      ours.summary(), theirs.summary())


@pytest.mark.parametrize("fsdp", ["zero2", "zero1"])
@pytest.mark.parametrize("bucket_bytes,buckets", [(reductions.BUCKET_BYTES, 1), (None, 1), (0, 3),
                                                  (600, 2)])
def test_fsdp_gradients_reduce_once_per_bucket(fsdp, bucket_bytes, buckets, monkeypatch):
  """The FSDP gradient's reduce-scatters (per micro-batch, or once per step) are one per
  bucket, not one per leaf: XLA:CPU combines none, and each is a rendezvous. Exact at every
  bucket size (fxaccum's own, 2 MiB, and others set in its module). (Full f32 gradients:
  w1 512 B, b1 64 B, w2 64 B.)"""
  monkeypatch.setattr(reductions, "BUCKET_BYTES", bucket_bytes)
  mesh = mesh_of((8,), ("data",), AxisType.Explicit)
  specs = {"w1": P("data", None), "b1": P("data"), "w2": P("data", None)}
  k = 4
  params, data = make_params(), make_data(k=k)
  step = jax.jit(fxaccum.value_and_grad(weighted_loss, micro_batches=k, fsdp=fsdp))
  with jax.set_mesh(mesh):
    args = (put(params, mesh, specs), put(data, mesh, DATA))
    rep = diagnostics.report(step, *args)
    got = step(*args)
  place = "loop" if fsdp == "zero2" else "top"
  scatters = rep.select("reduce-scatter", place=place, axes="data")
  assert len(scatters) == buckets, rep.summary()
  assert sum(c.bytes for c in scatters) >= grad_bytes(params), rep.summary()
  assert_tree_close(got, jax.value_and_grad(reference_token_mean)(params, data))


def test_replicated_gradients_reduce_in_one_all_reduce():
  mesh = mesh_of((8,), ("data",), AxisType.Explicit)
  params, data = make_params(), make_data(k=4)
  with jax.set_mesh(mesh):
    rep = diagnostics.report(jax.jit(fxaccum.value_and_grad(
        weighted_loss, micro_batches=4)), put(params, mesh, {}), put(data, mesh, DATA))
  big = [c for c in rep.reductions(place="top", axes="data") if c.bytes > 64]
  assert len(big) == 1 and big[0].bytes >= grad_bytes(params), rep.summary()

