"""Sequence parallelism: per-rank code (fxaccum inside the caller's shard_map over data x
seq) gives the single-device token mean over all valid tokens, with one reduction per step.

Reference: the same model with ordinary attention on one device, total / count over the
whole batch (the DeepSpeed #5248 trap, per-rank means, is the negative control).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import ulysses
from helpers import assert_tree_close, mesh_of
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import fxaccum
from fxaccum import diagnostics

AXES = ("data", "seq")
SPEC = P("data", "seq")


def skewed_batch(mesh_shape, k=4):
  """ulysses' padded batch, made harder: the last sequence shard of every row of the last
  data rank is padding (an all-padding shard), and micro-batch k-1 (rows i % k == k-1 of
  every device, with the strided split) holds no token at all."""
  batch = ulysses.make_batch()
  data, seq = mesh_shape
  rows, tokens = batch["weights"].shape
  w = batch["weights"].copy()
  last_rank = np.arange(rows) >= rows - rows // data
  w[last_rank, tokens - tokens // seq:] = 0
  w[np.arange(rows) % k == k - 1] = 0
  batch["weights"] = w
  return batch


@jax.jit
@jax.value_and_grad
def _token_mean(params, batch):
  total, count = ulysses.token_sums_plain(params, batch)
  return total / count


def reference(params, batch):
  """The token mean over the whole batch and its gradients, on one device (jitted: one
  compilation per batch shape instead of one per op run eagerly)."""
  with jax.default_matmul_precision("highest"):
    return _token_mean(params, batch)


@functools.cache
def expected(mesh_shape):
  """``reference`` on ``skewed_batch(mesh_shape)``, computed once per mesh shape."""
  return reference(ulysses.make_params(), skewed_batch(mesh_shape))


def per_rank_step(mesh, loss, k, **kwargs):
  """The user's train-step shape: a shard_map over data x seq, fxaccum inside it."""
  grad_fn = fxaccum.value_and_grad(loss, micro_batches=k, data_axes=AXES, **kwargs)
  return jax.jit(jax.shard_map(grad_fn, mesh=mesh, in_specs=(P(), SPEC), out_specs=P()))


def put(batch, mesh):
  return jax.tree.map(lambda a: jax.device_put(a, NamedSharding(mesh, SPEC)), batch)


def weighted_per_rank(params, batch):
  return fxaccum.Weighted(*ulysses.token_sums_per_rank(params, batch))


# k = 1 (no loop) and k = 4 (a loop, its last micro-batch all padding) on the Explicit
# (data 2, seq 4) mesh, k = 4 on the Auto (data 4, seq 2) one; k = 2 ran the same loop
# (and runs on an Auto (data 2, seq 4) mesh in the tests below).
@pytest.mark.parametrize("mesh_shape,k", [((2, 4), 1), ((2, 4), 4), ((4, 2), 4)],
                         ids=["data2_seq4-1", "data2_seq4-4", "data4_seq2-4"])
def test_per_rank_ulysses_matches_the_global_token_mean(mesh_shape, k):
  params, batch = ulysses.make_params(), skewed_batch(mesh_shape)
  axis_type = AxisType.Explicit if mesh_shape == (2, 4) else AxisType.Auto
  mesh = mesh_of(mesh_shape, AXES, axis_type)
  step = per_rank_step(mesh, weighted_per_rank, k)
  with jax.set_mesh(mesh), jax.default_matmul_precision("highest"):
    args = (params, put(batch, mesh))
    got = step(*args)
    rep = diagnostics.report(step, *args)
  assert_tree_close(got, expected(mesh_shape))
  # Local sums in the loop; the one reduction of gradients, loss total and token count
  # over data x seq after it (XLA may split it into a few all-reduces).
  assert rep.reductions(place="loop") == [], rep.summary()
  top = rep.reductions(place="top")
  assert top and all(c.axes == AXES for c in top), rep.summary()
  grad_bytes = sum(np.asarray(p).nbytes for p in jax.tree.leaves(params))
  assert grad_bytes <= rep.bytes_per_call(diagnostics.REDUCTIONS) <= grad_bytes + 64
  assert [p.view for p in rep.paths] == ["device"]


