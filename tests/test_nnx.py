"""flax NNX modules in-step, the nnx.value_and_grad way, and aux that combines like metrics.

Reference: nnx.value_and_grad called on the k global micro-batches (rows i::k) one after
another on a copy of the same module: the mean of its gradients, and the module state
(BatchNorm statistics, RNG counts, sown values) it leaves behind.
"""

import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import assert_tree_close, mesh_of
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import fxaccum
from fxaccum import diagnostics

ROWS, DIM, WIDTH = 64, 8, 16


class MLP(nnx.Module):
  """Linear -> BatchNorm (train mode) -> relu -> Dropout -> sow -> Linear."""

  def __init__(self, rate: float, rngs: nnx.Rngs):
    self.up = nnx.Linear(DIM, WIDTH, use_bias=False, rngs=rngs)  # BatchNorm cancels a bias
    self.norm = nnx.BatchNorm(WIDTH, rngs=rngs)
    self.drop = nnx.Dropout(rate, rngs=rngs)
    self.out = nnx.Linear(WIDTH, 1, rngs=rngs)

  def __call__(self, x):
    h = self.drop(nnx.relu(self.norm(self.up(x))))
    self.sow(nnx.Intermediate, "hidden_mean", jnp.mean(h))
    return self.out(h)[..., 0]


def data(seed=0):
  rng = np.random.default_rng(seed)
  return {"x": rng.normal(size=(ROWS, DIM)).astype(np.float32),
          "y": rng.normal(size=(ROWS,)).astype(np.float32)}


def loss_fn(model, batch):
  pred = model(batch["x"])
  aux = {"pred": fxaccum.Concat(pred), "big": fxaccum.Sum(jnp.sum(jnp.abs(pred) > 0.5))}
  return jnp.mean((pred - batch["y"]) ** 2), aux


def sequential(model, batch, k):
  """nnx.value_and_grad on micro-batches i::k, one after another, on `model` itself."""
  grads, losses, preds, big = None, [], [], 0
  for i in range(k):
    micro = jax.tree.map(lambda a, i=i: a[i::k], batch)
    (value, aux), g = nnx.value_and_grad(loss_fn, has_aux=True)(model, micro)
    grads = g if grads is None else jax.tree.map(jnp.add, grads, g)
    losses.append(value)
    preds.append(aux["pred"].value)
    big += int(aux["big"].value)
  rows = np.empty(ROWS, np.float32)
  for i, p in enumerate(preds):
    rows[i::k] = p
  return (sum(losses) / k, rows, big), jax.tree.map(lambda g: g / k, grads)


def state_of(model):
  """Every non-Param variable's value as numpy (PRNG keys as their key data)."""
  _, params, rest = nnx.split(model, nnx.Param, ...)
  return jax.tree.map(lambda a: np.asarray(jax.random.key_data(a) if jnp.issubdtype(
      a.dtype, jax.dtypes.prng_key) else a), rest)


@pytest.mark.filterwarnings("ignore:Using 'Module.sow\\(\\)':DeprecationWarning")
@pytest.mark.parametrize("rate", [0.0, 0.1])
@pytest.mark.parametrize("k", [1, 4])
def test_nnx_module_matches_the_sequential_nnx_value_and_grad(k, rate):
  batch = data()
  model = MLP(rate, nnx.Rngs(0))
  reference = nnx.clone(model)
  (ref_loss, ref_rows, ref_big), ref_grads = sequential(reference, batch, k)

  mesh = mesh_of((8,), ("data",), AxisType.Auto)

  @nnx.jit
  def step(model, batch):
    return fxaccum.value_and_grad(loss_fn, has_aux=True, micro_batches=k)(model, batch)

  with jax.set_mesh(mesh):
    sharded = jax.tree.map(lambda a: jax.device_put(a, NamedSharding(mesh, P("data"))), batch)
    (loss, aux), grads = step(model, sharded)
  assert isinstance(grads, nnx.State)
  assert_tree_close((loss, grads), (ref_loss, ref_grads))
  np.testing.assert_allclose(aux["pred"], ref_rows, rtol=1e-5, atol=1e-6)  # batch order
  assert int(aux["big"]) == ref_big
  # BatchNorm statistics, RNG counts and sown values, as k sequential calls left them.
  got, want = state_of(model), state_of(reference)
  assert jax.tree.structure(got) == jax.tree.structure(want)
  assert_tree_close(got, want)
  assert len(model.hidden_mean.get_value()) == k  # one sown value per micro-batch, in order
  if k == 1 and rate == 0.0:  # one micro-batch is the large batch
    large = nnx.clone(MLP(rate, nnx.Rngs(0)))
    (large_loss, _), large_grads = nnx.value_and_grad(loss_fn, has_aux=True)(large, batch)
    assert_tree_close((loss, grads), (large_loss, large_grads))


