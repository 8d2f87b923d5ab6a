"""Nothing silently wrong: bad input is an error that names the fix; traced edge cases have
a documented, tested behaviour (skipped calls and micro-batches, pre-normalized losses).

Every test here failed before this file was added: the inputs ran and gave a wrong result
or an unhelpful message.
"""

import inspect
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from helpers import assert_tree_close, mesh_of
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import fxaccum
from fxaccum.checkpoint import CheckpointMismatchError

PARAMS = {"w": np.array([1.0, -2.0, 0.5], np.float32)}


def gate(tx, grads_seq, weights=None, params=PARAMS):
  opt_state = tx.init(params)
  for i, g in enumerate(grads_seq):
    w = None if weights is None else weights[i]
    params, opt_state = fxaccum.apply_gradients(tx, g, opt_state, params, weight=w)
  return params, opt_state


def grad(value):
  return {"w": jnp.full(3, value, jnp.float32)}


# ------------------------------------------------------------------------------ cross-step


@pytest.mark.parametrize("schedule, error, match", [
    (lambda step: 0, ValueError, "at least 1 call"),
    (lambda step: -3, ValueError, "at least 1 call"),
    (lambda step: 2.7, TypeError, "must return an integer"),
    (lambda step: None, TypeError, "must return an integer"),
    (lambda step: jnp.float32(jnp.nan), TypeError, "must return an integer"),
])
def test_bad_every_k_schedules(schedule, error, match):
  tx = optax.chain(fxaccum.accumulate(schedule), optax.sgd(1.0))
  with pytest.raises(error, match=match):
    gate(tx, [grad(1.0)])


def test_traced_schedule_below_one_is_a_window_of_one_call():
  """Under jit the schedule's value is traced: below 1 it is clamped (documented)."""
  tx = optax.chain(fxaccum.accumulate(lambda step: jnp.int32(step) - 5), optax.sgd(1.0))
  opt_state = tx.init(PARAMS)
  step = jax.jit(lambda g, s, p: fxaccum.apply_gradients(tx, g, s, p))
  params, opt_state = step(grad(1.0), opt_state, PARAMS)
  assert fxaccum.is_boundary(opt_state)
  assert_tree_close(params, {"w": PARAMS["w"] - 1.0})


@pytest.mark.parametrize("bad", [np.float32(1.0), np.ones((2, 3), np.float32)])
def test_gradient_of_another_shape_is_refused(bad):
  tx = optax.chain(fxaccum.accumulate(2), optax.sgd(1.0))
  with pytest.raises(ValueError, match=r"\['w'\] has shape .*its param \(3,\).*no.* broadcast"):
    gate(tx, [{"w": bad}])


@pytest.mark.parametrize("weight", [-1.0, float("inf"), float("nan")])
def test_bad_python_weight_is_refused(weight):
  tx = optax.chain(fxaccum.accumulate(2), optax.sgd(1.0))
  with pytest.raises(ValueError, match="finite and >= 0"):
    gate(tx, [grad(1.0)], weights=[weight])


def test_traced_negative_weight_poisons_or_is_skipped():
  step = jax.jit(lambda tx_, g, s, p, w: fxaccum.apply_gradients(tx_, g, s, p, weight=w),
                 static_argnums=0)
  for skip in (False, True):
    tx = optax.chain(fxaccum.accumulate(2, skip_nonfinite=skip), optax.sgd(1.0))
    params, opt_state = PARAMS, tx.init(PARAMS)
    for w in (1.0, -1.0, 1.0):
      params, opt_state = step(tx, grad(1.0), opt_state, params, jnp.float32(w))
    if skip:  # the negative call never happened: one window of the two good calls
      assert int(opt_state[0].skipped) == 1
      assert_tree_close(params, {"w": PARAMS["w"] - 1.0})
    else:  # never silently wrong: the window's gradient is NaN
      assert np.isnan(np.asarray(params["w"])).all()


def test_weight_zero_adds_nothing_even_with_nan_gradients():
  tx = optax.chain(fxaccum.accumulate(3), optax.sgd(1.0))
  params, _ = gate(tx, [grad(1.0), grad(jnp.nan), grad(3.0)], weights=[1.0, 0.0, 1.0])
  assert_tree_close(params, {"w": PARAMS["w"] - 2.0})  # (1 + 3) / 2