def test_naive_combinations_are_wrong_on_the_same_data():
  """Negative controls: per-rank token means psum'd over seq (DeepSpeed #5248: about the
  SP size too large) and the mean of micro-batch token means."""
  mesh_shape, k = (2, 4), 4
  params, batch = ulysses.make_params(), skewed_batch(mesh_shape)
  ref_value, ref_grads = expected(mesh_shape)
  mesh = mesh_of(mesh_shape, AXES, AxisType.Auto)

  def trap(params, batch):
    total, count = ulysses.token_sums_per_rank(params, batch)
    per_rank_mean = jnp.where(count > 0, total / jnp.maximum(count, 1), 0.0)
    return jax.lax.pmean(jax.lax.psum(per_rank_mean, "seq"), "data")

  with jax.set_mesh(mesh):
    value = jax.jit(jax.shard_map(trap, mesh=mesh, in_specs=(P(), SPEC), out_specs=P()))(
        params, put(batch, mesh))
  assert abs(float(value) - float(ref_value)) > 1e-2 * float(ref_value)

  @jax.jit
  @jax.value_and_grad
  def micro_mean(p, micro):
    total, count = ulysses.token_sums_plain(p, micro)
    return jnp.where(count > 0, total / jnp.maximum(count, 1), 0.0)

  # The mean over the micro-batches of their token means, and its gradient: the mean of
  # theirs (one compilation, for the micro-batch shape).
  means = [micro_mean(params, jax.tree.map(lambda a, i=i: a[i::k], batch)) for i in range(k)]
  naive = jax.tree.map(lambda *parts: sum(parts) / k, *means)
  assert abs(float(naive[0]) - float(ref_value)) > 1e-2 * float(ref_value)
  rel = max(float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))
            for a, b in zip(jax.tree.leaves(naive[1]), jax.tree.leaves(ref_grads), strict=True))
  assert rel > 1e-2


def test_a_loss_that_already_psums_its_weighted_parts():
  """psum over seq inside the loss: fxaccum does not sum those parts again."""
  mesh_shape = (2, 4)
  params, batch = ulysses.make_params(), skewed_batch(mesh_shape)
  mesh = mesh_of(mesh_shape, AXES, AxisType.Auto)

  def summed_over_seq(params, batch):
    total, count = ulysses.token_sums_per_rank(params, batch)
    return fxaccum.Weighted(jax.lax.psum(total, "seq"), jax.lax.psum(count, "seq"))

  with jax.set_mesh(mesh), jax.default_matmul_precision("highest"):
    got = per_rank_step(mesh, summed_over_seq, 2)(params, put(batch, mesh))
  assert_tree_close(got, expected(mesh_shape))


@pytest.mark.parametrize("form", ["pmean_of_means", "psum_over_psum", "weighted_psums",
                                  "weighted_psummed_count", "weighted_global_count"])
def test_per_rank_losses_already_reduced_over_the_ranks(form):
  """A per-rank loss that already holds the global value (a pmean of the ranks' means, a
  psum over a psum) or a Weighted whose count was psummed from a number that is not batch
  data (the ranks' row counts) came back 1/8 of the reference: the scalar loss's weight of
  1, and the psummed count, were summed over the ranks again. A weight the same on every
  rank is now summed where the total is; a value fed by a psum is not summed again."""
  rng = np.random.default_rng(3)
  x, y = rng.normal(size=(32, 4)).astype(np.float32), rng.normal(size=32).astype(np.float32)
  w = np.linspace(0.5, 1.5, 4).astype(np.float32)
  mesh = mesh_of((8,), ("data",), AxisType.Auto)

  def squares(w, b):
    return (b[0] @ w - b[1]) ** 2

  def psum(v):
    return jax.lax.psum(v, "data")

  losses = {
      "pmean_of_means": lambda w, b: jax.lax.pmean(jnp.mean(squares(w, b)), "data"),
      "psum_over_psum": lambda w, b: psum(jnp.sum(squares(w, b))) / psum(
          jnp.float32(b[0].shape[0])),
      "weighted_psums": lambda w, b: fxaccum.Weighted(psum(jnp.sum(squares(w, b))), psum(
          jnp.float32(b[0].shape[0]))),
      "weighted_psummed_count": lambda w, b: fxaccum.Weighted(jnp.sum(squares(w, b)), psum(
          jnp.float32(b[0].shape[0]))),
      "weighted_global_count": lambda w, b: fxaccum.Weighted(psum(jnp.sum(squares(w, b))),
                                                             8.0 * b[0].shape[0]),
  }
  grad_fn = fxaccum.value_and_grad(losses[form], micro_batches=2, data_axes="data")
  with jax.set_mesh(mesh):
    got = jax.jit(jax.shard_map(grad_fn, mesh=mesh, in_specs=(P(), P("data")),
                                out_specs=P()))(w, (x, y))
  # Every micro-batch has as many rows: the mean of the micro-batches' means is the mean.
  assert_tree_close(got, jax.value_and_grad(lambda w: jnp.mean(squares(w, (x, y))))(w))


def test_per_rank_token_mean_is_refused():
  """A per-shard token mean cannot combine into the global one: a clear error."""
  mesh = mesh_of((2, 4), AXES, AxisType.Auto)
  params, batch = ulysses.make_params(), skewed_batch((2, 4))

  def per_rank_mean(params, batch):
    total, count = ulysses.token_sums_per_rank(params, batch)
    return total / jnp.maximum(count, 1.0)

  with jax.set_mesh(mesh), pytest.raises(ValueError, match="DeepSpeed #5248.*Weighted"):
    per_rank_step(mesh, per_rank_mean, 2)(params, put(batch, mesh))


