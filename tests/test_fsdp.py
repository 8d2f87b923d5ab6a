"""FSDP strategies. fsdp="zero3": params gathered where they are used, inside the
micro-batch loop and inside a scan over stacked layers, gathered again in the backward
pass; fsdp="auto" takes it where it lowers the peak. Exact against jax.value_and_grad on
the whole batch."""

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
      weighted_loss, micro_batches=k, fsdp="zero3",
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


def test_param_shardings_with_none_for_an_argument_of_a_tuple_argnums():
  """param_shardings=(None, specs) for argnums=(0, 1): None says nothing of argument 0
  (its leaves' sharding stays unknown) and specs shard argument 1's gradients."""
  mesh = mesh_of((8,), ("data",), AxisType.Auto)
  params, data = make_params(), make_data(k=2)
  first = {"w1": params["w1"]}
  rest = {n: v for n, v in params.items() if n != "w1"}
  specs = {n: MLP_SPECS[n] for n in rest}

  def loss(first, rest, batch):
    return weighted_loss({**first, **rest}, batch)

  step = jax.jit(fxaccum.value_and_grad(loss, argnums=(0, 1), micro_batches=2,
                                        batch_argnums=2, param_shardings=(None, specs)))
  with jax.set_mesh(mesh):
    value, (g_first, g_rest) = step(put(first, mesh, {"w1": P()}), put(rest, mesh, specs),
                                    put(data, mesh, DATA))
  ref_value, ref_grads = jax.value_and_grad(reference_token_mean)(params, data)
  assert_tree_close((value, {**g_first, **g_rest}), (ref_value, ref_grads))
  assert g_rest["w2"].sharding.spec == P("data"), g_rest["w2"].sharding


@pytest.mark.parametrize("k", [1, 4])
def test_scanned_layers_are_gathered_one_layer_at_a_time(k):
  """nn.scan over stacked params: each layer's shard is gathered inside the scan's body,
  in the forward and again in the backward pass (2 x layers x k gathers of one layer)."""
  layers = 4
  loss, params, data = stack_setup(layers)
  mesh = mesh_of((8,), ("data",), AxisType.Explicit)
  step = jax.jit(fxaccum.value_and_grad(loss, micro_batches=k, fsdp="zero3", view="device"))
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


@pytest.mark.slow
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
      for fsdp in ("zero3", "zero1"):
        step = jax.jit(fxaccum.value_and_grad(loss, micro_batches=4, fsdp=fsdp, view="device"))
        memory = step.lower(*args).compile().memory_analysis()
        temps[fsdp, layers] = memory.temp_size_in_bytes
  added = param_bytes[16] - param_bytes[8]
  grown = {fsdp: temps[fsdp, 16] - temps[fsdp, 8] for fsdp in ("zero3", "zero1")}
  assert grown["zero1"] >= added, (grown, added)
  assert grown["zero3"] < added / 2, (grown, added)


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
  step = jax.jit(fxaccum.value_and_grad(loss, micro_batches=2, fsdp="zero3"))
  with jax.set_mesh(mesh):
    got = step(put(params, mesh, specs), put(data, mesh, {"x": P("data")}))
  assert_tree_close(got, jax.value_and_grad(loss)(params, data))


def test_fsdp_errors():
  with pytest.raises(ValueError, match="fsdp must be one of"):
    fxaccum.value_and_grad(weighted_loss, micro_batches=2, fsdp="per_layer")


def test_a_step_in_the_global_view_warns_that_it_gathers_per_step():
  """A loss that mixes examples (batch statistics) runs in the global view, where the
  compiler places the gathers: the option cannot apply, and says so."""
  def batch_mean_loss(params, batch):
    h = jnp.tanh(batch["x"] @ params["w1"] + params["b1"])
    h = h - jnp.mean(h, axis=0)  # mixes the examples of the micro-batch
    return jnp.mean((h @ params["w2"])[..., 0] ** 2)

  mesh = mesh_of((8,), ("data",), AxisType.Auto)
  step = jax.jit(fxaccum.value_and_grad(batch_mean_loss, micro_batches=2, fsdp="zero3",
                                        param_shardings=MLP_SPECS))
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
    step = jax.jit(fxaccum.value_and_grad(loss, micro_batches=2, fsdp="zero3"))
    with pytest.warns(UserWarning, match="has no effect on this step"):
      got = step(*args)
    (path,) = diagnostics.paths(step, *args)
    reference = jax.jit(jax.value_and_grad(loss))(*args)  # the whole batch, plain JAX
  assert path.view == "global" and "fsdp='auto' gathers" in path.reason, path
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


