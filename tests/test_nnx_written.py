"""NNX layers that write their own params (nnx.WeightNorm, nnx.SpectralNorm) in-step.

Reference: nnx.value_and_grad on the k global micro-batches (rows i::k) one after another
on a copy of the same module: micro-batch i reads, and is differentiated at, the kernel
micro-batch i - 1 wrote; the module keeps what the last one wrote. The layer catalogue
(tests/test_layer_catalogue.py) sweeps k and meshes; these tests pin the contract's parts
one by one, with the negative control that tells the old behaviour apart.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import assert_tree_close, mesh_of
from jax.sharding import AxisType

import fxaccum
from fxaccum import diagnostics

ROWS, DIM, WIDTH = 32, 4, 8


def model_with(layer: type, seed: int = 0) -> nnx.Module:
  rngs = nnx.Rngs(seed)
  return nnx.Sequential(layer(nnx.Linear(DIM, WIDTH, rngs=rngs), rngs=rngs), nnx.relu,
                        nnx.Linear(WIDTH, 1, rngs=rngs))


def loss_fn(model, batch):
  return jnp.mean((model(batch["x"])[:, 0] - batch["y"]) ** 2)


def data(seed: int = 0):
  rng = np.random.default_rng(seed)
  return {"x": rng.normal(size=(ROWS, DIM)).astype(np.float32),
          "y": rng.normal(size=(ROWS,)).astype(np.float32)}


def sequential(model, batch, k):
  """nnx.value_and_grad on micro-batches i::k one after another, on `model` itself."""
  step = nnx.jit(nnx.value_and_grad(loss_fn))
  values, grads = [], []
  for i in range(k):
    value, g = step(model, jax.tree.map(lambda a, i=i: a[i::k], batch))
    values.append(value)
    grads.append(g)
  return sum(values) / k, jax.tree.map(lambda *g: sum(g) / k, *grads)


def everything(model):
  """The module's whole state, params included (PRNG keys as their key data)."""
  return jax.tree.map(lambda a: np.asarray(jax.random.key_data(a) if jnp.issubdtype(
      a.dtype, jax.dtypes.prng_key) else a), nnx.state(model))


@pytest.mark.parametrize("layer", [nnx.WeightNorm, nnx.SpectralNorm])
@pytest.mark.parametrize("k", [1, 4])
def test_written_params_are_threaded_and_written_back(layer, k):
  """Value, gradients and the whole module after the step (the written kernel, the power
  iteration's u and sigma) equal k sequential nnx.value_and_grad calls; at k = 1 that is
  nnx.value_and_grad on the large batch itself."""
  batch = data()
  model, reference = model_with(layer), model_with(layer)
  want = sequential(reference, batch, k)
  mesh = mesh_of((8,), ("data",), AxisType.Auto)
  with jax.set_mesh(mesh):
    got = nnx.jit(fxaccum.value_and_grad(loss_fn, micro_batches=k))(
        model, jax.device_put(batch, jax.P("data")))
  assert_tree_close(got, want)
  assert_tree_close(everything(model), everything(reference))


def test_old_behaviour_is_told_apart():
  """Negative control: each micro-batch differentiated at the kernel the call started
  from (the write dropped, as before this change) is off by far more than the tests'
  tolerance, and so is a module left holding the unwritten kernel."""
  batch, k = data(), 4
  start, reference = model_with(nnx.WeightNorm), model_with(nnx.WeightNorm)
  _, want = sequential(reference, batch, k)
  dropped = [nnx.value_and_grad(loss_fn)(nnx.clone(start), jax.tree.map(
      lambda a, i=i: a[i::k], batch))[1] for i in range(k)]
  dropped_mean = jax.tree.map(lambda *g: sum(g) / k, *dropped)
  with pytest.raises(AssertionError):
    assert_tree_close(dropped_mean, want)
  with pytest.raises(AssertionError):
    assert_tree_close(everything(model_with(nnx.WeightNorm)), everything(reference))


def test_the_report_says_why_the_step_runs_in_the_global_view():
  model, batch = model_with(nnx.WeightNorm), data()
  mesh = mesh_of((8,), ("data",), AxisType.Auto)
  step = nnx.jit(fxaccum.value_and_grad(loss_fn, micro_batches=2))
  with jax.set_mesh(mesh):
    (path,) = diagnostics.report(step, model, jax.device_put(batch, jax.P("data"))).paths
  assert path.view == "global"
  assert "writes a differentiated variable" in path.reason


