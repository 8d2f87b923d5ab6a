"""``fxaccum.Statistics().noise_scale``: the gradient noise scale of McCandlish et al. 2018
(App. A.1) from the micro-batch gradients the step computes anyway.

References are independent of fxaccum: ``jax.grad`` of each small batch's mean loss (the
global micro-batches, or each device's share of them in the per-device view) and of the
whole batch, and a linear regression whose ``|G|²`` and ``tr Σ`` are known in closed form.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import mesh_of
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import fxaccum
from fxaccum import diagnostics

K, DEVICES, ROWS, DIM, TOKENS = 4, 8, 64, 3, 5


def regression_data(seed=0, rows=ROWS):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(rows, TOKENS, DIM)).astype(np.float32)
  y = (x @ np.array([1.0, -2.0, 0.5]) + rng.normal(size=(rows, TOKENS))).astype(np.float32)
  mask = (rng.random((rows, TOKENS)) < 0.6).astype(np.float32)
  mask[0] = 1.0  # skewed padding: a full row, a one-token row, an all-padding row
  mask[1, 1:] = 0.0
  mask[2] = 0.0
  return {"x": x, "y": y, "mask": mask}


def mean_loss(w, batch):
  return jnp.mean((batch["x"] @ w - batch["y"]) ** 2)


def token_loss(w, batch):
  err = (batch["x"] @ w - batch["y"]) ** 2
  return fxaccum.Weighted(jnp.sum(batch["mask"] * err), jnp.sum(batch["mask"]))


def with_statistics(loss):
  """``loss`` asking for the step's statistics in its aux."""
  return lambda *args: (loss(*args), fxaccum.Statistics())


def noise_of(loss, **options):
  """``fxaccum.value_and_grad`` of ``loss`` returning ``(value, noise scale), grads``."""
  step = fxaccum.value_and_grad(with_statistics(loss), has_aux=True, **options)

  def run(*args):
    (value, stats), grads = step(*args)
    return (value, stats.noise_scale), grads

  return run


def reference(loss, w, small_batches, whole):
  """The estimator's inputs by hand: each small batch's mean-loss gradient, the step's."""
  def mean_of(w, b):
    out = loss(w, b)
    return out.value() if isinstance(out, fxaccum.Weighted) else out

  def size(b):
    return float(np.sum(b["mask"])) if loss is token_loss else len(b["x"])

  taken = [b for b in small_batches if size(b) > 0]
  sq = [float(jnp.sum(jax.grad(mean_of)(w, b) ** 2)) for b in taken]
  sizes = np.array([size(b) for b in taken])
  return {"small_sq_norm": np.mean(sq), "big_sq_norm": float(jnp.sum(jax.grad(mean_of)(w, whole)
                                                                     ** 2)),
          "small_batch": len(sizes) / np.sum(1 / sizes), "big_batch": size(whole)}


def small_batches(batch, view):
  """The device view's small batches are each device's share of a micro-batch; the
  global view's the global micro-batches."""
  shards = [jax.tree.map(lambda a, d=d: np.split(a, DEVICES)[d], batch) for d in range(DEVICES)]
  if view == "device":
    return [jax.tree.map(lambda a, i=i: a[i::K], s) for s in shards for i in range(K)]
  return [jax.tree.map(lambda *parts, i=i: np.concatenate([p[i::K] for p in parts]), *shards)
          for i in range(K)]


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit], ids=lambda t: t.name)
@pytest.mark.parametrize("loss", [mean_loss, token_loss], ids=["mean", "weighted"])
@pytest.mark.parametrize("view", ["device", "global"])
def test_statistics_match_the_micro_batch_gradients(view, loss, axis_type):
  batch = regression_data()
  if loss is token_loss:  # one all-padding micro-batch share: weight 0, left out
    batch["mask"][8:16:K] = 0.0
  w = jnp.array([0.3, 0.1, -0.2])
  mesh = mesh_of((DEVICES,), ("data",), axis_type)
  with jax.set_mesh(mesh):
    step = jax.jit(noise_of(loss, micro_batches=K, view=view))
    args = (jax.device_put(w, NamedSharding(mesh, P())),
            jax.device_put(batch, NamedSharding(mesh, P("data"))))
    (value, noise), grads = step(*args)
    (path,) = diagnostics.paths(step, *args)
  assert path.view == view
  if view == "global" and axis_type == AxisType.Explicit:  # its squares need each
    assert path.reduced_leaves == 0, path  # micro-batch's gradient reduced
    assert "noise scale squares each micro-batch's reduced gradient" in path.reason, path
  assert isinstance(noise, fxaccum.NoiseScale)
  expected = reference(loss, w, small_batches(batch, view), batch)
  for name, want in expected.items():
    np.testing.assert_allclose(getattr(noise, name), want, rtol=2e-5, err_msg=name)
  # The gradient is unchanged by the option (against jax.value_and_grad on the batch).
  ref_value, ref_grads = jax.value_and_grad(
      lambda w, b: token_loss(w, b).value() if loss is token_loss else loss(w, b))(w, batch)
  np.testing.assert_allclose(grads, ref_grads, rtol=2e-5)
  np.testing.assert_allclose(value, ref_value, rtol=2e-5)


