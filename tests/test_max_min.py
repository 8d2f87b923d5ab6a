"""``fxaccum.Max`` / ``fxaccum.Min`` aux leaves: combined by their maximum / minimum over
the micro-batches and devices, per device only where the value provably is an extremum
over examples.

References are independent of fxaccum: numpy over the whole batch, or the extremum over
the k global micro-batches (rows ``i::k`` of each device's rows) of the leaf's value.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import AXIS_TYPES, mesh_of
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import fxaccum
from fxaccum import diagnostics

K, DEVICES, ROWS, DIM = 4, 8, 64, 4


def data(seed=0):
  rng = np.random.default_rng(seed)
  # All negative: a maximum started from 0 (a zero-initialized accumulator) would be wrong.
  return -np.abs(rng.normal(size=(ROWS, DIM))).astype(np.float32) - 1.0


def global_micro_batches(x, k=K, devices=DEVICES):
  """Micro-batch i: rows i::k of every device's rows, as fxaccum splits a sharded batch."""
  blocks = np.split(x, devices)
  return [np.concatenate([b[i::k] for b in blocks]) for i in range(k)]


def run(aux_fn, axis_type, x, **options):
  """fxaccum over a batch sharded over 8 devices: the aux and the view taken."""
  mesh = mesh_of((DEVICES,), ("data",), axis_type)

  def loss(w, x):
    return jnp.mean(x * w), aux_fn(x, w)

  with jax.set_mesh(mesh):
    step = jax.jit(fxaccum.value_and_grad(loss, has_aux=True, micro_batches=K, **options))
    args = (jax.device_put(jnp.ones(DIM), NamedSharding(mesh, P())),
            jax.device_put(x, NamedSharding(mesh, P("data"))))
    (_, aux), _ = step(*args)
    (path,) = diagnostics.paths(step, *args)
  return jax.tree.map(np.asarray, aux), path.view


EXTREMA = {  # an extremum over examples: per device, then one pmax / pmin
    "max": (lambda x, w: fxaccum.Max(jnp.max(x * w)), lambda x: np.max(x)),
    "amax": (lambda x, w: fxaccum.Max(jnp.max(jnp.abs(x))), lambda x: np.max(np.abs(x))),
    "min": (lambda x, w: fxaccum.Min(jnp.min(x)), lambda x: np.min(x)),
    "negated": (lambda x, w: fxaccum.Min(-jnp.max(x)), lambda x: -np.max(x)),
    "per_column": (lambda x, w: fxaccum.Max(jnp.max(x, axis=0)), lambda x: np.max(x, 0)),
    "bf16": (lambda x, w: fxaccum.Max(jnp.max(x).astype(jnp.bfloat16)),
             lambda x: np.max(x).astype(jnp.bfloat16)),
    "constant": (lambda x, w: fxaccum.Max(jnp.max(w) - 3.0), lambda x: np.float32(-2.0)),
}


