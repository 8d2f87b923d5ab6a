"""micro_batches=MicroBatchSize(m): k follows the batch at trace time (k = B // m), so a batch-size
ramp-up keeps the micro-batch fixed; exact against jax.value_and_grad on each batch."""

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
from jax.sharding import AxisType

import fxaccum
from fxaccum import diagnostics


@pytest.mark.parametrize("batch", [32, 64, 128])
def test_k_follows_the_batch(batch):
  """m = 16 rows across 8 devices: k = 2, 4, 8 for batches of 32, 64, 128 rows (the
  ramp-up), each exact, and equal to micro_batches=B // m (the same program)."""
  mesh = mesh_of((8,), ("data",), AxisType.Explicit)
  params, data = make_params(), make_data(k=batch // 16, batch=batch)
  sized = jax.jit(fxaccum.value_and_grad(weighted_loss, micro_batches=fxaccum.MicroBatchSize(16)))
  counted = jax.jit(fxaccum.value_and_grad(weighted_loss, micro_batches=batch // 16))
  with jax.set_mesh(mesh):
    args = (put(params, mesh, {}), put(data, mesh, DATA))
    got = sized(*args)
    same = sized.lower(*args).as_text() == counted.lower(*args).as_text()
  assert same, "MicroBatchSize(m) must compile micro_batches=B // m's program"
  assert_tree_close(got, jax.value_and_grad(reference_token_mean)(params, data))


def test_eager_calls_compile_once_per_batch_size():
  """Called eagerly with growing batches: each size gets its own k (the cached program of
  one size is not reused for another)."""
  def loss(w, x):
    return jnp.mean((x @ w) ** 2)

  step = fxaccum.value_and_grad(loss, micro_batches=fxaccum.MicroBatchSize(2))
  w = jnp.ones(3)
  for rows in (4, 8, 4):
    x = jnp.arange(rows * 3.0).reshape(rows, 3) / 10
    value, grads = step(w, x)
    ref_value, ref_grads = jax.value_and_grad(loss)(w, x)
    np.testing.assert_allclose(value, ref_value, rtol=1e-6)
    np.testing.assert_allclose(grads, ref_grads, rtol=1e-6)


def test_the_micro_batch_stays_fixed_as_the_batch_grows():
  """The point of the option: temp memory stays about flat from 64 to 256 rows at m = 16
  (the activations of one micro-batch), where micro_batches=4 (the negative control)
  grows with the batch."""
  mesh = mesh_of((8,), ("data",), AxisType.Explicit)

  def temp(batch, **option):
    step = jax.jit(fxaccum.value_and_grad(weighted_loss, **option))
    with jax.set_mesh(mesh):
      args = (put(make_params(), mesh, {}), put(make_data(batch=batch), mesh, DATA))
      return diagnostics.report(step, *args).memory.temp_bytes

  sized = {b: temp(b, micro_batches=fxaccum.MicroBatchSize(16)) for b in (64, 256)}
  counted = {b: temp(b, micro_batches=4) for b in (64, 256)}
  assert sized[256] <= 1.25 * sized[64], sized
  assert counted[256] >= 2 * counted[64], counted


@pytest.mark.parametrize("rows,error,match", [
    (24, ValueError, r"MicroBatchSize\(24\) does not divide the batch's 64"),
    (4, ValueError, "over 8 data devices"),
    (None, TypeError, "needs micro_batches=k"),
    (0, ValueError, "MicroBatchSize's rows must be a positive int"),
])
def test_errors_name_micro_batch_size(rows, error, match):
  mesh = mesh_of((8,), ("data",), AxisType.Explicit)
  with pytest.raises(error, match=match):
    options = {} if rows is None else {"micro_batches": fxaccum.MicroBatchSize(rows)}
    step = jax.jit(fxaccum.value_and_grad(weighted_loss, **options))
    with jax.set_mesh(mesh):
      step(put(make_params(), mesh, {}), put(make_data(), mesh, DATA))