@pytest.mark.filterwarnings("ignore:Using 'Module.sow\\(\\)':DeprecationWarning")
def test_dropout_masks_differ_from_a_frozen_rng():
  """Negative control: without threading the RNG count every micro-batch would draw the
  same mask; the sequential reference (different masks) tells the two apart."""
  batch, k = data(), 4
  model = MLP(0.5, nnx.Rngs(0))
  frozen = nnx.clone(model)
  (_, _, _), ref_grads = sequential(nnx.clone(model), batch, k)

  def same_mask(model, batch):  # rewinds the RNG count each micro-batch
    count = model.drop.rngs.count[...]
    out = loss_fn(model, batch)
    model.drop.rngs.count[...] = count
    return out

  _, frozen_grads = fxaccum.value_and_grad(same_mask, has_aux=True, micro_batches=k)(frozen,
                                                                                    batch)
  _, grads = fxaccum.value_and_grad(loss_fn, has_aux=True, micro_batches=k)(model, batch)
  assert_tree_close(grads, ref_grads)
  diff = max(float(np.max(np.abs(a - b))) for a, b in zip(
      jax.tree.leaves(frozen_grads), jax.tree.leaves(ref_grads), strict=True))
  assert diff > 1e-3


def test_nnx_optimizer_and_jax_jit_with_split_merge():
  """The returned nnx.State feeds nnx.Optimizer; the same step under jax.jit (split/merge)."""
  batch, k = data(), 2
  model = MLP(0.0, nnx.Rngs(0))
  twin = nnx.clone(model)
  opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
  grad_fn = fxaccum.value_and_grad(loss_fn, has_aux=True, micro_batches=k)

  with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    _, grads = grad_fn(model, batch)
    opt.update(model, grads)

    graphdef, state = nnx.split(twin)

    @jax.jit
    def step(state, batch):
      module = nnx.merge(graphdef, state)
      _, grads = grad_fn(module, batch)
      nnx.update(module, jax.tree.map(lambda p, g: p - 0.1 * g, nnx.state(module, nnx.Param),
                                      grads))
      return nnx.state(module, nnx.Not(nnx.Intermediate))

    nnx.update(twin, step(state, batch))
  for kind in (nnx.Param, nnx.BatchStat, nnx.RngCount):
    assert_tree_close(nnx.state(twin, kind), nnx.state(model, kind))


def test_device_view_for_a_module_whose_state_passes_through():
  """BatchNorm in eval mode and no dropout: state is read, not written; the per-example
  loss runs per device with one reduction after the loop."""
  batch, k = data(), 4
  model = MLP(0.0, nnx.Rngs(0))
  model.eval()

  def loss(model, batch):
    pred = model.out(nnx.relu(model.norm(model.up(batch["x"]))))[..., 0]
    return jnp.mean((pred - batch["y"]) ** 2)

  reference = jax.tree.map(lambda *g: sum(g) / k, *[nnx.grad(loss)(
      nnx.clone(model), jax.tree.map(lambda a, i=i: a[i::k], batch)) for i in range(k)])
  mesh = mesh_of((8,), ("data",), AxisType.Explicit)
  graphdef, state = nnx.split(model)

  def step(state, batch):
    return fxaccum.grad(loss, micro_batches=k)(nnx.merge(graphdef, state), batch)

  with jax.set_mesh(mesh):
    sharded = jax.tree.map(lambda a: jax.device_put(a, NamedSharding(mesh, P("data"))), batch)
    rep = diagnostics.report(jax.jit(step), state, sharded)
    grads = jax.jit(step)(state, sharded)
  assert_tree_close(grads, reference)
  assert [p.view for p in rep.paths] == ["device"], rep.summary()
  assert rep.reductions(place="loop") == [], rep.summary()