def test_averaging_norms_instead_of_squared_norms_is_biased():
  """Negative control: the mean of |g_i| squared (mesh-transformer-jax) is not the
  statistic; fxaccum's small_sq_norm is the mean of |g_i|²."""
  batch = regression_data(3)
  w = jnp.zeros(DIM)
  (_, noise), _ = noise_of(mean_loss, micro_batches=K)(w, batch)
  norms = [float(jnp.linalg.norm(jax.grad(mean_loss)(w, jax.tree.map(lambda a, i=i: a[i::K],
                                                                        batch))))
           for i in range(K)]
  np.testing.assert_allclose(noise.small_sq_norm, np.mean(np.square(norms)), rtol=1e-5)
  assert not np.isclose(noise.small_sq_norm, np.mean(norms) ** 2, rtol=1e-3)


def test_smoothed_b_simple_recovers_a_known_noise_scale():
  """Linear regression y = x·w* + ε, x ~ N(0, I_d), ε ~ N(0, σ²), loss ½(x·w - y)² at
  w = w* + δ: the gradient is δ and tr Σ = (d + 1)|δ|² + d σ², so B_simple = 21 for d = 4,
  |δ| = 1, σ = 2. Two hundred steps inside one jit, smoothed by NoiseScaleEMA."""
  d, sigma, steps, rows = 4, 2.0, 200, 256
  w_star = jnp.arange(1.0, d + 1)
  delta = jnp.array([1.0, 0.0, 0.0, 0.0])
  truth = ((d + 1) * 1.0 + d * sigma**2) / 1.0

  def loss(w, batch):
    x, y = batch
    return jnp.mean(0.5 * (x @ w - y) ** 2)

  grad_fn = fxaccum.grad(with_statistics(loss), has_aux=True, micro_batches=8)

  @jax.jit
  def run(key):
    def one_step(ema, key):
      kx, ke = jax.random.split(key)
      x = jax.random.normal(kx, (rows, d))
      y = x @ w_star + sigma * jax.random.normal(ke, (rows,))
      noise = grad_fn(w_star + delta, (x, y))[1].noise_scale
      return ema.update(noise), noise.b_simple

    return jax.lax.scan(one_step, diagnostics.NoiseScaleEMA(decay=0.99),
                        jax.random.split(key, steps))

  ema, per_step = run(jax.random.key(0))
  assert abs(float(ema.b_simple) / truth - 1) < 0.1, (float(ema.b_simple), truth)
  np.testing.assert_allclose(ema.grad_sq, 1.0, rtol=0.15)
  np.testing.assert_allclose(ema.trace_sigma, truth, rtol=0.1)
  # Single steps scatter widely: the ratio of averages, not one step's ratio.
  assert float(jnp.std(per_step)) > 0.1 * truth


