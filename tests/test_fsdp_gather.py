"""fsdp_gather="per_micro_batch" (ZeRO-3): FSDP params gathered where they are used, inside
the micro-batch loop and inside a scan over stacked layers, gathered again in the backward
pass; exact against jax.value_and_grad on the whole batch."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
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
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import fxaccum
from fxaccum import diagnostics

MLP_SPECS = {"w1": P("data", None), "b1": P("data"), "w2": P("data", None)}


class Block(nn.Module):
  width: int

  @nn.compact
  def __call__(self, x, _):
    return nn.gelu(nn.Dense(self.width)(x)), None


class ScannedStack(nn.Module):
  """Layers stacked by nn.scan (with nn.remat), as large flax models write them."""

  layers: int
  width: int = 32

  @nn.compact
  def __call__(self, x):
    x = nn.Dense(self.width)(x)
    x, _ = nn.scan(nn.remat(Block), variable_axes={"params": 0}, split_rngs={"params": True},
                   length=self.layers)(self.width)(x, None)
    return nn.Dense(1)(x)[..., 0]


def stack_setup(layers, batch=64, width=32):
  model = ScannedStack(layers, width)
  rng = np.random.default_rng(0)
  x = rng.normal(size=(batch, 8)).astype(np.float32)
  y = rng.normal(size=(batch,)).astype(np.float32)
  params = model.init(jax.random.key(0), x[:1])

  def loss(p, b):
    return jnp.mean((model.apply(p, b["x"]) - b["y"]) ** 2)

  return loss, params, {"x": x, "y": y}


def fsdp_put(params, mesh):
  """Every leaf sharded over `data` along its last dimension divisible by 8 (never the
  stacked layers' dimension, 0, of a scanned kernel or bias)."""
  def place(a):
    dims = [d for d in range(a.ndim) if a.shape[d] % 8 == 0]
    spec = [None] * a.ndim
    if dims:
      spec[dims[-1]] = "data"
    return jax.device_put(a, NamedSharding(mesh, P(*spec)))
  return jax.tree.map(place, params)


@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto])
@pytest.mark.parametrize("k", [2, 4])
def test_gathered_per_use_is_exact_on_an_mlp(axis_type, k):
  mesh = mesh_of((8,), ("data",), axis_type)
  params, data = make_params(), make_data(k=k)
  step = jax.jit(fxaccum.value_and_grad(
      weighted_loss, micro_batches=k, fsdp_gather="per_micro_batch",
      param_shardings=MLP_SPECS if axis_type == AxisType.Auto else None))
  with jax.set_mesh(mesh):
    args = (put(params, mesh, MLP_SPECS), put(data, mesh, DATA))
    rep = diagnostics.report(step, *args)
    got = step(*args)
  assert [p.view for p in rep.paths] == ["device"], rep.paths
  # Gathered inside the loop (each micro-batch), never hoisted above it.
  assert rep.select("all-gather", place="top", axes="data") == [], rep.summary()
  gathers = rep.select("all-gather", place="loop", axes="data")
  assert gathers and all(c.executions == k for c in gathers), rep.summary()
  assert_tree_close(got, jax.value_and_grad(reference_token_mean)(params, data))


@pytest.mark.parametrize("k", [1, 4])
def test_scanned_layers_are_gathered_one_layer_at_a_time(k):
  """nn.scan over stacked params: each layer's shard is gathered inside the scan's body,
  in the forward and again in the backward pass (2 x layers x k gathers of one layer)."""
  layers = 4
  loss, params, data = stack_setup(layers)
  mesh = mesh_of((8,), ("data",), AxisType.Explicit)
  step = jax.jit(fxaccum.value_and_grad(loss, micro_batches=k, fsdp_gather="per_micro_batch",
                                        view="device"))
  with jax.set_mesh(mesh):
    args = (fsdp_put(params, mesh), jax.device_put(data, NamedSharding(mesh, P("data"))))
    rep = diagnostics.report(step, *args)
    got = step(*args)
  kernel = params["params"]["ScanCheckpointBlock_0"]["Dense_0"]["kernel"]
  layer_bytes = kernel[0].nbytes
  per_layer = [c for c in rep.select("all-gather", axes="data") if c.bytes == layer_bytes]
  assert sum(c.executions for c in per_layer) >= 2 * layers * k, rep.summary()
  assert not [c for c in rep.select("all-gather", axes="data") if c.bytes >= kernel.nbytes]
  assert_tree_close(got, jax.value_and_grad(loss)(params, data))