def multisteps_vs_gate(inner, grads_seq, k=2):
  """optax's MultiSteps skip scenario (skip_not_finite) and the gate with skip_nonfinite,
  call by call: the same params and inner optimizer state."""
  ms = optax.MultiSteps(inner, k, should_skip_update_fn=optax.skip_not_finite)
  tx = optax.chain(fxaccum.accumulate(k, skip_nonfinite=True), inner)
  ms_params, ms_state = PARAMS, ms.init(PARAMS)
  params, opt_state = PARAMS, tx.init(PARAMS)
  for g in grads_seq:
    updates, ms_state = ms.update(g, ms_state, ms_params)
    ms_params = optax.apply_updates(ms_params, updates)
    params, opt_state = fxaccum.apply_gradients(tx, g, opt_state, params)
    assert_tree_close(params, ms_params)
    assert int(opt_state[0].micro_step) == int(ms_state.mini_step)
    if jax.tree.leaves(ms_state.inner_opt_state):  # sgd has no state
      assert_tree_close(jax.tree.leaves(opt_state[1]),
                        jax.tree.leaves(ms_state.inner_opt_state))
  return opt_state


@pytest.mark.parametrize("inner", [optax.sgd(1.0), optax.adam(0.1)], ids=["sgd", "adam"])
def test_skip_nonfinite_is_multisteps_skip_not_finite(inner):
  """optax's test_multi_steps_skip_not_finite sequence: good, good, inf, nan, good, good."""
  seq = [grad(1.0), grad(1.0), grad(jnp.inf), grad(jnp.nan), grad(1.0), grad(1.0)]
  opt_state = multisteps_vs_gate(inner, seq)
  assert int(opt_state[0].skipped) == 2 and int(opt_state[0].optimizer_step) == 2


def test_a_window_of_skipped_calls_never_steps():
  tx = optax.chain(fxaccum.accumulate(2, skip_nonfinite=True), optax.adam(0.1))
  params, opt_state = gate(tx, [grad(jnp.nan)] * 5)
  assert_tree_close(params, PARAMS)
  assert int(opt_state[0].optimizer_step) == 0 and int(opt_state[1][0].count) == 0
  assert int(opt_state[0].skipped) == 5


def test_accumulate_wrapped_in_multisteps_or_masked_is_refused():
  params = {"a": jnp.zeros(2), "b": jnp.zeros(3)}
  inside = optax.MultiSteps(optax.chain(fxaccum.accumulate(2), optax.sgd(1.0)), 2)
  with pytest.raises(ValueError, match=r"ran 2 times.*optax.MultiSteps"):
    fxaccum.apply_gradients(inside, params, inside.init(params), params)
  masked = optax.chain(optax.masked(fxaccum.accumulate(2), {"a": True, "b": False}),
                       optax.sgd(1.0))
  with pytest.raises(ValueError, match="masked params tree.*first in a top-level chain"):
    masked.init(params)


# -------------------------------------------------------------------------------- in-step


def rows_data(rows=64, dim=4, seed=0):
  rng = np.random.default_rng(seed)
  return {"x": rng.normal(size=(rows, dim)).astype(np.float32),
          "y": rng.normal(size=(rows,)).astype(np.float32)}


def mse(w, b):
  return jnp.mean((b["x"] @ w - b["y"]) ** 2)


def centred(w, b):  # mixes examples: the global view
  h = b["x"] @ w
  return jnp.mean((h - jnp.mean(h)) ** 2)


def with_statistics(loss):
  """``loss`` with the step's statistics asked for in its aux."""
  return lambda *args: (loss(*args), fxaccum.Statistics())