def test_one_micro_batch_on_one_device_gives_nan_and_the_ema_skips_it():
  batch = regression_data(4, rows=8)
  (_, noise), _ = noise_of(mean_loss, micro_batches=1)(jnp.zeros(DIM), batch)
  assert float(noise.small_batch) == float(noise.big_batch) == 8
  assert np.isnan(noise.grad_sq) and np.isnan(noise.trace_sigma) and np.isnan(noise.b_simple)
  ema = diagnostics.NoiseScaleEMA().update(noise)
  assert float(ema.weight) == 0 and np.isnan(ema.b_simple)


def test_result_structure_with_aux_and_skipped_micro_batches():
  """The statistics come back where the aux asked for them (twice: both filled); the
  value, the rest of the aux and the gradients are where jax.value_and_grad puts them."""
  batch = regression_data(5, rows=16)
  batch["x"][4] = np.nan  # micro-batch 0 of 4 (rows 0::4): skipped

  def loss(w, batch):
    return mean_loss(w, batch), {"n": fxaccum.Sum(batch["x"].shape[0]),
                                 "stats": [fxaccum.Statistics(), fxaccum.Statistics()]}

  (value, aux), grads = fxaccum.value_and_grad(
      loss, has_aux=True, micro_batches=4, skip_nonfinite=True)(jnp.zeros(DIM), batch)
  stats, again = aux["stats"]
  assert int(stats.skipped) == 1 and int(aux["n"]) == 12  # the skipped rows add nothing
  kept = [jax.tree.map(lambda a, i=i: a[i::4], batch) for i in (1, 2, 3)]
  whole = jax.tree.map(lambda *p: np.concatenate(p), *kept)
  expected = reference(mean_loss, jnp.zeros(DIM), kept, whole)
  for name, want in expected.items():
    np.testing.assert_allclose(getattr(stats.noise_scale, name), want, rtol=2e-5,
                               err_msg=name)
    np.testing.assert_allclose(getattr(again.noise_scale, name), want, rtol=2e-5)
  ref_value, ref_grads = jax.value_and_grad(mean_loss)(jnp.zeros(DIM), whole)
  np.testing.assert_allclose(value, ref_value, rtol=2e-5)
  np.testing.assert_allclose(grads, ref_grads, rtol=2e-5)
  g, stats_only = fxaccum.grad(with_statistics(mean_loss), has_aux=True, micro_batches=2)(
      jnp.zeros(DIM), regression_data(5, rows=16))
  assert isinstance(stats_only.noise_scale, fxaccum.NoiseScale)
  assert int(stats_only.skipped) == 0 and g.shape == (DIM,)


def test_no_extra_gradient_collective():
  """Per device, the noise terms add one scalar all-reduce; the gradient's reduction
  stays the one after the loop."""
  mesh = mesh_of((DEVICES,), ("data",), AxisType.Auto)
  w = jax.device_put(jnp.zeros((DIM, 256)), NamedSharding(mesh, P()))
  batch = jax.device_put(regression_data(6), NamedSharding(mesh, P("data")))

  def loss(w, batch):
    return jnp.mean((jnp.sum(batch["x"] @ w, -1) - batch["y"]) ** 2)

  def big_reductions(loss, has_aux):
    step = jax.jit(fxaccum.value_and_grad(loss, has_aux=has_aux, micro_batches=K))
    rep = diagnostics.report(step, w, batch)
    return [c for c in rep.collectives if c.kind in diagnostics.REDUCTIONS and c.bytes > 64]

  plain, with_noise = big_reductions(loss, False), big_reductions(with_statistics(loss), True)
  assert len(plain) == len(with_noise) >= 1
  assert all(c.place == "top" for c in with_noise)