def test_peak_memory_does_not_grow_with_the_whole_params():
  """From 8 to 16 scanned layers (128 wide), the compiled temp memory grows by less than
  half the params added with per-use gathering (their shards, the accumulator's and the
  gradient's: 3/8 on 8 devices); gathering once per step (the negative control) holds the
  whole params and grows by more than all of them."""
  mesh = mesh_of((8,), ("data",), AxisType.Explicit)
  temps, param_bytes = {}, {}
  with jax.set_mesh(mesh):
    for layers in (8, 16):
      loss, params, data = stack_setup(layers, batch=64, width=128)
      param_bytes[layers] = sum(a.nbytes for a in jax.tree.leaves(params))
      args = (fsdp_put(params, mesh), jax.device_put(data, NamedSharding(mesh, P("data"))))
      for gather, reduce in (("per_micro_batch", "per_micro_batch"), ("per_step", "per_step")):
        step = jax.jit(fxaccum.value_and_grad(loss, micro_batches=4, fsdp_gather=gather,
                                              fsdp_reduce=reduce, view="device"))
        memory = step.lower(*args).compile().memory_analysis()
        temps[gather, layers] = memory.temp_size_in_bytes
  added = param_bytes[16] - param_bytes[8]
  grown = {gather: temps[gather, 16] - temps[gather, 8] for gather in ("per_micro_batch",
                                                                       "per_step")}
  assert grown["per_step"] >= added, (grown, added)
  assert grown["per_micro_batch"] < added / 2, (grown, added)


def test_plain_scan_over_stacked_params_with_a_loop_invariant_param():
  """lax.scan written by hand: stacked xs gathered per layer, a param the body closes over
  (a scan const) gathered once before the scan; exact against the whole batch."""
  rng = np.random.default_rng(3)
  params = {"stack": (rng.normal(size=(3, 16, 16)) / 4).astype(np.float32),
            "shared": (rng.normal(size=(16, 16)) / 4).astype(np.float32)}
  data = {"x": rng.normal(size=(32, 16)).astype(np.float32)}

  def loss(p, b):
    def layer(h, w):
      return jnp.tanh(h @ w + h @ p["shared"]), jnp.mean(h)
    h, sums = lax.scan(layer, b["x"], p["stack"])
    return jnp.mean(h ** 2) + 1e-3 * jnp.mean(sums)

  mesh = mesh_of((8,), ("data",), AxisType.Explicit)
  specs = {"stack": P(None, "data"), "shared": P("data")}
  step = jax.jit(fxaccum.value_and_grad(loss, micro_batches=2, fsdp_gather="per_micro_batch"))
  with jax.set_mesh(mesh):
    got = step(put(params, mesh, specs), put(data, mesh, {"x": P("data")}))
  assert_tree_close(got, jax.value_and_grad(loss)(params, data))


def test_fsdp_gather_errors():
  with pytest.raises(ValueError, match="fsdp_gather must be one of"):
    fxaccum.value_and_grad(weighted_loss, micro_batches=2, fsdp_gather="per_layer")
  with pytest.raises(ValueError, match="fsdp_reduce='per_micro_batch'"):
    fxaccum.value_and_grad(weighted_loss, micro_batches=2, fsdp_gather="per_micro_batch",
                           fsdp_reduce="per_step")


def test_a_step_in_the_global_view_warns_that_it_gathers_per_step():
  """A loss that mixes examples (batch statistics) runs in the global view, where the
  compiler places the gathers: the option cannot apply, and says so."""
  def batch_mean_loss(params, batch):
    h = jnp.tanh(batch["x"] @ params["w1"] + params["b1"])
    h = h - jnp.mean(h, axis=0)  # mixes the examples of the micro-batch
    return jnp.mean((h @ params["w2"])[..., 0] ** 2)

  mesh = mesh_of((8,), ("data",), AxisType.Auto)
  step = jax.jit(fxaccum.value_and_grad(batch_mean_loss, micro_batches=2,
                                        fsdp_gather="per_micro_batch", param_shardings=MLP_SPECS))
  params, data = make_params(), make_data(k=2)
  with jax.set_mesh(mesh), pytest.warns(UserWarning, match="has no effect on this step"):
    step(put(params, mesh, MLP_SPECS), put(data, mesh, DATA))