def test_skip_nonfinite_micro_batch_per_device_and_global():
  """A NaN row: the device view drops that device's share of its micro-batch, the global
  view the whole micro-batch; both equal their reference without those rows."""
  k, bad_row = 4, 21
  data = rows_data()
  data["x"][bad_row, 0] = np.nan
  w = np.ones(4, np.float32)
  mesh = mesh_of((8,), ("data",), AxisType.Auto)
  with jax.set_mesh(mesh):
    sharded = jax.tree.map(lambda a: jax.device_put(a, NamedSharding(mesh, P("data"))), data)
    per_device = jax.jit(fxaccum.value_and_grad(
        with_statistics(mse), has_aux=True, micro_batches=k, skip_nonfinite=True))
    global_ = jax.jit(fxaccum.value_and_grad(
        with_statistics(centred), has_aux=True, micro_batches=k, skip_nonfinite=True))
    (value, stats), grads = per_device(w, sharded)
    (gvalue, gstats), ggrads = global_(w, sharded)
  skipped, gskipped = stats.skipped, gstats.skipped
  # Device view: 8 rows per device, 2 per micro-batch; the bad row's pair is dropped.
  device, local = divmod(bad_row, 8)
  dropped = {device * 8 + r for r in range(8) if r % k == local % k}
  keep = np.array([r for r in range(64) if r not in dropped])
  # Every other (device, micro-batch) part keeps weight 1: the mean of 31 part means.
  parts = [(d, i) for d in range(8) for i in range(k) if (d, i) != (device, local % k)]

  def part_mean(w, d, i):
    rows = np.arange(d * 8, d * 8 + 8)[i::k]
    return mse(w, jax.tree.map(lambda a: a[rows], data))

  ref = jax.value_and_grad(lambda w: sum(part_mean(w, d, i) for d, i in parts) / len(parts))(w)
  assert_tree_close((value, grads), ref)
  assert int(skipped) == 1 and len(keep) == 62
  # Global view: micro-batch bad_row % k is dropped whole.
  micro = [i for i in range(k) if i != bad_row % k]
  gref = jax.value_and_grad(lambda w: sum(
      centred(w, jax.tree.map(lambda a, i=i: a[i::k], data)) for i in micro) / len(micro))(w)
  assert_tree_close((gvalue, ggrads), gref)
  assert int(gskipped) == 1


def test_skip_nonfinite_with_aux_and_grad():
  data = rows_data()
  data["x"][3, 1] = np.inf
  fn = fxaccum.grad(lambda w, b: (mse(w, b), {"n": fxaccum.Sum(b["x"].shape[0]),
                                               "stats": fxaccum.Statistics()}),
                    has_aux=True, micro_batches=4, skip_nonfinite=True)
  grads, aux = fn(np.ones(4, np.float32), data)
  # 3 of 4 micro-batches of 16 rows
  assert int(aux["stats"].skipped) == 1 and int(aux["n"]) == 48
  assert np.isfinite(np.asarray(grads)).all()


def test_loss_already_normalized_by_a_global_count():
  """The Hugging Face num_items_in_batch pattern: a loss returned as fxaccum.Sum gives the
  large batch's value; a plain scalar is taken as a mean over its micro-batch (1/k)."""
  data = rows_data()
  data["m"] = (np.arange(64) % 3 != 0).astype(np.float32)
  count = data["m"].sum()

  def loss(w, b, num_items):
    return jnp.sum(b["m"] * (b["x"] @ w - b["y"]) ** 2) / num_items

  w = np.ones(4, np.float32)
  ref = jax.value_and_grad(loss)(w, data, count)
  mesh = mesh_of((8,), ("data",), AxisType.Explicit)
  with jax.set_mesh(mesh):
    sharded = jax.tree.map(lambda a: jax.device_put(a, NamedSharding(mesh, P("data"))), data)
    summed = jax.jit(fxaccum.value_and_grad(
        lambda *args: fxaccum.Sum(loss(*args)), micro_batches=4))(w, sharded, count)
    mean = jax.jit(fxaccum.value_and_grad(loss, micro_batches=4))(w, sharded, count)
  assert_tree_close(summed, ref)
  assert_tree_close(mean, jax.tree.map(lambda r: r / 4, ref))
  with pytest.raises(TypeError, match="fxaccum.Sum of"):
    fxaccum.value_and_grad(lambda w, b: fxaccum.Sum(b["x"] @ w), micro_batches=2)(w, data)


@pytest.mark.parametrize("option,value,names", [
    ("micro_batch_size", 16, "MicroBatchSize"),
    ("fsdp_reduce", "per_step", "fsdp='zero1'"),
    ("fsdp_gather", "per_micro_batch", "fsdp='zero3'"),
    ("bucket_bytes", 0, "bucketed at 2 MiB"),
    ("reduce", False, "value_and_unreduced_grad"),
    ("noise_scale", True, "fxaccum.Statistics"),
    ("loss_reduction", "sum", "fxaccum.Sum"),
    ("accum_dtype", jnp.float32, "accumulator_dtype="),
])
@pytest.mark.parametrize("entry", ["value_and_grad", "grad", "value_and_unreduced_grad"])
def test_removed_options_name_their_new_spelling(entry, option, value, names):
  with pytest.raises(TypeError, match=f"no longer takes {option}=.*{names}"):
    getattr(fxaccum, entry)(mse, micro_batches=2, **{option: value})