@pytest.mark.parametrize("axis_type", AXIS_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("name", EXTREMA)
def test_an_extremum_over_examples_runs_per_device_and_is_exact(name, axis_type):
  aux_fn, expected = EXTREMA[name]
  x = data()
  aux, view = run(aux_fn, axis_type, x)
  assert view == "device"
  np.testing.assert_array_equal(aux.astype(np.float32), np.asarray(expected(x), np.float32))
  assert aux.dtype == jnp.result_type(aux_fn(x, jnp.ones(DIM)).value)


NOT_EXTREMA = {  # per device these would be another value than the batch's
    "max_of_mean": (lambda x, w: fxaccum.Max(jnp.mean(x * w)), np.mean),
    "scaled_by_rows": (lambda x, w: fxaccum.Max(jnp.max(x) / x.shape[0]),
                       lambda m: np.max(m) / len(m)),
    "min_of_max": (lambda x, w: fxaccum.Min(jnp.max(x)), np.max),
    "to_bool": (lambda x, w: fxaccum.Max((jnp.max(x) + 1.5).astype(bool)),
                lambda m: np.max(m) + 1.5 != 0),
    # Running sums of per-column maxima: once kept the marker through cumsum (and pmax'd).
    "cumsum_of_maxima": (lambda x, w: fxaccum.Max(jnp.cumsum(jnp.max(x, axis=0))),
                         lambda m: np.cumsum(np.max(m, axis=0))),
    # Negating an unsigned maximum wraps: no minimum (the marker was once swapped anyway).
    "negated_unsigned": (lambda x, w: fxaccum.Min(-jnp.max((x < -2.5).astype(jnp.uint32))),
                         lambda m: -np.max((m < -2.5).astype(np.uint32))),
}


@pytest.mark.parametrize("name", NOT_EXTREMA)
def test_a_value_that_is_no_extremum_over_examples_takes_the_global_view(name):
  aux_fn, per_micro_batch = NOT_EXTREMA[name]
  x = data(1)
  extremum = np.max if isinstance(aux_fn(x, jnp.ones(DIM)), fxaccum.Max) else np.min
  combine = functools.partial(extremum, axis=0)  # elementwise over the micro-batches
  expected = combine([per_micro_batch(m) for m in global_micro_batches(x)])
  aux, view = run(aux_fn, jax.sharding.AxisType.Auto, x)
  assert view == "global"
  np.testing.assert_allclose(aux, expected, rtol=1e-6)
  # Negative control: per device each device's micro-batches stand for the batch.
  forced, _ = run(aux_fn, jax.sharding.AxisType.Auto, x, view="device")
  per_device = combine([per_micro_batch(b[i::K]) for b in np.split(x, DEVICES)
                        for i in range(K)])
  np.testing.assert_allclose(forced, per_device, rtol=1e-6)
  if name != "to_bool":  # a boolean of anything nonzero is True either way
    assert not np.allclose(forced, expected)


def test_a_skipped_micro_batch_adds_nothing_to_a_maximum():
  x = data(2)
  x[1, 0] = np.inf  # micro-batch 1 of device 0 (row 1 of its rows 0..7): not finite
  aux, _ = run(lambda x, w: (fxaccum.Max(jnp.max(jnp.where(jnp.isinf(x), 1e6, x))),
                             fxaccum.Min(jnp.min(jnp.where(jnp.isinf(x), -1e6, x))),
                             fxaccum.Statistics()),
               jax.sharding.AxisType.Auto, x, skip_nonfinite=True)
  amax, amin, stats = aux
  skipped = stats.skipped
  blocks = np.split(x, DEVICES)
  kept = np.concatenate([b[i::K] for d, b in enumerate(blocks) for i in range(K)
                         if not (d == 0 and i == 1)])
  assert int(skipped) == 1
  np.testing.assert_array_equal(amax, np.max(kept))  # < 0: not 0, not 1e6
  np.testing.assert_array_equal(amin, np.min(kept))


def test_integer_and_boolean_extrema_in_one_device_loop():
  x = np.arange(12, dtype=np.int32).reshape(6, 2) - 20

  def loss(w, x):
    return jnp.mean(x * w), (fxaccum.Max(jnp.max(x)), fxaccum.Min(jnp.all(x < -10, axis=1)))

  (_, (imax, rows_all)), _ = fxaccum.value_and_grad(loss, has_aux=True, micro_batches=3)(
      jnp.ones(2), x)
  assert imax.dtype == jnp.int32 and int(imax) == -9
  micro = [x[i::3] for i in range(3)]
  np.testing.assert_array_equal(rows_all, np.min([np.all(m < -10, axis=1) for m in micro], 0))


def test_inside_the_callers_shard_map():
  """Per-rank code: fxaccum inside the user's shard_map over `data`; each rank's maximum
  over its micro-batches, then one pmax over the ranks."""
  x = data(3)
  mesh = mesh_of((DEVICES,), ("data",), jax.sharding.AxisType.Auto)

  def loss(w, x):
    return jnp.mean(x * w), (fxaccum.Max(jnp.max(x)), fxaccum.Min(jnp.min(x, axis=0)))

  grad_fn = fxaccum.grad(loss, has_aux=True, micro_batches=K, data_axes="data")
  step = jax.jit(jax.shard_map(lambda w, x: grad_fn(w, x)[1], mesh=mesh,
                               in_specs=(P(), P("data")), out_specs=P()))
  with jax.set_mesh(mesh):
    largest, lowest = step(jnp.ones(DIM), jax.device_put(x, NamedSharding(mesh, P("data"))))
  np.testing.assert_array_equal(largest, np.max(x))
  np.testing.assert_array_equal(lowest, np.min(x, axis=0))