def test_inside_a_shard_map_without_data_axes_is_an_error_naming_them():
  mesh = mesh_of((2, 4), AXES, AxisType.Auto)
  params, batch = ulysses.make_params(), skewed_batch((2, 4))
  grad_fn = fxaccum.value_and_grad(weighted_per_rank, micro_batches=2)
  step = jax.jit(jax.shard_map(grad_fn, mesh=mesh, in_specs=(P(), SPEC), out_specs=P()))
  with jax.set_mesh(mesh), pytest.raises(
      ValueError, match=r"manual over \('data', 'seq'\).*data_axes=\('data', 'seq'\)"):
    step(params, put(batch, mesh))
  with pytest.raises(ValueError, match="mixes axes that are manual"), jax.set_mesh(mesh):
    jax.jit(jax.shard_map(
        fxaccum.value_and_grad(weighted_per_rank, micro_batches=2, data_axes=AXES),
        mesh=mesh, in_specs=(P(), P("data")), out_specs=P(), axis_names={"data"}))(
            params, jax.tree.map(lambda a: jax.device_put(a, NamedSharding(mesh, P("data"))),
                                 batch))


def test_cross_step_deferred_sync_per_rank():
  """value_and_unreduced_grad inside the shard_map feeds accumulate(k, data_axes=(data,
  seq)): the gradient is reduced once per window, in the boundary branch; the SGD step
  equals the one on the window's global token mean."""
  mesh_shape, calls = (2, 4), 2
  params = ulysses.make_params()
  batches = [skewed_batch(mesh_shape), ulysses.make_batch(seed=1)]
  mesh = mesh_of(mesh_shape, AXES, AxisType.Auto)
  tx = optax.chain(fxaccum.accumulate(calls, data_axes=AXES), optax.sgd(0.5))
  grad_fn = fxaccum.value_and_unreduced_grad(weighted_per_rank, micro_batches=2, data_axes=AXES)

  def step(params, opt_state, batch):
    _, grads = grad_fn(params, batch)
    return fxaccum.apply_gradients(tx, grads, opt_state, params)

  with jax.set_mesh(mesh):
    # Placed as `run` returns them: both calls (and the report) use one compilation.
    placed = jax.device_put(params, NamedSharding(mesh, P()))
    opt_state = tx.init(placed)
    acc_spec = jax.tree.map(lambda _: P(AXES), opt_state[0].accumulator)
    state_specs = (opt_state[0]._replace(micro_step=P(), optimizer_step=P(),
                                         accumulator=acc_spec, weight=P(AXES), skipped=P(),
                                         calls=P()),
                   jax.tree.map(lambda _: P(), opt_state[1]))
    run = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), state_specs, SPEC),
                                out_specs=(P(), state_specs)))
    p = placed
    for batch in batches:
      p, opt_state = run(p, opt_state, put(batch, mesh))
      jax.block_until_ready(p)
    rep = diagnostics.report(run, p, opt_state, put(batches[0], mesh))
  # Reference: the window's gradient is sum(total) / sum(count) over both calls, the
  # batches' token-mean gradients weighted by their token counts.
  counts = [float(b["weights"].sum()) for b in batches]
  grads = [expected(mesh_shape)[1], reference(params, batches[1])[1]]
  window = jax.tree.map(lambda a, b: (counts[0] * a + counts[1] * b) / sum(counts), *grads)
  want = jax.tree.map(lambda w, g: w - 0.5 * g, params, window)
  assert_tree_close(p, want)
  grad_bytes = sum(np.asarray(x).nbytes for x in jax.tree.leaves(params))
  big = [c for c in rep.reductions() if c.bytes >= grad_bytes // 2]
  assert big and all(c.place == "conditional" for c in big), rep.summary()


def test_inside_a_shard_map_without_vma_checks_data_axes_must_be_named():
  """With check_vma=False no value says whether the batch is split over the manual axes:
  fxaccum asks for data_axes instead of computing each rank's loss as if it were whole
  (off by 1.0 on the loss and 4.35 on the gradients before)."""
  mesh = mesh_of((2, 4), AXES, AxisType.Auto)
  params, batch = ulysses.make_params(), skewed_batch((2, 4))

  def step(**kwargs):
    grad_fn = fxaccum.value_and_grad(weighted_per_rank, micro_batches=2, **kwargs)
    return jax.jit(jax.shard_map(grad_fn, mesh=mesh, in_specs=(P(), SPEC), out_specs=P(),
                                 check_vma=False))

  with jax.set_mesh(mesh), pytest.raises(
      ValueError, match=r"manual over \('data', 'seq'\) with check_vma=False.*data_axes="):
    step()(params, put(batch, mesh))
  with jax.set_mesh(mesh):  # named, it is the global token mean again
    got = step(data_axes=AXES)(params, put(batch, mesh))
  want = expected((2, 4))
  np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
  assert_tree_close(got[1], want[1])