def test_a_param_also_sharded_over_an_explicit_model_axis_is_not_gathered_per_use():
  """FSDP x tensor parallelism on an Explicit mesh: JAX 0.10.2 fails to differentiate an
  all_gather over the data axis of a param also sharded over `model` (an AssertionError in
  its sharding rule, without fxaccum too; it used to surface from fxaccum's loop). Such a
  step runs in the global view, says why, and is exact."""
  mesh = mesh_of((4, 2), ("data", "model"), AxisType.Explicit)
  rng = np.random.default_rng(5)
  w = rng.normal(size=(8, 16)).astype(np.float32)
  x = rng.normal(size=(16, 8)).astype(np.float32)

  def loss(p, b):
    kernel = jax.sharding.reshard(p["w"], P(None, "model"))
    return jnp.mean(jnp.tanh(b["x"] @ kernel) ** 2)

  with jax.set_mesh(mesh):
    args = ({"w": jax.device_put(w, P("data", "model"))}, {"x": jax.device_put(x, P("data"))})
    step = jax.jit(fxaccum.value_and_grad(loss, micro_batches=2, fsdp_gather="per_micro_batch"))
    with pytest.warns(UserWarning, match="has no effect on this step"):
      got = step(*args)
    (path,) = diagnostics.paths(step, *args)
    reference = jax.jit(jax.value_and_grad(loss))(*args)  # the whole batch, plain JAX
  assert path.view == "global" and "fsdp_gather='per_step'" in path.reason, path
  assert_tree_close(got, reference)


class LogicalMLP(nn.Module):
  """Kernels annotated with logical axes, as flax's lm1b and wmt examples write them
  (nn.DenseGeneral, as in their attention projections, re-boxes its kernel in its init)."""

  @nn.compact
  def __call__(self, x):
    init = nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("embed", "mlp"))
    x = nn.gelu(nn.DenseGeneral(32, kernel_init=init)(x))
    x = nn.gelu(nn.Dense(16, kernel_init=init)(x))
    return nn.Dense(1)(x)[..., 0]


@pytest.mark.parametrize("gather", ["per_step", "per_micro_batch"])
def test_linen_logical_partitioning_runs_per_device(gather):
  """A linen model whose params carry logical partitioning constrains them on every apply
  under nn_partitioning.axis_rules; inside the per-device region the data axes are manual,
  so fxaccum maps them out of the rules there. The step takes the device view (it fell
  back to the global view before) and matches jax.value_and_grad on the whole batch."""
  from flax.linen import partitioning as nn_partitioning

  rules = (("embed", "fsdp"), ("mlp", "tensor"))  # lm1b's rules and mesh axes
  mesh = jax.make_mesh((2, 4, 1), ("data", "fsdp", "tensor"), axis_types=(AxisType.Auto,) * 3)
  model = LogicalMLP()
  rng = np.random.default_rng(5)
  x = rng.normal(size=(64, 16)).astype(np.float32)
  y = rng.normal(size=(64,)).astype(np.float32)
  abstract = jax.eval_shape(lambda: model.init(jax.random.key(0), x[:1]))
  logical = nn.get_partition_spec(abstract)["params"]

  def loss(p, b):
    return jnp.mean((model.apply({"params": p}, b["x"]) - b["y"]) ** 2)

  with jax.set_mesh(mesh), nn_partitioning.axis_rules(rules):
    shardings = nn.logical_to_mesh_sharding(logical, mesh, rules)
    params = nn.meta.unbox(jax.jit(lambda: model.init(jax.random.key(0), x[:1])["params"],
                                   out_shardings=shardings)())
    specs = jax.tree.map(lambda s: s.spec, shardings,
                         is_leaf=lambda s: isinstance(s, NamedSharding))
    batch = jax.device_put({"x": x, "y": y}, NamedSharding(mesh, P(("data", "fsdp"))))
    step = jax.jit(fxaccum.value_and_grad(loss, micro_batches=2, param_shardings=specs,
                                          fsdp_gather=gather))
    rep = diagnostics.report(step, params, batch)
    got = step(params, batch)
  assert [p.view for p in rep.paths] == ["device"], rep.paths
  assert rep.select("all-gather", axes="fsdp"), rep.summary()
  assert_tree_close(got, jax.value_and_grad(loss)(nn.meta.unbox(params), {"x": x, "y": y}))