def test_accumulate_takes_optax_spelling_of_the_accumulator_dtype():
  """``accumulator_dtype=`` as optax.MultiSteps spells it; the old name names it."""
  state = fxaccum.accumulate(2, accumulator_dtype=jnp.bfloat16).init(jnp.ones(3))
  assert state.accumulator.dtype == jnp.bfloat16
  with pytest.raises(TypeError, match="no longer takes accum_dtype=; use accumulator_dtype="):
    fxaccum.accumulate(2, accum_dtype=jnp.float32)
  with pytest.raises(TypeError, match="unexpected keyword argument 'every'"):
    fxaccum.accumulate(2, every=3)


def test_unknown_options_are_refused():
  with pytest.raises(TypeError, match="unexpected keyword argument 'fsdp'"):
    fxaccum.value_and_unreduced_grad(mse, micro_batches=2, fsdp="zero2")
  with pytest.raises(TypeError, match="unexpected keyword argument 'micro_batch'"):
    fxaccum.grad(mse, micro_batch=2)


def test_batch_shaped_keyword_argument_is_refused():
  data = rows_data()
  with pytest.raises(ValueError, match=r"'mask'.*64 rows.*batch_argnums \(now \(1,\)\)"):
    fxaccum.value_and_grad(lambda w, b, *, mask: mse(w, b), micro_batches=4)(
        np.ones(4, np.float32), data, mask=np.ones(64, np.float32))


@pytest.mark.parametrize("axes, error, match", [
    (5, TypeError, "mesh axis name or a tuple"),
    (("data", "data"), ValueError, "names an axis twice"),
])
def test_bad_data_axes(axes, error, match):
  with pytest.raises(error, match=match):
    fxaccum.value_and_grad(mse, micro_batches=2, data_axes=axes)


def test_eager_calls_with_keyword_arguments_compile_once():
  traces = []

  def loss(w, b, *, scale, squared):
    traces.append(1)
    err = b["x"] @ w - b["y"]
    return scale * jnp.mean(err ** 2 if squared else jnp.abs(err))

  fn = fxaccum.value_and_grad(loss, micro_batches=2)
  data, w = rows_data(), np.ones(4, np.float32)
  fn(w, data, scale=jnp.float32(1.0), squared=True)
  first = len(traces)
  got = fn(w, data, scale=jnp.float32(2.0), squared=True)  # new array value: no retrace
  assert len(traces) == first
  assert_tree_close(got, jax.value_and_grad(lambda w: 2 * mse(w, data))(w))
  fn(w, data, scale=jnp.float32(2.0), squared=False)  # new static value: compiled anew
  assert len(traces) > first


# ----------------------------------------------------------------------------- checkpoint


def linen_state(every_k=4):
  tx = optax.chain(fxaccum.accumulate(every_k), optax.sgd(0.1))
  return fxaccum.TrainState.create(apply_fn=None, params=dict(PARAMS), tx=tx)


def test_missing_and_incomplete_steps_are_named(tmp_path):
  mgr = ocp.CheckpointManager(str(tmp_path / "ckpt"))
  with pytest.raises(FileNotFoundError, match="holds no complete step.*create=False"):
    fxaccum.checkpoint.restore(mgr, None, linen_state())
  fxaccum.checkpoint.save(mgr, 1, linen_state())
  fxaccum.checkpoint.save(mgr, 2, linen_state())
  mgr.wait_until_finished()
  with pytest.raises(FileNotFoundError, match=r"step 7 .*does not exist.*Saved steps: \[1, 2\]"):
    fxaccum.checkpoint.restore(mgr, 7, linen_state())
  (tmp_path / "ckpt" / "3").mkdir()  # a step whose save never finished
  with pytest.raises(FileNotFoundError, match="step 3 .*incomplete"):
    fxaccum.checkpoint.restore(mgr, 3, linen_state())