@pytest.mark.parametrize("fsdp", ["zero2", "zero3"])
def test_linen_logical_partitioning_runs_per_device(fsdp):
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
                                          fsdp=fsdp))
    rep = diagnostics.report(step, params, batch)
    got = step(params, batch)
  assert [p.view for p in rep.paths] == ["device"], rep.paths
  assert rep.select("all-gather", axes="fsdp"), rep.summary()
  assert_tree_close(got, jax.value_and_grad(loss)(nn.meta.unbox(params), {"x": x, "y": y}))


def scanned_mlp(layers, width=256, batch=64):
  """Layers stacked ``(layers, width, width)`` and run by ``lax.scan``, each gathering its
  params with ``jax.sharding.reshard`` before use (as Explicit meshes require), as large
  models are written; every kernel and bias sharded over ``data`` along its width."""
  rng = np.random.default_rng(7)
  params = {"w": (rng.normal(size=(layers, width, width)) / np.sqrt(width)).astype(np.float32),
            "b": (rng.normal(size=(layers, width)) / 10).astype(np.float32)}
  data = {"x": rng.normal(size=(batch, width)).astype(np.float32),
          "y": rng.normal(size=(batch, width)).astype(np.float32)}

  def loss(p, b):
    def layer(h, wb):
      w, bias = (jax.sharding.reshard(v, P()) for v in wb)
      return jnp.tanh(h @ w + bias), None
    h, _ = lax.scan(layer, b["x"], (p["w"], p["b"]))
    return jnp.mean((h - b["y"]) ** 2)

  return loss, params, data, {"w": P(None, None, "data"), "b": P(None, "data")}


def compiled_peak(step, *args):
  """Compiled peak bytes per device: temp + arguments + outputs - aliased."""
  m = step.lower(*args).compile().memory_analysis()
  return (m.temp_size_in_bytes + m.argument_size_in_bytes + m.output_size_in_bytes
          - m.alias_size_in_bytes)


@pytest.mark.parametrize("layers", [4, 8])
def test_the_default_peaks_below_the_large_batch_on_a_scanned_fsdp_model(layers):
  """The default takes zero3 on stacked, scanned FSDP layers: its compiled peak is at most
  the large batch's (jax.value_and_grad on the whole batch), where gathering once per step
  (zero2, the default before) needs about twice the large batch's. Exact."""
  loss, params, data, specs = scanned_mlp(layers)
  mesh = mesh_of((8,), ("data",), AxisType.Explicit)
  step = jax.jit(fxaccum.value_and_grad(loss, micro_batches=8))
  with jax.set_mesh(mesh):
    args = (put(params, mesh, specs), put(data, mesh, {"x": P("data"), "y": P("data")}))
    peaks = {name: compiled_peak(jax.jit(f), *args) for name, f in (
        ("large batch", jax.value_and_grad(loss)), ("default", step),
        ("zero2", fxaccum.value_and_grad(loss, micro_batches=8, fsdp="zero2")))}
    (path,) = diagnostics.paths(step, *args)
    got = step(*args)
    reference = jax.value_and_grad(loss)(params, data)  # unsharded
  assert path.fsdp.startswith("zero3: params stacked over layers are scanned"), path
  assert peaks["default"] <= peaks["large batch"] < peaks["zero2"] / 1.5, peaks
  assert_tree_close(got, reference)


def test_zero3_gathers_each_layer_again_in_the_backward_pass():
  """A layer that reshards its gathered param (or casts it): zero3 keeps neither for the
  backward pass but gathers the layer again there, 2 x layers x k gathers of one layer
  (before, the reshard was kept: one gather per layer and micro-batch, and every layer's
  whole param live until the backward pass)."""
  layers, k = 4, 2
  loss, params, data, specs = scanned_mlp(layers, width=64, batch=32)
  mesh = mesh_of((8,), ("data",), AxisType.Explicit)
  step = jax.jit(fxaccum.value_and_grad(loss, micro_batches=k, fsdp="zero3"))
  with jax.set_mesh(mesh):
    args = (put(params, mesh, specs), put(data, mesh, {"x": P("data"), "y": P("data")}))
    rep = diagnostics.report(step, *args)
  layer_bytes = params["w"][0].nbytes
  per_layer = [c for c in rep.select("all-gather", axes="data") if c.bytes == layer_bytes]
  assert sum(c.executions for c in per_layer) == 2 * layers * k, rep.summary()


