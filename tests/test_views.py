"""Exact for every loss and every model as written: the global view where the loss mixes
examples or cannot run per device, the per-device fast path only where it is the same.

References are independent of fxaccum: ``jax.value_and_grad`` on the whole batch (k=1) and
the mean of ``jax.value_and_grad`` over the global micro-batches (rows ``i::k``).
"""

import functools
import math

import flax.linen as nn
import gemma_style
import jax
import jax.numpy as jnp
import lm1b_style
import numpy as np
import optax
import pytest
import ulysses
from flax import nnx
from helpers import (
    AXIS_TYPES,
    DATA,
    assert_tree_close,
    example_mean_loss,
    global_micro_batch_reference,
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

# k = 1 runs jax.value_and_grad's program; k > 1 the analysis and the loop (k = 2 and 4 alike).
KS = (1, 4)
ROWS, DIM, WIDTH = 64, 8, 16
MESHES = {"dp8": ((8,), ("data",)), "data_x_model": ((4, 2), ("data", "model"))}


def rows_of_all_devices(z):
  """Every example's embedding on every device, as contrastive code on an Explicit mesh
  spells it (an Auto mesh lets the compiler gather)."""
  mesh = jax.typeof(z).sharding.mesh
  if any(t == AxisType.Explicit for t in mesh.axis_types):
    return jax.sharding.reshard(z, P())
  return z


def centred_setup():
  """Each example minus the batch mean: the issue's first example, as a matmul."""
  rng = np.random.default_rng(0)
  params = {"w": rng.normal(size=(DIM, WIDTH)).astype(np.float32)}
  batch = {"x": rng.normal(size=(ROWS, DIM)).astype(np.float32)}

  def loss(params, batch):
    h = batch["x"] @ params["w"]
    return jnp.mean((h - jnp.mean(h, axis=0)) ** 2)

  return loss, params, batch, {"w": P(None, "model")}


class BatchNormMLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.Dense(WIDTH, use_bias=False)(x)  # BatchNorm cancels a bias (as in ResNets)
    x = nn.relu(nn.BatchNorm(use_running_average=False)(x))
    return nn.Dense(1)(x)[..., 0]


def batchnorm_setup():
  """A linen model with BatchNorm in train mode (batch statistics of the micro-batch)."""
  model = BatchNormMLP()
  rng = np.random.default_rng(1)
  batch = {"x": rng.normal(size=(ROWS, DIM)).astype(np.float32),
           "y": rng.normal(size=(ROWS,)).astype(np.float32)}
  variables = jax.jit(model.init)(jax.random.key(0), batch["x"])  # one compile, not one per op
  stats = variables["batch_stats"]

  def loss(params, batch):
    out, _ = model.apply({"params": params, "batch_stats": stats}, batch["x"],
                         mutable=["batch_stats"])
    return jnp.mean((out - batch["y"]) ** 2)

  return loss, variables["params"], batch, {}


def contrastive_setup():
  """In-batch negatives: every example's positive against all others as negatives."""
  rng = np.random.default_rng(2)
  params = {"w": (rng.normal(size=(DIM, WIDTH)) / np.sqrt(DIM)).astype(np.float32)}
  anchors = rng.normal(size=(ROWS, DIM)).astype(np.float32)
  batch = {"a": anchors,
           "b": (anchors + 0.5 * rng.normal(size=(ROWS, DIM))).astype(np.float32)}

  def loss(params, batch):
    def embed(x):
      z = x @ params["w"]
      return z / jnp.linalg.norm(z, axis=-1, keepdims=True)

    logits = embed(batch["a"]) @ rows_of_all_devices(embed(batch["b"])).T / 0.1
    labels = jnp.arange(logits.shape[0])
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

  return loss, params, batch, {}


MIXING = {"centred": centred_setup, "batchnorm": batchnorm_setup,
          "contrastive": contrastive_setup}


def _read_only(tree):
  """The tree with its numpy arrays made read-only (jax arrays are): safe to share."""
  def freeze(a):
    if isinstance(a, np.ndarray):
      a = a.view()
      a.flags.writeable = False
    return a
  return jax.tree.map(freeze, tree)


@functools.cache
def mixing_setup(name):
  """MIXING[name](), built once per process and shared (read-only) by the tests below."""
  loss, params, batch, model_specs = MIXING[name]()
  return loss, _read_only(params), _read_only(batch), model_specs


@functools.cache
def mixing_reference(name, k):
  """The plain-JAX reference of mixing_setup(name) at k: the same for every mesh."""
  loss, params, batch, _ = mixing_setup(name)
  return global_micro_batch_reference(loss, params, batch, k)


# centred (params sharded over "model" on the 2-D mesh) on each mesh with each axis type;
# batchnorm and contrastive (replicated params) on each mesh and each axis type once.
MIXING_CASES = [("centred", mesh_name, axis_type) for mesh_name in MESHES
                for axis_type in AXIS_TYPES] + [
    ("batchnorm", "dp8", AxisType.Auto), ("batchnorm", "data_x_model", AxisType.Explicit),
    ("contrastive", "dp8", AxisType.Explicit), ("contrastive", "data_x_model", AxisType.Auto)]


@pytest.mark.parametrize(("name", "mesh_name", "axis_type"), MIXING_CASES,
                         ids=[f"{n}-{m}-{t.name.lower()}" for n, m, t in MIXING_CASES])
def test_losses_that_mix_examples_are_exact(name, mesh_name, axis_type):
  loss, params, batch, model_specs = mixing_setup(name)
  shape, names = MESHES[mesh_name]
  specs = model_specs if "model" in names else {}
  mesh = mesh_of(shape, names, axis_type)
  fns = {k: fxaccum.value_and_grad(loss, micro_batches=k) for k in KS}
  step = jax.jit(lambda p, b: {k: f(p, b) for k, f in fns.items()})
  with jax.set_mesh(mesh):
    args = (put(params, mesh, specs) if specs else params,
            jax.tree.map(lambda a: jax.device_put(a, NamedSharding(mesh, P("data"))), batch))
    got = step(*args)
    views = diagnostics.paths(step, *args)
  for k in KS:
    assert_tree_close(got[k], mixing_reference(name, k))
  assert [p.view for p in views] == ["global"] * len(KS)
  # k = 1 runs as jax.value_and_grad (nothing to accumulate); k > 1 found the mixing.
  direct = [p for p in views if p.reason.startswith("one micro-batch")]
  assert len(direct) == 1, views
  assert all("mixes examples" in p.reason for p in views if p not in direct), views


@pytest.mark.parametrize("name", MIXING)
def test_per_device_view_of_a_mixing_loss_differs(name):
  """Negative control: forced per device (DDP without SyncBatchNorm), these losses give
  another result, so the exactness test above can tell the views apart."""
  loss, params, batch, _ = mixing_setup(name)
  mesh = mesh_of((8,), ("data",), AxisType.Auto)
  with jax.set_mesh(mesh):
    sharded = jax.tree.map(lambda a: jax.device_put(a, NamedSharding(mesh, P("data"))), batch)
    value, _ = jax.jit(fxaccum.value_and_grad(loss, micro_batches=1, view="device"))(
        params, sharded)
  ref_value, _ = mixing_reference(name, 1)  # jax.value_and_grad on the whole batch
  assert abs(float(value) - float(ref_value)) > 1e-2 * abs(float(ref_value))


class SyncBatchNormMLP(nn.Module):
  axis_name: str | None = None

  @nn.compact
  def __call__(self, x):
    x = nn.Dense(WIDTH, use_bias=False)(x)
    x = nn.relu(nn.BatchNorm(use_running_average=False, axis_name=self.axis_name)(x))
    return nn.Dense(1)(x)[..., 0]


def sync_batchnorm_losses(seed, with_aux=False):
  """A batch, the MLP's variables, its loss with statistics synchronized over "data" and
  the same loss on one device's view of the batch (the global micro-batch's statistics);
  ``with_aux``: with per-example predictions (Concat) and their mean as aux."""
  rng = np.random.default_rng(seed)
  batch = {"x": rng.normal(size=(ROWS, DIM)).astype(np.float32),
           "y": rng.normal(size=(ROWS,)).astype(np.float32)}
  variables = jax.jit(SyncBatchNormMLP().init)(jax.random.key(0), batch["x"])

  def make_loss(model):
    def loss(params, batch):
      out, _ = model.apply({"params": params, "batch_stats": variables["batch_stats"]},
                           batch["x"], mutable=["batch_stats"])
      value = jnp.mean((out - batch["y"]) ** 2)
      return (value, {"pred": fxaccum.Concat(out), "mean_pred": jnp.mean(out)}) if (
          with_aux) else value
    return loss

  return batch, variables, make_loss(SyncBatchNormMLP("data")), make_loss(SyncBatchNormMLP())


def test_device_view_with_synchronized_batch_statistics_is_exact():
  """The documented way to keep the per-device view for BatchNorm: flax's
  BatchNorm(axis_name="data") averages the statistics over the devices (the data axes are
  manual there), which gives the global micro-batch's statistics again."""
  batch, variables, synced, plain = sync_batchnorm_losses(seed=7)
  mesh = mesh_of((8,), ("data",), AxisType.Auto)
  with jax.set_mesh(mesh):
    sharded = jax.tree.map(lambda a: jax.device_put(a, NamedSharding(mesh, P("data"))), batch)
    for k in (1, 2):
      got = jax.jit(fxaccum.value_and_grad(synced, micro_batches=k, view="device"))(
          variables["params"], sharded)
      assert_tree_close(got, global_micro_batch_reference(plain, variables["params"], batch,
                                                          k))
    # The default view traces the loss on the global micro-batch first, where "data" is
    # no bound axis: a clear error names the fix.
    with pytest.raises(ValueError, match="runs only per device: pass view='device'"):
      jax.jit(fxaccum.value_and_grad(synced, micro_batches=2))(variables["params"], sharded)


def test_issue_example_batch_centred_loss():
  """The issue's reproducer: 0.910 instead of 4.231 per device; now the large batch's."""
  def loss(w, x):
    h = x * w
    return jnp.mean((h - jnp.mean(h, axis=0)) ** 2)

  rng = np.random.default_rng(0)
  x = (rng.normal(size=(32, 4)) * np.arange(1, 33)[:, None] / 8).astype(np.float32)
  w = jnp.ones(4)
  ref = jax.jit(jax.value_and_grad(loss))(w, x)
  for axis_type in AXIS_TYPES:
    mesh = mesh_of((8,), ("data",), axis_type)
    with jax.set_mesh(mesh):
      got = jax.jit(fxaccum.value_and_grad(loss, micro_batches=1))(
          w, jax.device_put(x, NamedSharding(mesh, P("data"))))
    assert_tree_close(got, ref)


@pytest.mark.parametrize("axis_type", AXIS_TYPES, ids=["auto", "explicit"])
def test_per_example_losses_take_the_fast_path(axis_type):
  """Weighted token sums and example means: per device, no reduction inside the loop."""
  mesh = mesh_of((8,), ("data",), axis_type)
  data, params = make_data(k=4), make_params()
  with jax.set_mesh(mesh):
    args = (put(params, mesh, {}), put(data, mesh, {k: P("data") for k in data}))
    for loss in (weighted_loss, example_mean_loss):
      rep = diagnostics.report(jax.jit(fxaccum.value_and_grad(loss, micro_batches=4)), *args)
      assert [p.view for p in rep.paths] == ["device"], rep.summary()
      assert rep.reductions(place="loop") == [], rep.summary()


def test_a_constant_equal_to_the_micro_batch_size_is_not_a_mean():
  """sum / 256 with 256 examples in the micro-batch looks like a mean at that size only; per
  device it would be 8x too small. The analysis traces two sizes and keeps it global."""
  rng = np.random.default_rng(3)
  x = rng.normal(size=(512, 4)).astype(np.float32)
  mesh = mesh_of((8,), ("data",), AxisType.Auto)

  def total_over_256(w, x):
    return jnp.sum((x @ w) ** 2) / 256.0

  def mean(w, x):
    return jnp.mean((x @ w) ** 2)

  w = jnp.ones(4)
  with jax.set_mesh(mesh):
    sharded = jax.device_put(x, NamedSharding(mesh, P("data")))
    views = {f.__name__: diagnostics.paths(jax.jit(fxaccum.value_and_grad(
        f, micro_batches=2)), w, sharded)[0].view for f in (total_over_256, mean)}
    got = jax.jit(fxaccum.value_and_grad(total_over_256, micro_batches=2))(w, sharded)
  assert views == {"total_over_256": "global", "mean": "device"}
  assert_tree_close(got, global_micro_batch_reference(total_over_256, w, x, 2))


def branch_on_equality(w, x):
  if x.shape[0] == 2:  # one device's share of a micro-batch below
    return jnp.sum((x @ w) ** 2)
  return jnp.mean((x @ w) ** 2)


def branch_on_inequality(w, x):
  scale = 1.0 if x.shape[0] != 2 else float(x.shape[0])
  return jnp.mean((x @ w) ** 2) * scale


def where_on_equality(w, x):
  return jnp.where(x.shape[0] == 2, 2.0, 1.0) * jnp.mean((x @ w) ** 2)


def branch_on_truth(w, x):
  return jnp.mean((x @ w) ** 2) * (2.0 if x.shape[0] % 4 else 1.0)  # a symbolic size: true


def lookup_by_rows(w, x):
  return jnp.mean((x @ w) ** 2) * {2: 2.0}.get(x.shape[0], 1.0)  # a symbolic key: missing


def member_of_a_set(w, x):
  return jnp.mean((x @ w) ** 2) * (2.0 if x.shape[0] in {2} else 1.0)


def caught_conversion(w, x):
  try:
    rows = int(x.shape[0])
  except Exception:  # noqa: BLE001 - raised for a symbolic size only
    rows = None
  return jnp.sum((x @ w) ** 2) if rows == 2 else jnp.mean((x @ w) ** 2)


def branch_on_text(w, x):
  return jnp.mean((x @ w) ** 2) * (2.0 if f"{x.shape[0]}" == "2" else 1.0)


@pytest.mark.parametrize("loss", [branch_on_equality, branch_on_inequality, where_on_equality,
                                  branch_on_truth, lookup_by_rows, member_of_a_set,
                                  caught_conversion, branch_on_text])
def test_a_loss_that_asks_the_row_count_is_exact(loss):
  """A symbolic size answers some of Python's questions without deciding: `rows == 2` is
  "not equal", `rows % 4` is true, `{2: ...}` has no key `rows`, `int(rows)` raises, its
  text is "rows". The symbolic trace then took another branch than the per-device program
  (2 rows); before the trace watched for such uses, the device view came back 2x (or 4x)
  the reference."""
  rng = np.random.default_rng(4)
  x = rng.normal(size=(64, 4)).astype(np.float32)
  mesh = mesh_of((8,), ("data",), AxisType.Auto)
  w = jnp.ones(4)
  with jax.set_mesh(mesh):
    sharded = jax.device_put(x, NamedSharding(mesh, P("data")))
    step = jax.jit(fxaccum.value_and_grad(loss, micro_batches=4))  # 2 rows per device
    got = step(w, sharded)
    (path,) = diagnostics.paths(step, w, sharded)
  assert path.view == "global", path
  assert_tree_close(got, global_micro_batch_reference(loss, w, x, 4))


def test_dropout_from_one_shared_key_is_global_and_matches_the_sequential_keys():
  """Random numbers from one key depend on the row's position in the micro-batch: the
  global view draws them like jax.value_and_grad with fold_in(key, i) per micro-batch."""
  rng = np.random.default_rng(4)
  x = rng.normal(size=(64, 8)).astype(np.float32)
  w = rng.normal(size=(8, 4)).astype(np.float32)
  key = jax.random.key(5)

  def loss(w, x, key):
    keep = jax.random.bernoulli(key, 0.7, (x.shape[0], w.shape[1]))
    return jnp.mean((jnp.where(keep, x @ w, 0.0) / 0.7) ** 2)

  k = 4
  step = jax.jit(jax.value_and_grad(loss))
  ref = [step(w, x[i::k], jax.random.fold_in(key, i)) for i in range(k)]
  ref = jax.tree.map(lambda *xs: sum(xs) / k, *ref)
  mesh = mesh_of((8,), ("data",), AxisType.Explicit)
  with jax.set_mesh(mesh):
    f = jax.jit(fxaccum.value_and_grad(loss, micro_batches=k, rng_argnums=2))
    sharded = jax.device_put(x, NamedSharding(mesh, P("data")))
    got = f(w, sharded, key)
    (path,) = diagnostics.paths(f, w, sharded, key)
  assert path.view == "global" and "position in the batch" in path.reason
  assert_tree_close(got, ref)


def _edge_batch(seed=0):
  """Int8 ids, one of them -128 (its negation wraps), and features whose last column is
  +10 on the first device's rows and -1 on the others'."""
  rng = np.random.default_rng(seed)
  ids = rng.integers(-30, 30, size=ROWS).astype(np.int8)
  ids[5] = -128  # the int8 whose negation wraps
  x = rng.normal(size=(ROWS, 4)).astype(np.float32)
  x[:, 3] = np.where(np.arange(ROWS) < ROWS // 8, 10.0, -1.0)  # first device's rows: +10
  return {"x": x, "ids": ids}


def _run_on_the_edge_batch(loss, k=4, axis_type=AxisType.Auto):
  """fxaccum.value_and_grad(loss, has_aux=True) on _edge_batch() over 8 devices, and
  jax.value_and_grad(loss, has_aux=True) on each of its global micro-batches (rows i::k)."""
  params, batch = jnp.ones((4, 4)), _edge_batch()
  mesh = mesh_of((8,), ("data",), axis_type)
  step = jax.jit(fxaccum.value_and_grad(loss, has_aux=True, micro_batches=k))
  with jax.set_mesh(mesh):
    got = step(jax.device_put(params, NamedSharding(mesh, P())),
               jax.device_put(batch, NamedSharding(mesh, P("data"))))
  micro = [jax.tree.map(lambda a, i=i: a[i::k], batch) for i in range(k)]
  reference = jax.jit(jax.value_and_grad(loss, has_aux=True))  # one compile for the k shares
  return got, [reference(params, b) for b in micro]


def _mean_value_and_grads(results):
  """The mean over the micro-batches of the value and the gradients, aux left out."""
  return jax.tree.map(lambda *xs: sum(xs) / len(results), *[(v, g) for (v, _), g in results])


def position_segments(w, b):  # rows summed by their position (iota % 3)
  x = b["x"]
  s = jax.ops.segment_sum(lax.stop_gradient(x[:, 0]), jnp.arange(x.shape[0]) % 3, 3)
  return jnp.mean((x @ w) ** 2) + jnp.sum(s * jnp.arange(1.0, 4.0)) / x.shape[0], ()


def top_k_over_the_batch(w, b):
  x = b["x"]
  return jnp.mean((x @ w) ** 2) + jnp.sum(lax.top_k(x, 2, axis=0)[0]) / x.shape[0], ()


@pytest.mark.parametrize("loss", [position_segments, top_k_over_the_batch])
def test_selections_by_position_or_over_the_batch_are_exact(loss):
  """Rows picked by their position in the batch, or the top rows over the batch, mix
  examples (they took the device view once, and came back wrong)."""
  got, results = _run_on_the_edge_batch(loss)
  assert_tree_close(got, _mean_value_and_grads(results))


@pytest.mark.parametrize("rows, reason", [
    (lambda h: h / h.shape[0], "scales with the micro-batch size"),
    (lambda h: jax.lax.rev(h, (0,)), "in another order"),
], ids=["divided_by_the_rows", "reversed"])
def test_a_concat_aux_of_rescaled_or_reordered_rows_says_which(rows, reason):
  """Per-example values divided by the number of rows, or reversed, mix no examples but
  differ per device as a Concat aux leaf: the global view, and the reason says which."""
  def loss(w, x):
    h = jnp.sum(x @ w, -1)
    return jnp.mean(h ** 2), fxaccum.Concat(rows(h))

  mesh = mesh_of((8,), ("data",), AxisType.Auto)
  with jax.set_mesh(mesh):
    x = jax.device_put(jnp.ones((16, 4)), NamedSharding(mesh, P("data")))
    f = jax.jit(fxaccum.value_and_grad(loss, has_aux=True, micro_batches=2))
    (path,) = diagnostics.paths(f, jnp.ones((4, 3)), x)
  assert path.view == "global" and reason in path.reason, path


@pytest.mark.parametrize("dtype", [jnp.float8_e4m3fn, jnp.float8_e4m3fnuz])
def test_an_extremum_in_a_float8_without_infinities_is_no_nan(dtype):
  """Such dtypes turn -inf (a maximum's identity) into NaN."""
  def loss(w, b):
    h = b["x"] @ w
    return jnp.mean(h ** 2), (fxaccum.Max(jnp.max(h).astype(dtype)),
                              fxaccum.Min(jnp.min(h).astype(dtype)))

  ((_, (top, bottom)), _), results = _run_on_the_edge_batch(loss)
  assert float(top) == max(float(a[0].value) for (_, a), _ in results)
  assert float(bottom) == min(float(a[1].value) for (_, a), _ in results)


def test_negated_int8_extremes_and_infinite_sums_are_exact():
  """-(-128) wraps to -128, so a negated int8 maximum is no minimum; and devices' shares
  of a sum times inf of opposite signs (the first device's +10s, the others' -1s) would
  add up to NaN where every micro-batch's sum is positive."""
  def loss(w, b):
    h = b["x"] @ w
    return jnp.mean(h ** 2), (fxaccum.Min(-jnp.max(b["ids"])),
                              fxaccum.Sum(jnp.sum(b["x"][:, 3]) * jnp.inf))

  ((_, (low, total)), _), results = _run_on_the_edge_batch(loss)
  assert int(low) == min(int(a[0].value) for (_, a), _ in results)
  assert float(total) == float(sum(a[1].value for (_, a), _ in results)) == np.inf


def test_explicit_global_view_keeps_matmul_params_reduced_across_the_loop():
  """On an Explicit mesh the global view types matmul params `reduced`: their gradients
  are reduced once after the loop; an elementwise param (the bias) per micro-batch."""
  rng = np.random.default_rng(6)
  params = {"w": rng.normal(size=(DIM, WIDTH)).astype(np.float32),
            "b": rng.normal(size=(WIDTH,)).astype(np.float32)}
  x = rng.normal(size=(ROWS, DIM)).astype(np.float32)

  def loss(params, x):
    h = jnp.tanh(x @ params["w"] + params["b"])
    return jnp.mean((h - jnp.mean(h, axis=0)) ** 2)

  k = 4
  mesh = mesh_of((8,), ("data",), AxisType.Explicit)
  with jax.set_mesh(mesh):
    f = jax.jit(fxaccum.value_and_grad(loss, micro_batches=k))
    sharded = jax.device_put(x, NamedSharding(mesh, P("data")))
    got = f(params, sharded)
    rep = diagnostics.report(f, params, sharded)
  assert_tree_close(got, global_micro_batch_reference(loss, params, x, k))
  (path,) = rep.paths
  assert (path.view, path.reduced_leaves, path.leaves) == ("global", 1, 2), path
  w_bytes = DIM * WIDTH * 4
  top = rep.reductions(place="top", axes="data")
  assert any(c.bytes == w_bytes for c in top), rep.summary()
  loop = rep.reductions(place="loop", axes="data")
  assert loop and max(c.bytes for c in loop) < w_bytes, rep.summary()


def test_global_view_with_deferred_sync_is_exact():
  """value_and_unreduced_grad on a loss that mixes examples: the per-device form holds the
  global sum (already reduced) and cross-step accumulate gives the large-batch step."""
  loss, params, batch, _ = centred_setup()
  k = 2
  tx = optax.chain(fxaccum.accumulate(2, data_axes="data"), optax.sgd(0.1))
  ref_tx = optax.sgd(0.1)
  mesh = mesh_of((8,), ("data",), AxisType.Explicit)
  halves = [jax.tree.map(lambda a, i=i: a[i * 32:(i + 1) * 32], batch) for i in range(2)]
  grad_fn = fxaccum.value_and_unreduced_grad(loss, micro_batches=k)

  @jax.jit
  def step(state, batch):
    _, grads = grad_fn(state.params, batch)
    return state.apply_gradients(grads=grads)

  with jax.set_mesh(mesh):
    state = fxaccum.TrainState.create(apply_fn=None, params=put(params, mesh, {}), tx=tx)
    for half in halves:
      state = step(state, jax.tree.map(
          lambda a: jax.device_put(a, NamedSharding(mesh, P("data"))), half))
      jax.block_until_ready(state)
  # Reference: each call's gradient is the mean over its 2 global micro-batches; the
  # window's gradient is the mean of the 2 calls (equal weights).
  grads = [global_micro_batch_reference(loss, params, half, k)[1] for half in halves]
  mean = jax.tree.map(lambda a, b: (a + b) / 2, *grads)
  want = optax.apply_updates(params, ref_tx.update(mean, ref_tx.init(params), params)[0])
  assert_tree_close(state.params, want)


def lm1b_reference(model, params, batch):
  """jax.value_and_grad of the full batch's token mean, on one device: the same for both
  meshes, so compiled once per process (lm1b_style.init builds the same model each time)."""
  with jax.default_matmul_precision("highest"):
    return _lm1b_reference_step(model)(params, batch)


@functools.cache
def _lm1b_reference_step(model):
  return jax.jit(jax.value_and_grad(lambda p, b: lm1b_style.reference_loss(model, p, b)))


@pytest.mark.slow
@pytest.mark.parametrize("mesh_shape", [(2, 4), (8,)], ids=["data2_fsdp4", "fsdp8"])
def test_lm1b_style_fsdp_under_jit_on_an_auto_mesh(mesh_shape):
  """lm1b's structure: logical axis rules, activation constraints, jit with in/out
  shardings and donation. Exact; gradients sharded like the params (per-device gradient
  bytes == param bytes); temp memory falls with k."""
  names = ("data", "fsdp") if len(mesh_shape) == 2 else ("fsdp",)
  mesh = mesh_of(mesh_shape, names, AxisType.Auto)
  rules = lm1b_style.rules_for(mesh)
  model, ref_params, _ = lm1b_style.init()
  batch = lm1b_style.make_batch(batch=32, k=4)
  ref = lm1b_reference(model, ref_params, batch)

  def loss(params, batch):
    return fxaccum.Weighted(*lm1b_style.token_sums(model, params, batch))

  temps = {}
  for k in (1, 4):
    _, params, param_shardings = lm1b_style.init(mesh, rules)
    step = jax.jit(
        fxaccum.value_and_grad(loss, micro_batches=k, param_shardings=param_shardings),
        in_shardings=(param_shardings, lm1b_style.batch_sharding(mesh, rules)),
        donate_argnums=0)
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules), \
        jax.default_matmul_precision("highest"):
      compiled = step.lower(params, batch).compile()
      value, grads = compiled(params, batch)
    temps[k] = compiled.memory_analysis().temp_size_in_bytes
    assert_tree_close((value, grads), ref)
    for g, s in zip(jax.tree.leaves(grads), jax.tree.leaves(param_shardings), strict=True):
      assert g.sharding.is_equivalent_to(s, g.ndim), (g.sharding, s)
    grad_bytes = sum(g.addressable_shards[0].data.nbytes for g in jax.tree.leaves(grads))
    param_bytes = sum(int(np.prod(s.shard_shape(g.shape))) * 4 for g, s in zip(
        jax.tree.leaves(grads), jax.tree.leaves(param_shardings), strict=True))
    assert grad_bytes == param_bytes
  assert temps[4] < temps[1], temps


@functools.cache
def gemma_reference():
  """jax.value_and_grad of the full batch's token mean (gemma_style.make_batch(batch=32)),
  on a one-device mesh: the same for both meshes (gemma_style.create gives the same values
  on any mesh), so computed once."""
  one = gemma_style.one_device_mesh()
  graphdef, params, rest = gemma_style.create(one)
  with jax.set_mesh(one), jax.default_matmul_precision("highest"):
    return jax.jit(jax.value_and_grad(
        lambda p, b: gemma_style.reference_loss(graphdef, p, rest, b)))(
            params, gemma_style.put_batch(gemma_style.make_batch(batch=32), one))


@pytest.mark.slow
@pytest.mark.parametrize("mesh_shape", [(8,), (2, 4)], ids=["fsdp8", "data2_fsdp4"])
def test_gemma_style_nnx_model_on_an_explicit_mesh(mesh_shape):
  """FSDP param annotations and activation out_shardings naming the data axes: runs
  unmodified (global view) and is exact."""
  names = ("fsdp",) if len(mesh_shape) == 1 else ("data", "fsdp")
  mesh = mesh_of(mesh_shape, names, AxisType.Explicit)
  batch = gemma_style.make_batch(batch=32)
  ref = gemma_reference()
  graphdef, params, rest = gemma_style.create(mesh)

  def loss(params, batch):
    return fxaccum.Weighted(*gemma_style.token_sums(graphdef, params, rest, batch))

  with jax.set_mesh(mesh), jax.default_matmul_precision("highest"):
    got = jax.jit(fxaccum.value_and_grad(loss, micro_batches=4))(
        params, gemma_style.put_batch(batch, mesh))
  assert_tree_close(jax.tree.map(np.asarray, got), jax.tree.map(np.asarray, ref))
  for g, p in zip(jax.tree.leaves(got[1]), jax.tree.leaves(params), strict=True):
    assert jax.typeof(g).sharding.spec == jax.typeof(p).sharding.spec


@functools.cache
def ulysses_reference():
  """ulysses.token_sums_plain and jax.value_and_grad of its token mean, jitted (op by op
  they compile seconds of small programs), once for every mesh."""
  params, batch = ulysses.make_params(), ulysses.make_batch()
  sums = jax.jit(ulysses.token_sums_plain)(params, batch)
  with jax.default_matmul_precision("highest"):
    ref = jax.jit(jax.value_and_grad(lambda p, b: (lambda t, c: t / c)(
        *ulysses.token_sums_plain(p, b))))(params, batch)
  return sums, ref


# Each mesh shape (4 or 2 heads' all-to-all) and each axis type, once.
@pytest.mark.parametrize(("mesh_shape", "axis_type"),
                         [((2, 4), AxisType.Auto), ((4, 2), AxisType.Explicit)],
                         ids=["data2_seq4-auto", "data4_seq2-explicit"])
def test_loss_with_its_own_shard_map_ulysses(mesh_shape, axis_type):
  """A loss whose attention is its own shard_map over `seq` (all-to-all): exact."""
  mesh = mesh_of(mesh_shape, ("data", "seq"), axis_type)
  params, batch = ulysses.make_params(), ulysses.make_batch()
  (total, count), ref = ulysses_reference()

  def loss(params, batch):
    return fxaccum.Weighted(*ulysses.token_sums(params, batch, custom_vjp=False))

  with jax.set_mesh(mesh), jax.default_matmul_precision("highest"):
    f = jax.jit(fxaccum.value_and_grad(loss, micro_batches=4))
    sharded = jax.tree.map(
        lambda a: jax.device_put(a, NamedSharding(mesh, ulysses.batch_spec())), batch)
    got = f(params, sharded)
    (path,) = diagnostics.paths(f, params, sharded)
  assert path.view == "global" and "shard_map" in path.reason
  assert float(count) > 0 and float(total) > 0
  assert_tree_close(got, ref)


def test_array_keyword_arguments_on_an_explicit_mesh():
  data, params = make_data(k=2), make_params()
  mesh = mesh_of((8,), ("data",), AxisType.Explicit)

  def loss(p, b, *, scale):
    value = weighted_loss(p, b)
    return fxaccum.Weighted(scale * value.total, value.weight)

  ref = jax.jit(jax.value_and_grad(lambda p, b: 1.5 * reference_token_mean(p, b)))(params, data)
  with jax.set_mesh(mesh):
    args = (put(params, mesh, {}), put(data, mesh, {k: P("data") for k in data}))
    scale = jax.device_put(jnp.float32(1.5), NamedSharding(mesh, P()))
    f = jax.jit(fxaccum.value_and_grad(loss, micro_batches=2))
    got = f(*args, scale=scale)
    eager = fxaccum.value_and_grad(loss, micro_batches=2)(*args, scale=scale)
    (path,) = diagnostics.paths(f, *args, scale=scale)
  assert path.view == "device"
  assert_tree_close(got, ref)
  assert_tree_close(eager, ref)


def _sgd_step(p, b, grad_fn):
  g = grad_fn(p, b)
  return jax.tree.map(lambda a, da: a - 0.1 * da, p, g)


def _after_one_step(p, b, grad_fn):
  return reference_token_mean(_sgd_step(p, b, grad_fn), b)


@functools.cache
def nested_reference():
  """test_nested_calls's reference (the loss written with jax.grad), jitted, once for
  both axis types."""
  data, params = make_data(k=2), make_params()
  return jax.jit(jax.value_and_grad(
      lambda p, b: _after_one_step(p, b, jax.grad(reference_token_mean))))(params, data)


@pytest.mark.parametrize("axis_type", AXIS_TYPES, ids=["auto", "explicit"])
def test_nested_calls(axis_type):
  """A loss that itself accumulates (one inner SGD step, as in meta-learning) inside an
  outer fxaccum call: exact against the same written with jax.grad."""
  data, params = make_data(k=2), make_params()
  ref = nested_reference()
  inner = fxaccum.grad(weighted_loss, micro_batches=2)
  mesh = mesh_of((8,), ("data",), axis_type)
  with jax.set_mesh(mesh):
    args = (put(params, mesh, {}), put(data, mesh, {k: P("data") for k in data}))
    got = jax.jit(fxaccum.value_and_grad(lambda p, b: _after_one_step(p, b, inner),
                                         micro_batches=1))(*args)
  assert_tree_close(got, ref)


def test_param_shardings_keep_fsdp_gradients_sharded_under_jit_on_auto():
  """Inside jit on an Auto mesh JAX hides the params' shardings: param_shardings gives
  them, and FSDP gradients come back sharded (per-device bytes == param bytes)."""
  data, params = make_data(k=4), make_params()
  specs = {"w1": P("data", None), "b1": P("data"), "w2": P("data", None)}
  mesh = mesh_of((8,), ("data",), AxisType.Auto)
  ref = jax.jit(jax.value_and_grad(reference_token_mean))(params, data)
  shardings = {k: NamedSharding(mesh, s) for k, s in specs.items()}
  with jax.set_mesh(mesh):
    args = (put(params, mesh, specs), put(data, mesh, {k: P("data") for k in data}))
    for given, sharded in ((specs, True), (shardings, True), (None, False)):
      f = jax.jit(fxaccum.value_and_grad(weighted_loss, micro_batches=4,
                                         param_shardings=given))
      value, grads = f(*args)
      assert_tree_close((value, grads), ref)
      grad_bytes = sum(g.addressable_shards[0].data.nbytes for g in grads.values())
      param_bytes = sum(p.addressable_shards[0].data.nbytes for p in args[0].values())
      assert (grad_bytes == param_bytes) == sharded, (given, grad_bytes, param_bytes)


def test_nnx_sharding_metadata_is_read_under_jit_on_auto():
  """nnx.Param metadata (nnx.with_partitioning) is read without param_shardings."""
  mesh = mesh_of((8,), ("data",), AxisType.Auto)

  class Model(nnx.Module):
    def __init__(self, rngs):
      init = nnx.with_partitioning(nnx.initializers.lecun_normal(), ("data", None))
      self.linear = nnx.Linear(8, 16, kernel_init=init, rngs=rngs)

    def __call__(self, x):
      return self.linear(x)

  with jax.set_mesh(mesh):
    graphdef, state = nnx.split(Model(nnx.Rngs(0)))
  x = np.random.default_rng(0).normal(size=(32, 8)).astype(np.float32)

  def loss(state, x):
    return jnp.mean(nnx.merge(graphdef, state)(x) ** 2)

  ref = jax.jit(jax.value_and_grad(loss))(jax.device_get(state), x)
  with jax.set_mesh(mesh):
    _, grads = jax.jit(fxaccum.value_and_grad(loss, micro_batches=2))(
        state, jax.device_put(x, NamedSharding(mesh, P("data"))))
  assert_tree_close(grads, ref[1])
  kernel = grads["linear"]["kernel"][...]
  assert kernel.addressable_shards[0].data.shape == (1, 16)


def test_view_device_refuses_a_loss_it_cannot_run():
  mesh = mesh_of((2, 4), ("data", "seq"), AxisType.Auto)
  params, batch = ulysses.make_params(), ulysses.make_batch()

  def loss(params, batch):
    return fxaccum.Weighted(*ulysses.token_sums(params, batch, custom_vjp=False))

  with jax.set_mesh(mesh), pytest.raises(ValueError, match="view='device' cannot run.*shard_map"):
    jax.jit(fxaccum.value_and_grad(loss, micro_batches=2, view="device"))(
        params, jax.tree.map(
            lambda a: jax.device_put(a, NamedSharding(mesh, ulysses.batch_spec())), batch))
  with pytest.raises(ValueError, match="view must be"):
    fxaccum.value_and_grad(loss, micro_batches=2, view="sometimes")


def test_device_view_aux_shapes_with_rng_argnums():
  """The device view traces the loss once for its aux's shapes: that trace must pass the
  micro-batch index and the module state in their places (a key folded with the index)."""
  def loss(w, x, key):
    scale = 1.0 + 0.0 * jax.random.uniform(key)
    return jnp.mean(jnp.sum(x * w, axis=-1)) * scale, {"mean": jnp.mean(x)}

  mesh = mesh_of((8,), ("data",), AxisType.Explicit)
  x = np.arange(64.0, dtype=np.float32).reshape(16, 4) / 64
  w = np.ones(4, np.float32)
  f = jax.jit(fxaccum.value_and_grad(loss, has_aux=True, micro_batches=2, rng_argnums=2))
  with jax.set_mesh(mesh):
    xs = jax.device_put(x, P("data"))
    (value, aux), grads = f(w, xs, jax.random.key(0))
    paths = fxaccum.diagnostics.paths(f, w, xs, jax.random.key(0))
  assert paths[0].view == "device", paths
  (ref, ref_aux), ref_grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(
      w, x, jax.random.key(0))
  assert_tree_close((value, aux, grads), (ref, ref_aux, ref_grads))


def test_device_view_with_a_collective_and_aux():
  """The sync-BatchNorm route with has_aux: the aux's layout is found where the loss runs
  (inside the region manual over the data axes), not by a trace outside it where "data"
  is unbound (before: NameError, then a message pointing back to view='auto')."""
  batch, variables, synced, plain = sync_batchnorm_losses(seed=8, with_aux=True)
  k = 2
  step = jax.jit(jax.value_and_grad(plain, has_aux=True))
  parts = [step(variables["params"], jax.tree.map(lambda a, i=i: a[i::k], batch))
           for i in range(k)]
  mesh = mesh_of((8,), ("data",), AxisType.Auto)
  with jax.set_mesh(mesh):
    sharded = jax.tree.map(lambda a: jax.device_put(a, NamedSharding(mesh, P("data"))), batch)
    (value, aux), grads = jax.jit(fxaccum.value_and_grad(
        synced, has_aux=True, micro_batches=k, view="device"))(variables["params"], sharded)
  np.testing.assert_allclose(value, sum(p[0][0] for p in parts) / k, rtol=1e-5)
  assert_tree_close(grads, jax.tree.map(lambda *g: sum(g) / k, *(p[1] for p in parts)))
  rows = np.empty(ROWS, np.float32)
  for i, p in enumerate(parts):
    rows[i::k] = p[0][1]["pred"].value
  np.testing.assert_allclose(aux["pred"], rows, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(aux["mean_pred"],
                             sum(p[0][1]["mean_pred"] for p in parts) / k, rtol=1e-5)


def test_closure_over_a_traced_value_on_an_explicit_mesh_names_the_fix():
  """JAX 0.10.2 cannot close over a value typed on an Explicit mesh inside shard_map: the
  global view runs (exact), its reason names the fix, and passing the value as a keyword
  argument takes the fast path with the same result."""
  x = np.random.default_rng(9).normal(size=(ROWS, DIM)).astype(np.float32)
  w = np.ones((DIM, 3), np.float32)

  def loss(w, x, *, scale):
    return jnp.mean(((x @ w) * scale) ** 2)

  @jax.jit
  def closing_over(w, x):
    scale = jnp.sum(w) / 10
    return fxaccum.value_and_grad(lambda w, x: loss(w, x, scale=scale), micro_batches=2)(w, x)

  @jax.jit
  def passing(w, x):
    return fxaccum.value_and_grad(loss, micro_batches=2)(w, x, scale=jnp.sum(w) / 10)

  mesh = mesh_of((8,), ("data",), AxisType.Explicit)
  with jax.set_mesh(mesh):
    sharded = jax.device_put(x, NamedSharding(mesh, P("data")))
    (closed,) = diagnostics.paths(closing_over, w, sharded)
    (passed,) = diagnostics.paths(passing, w, sharded)
    got_closed, got_passed = closing_over(w, sharded), passing(w, sharded)
  assert closed.view == "global" and "pass it to the loss as an argument" in closed.reason
  assert passed.view == "device"
  scale = float(np.sum(w) / 10)  # a constant to the gradient, closed over or passed
  want = global_micro_batch_reference(lambda w, b: loss(w, b, scale=scale), w, x, 2)
  assert_tree_close(got_closed, want)
  assert_tree_close(got_passed, want)


@pytest.mark.parametrize("axis_type", AXIS_TYPES, ids=["auto", "explicit"])
@pytest.mark.parametrize("case", ["per_example", "mixing", "one_micro_batch"])
def test_how_often_the_loss_is_traced(case, axis_type):
  """Per traced call: once for the view analysis (value and gradients, a symbolic number of
  rows), whose jaxpr the per-device loop runs; the global view's loop traces it again;
  k = 1 needs no analysis (the loop runs the decision's trace)."""
  traces = []
  x = np.random.default_rng(10).normal(size=(ROWS, DIM)).astype(np.float32)

  def loss(w, x):
    traces.append(1)
    h = x @ w
    if case == "mixing":
      h = h - jnp.mean(h, axis=0)
    return jnp.mean(h ** 2), {"rows": fxaccum.Concat(jnp.sum(h, -1)), "mean": jnp.mean(h)}

  k = 1 if case == "one_micro_batch" else 4
  mesh = mesh_of((8,), ("data",), axis_type)
  with jax.set_mesh(mesh):
    sharded = jax.device_put(x, NamedSharding(mesh, P("data")))
    f = jax.jit(fxaccum.value_and_grad(loss, has_aux=True, micro_batches=k))
    f.lower(np.ones((DIM, 3), np.float32), sharded)
    traced = len(traces)  # one traced call
    (path,) = diagnostics.paths(f, np.ones((DIM, 3), np.float32), sharded)
  assert path.view == {"per_example": "device", "mixing": "global",
                       "one_micro_batch": "global"}[case], path
  assert traced == (2 if case == "mixing" else 1), traces


def test_an_internal_error_fails_tests_and_warns_users_instead_of_a_silent_slow_path(
    monkeypatch):
  """A trace of the loss that fails in the loss's own code is a fact the decision records
  (another view, exact). A failure without the loss's code in its traceback is fxaccum's
  bug: it raises under the test suite (``FXACCUM_RULE_ERRORS=raise``, set by conftest) and
  warns users once, asking for a report, instead of turning silently into another way to
  run the loss."""
  from fxaccum.analysis import interpreter
  from fxaccum.instep import attempts, decision

  own = attempts.attempt(lambda: jnp.zeros((-1,)))  # the caller's code raised: a fact
  assert own.value is None and own.error is not None
  with pytest.raises((TypeError, ValueError)):
    attempts.attempt(jnp.zeros, (-1,))  # only JAX and fxaccum in its traceback

  # A bug in the decision's trace of one micro-batch as jax.value_and_grad runs it: a call
  # that raises without code of the caller's (a function defined here would count as the
  # loss's code).
  monkeypatch.setattr(decision, "trace_step", math.sqrt)
  mesh = mesh_of((8,), ("data",), AxisType.Explicit)
  step = fxaccum.value_and_grad(weighted_loss, micro_batches=1)
  with jax.set_mesh(mesh):
    args = (put(make_params(), mesh, {}), put(make_data(k=1), mesh, DATA))
    with pytest.raises(TypeError, match="sqrt"):
      jax.jit(step).lower(*args)
    monkeypatch.delenv(interpreter.RULE_ERRORS)
    monkeypatch.setattr(attempts, "_WARNED", set())
    with pytest.warns(RuntimeWarning, match="internal error.*TypeError.*report"):
      value, grads = jax.jit(step)(*args)
    rep = diagnostics.report(jax.jit(step), *args)
  # Decided as for more micro-batches: the per-device view, exact.
  assert [p.view for p in rep.paths] == ["device"], rep.paths
  assert_tree_close((value, grads), jax.value_and_grad(reference_token_mean)(
      make_params(), make_data(k=1)))


class _Constrained(nn.Module):
  """A tanh MLP whose hidden activations are constrained over the data axis: with flax's
  logical rules (``activation_batch`` -> ``data``, as MaxText writes them) or
  with the model's own ``with_sharding_constraint``."""
  logical: bool

  @nn.compact
  def __call__(self, x):
    h = nn.Dense(16)(x)
    if self.logical:
      h = nn.with_logical_constraint(h, ("activation_batch", None))
    else:
      h = lax.with_sharding_constraint(h, P("data", None))
    return nn.Dense(1)(jnp.tanh(h))[..., 0]


@pytest.mark.parametrize("axis_type", AXIS_TYPES, ids=str)
@pytest.mark.parametrize("logical", [True, False], ids=["flax_rules", "own_constraint"])
def test_a_sharding_constraint_over_the_data_axes(logical, axis_type):
  """Per device the data axes are manual: flax's logical constraints drop them there (the
  device view), and the view analysis traces the loss per device as the region runs it,
  its rules without the data axes: one trace of the loss, the loop runs it. A constraint
  of the model's own cannot run per device (the global view, the reason quoting JAX): a
  jaxpr traced outside the region does not say that it fails there, so the decision
  traces the forward pass per device to find out (Auto: a third trace of the loss; on an
  Explicit mesh the per-device traces fail first, as before: a fourth). Both exact."""
  x = np.random.default_rng(3).normal(size=(64, 8)).astype(np.float32)
  params = _Constrained(logical=True).init(jax.random.key(0), x[:1])  # no rules: no-op
  model = _Constrained(logical=logical)

  traces = []

  def loss(params, batch):
    traces.append(None)
    return jnp.mean((model.apply(params, batch["x"]) - batch["x"][:, 0]) ** 2)

  mesh = mesh_of((8,), ("data",), axis_type)
  with jax.set_mesh(mesh), nn.logical_axis_rules((("activation_batch", "data"),)):
    batch = jax.device_put({"x": x}, NamedSharding(mesh, P("data")))
    step = jax.jit(fxaccum.value_and_grad(loss, micro_batches=4))
    got = step(params, batch)
    expected = 1 if logical else 3 if axis_type == AxisType.Auto else 4
    assert len(traces) == expected, len(traces)
    (path,) = diagnostics.paths(step, params, batch)
    want = jax.jit(jax.value_and_grad(loss))(params, batch)
  assert_tree_close(got, want)
  if logical:
    assert path.view == "device", path
  else:
    assert path.view == "global" and "did not trace per device" in path.reason, path
