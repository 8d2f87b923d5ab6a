"""What fxaccum tells a user who did not read the docs: true reasons on every mesh size, a
warning on an empty compiled step, and a warning on a PRNG key every micro-batch shares."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import assert_tree_close
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import fxaccum
from fxaccum import diagnostics

ROWS, DIM = 16, 4
RNG = np.random.default_rng(0)
X = RNG.normal(size=(ROWS, DIM)).astype(np.float32)
Y = RNG.normal(size=(ROWS, 2)).astype(np.float32)
W = RNG.normal(size=(DIM, 2)).astype(np.float32)


def mean_loss(w, batch):
  x, y = batch
  return jnp.mean((x @ w - y) ** 2)


def constant_count_loss(w, batch):
  """A sum over examples divided by a constant: not a mean on fewer rows than 16."""
  x, y = batch
  return jnp.sum((x @ w - y) ** 2) / ROWS


def on_mesh(devices, loss):
  mesh = jax.make_mesh((devices,), ("data",), devices=jax.devices()[:devices])
  with jax.set_mesh(mesh):
    batch = jax.device_put((X, Y), NamedSharding(mesh, P("data")))
    fn = jax.jit(fxaccum.value_and_grad(loss, micro_batches=2))
    (path,) = diagnostics.paths(fn, W, batch)
    return path, fn(W, batch)


@pytest.mark.parametrize("devices", [1, 2, 8])
def test_the_reason_for_a_mean_loss_is_true_on_every_mesh_size(devices):
  path, (value, grad) = on_mesh(devices, mean_loss)
  # The reference: jax.value_and_grad of the mean over the 2 micro-batches (rows i::2).
  parts = [jax.value_and_grad(mean_loss)(W, (X[i::2], Y[i::2])) for i in range(2)]
  assert_tree_close((value, grad), jax.tree.map(lambda *a: sum(a) / 2, *parts), rtol=1e-5)
  assert "scale differently" not in path.reason, path
  if devices == 1:  # one device: its rows are the global micro-batch
    assert path.reason.startswith("one data-parallel device"), path
  else:
    assert path == diagnostics.Path("device", "the loss is a mean of per-example terms",
                                    ("data",)), path


@pytest.mark.parametrize("devices", [1, 8])
def test_a_loss_divided_by_a_constant_count_reads_so_only_where_it_matters(devices):
  """Negative control: on 8 devices the reason is the loss's scaling (true there); on one
  device it would not be, and the reason is the device count."""
  path, (value, grad) = on_mesh(devices, constant_count_loss)
  parts = [jax.value_and_grad(constant_count_loss)(W, (X[i::2], Y[i::2])) for i in range(2)]
  assert_tree_close((value, grad), jax.tree.map(lambda *a: sum(a) / 2, *parts), rtol=1e-5)
  assert path.view == "global"
  if devices == 1:
    assert path.reason.startswith("one data-parallel device"), path
  else:
    assert "scale differently" in path.reason, path


# --------------------------------------------------------------------------- empty steps


def nnx_step_parts():
  model = nnx.Linear(DIM, 2, rngs=nnx.Rngs(0))
  opt = fxaccum.Optimizer(model, optax.chain(fxaccum.accumulate(2), optax.adam(1e-3)),
                          wrt=nnx.Param)

  def step(model, opt, x):
    opt.update(model, nnx.grad(lambda m, x: jnp.mean(m(x) ** 2))(model, x))

  return step, model, opt, jnp.asarray(X)


def test_report_of_an_nnx_step_mutated_under_jax_jit_warns_with_the_fix():
  step, model, opt, x = nnx_step_parts()
  with pytest.warns(UserWarning, match=r"returns nothing.*nnx\.jit"):
    rep = diagnostics.report(jax.jit(step), model, opt, x)
  assert rep.memory.peak_bytes == 0  # what the user saw: an empty report
  compiled = jax.jit(step).lower(model, opt, x).compile()
  with pytest.warns(UserWarning, match="returns nothing"):
    diagnostics.from_compiled(compiled)


def test_report_of_a_step_that_computes_something_does_not_warn():
  """Negative control: the same step under nnx.jit, and a plain function."""
  step, model, opt, x = nnx_step_parts()
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    rep = diagnostics.report(nnx.jit(step), model, opt, x)
    assert rep.memory.output_bytes > 0
    diagnostics.report(jax.jit(lambda v: v * 2), x)


# --------------------------------------------------------------------------- shared keys


def dropout_loss():
  """A loss that draws a dropout mask per example from its key argument (a new function
  per test: the warning comes once per function)."""
  def loss(w, batch, key):
    x, y = batch
    keep = jax.random.bernoulli(key, 0.5, x.shape)
    return jnp.mean((jnp.where(keep, x / 0.5, 0) @ w - y) ** 2)
  return loss


def projection_loss():
  """A loss whose random draw has no batch axis: one projection every example shares."""
  def loss(w, batch, key):
    x, y = batch
    return jnp.mean((x @ jax.random.normal(key, (DIM, DIM)) @ w - y) ** 2)
  return loss


def shared_warnings(loss, key, **options):
  fn = fxaccum.value_and_grad(loss, micro_batches=4, **options)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    out = fn(W, (X, Y), key)
    fn(W, (X, Y), key)  # the second call does not warn again
  return [str(w.message) for w in caught if "PRNG key" in str(w.message)], out


@pytest.mark.parametrize("key", [jax.random.key(1), jax.random.PRNGKey(1)],
                         ids=["typed", "raw"])
def test_a_shared_key_drawing_per_example_noise_warns_once_naming_rng_argnums(key):
  loss = dropout_loss()
  found, (value, grad) = shared_warnings(loss, key)
  assert len(found) == 1, found
  assert "rng_argnums=2" in found[0] and "every micro-batch" in found[0], found
  # What the warning says happens: every micro-batch draws with the same key.
  parts = [jax.value_and_grad(loss)(W, (X[i::4], Y[i::4]), key) for i in range(4)]
  assert_tree_close((value, grad), jax.tree.map(lambda *a: sum(a) / 4, *parts), rtol=1e-5)


def test_no_warning_with_rng_argnums_or_without_a_batch_axis_under_jit():
  """Negative controls: the same dropout with rng_argnums (folded per micro-batch), and a
  draw without a batch axis, shared on purpose; also traced under jax.jit."""
  key = jax.random.key(1)
  assert shared_warnings(dropout_loss(), key, rng_argnums=2)[0] == []
  assert shared_warnings(projection_loss(), key)[0] == []
  with warnings.catch_warnings(record=True) as caught:  # one micro-batch shares with none
    warnings.simplefilter("always")
    fxaccum.value_and_grad(dropout_loss(), micro_batches=1)(W, (X, Y), key)
  assert not [w for w in caught if "PRNG key" in str(w.message)]
  loss = dropout_loss()
  with pytest.warns(UserWarning, match="rng_argnums=2"):
    jax.jit(fxaccum.value_and_grad(loss, micro_batches=4))(W, (X, Y), key)


def test_no_warning_for_an_nnx_rngs_argument_threaded_through_the_micro_batches():
  """Negative control: an nnx.Rngs argument holds keys too, but fxaccum threads it (it
  advances once per micro-batch), so its dropout masks differ between micro-batches."""
  model = nnx.Linear(DIM, 2, rngs=nnx.Rngs(0))
  drop = nnx.Dropout(0.5)

  def loss(model, batch, rngs):
    x, y = batch
    return jnp.mean((model(drop(x, rngs=rngs)) - y) ** 2)

  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    nnx.jit(fxaccum.value_and_grad(loss, micro_batches=4))(model, (X, Y), nnx.Rngs(dropout=1))
  assert not [w for w in caught if "PRNG key" in str(w.message)]