def test_linen_batch_stats_through_the_nnx_bridge():
  """The linen recipe: wrap the model with nnx.bridge.ToNNX and call it with
  mutable=["batch_stats"]; batch_stats then thread through the micro-batches in order."""

  class LinenMLP(nn.Module):
    @nn.compact
    def __call__(self, x):
      x = nn.BatchNorm(use_running_average=False)(nn.Dense(WIDTH, use_bias=False)(x))
      return nn.Dense(1)(nn.relu(x))[..., 0]

  batch, k = data(), 4
  model = nnx.bridge.ToNNX(LinenMLP(), rngs=nnx.Rngs(0))
  nnx.bridge.lazy_init(model, batch["x"][:2])
  reference = nnx.clone(model)

  def loss(model, batch):
    return jnp.mean((model(batch["x"], mutable=["batch_stats"]) - batch["y"]) ** 2)

  grads = None
  for i in range(k):  # linen's own sequential semantics, via the same bridge
    g = nnx.grad(loss)(reference, jax.tree.map(lambda a, i=i: a[i::k], batch))
    grads = g if grads is None else jax.tree.map(jnp.add, grads, g)
  got = fxaccum.grad(loss, micro_batches=k)(model, batch)
  assert_tree_close(got, jax.tree.map(lambda g: g / k, grads))
  assert_tree_close(state_of(model), state_of(reference))


def test_plain_batch_shaped_aux_warns_and_points_to_concat():
  def loss(w, x):
    per_example = x @ w
    return jnp.mean(per_example), per_example

  with pytest.warns(UserWarning, match="fxaccum.Concat"):
    fxaccum.value_and_grad(loss, has_aux=True, micro_batches=4)(jnp.ones(3),
                                                                jnp.ones((16, 3)))


class MnistLikeCNN(nnx.Module):
  """flax's NNX mnist example in small: dropout from an ``nnx.Rngs`` passed at call time."""

  def __init__(self, rngs: nnx.Rngs):
    self.up = nnx.Linear(DIM, WIDTH, use_bias=False, rngs=rngs)  # BatchNorm cancels a bias
    self.norm = nnx.BatchNorm(WIDTH, rngs=rngs)
    self.drop = nnx.Dropout(rate=0.25)
    self.out = nnx.Linear(WIDTH, 1, rngs=rngs)

  def __call__(self, x, rngs: nnx.Rngs):
    return self.out(nnx.relu(self.drop(self.norm(self.up(x)), rngs=rngs)))[..., 0]


def mnist_loss(model, batch, rngs):
  pred = model(batch["x"], rngs)
  return jnp.mean((pred - batch["y"]) ** 2), fxaccum.Concat(pred)


@pytest.mark.parametrize("k", [1, 4])
def test_rngs_argument_is_threaded_like_module_state(k):
  """``loss_fn(model, batch, rngs)`` (flax's NNX mnist example): the Rngs is split with
  the model and its counts threaded, as nnx.value_and_grad on the micro-batches one after
  another does; before, a TraceContextError."""
  batch = data(3)
  ref_model, ref_rngs = MnistLikeCNN(nnx.Rngs(0)), nnx.Rngs(dropout=7)
  grads, losses, rows = None, [], np.empty(ROWS, np.float32)
  for i in range(k):
    micro = jax.tree.map(lambda a, i=i: a[i::k], batch)
    (value, pred), g = nnx.value_and_grad(mnist_loss, has_aux=True)(ref_model, micro, ref_rngs)
    grads = g if grads is None else jax.tree.map(jnp.add, grads, g)
    losses.append(value)
    rows[i::k] = pred.value
  model, rngs = MnistLikeCNN(nnx.Rngs(0)), nnx.Rngs(dropout=7)
  step = nnx.jit(fxaccum.value_and_grad(mnist_loss, has_aux=True, micro_batches=k))
  (value, pred), got = step(model, batch, rngs)
  np.testing.assert_allclose(value, sum(losses) / k, rtol=1e-5)
  np.testing.assert_allclose(pred, rows, rtol=1e-5, atol=1e-6)
  assert_tree_close(got, jax.tree.map(lambda g: g / k, grads))
  assert_tree_close(state_of(model), state_of(ref_model))
  assert int(rngs.dropout.count[...]) == int(ref_rngs.dropout.count[...]) == k