@pytest.mark.parametrize("case", ["a Sum loss", "unreduced gradients", "zero3"])
def test_steps_without_a_micro_batch_gradient_give_nan(case):
  """A Sum loss has no micro-batch mean, value_and_unreduced_grad no step gradient, and
  zero3 reduces each micro-batch's gradient in its backward pass: their noise scale is
  NaN (the EMA skips such steps); the skipped count and the rest are there."""
  batch = regression_data(9)
  w = jnp.array([0.3, 0.1, -0.2])
  def loss(w, b):
    if case == "a Sum loss":  # already divided by the whole batch's size
      return fxaccum.Sum(jnp.sum(jnp.mean((b["x"] @ w - b["y"]) ** 2, -1)) / ROWS)
    return mean_loss(w, b)

  entry = (fxaccum.value_and_unreduced_grad if case == "unreduced gradients"
           else fxaccum.value_and_grad)
  mesh = mesh_of((DEVICES,), ("data",), AxisType.Explicit)
  spec = P("data") if case == "zero3" else P()  # w's 3 rows: FSDP over 8 needs 8, so tile
  w = jnp.tile(w, 8) if case == "zero3" else w
  x_tiled = {**batch, "x": np.tile(batch["x"], (1, 1, 8))} if case == "zero3" else batch
  with jax.set_mesh(mesh):
    options = {"fsdp": "zero3"} if case == "zero3" else {}
    step = jax.jit(entry(with_statistics(loss), has_aux=True, micro_batches=K, **options))
    (value, stats), _ = step(jax.device_put(w, NamedSharding(mesh, spec)),
                             jax.device_put(x_tiled, NamedSharding(mesh, P("data"))))
    (path,) = diagnostics.paths(step, jax.device_put(w, NamedSharding(mesh, spec)),
                                jax.device_put(x_tiled, NamedSharding(mesh, P("data"))))
  assert path.view == "device" and (case != "zero3" or path.fsdp.startswith("zero3")), path
  assert int(stats.skipped) == 0 and np.isfinite(float(value))
  noise = stats.noise_scale
  assert all(np.isnan(float(x)) for x in (noise.small_sq_norm, noise.big_sq_norm,
                                          noise.b_simple))


def test_ema_rejects_a_decay_outside_zero_one():
  with pytest.raises(ValueError, match="decay"):
    diagnostics.NoiseScaleEMA(decay=1.0)


def test_inside_the_callers_shard_map():
  """Per-rank code over `data`: each rank's micro-batch gradient is a small batch of its
  own, as in the per-device view."""
  batch = regression_data(7)
  w = jnp.array([0.3, 0.1, -0.2])
  mesh = mesh_of((DEVICES,), ("data",), AxisType.Auto)
  value_and_grad = noise_of(token_loss, micro_batches=K, data_axes="data")
  step = jax.jit(jax.shard_map(lambda w, b: value_and_grad(w, b)[0][1], mesh=mesh,
                               in_specs=(P(), P("data")), out_specs=P()))
  with jax.set_mesh(mesh):
    noise = step(w, jax.device_put(batch, NamedSharding(mesh, P("data"))))
  expected = reference(token_loss, w, small_batches(batch, "device"), batch)
  for name, want in expected.items():
    np.testing.assert_allclose(getattr(noise, name), want, rtol=2e-5, err_msg=name)


def test_a_rank_that_is_part_of_a_small_batch_gives_nan():
  """Sequence parallelism: the loss sums its token count over `seq` itself, so a rank's
  gradient is part of a small batch's; that gradient's norm would mean nothing: NaN."""
  mesh = mesh_of((4, 2), ("data", "seq"), AxisType.Auto)

  def loss(w, b):
    err = jnp.sum(b["mask"] * (b["x"] @ w - b["y"]) ** 2)
    return fxaccum.Weighted(jax.lax.psum(err, "seq"), jax.lax.psum(jnp.sum(b["mask"]), "seq"))

  value_and_grad = noise_of(loss, micro_batches=2, data_axes=("data", "seq"))
  step = jax.jit(jax.shard_map(lambda w, b: value_and_grad(w, b)[0][1], mesh=mesh,
                               in_specs=(P(), P("data", "seq")), out_specs=P()))
  with jax.set_mesh(mesh):
    four_tokens = jax.tree.map(lambda a: a[:, :4], regression_data(8))
    noise = step(jnp.zeros(DIM),
                 jax.device_put(four_tokens, NamedSharding(mesh, P("data", "seq"))))
  assert np.isnan(float(noise.small_sq_norm)) and np.isnan(float(noise.b_simple))
