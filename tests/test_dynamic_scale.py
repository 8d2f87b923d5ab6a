"""fp16 loss scaling (flax's DynamicScale, as the imagenet and wmt trainers use it) with
in-step and cross-step accumulation: the scale checks the accumulated gradient once per
optimizer step. Reference: flax's own DynamicScale.value_and_grad on the whole batch of
each step, with the imagenet trainer's skip of a non-finite step."""

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import dynamic_scale as dynamic_scale_lib
from flax.training import train_state
from helpers import assert_tree_close

import fxaccum

K, ROWS, DIM = 4, 32, 3


def loss_fn(params, batch):
  pred = batch["x"] @ params["w"]
  return jnp.mean((pred - batch["y"]) ** 2), jnp.mean(pred)


def batches(steps, bad_step=None):
  """One whole batch per optimizer step; at ``bad_step`` one row (in one micro-batch) is
  inf, so that step's gradient is not finite."""
  rng = np.random.default_rng(0)
  out = []
  for step in range(steps):
    x = rng.normal(size=(ROWS, DIM)).astype(np.float32)
    if step == bad_step:
      x[5, 1] = np.inf
    out.append({"x": x, "y": rng.normal(size=(ROWS,)).astype(np.float32)})
  return out


@pytest.mark.parametrize("bad", [False, True])
def test_in_step_scale_checks_the_accumulated_gradient_once(bad):
  batch = batches(1, bad_step=0 if bad else None)[0]
  w = {"w": np.ones(DIM, np.float32)}
  # fin_steps at the growth interval: a finite step grows the scale, a non-finite backs off.
  flax_scale = dynamic_scale_lib.DynamicScale(growth_interval=3, fin_steps=3, scale=256.0)
  ours = fxaccum.DynamicScale(growth_interval=3, fin_steps=3, scale=256.0)
  want = jax.jit(lambda s, w, b: s.value_and_grad(loss_fn, has_aux=True)(w, b))(
      flax_scale, w, batch)
  got = jax.jit(lambda s, w, b: s.value_and_grad(loss_fn, has_aux=True, micro_batches=K)(
      w, b))(ours, w, batch)
  assert bool(got.finite) == bool(want.finite) == (not bad)
  assert float(got.dynamic_scale.scale) == float(want.dynamic_scale.scale) == (
      128.0 if bad else 512.0)
  assert int(got.dynamic_scale.fin_steps) == int(want.dynamic_scale.fin_steps) == 0
  if not bad:
    assert_tree_close((got.aux, got.grad), (want.aux, want.grad))