def test_forced_device_view_is_refused_with_the_fix():
  model, batch = model_with(nnx.SpectralNorm), data()
  mesh = mesh_of((8,), ("data",), AxisType.Auto)
  step = fxaccum.value_and_grad(loss_fn, micro_batches=2, view="device")
  with jax.set_mesh(mesh), pytest.raises(ValueError, match="writes a differentiated"):
    step(model, jax.device_put(batch, jax.P("data")))


class Discriminator(nnx.Module):
  """A small GAN discriminator with spectral normalization, as flax's docs write one."""

  def __init__(self, rngs: nnx.Rngs):
    self.hidden = nnx.SpectralNorm(nnx.Linear(DIM, WIDTH, rngs=rngs), rngs=rngs)
    self.out = nnx.SpectralNorm(nnx.Linear(WIDTH, 1, rngs=rngs), rngs=rngs)

  def __call__(self, x):
    return self.out(nnx.leaky_relu(self.hidden(x), 0.2))[:, 0]


def discriminator_loss(model, batch):
  """Real rows labelled 1, generated rows 0."""
  return jnp.mean(optax.sigmoid_binary_cross_entropy(model(batch["x"]), batch["real"]))


@pytest.mark.parametrize("k", [1, 4])
def test_spectral_norm_discriminator_trains_like_nnx(k):
  """Three optimizer steps, as flax's docs write a training loop (nnx.Optimizer under
  nnx.jit): with fxaccum's k micro-batches, params and state equal the same loop with
  nnx.value_and_grad on the large batch (k = 1) or on the micro-batches one after
  another (k = 4)."""
  rng = np.random.default_rng(1)
  batches = [{"x": rng.normal(size=(ROWS, DIM)).astype(np.float32),
              "real": (np.arange(ROWS) % 2).astype(np.float32)} for _ in range(3)]
  model, reference = Discriminator(nnx.Rngs(0)), Discriminator(nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
  ref_optimizer = nnx.Optimizer(reference, optax.adam(1e-2), wrt=nnx.Param)

  @nnx.jit
  def train_step(model, optimizer, batch):
    loss, grads = fxaccum.value_and_grad(discriminator_loss, micro_batches=k)(model, batch)
    optimizer.update(model, grads)
    return loss

  @nnx.jit
  def micro_grads(model, batch):
    return nnx.value_and_grad(discriminator_loss)(model, batch)[1]

  @nnx.jit
  def apply(model, optimizer, grads):
    optimizer.update(model, grads)

  mesh = mesh_of((8,), ("data",), AxisType.Auto)
  with jax.set_mesh(mesh):
    for batch in batches:
      train_step(model, optimizer, jax.device_put(batch, jax.P("data")))
      grads = [micro_grads(reference, jax.tree.map(lambda a, i=i: a[i::k], batch))
               for i in range(k)]
      apply(reference, ref_optimizer, jax.tree.map(lambda *g: sum(g) / k, *grads))
  assert_tree_close(everything(model), everything(reference))


class Rematted(nnx.Module):
  """A layer run under nnx.remat, which sets its params again to the values it was given."""

  def __init__(self, layer: type | None, rngs: nnx.Rngs):
    inner = nnx.Linear(DIM, WIDTH, rngs=rngs)
    self.hidden = inner if layer is None else layer(inner, rngs=rngs)
    self.out = nnx.Linear(WIDTH, 1, rngs=rngs)

  def __call__(self, x):
    hidden = nnx.remat(lambda layer, x: nnx.relu(layer(x)))(self.hidden, x)
    return self.out(hidden)


@pytest.mark.parametrize("layer", [None, nnx.WeightNorm])
def test_a_param_set_again_to_what_it_read_is_no_write(layer):
  """nnx.remat writes its params back unchanged: no written param (the per-device view,
  as before), where a WeightNorm inside it still writes its kernel; both exact."""
  batch, k = data(), 4
  model, reference = Rematted(layer, nnx.Rngs(0)), Rematted(layer, nnx.Rngs(0))
  want = sequential(reference, batch, k)
  mesh = mesh_of((8,), ("data",), AxisType.Auto)
  step = nnx.jit(fxaccum.value_and_grad(loss_fn, micro_batches=k))
  with jax.set_mesh(mesh):
    sharded = jax.device_put(batch, jax.P("data"))
    (path,) = diagnostics.paths(step, nnx.clone(model), sharded)
    got = step(model, sharded)
  assert path.view == ("device" if layer is None else "global"), path
  assert_tree_close(got, want)
  assert_tree_close(everything(model), everything(reference))