def test_relative_directory_is_refused_at_save(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  mgr = ocp.CheckpointManager("relative")
  with pytest.raises(ValueError, match="relative.*absolute path"):
    fxaccum.checkpoint.save(mgr, 1, linen_state())


def test_saving_a_step_twice_raises_or_overwrites(tmp_path):
  mgr = ocp.CheckpointManager(str(tmp_path))
  state = linen_state()
  fxaccum.checkpoint.save(mgr, 1, state)
  mgr.wait_until_finished()
  newer = state.apply_gradients(grads=grad(1.0))
  with pytest.raises(ValueError, match="already saved.*overwrite=True"):
    fxaccum.checkpoint.save(mgr, 1, newer)
  assert fxaccum.checkpoint.save(mgr, 1, newer, overwrite=True)
  assert int(fxaccum.checkpoint.restore(mgr, 1, linen_state()).micro_step) == 1


def test_every_k_is_checked_for_raw_states_and_schedules(tmp_path):
  tx4 = optax.chain(fxaccum.accumulate(4), optax.sgd(0.1))
  tx2 = optax.chain(fxaccum.accumulate(2), optax.sgd(0.1))
  raw = (dict(PARAMS), tx4.init(dict(PARAMS)))
  mgr = ocp.CheckpointManager(str(tmp_path / "raw"))
  with pytest.raises(TypeError, match="pass the optax chain.*tx=tx"):
    fxaccum.checkpoint.save(mgr, 1, raw)
  fxaccum.checkpoint.save(mgr, 1, raw, tx=tx4)
  with pytest.raises(CheckpointMismatchError, match="every_k=4.*every_k=2"):
    fxaccum.checkpoint.restore(mgr, 1, (dict(PARAMS), tx2.init(dict(PARAMS))), tx=tx2)

  def schedule(n):
    return lambda step: jnp.where(step < 1, n, 8)

  def with_schedule(n):
    tx = optax.chain(fxaccum.accumulate(schedule(n)), optax.sgd(0.1))
    return fxaccum.TrainState.create(apply_fn=None, params=dict(PARAMS), tx=tx)

  mgr = ocp.CheckpointManager(str(tmp_path / "schedule"))
  fxaccum.checkpoint.save(mgr, 1, with_schedule(3).apply_gradients(grads=grad(1.0)))
  with pytest.raises(CheckpointMismatchError, match="schedule giving 3 calls at optimizer"):
    fxaccum.checkpoint.restore(mgr, 1, with_schedule(5))
  restored = fxaccum.checkpoint.restore(mgr, 1, with_schedule(3))
  assert int(restored.micro_step) == 1


def test_mismatch_listing_says_how_many_more(tmp_path):
  mgr = ocp.CheckpointManager(str(tmp_path))
  fxaccum.checkpoint.save(mgr, 1, linen_state())
  params = {f"p{i}": np.zeros(2, np.float32) for i in range(9)}
  tx = optax.chain(fxaccum.accumulate(4), optax.sgd(0.1))
  target = fxaccum.TrainState.create(apply_fn=None, params=params, tx=tx)
  with pytest.raises(CheckpointMismatchError, match=r"only in the target: \[.*\] and \d+ more"):
    fxaccum.checkpoint.restore(mgr, 1, target)
  assert os.path.isabs(str(mgr.directory))


@pytest.mark.parametrize("entry,most", [("value_and_grad", 10), ("grad", 10),
                                        ("value_and_unreduced_grad", 9)])
def test_the_public_signature_has_at_most_ten_options(entry, most):
  """Besides jax.value_and_grad's own (fun, argnums, has_aux), at most ten keyword options,
  as the type stubs (the overloads) show them."""
  import typing

  from fxaccum.instep import api
  overloads = typing.get_overloads(getattr(api, entry))
  assert len(overloads) == 4
  for overload in overloads:
    parameters = inspect.signature(overload).parameters
    options = [name for name, p in parameters.items()
               if name not in ("fun", "argnums", "has_aux") and p.kind != p.VAR_KEYWORD]
    typed = typing.get_type_hints(overload, include_extras=True).get("options")
    keywords = options + list(typing.get_args(typed)[0].__annotations__ if typed else [])
    assert options == ["micro_batches"] and len(keywords) <= most, keywords