def test_in_step_scale_unscales_every_output_of_fxaccums_options():
  """Statistics in the aux (the skipped count, the noise scale's norms of scaled
  gradients) and value_and_unreduced_grad's per-device sums come back as
  fxaccum.value_and_grad gives them unscaled (before: a TypeError on the tuple value, the
  NoiseScale dropped, and the unreduced weights divided by the scale, which made the
  cross-step gradient 65536x too large)."""
  batch = batches(1)[0]
  w = {"w": np.ones(DIM, np.float32)}
  scale = fxaccum.DynamicScale(scale=2.0 ** 16)
  value_fn = lambda p, b: loss_fn(p, b)[0]  # noqa: E731
  ref_value, ref_grad = jax.value_and_grad(value_fn)(w, batch)
  micro = [jax.tree.map(lambda a, i=i: a[i::K], batch) for i in range(K)]
  small = np.mean([optax.tree.norm(jax.grad(value_fn)(w, m), squared=True) for m in micro])

  def with_statistics(p, b):
    value, aux = loss_fn(p, b)
    return value, {"aux": aux, "stats": fxaccum.Statistics()}

  got = scale.value_and_grad(with_statistics, has_aux=True, micro_batches=K,
                             skip_nonfinite=True)(w, batch)
  (value, aux), grads = got.aux, got.grad  # flax names the value "aux"
  assert_tree_close((value, aux["aux"], grads), (ref_value, loss_fn(w, batch)[1], ref_grad))
  noise = aux["stats"].noise_scale
  assert int(aux["stats"].skipped) == 0
  np.testing.assert_allclose([noise.small_sq_norm, noise.big_sq_norm, noise.small_batch,
                              noise.big_batch],
                             [small, optax.tree.norm(ref_grad, squared=True), ROWS // K, ROWS],
                             rtol=1e-5)

  mesh = jax.make_mesh((4,), ("data",))
  with jax.set_mesh(mesh):
    got = jax.jit(scale.value_and_unreduced_grad(value_fn, micro_batches=K))(
        w, jax.device_put(batch, jax.P("data")))
  unreduced = got.grad
  assert isinstance(unreduced, fxaccum.Unreduced)
  assert float(jnp.sum(unreduced.weight)) == 4 * K  # one per micro-batch and device
  assert_tree_close(jax.tree.map(lambda t: jnp.sum(t, 0) / jnp.sum(unreduced.weight),
                                 unreduced.total), ref_grad)


class ScaledState(fxaccum.TrainState):
  dynamic_scale: dynamic_scale_lib.DynamicScale


class FlaxScaledState(train_state.TrainState):
  dynamic_scale: dynamic_scale_lib.DynamicScale


@jax.jit
def accumulated_call(state, micro):
  # As the imagenet trainer computes its gradient; the per-call scale it returns is unused:
  # the gate updates state.dynamic_scale once per window.
  _, _, _, grads = state.dynamic_scale.value_and_grad(loss_fn, has_aux=True)(state.params,
                                                                               micro)
  return state.apply_gradients(grads=grads)


@jax.jit
def flax_step(state, batch):
  """flax's imagenet train_step, reduced to its dynamic-scale logic."""
  dynamic_scale, is_fin, _, grads = state.dynamic_scale.value_and_grad(
      loss_fn, has_aux=True)(state.params, batch)
  new_state = state.apply_gradients(grads=grads)
  keep = functools.partial(jax.tree.map, functools.partial(jnp.where, is_fin))
  return new_state.replace(opt_state=keep(new_state.opt_state, state.opt_state),
                           params=keep(new_state.params, state.params),
                           dynamic_scale=dynamic_scale)


def test_cross_step_scale_updates_once_per_window_on_its_gradient():
  steps, bad = 6, 2
  w = {"w": np.ones(DIM, np.float32)}
  scale = dict(growth_interval=2, scale=2.0 ** 8)
  ours = ScaledState.create(apply_fn=None, params=w, dynamic_scale=fxaccum.DynamicScale(**scale),
                            tx=optax.chain(fxaccum.accumulate(K), optax.adam(0.1)))
  ref = FlaxScaledState.create(apply_fn=None, params=w, tx=optax.adam(0.1),
                               dynamic_scale=dynamic_scale_lib.DynamicScale(**scale))
  scales: list[Any] = []
  for batch in batches(steps, bad_step=bad):
    ref = flax_step(ref, batch)
    for i in range(K):
      ours = accumulated_call(ours, jax.tree.map(lambda a, i=i: a[i::K], batch))
      if i < K - 1:  # mid-window: the scale holds
        assert float(ours.dynamic_scale.scale) == float(scales[-1] if scales else 256.0)
    scales.append(float(ours.dynamic_scale.scale))
    assert float(ours.dynamic_scale.scale) == float(ref.dynamic_scale.scale)
    assert int(ours.dynamic_scale.fin_steps) == int(ref.dynamic_scale.fin_steps)
    assert_tree_close(ours.params, ref.params)
  # Backed off at the inf step, grown once fin_steps reached the interval again.
  assert scales == [256.0, 256.0, 128.0, 128.0, 128.0, 256.0]
  assert int(ours.step) == steps and bool(jnp.all(jnp.isfinite(ours.params["w"])))
  assert_tree_close(ours.opt_state[1], ref.opt_state)