class WideMLP(nn.Module):
  """Unrolled layers (a Python loop of nn.Dense)."""

  width: int
  layers: int = 3

  @nn.compact
  def __call__(self, x):
    for _ in range(self.layers):
      x = nn.gelu(nn.Dense(self.width)(x))
    return nn.Dense(1)(x)[..., 0]


@pytest.mark.parametrize("width,batch", [(256, 16), (16, 512)])
def test_auto_gathers_unrolled_layers_once_per_step(width, batch):
  """Unrolled layers (0.8 MiB of params beside 1 row per device and micro-batch, and 3 KiB
  beside 32 rows): zero2, gathered once per step; whether zero3 would lower their peak is
  the compiler's schedule, while its second gather per micro-batch always costs. The path
  says which and why; exact."""
  model = WideMLP(width)
  rng = np.random.default_rng(2)
  data = {"x": rng.normal(size=(batch, width)).astype(np.float32),
          "y": rng.normal(size=(batch,)).astype(np.float32)}
  params = model.init(jax.random.key(0), data["x"][:1])

  def loss(p, b):
    return jnp.mean((model.apply(p, b["x"]) - b["y"]) ** 2)

  mesh = mesh_of((8,), ("data",), AxisType.Explicit)
  step = jax.jit(fxaccum.value_and_grad(loss, micro_batches=2))
  with jax.set_mesh(mesh):
    args = (fsdp_put(params, mesh), jax.device_put(data, NamedSharding(mesh, P("data"))))
    (path,) = diagnostics.paths(step, *args)
    got = step(*args)
  assert path.view == "device", path
  assert path.fsdp.startswith("zero2: gathered once per step: no FSDP param is scanned"), path
  assert_tree_close(got, jax.value_and_grad(loss)(params, data))


def test_zero3_skips_a_non_finite_micro_batch_on_every_device():
  """skip_nonfinite with zero3: each micro-batch's gradient is reduce-scattered as the
  backward pass makes it, so no device can drop its share alone; the whole global
  micro-batch is dropped. (Before, the device whose rows held the NaN dropped them, as did
  the one whose shard held the NaN gradient element, and the others kept the rest: a
  linear loss keeps the NaN in one element.) Equal to the mean over the other global
  micro-batches."""
  k, bad_row, width = 4, 21, 16
  rng = np.random.default_rng(4)
  params = {"w": rng.normal(size=(width,)).astype(np.float32)}
  data = {"x": rng.normal(size=(64, width)).astype(np.float32)}
  data["x"][bad_row, 3] = np.nan

  def loss(p, b):
    return jnp.mean(jnp.sum(b["x"] * p["w"], axis=-1))

  mesh = mesh_of((8,), ("data",), AxisType.Explicit)
  step = jax.jit(fxaccum.value_and_grad(lambda p, b: (loss(p, b), fxaccum.Statistics()),
                                        has_aux=True, micro_batches=k, fsdp="zero3",
                                        skip_nonfinite=True))
  with jax.set_mesh(mesh):
    args = (put(params, mesh, {"w": P("data")}), put(data, mesh, {"x": P("data")}))
    (value, stats), grads = step(*args)
  # Micro-batch i holds rows i::k of each device's 8 rows.
  bad = (bad_row % 8) % k
  kept = [data["x"].reshape(8, 8 // k, k, width)[:, :, i].reshape(-1, width)
          for i in range(k) if i != bad]
  ref = jax.value_and_grad(lambda p: sum(loss(p, {"x": x}) for x in kept) / len(kept))(params)
  assert_tree_close((value, grads), ref)
  assert int(stats.skipped) == 8  # every device's share of one micro-batch
  assert np.isnan(float(stats.noise_scale.b_simple))  # zero3 holds no micro-batch gradient



def test_auto_traces_the_loss_as_often_as_a_named_strategy():
  """fsdp='auto' reads the view analysis's trace of the micro-step to see whether it scans
  over stacked params: an unrolled FSDP step traces the loss as often as with fsdp='zero2'
  (a trace of its own would cost 10-15 % of the step's trace and lower)."""
  mesh = mesh_of((8,), ("data",), AxisType.Explicit)
  traces = {}
  for fsdp in ("auto", "zero2"):
    count = [0]

    def loss(p, b, count=count):
      count[0] += 1
      return weighted_loss(p, b)

    with jax.set_mesh(mesh):
      jax.jit(fxaccum.value_and_grad(loss, micro_batches=2, fsdp=fsdp)).lower(
          put(make_params(), mesh, MLP_SPECS), put(make_data(k=2), mesh, DATA))
    traces[fsdp] = count[0]
  assert traces["auto"] == traces["zero2"], traces