def test_graph_node_in_the_batch_position_is_refused_with_the_fix():
  """gemma's ``grad_fn(model, rngs.fork())`` closes over the batch: with fxaccum's default
  batch_argnums=1 the Rngs is where the batch should be."""
  model, batch = MnistLikeCNN(nnx.Rngs(0)), data(4)

  def loss(model, rngs):
    return jnp.mean((model(batch["x"], rngs) - batch["y"]) ** 2)

  with pytest.raises(TypeError, match=r"argument 1 .*Rngs.*batch_argnums"):
    fxaccum.value_and_grad(loss, micro_batches=2)(model, nnx.Rngs(dropout=1).fork())


class Sower(nnx.Module):
  def __init__(self, rngs):
    self.lin = nnx.Linear(DIM, 1, rngs=rngs)

  def __call__(self, x):
    y = self.lin(x)[..., 0]
    self.sow(nnx.Intermediate, "mean", jnp.mean(y))
    return y


@pytest.mark.filterwarnings("ignore:Using 'Module.sow\\(\\)':DeprecationWarning")
def test_values_sown_before_the_call_are_kept_and_new_ones_appended():
  """A module that already holds a sown value (it ran once) crashed in nnx.merge."""
  batch, k = data(5), 2
  ref, model = Sower(nnx.Rngs(0)), Sower(nnx.Rngs(0))
  ref(batch["x"][:3])
  model(batch["x"][:3])
  grads = []
  for i in range(k):
    micro = jax.tree.map(lambda a, i=i: a[i::k], batch)
    grads.append(nnx.grad(lambda m, b: jnp.mean((m(b["x"]) - b["y"]) ** 2))(ref, micro))
  got = fxaccum.grad(lambda m, b: jnp.mean((m(b["x"]) - b["y"]) ** 2), micro_batches=k)(
      model, batch)
  assert_tree_close(got, jax.tree.map(lambda *g: sum(g) / k, *grads))
  want, have = ref.mean.get_value(), model.mean.get_value()
  assert len(have) == len(want) == 1 + k
  for a, b in zip(have, want, strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-6)


def test_aux_shaped_like_the_rows_but_not_per_example_does_not_warn():
  """8 channel statistics beside a micro-batch of 8 rows (imagenet's BatchNorm means at
  k=4): no Concat warning; a per-example leaf of the same shape still gets one."""
  x = np.arange(32 * 8, dtype=np.float32).reshape(32, 8) / 100

  def loss(w, x):
    h = x * w
    return jnp.mean(h), {"channel_means": jnp.mean(h, axis=0)}

  with warnings.catch_warnings():
    warnings.simplefilter("error")
    (_, aux), _ = fxaccum.value_and_grad(loss, has_aux=True, micro_batches=4)(
        jnp.ones(8), x)
  np.testing.assert_allclose(aux["channel_means"], np.mean(x, axis=0), rtol=1e-6)

  def per_example(w, x):
    return jnp.mean(x * w), {"row_means": jnp.mean(x * w, axis=1)}

  with pytest.warns(UserWarning, match="one value per example.*fxaccum.Concat"):
    fxaccum.value_and_grad(per_example, has_aux=True, micro_batches=4)(jnp.ones(8), x)


class Counter(nnx.Pytree):
  """A graph node that is no module: an nnx.Pytree holding a Variable."""

  def __init__(self):
    self.seen = nnx.Variable(jnp.zeros((), jnp.int32))


def test_any_graph_node_argument_is_threaded():
  """An nnx.Pytree (and the Variable inside it) passed to the loss is threaded through the
  micro-batches like module state: the loss's count of rows reaches the whole batch."""
  batch, k = data(6), 4
  model, counter = Sower(nnx.Rngs(0)), Counter()

  def loss(model, batch, counter):
    counter.seen[...] += batch["x"].shape[0]
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)

  with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)  # Module.sow
    fxaccum.grad(loss, micro_batches=k)(model, batch, counter)
  assert int(counter.seen[...]) == ROWS
