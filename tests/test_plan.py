"""plan_micro_batches: compiles a real train step (flax MLP, adam, donated state, batch
sharded over 8 CPU devices) for ascending k and stops at the first whose compiled peak fits;
the figures are checked against memory_analysis() read here, and the chosen step is exact
against jax.value_and_grad on the whole batch."""

import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_tree_close, mesh_of
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import fxaccum

BATCH, DIM, HIDDEN = 1024, 8, 64  # 128 rows per device: activations dominate the peak
TX = optax.adam(1e-2)


class MLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    for _ in range(2):
      x = jnp.tanh(nn.Dense(HIDDEN)(x))
    return nn.Dense(1)(x)[..., 0]


MODEL = MLP()


def loss(params, batch):
  return jnp.mean((MODEL.apply(params, batch["x"]) - batch["y"]) ** 2)


def train_step(k):
  grad_fn = fxaccum.value_and_grad(loss, micro_batches=k)

  def step(params, opt_state, batch):
    value, grads = grad_fn(params, batch)
    updates, opt_state = TX.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value

  return step


def make_step(k):
  return jax.jit(train_step(k), donate_argnums=(0, 1))


def host_data(seed=0):
  rng = np.random.default_rng(seed)
  return {"x": rng.normal(size=(BATCH, DIM)).astype(np.float32),
          "y": rng.normal(size=(BATCH,)).astype(np.float32)}


def host_params():
  return jax.tree.map(np.asarray, MODEL.init(jax.random.key(0), jnp.zeros((1, DIM))))


@pytest.fixture(scope="module")
def mesh():
  return mesh_of((8,), ("data",), AxisType.Explicit)


@pytest.fixture(scope="module")
def abstract(mesh):
  """(params, opt_state, batch) as ShapeDtypeStructs: replicated state, batch over data."""

  def spec(tree, partition):
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(
        a.shape, a.dtype, sharding=NamedSharding(mesh, partition)), tree)

  params = spec(jax.eval_shape(MODEL.init, jax.random.key(0), jnp.zeros((1, DIM))), P())
  return params, spec(jax.eval_shape(TX.init, params), P()), spec(host_data(), P("data"))


@pytest.fixture(scope="module")
def peaks(mesh, abstract):
  """Peak bytes per device of the step at k = 1, 2, 4, compiled here, not by the planner."""
  found = {}
  with jax.set_mesh(mesh):
    for k in (1, 2, 4):
      m = jax.jit(train_step(k), donate_argnums=(0, 1)).lower(*abstract).compile() \
          .memory_analysis()
      found[k] = (m.temp_size_in_bytes + m.argument_size_in_bytes + m.output_size_in_bytes
                  - m.alias_size_in_bytes)
  return found


def plan(mesh, abstract, **options):
  with jax.set_mesh(mesh):
    return fxaccum.plan_micro_batches(make_step, *abstract, batch_argnums=2, **options)


@pytest.fixture(scope="module")
def plan4(mesh, abstract, peaks):
  """The plan for a budget of exactly k = 4's peak, default candidates (1, 2, 4, ... 128)."""
  assert peaks[4] < min(peaks[1], peaks[2]), peaks  # so k = 4 is the first that fits
  return plan(mesh, abstract, budget_bytes=peaks[4])


def test_stops_at_the_first_k_that_fits(plan4, peaks):
  """Compiled ascending from the divisors of the 128 rows per device, stopping at k = 4:
  its peak fits, every earlier one does not; the figures are memory_analysis()'s."""
  assert plan4.micro_batches == 4
  assert [row.micro_batches for row in plan4.table] == [1, 2, 4]
  assert [row.peak_bytes for row in plan4.table] == [peaks[1], peaks[2], peaks[4]]
  assert [row.fits for row in plan4.table] == [False, False, True]
  assert plan4.peak_bytes <= plan4.budget_bytes < plan4.table[-2].peak_bytes
  assert all(0 < row.temp_bytes < row.peak_bytes and row.compile_seconds > 0
             for row in plan4.table)
  text = str(plan4)
  assert text == plan4.format()
  lines = text.splitlines()
  assert lines[0].split() == ["k", "peak", "MiB", "temp", "MiB", "compile", "s", "fits"]
  assert [line.split()[0] for line in lines[1:4]] == ["1", "2", "4"]
  assert f"{peaks[1] / 2**20:.2f}" in lines[1] and lines[3].endswith("yes")
  assert lines[-1].endswith("micro_batches=4")


@pytest.mark.parametrize("k", [1, 2])
def test_budget_at_a_peak_chooses_that_k(mesh, abstract, peaks, k):
  assert all(peaks[j] > peaks[k] for j in peaks if j < k), peaks
  chosen = plan(mesh, abstract, budget_bytes=peaks[k], candidates=[4, 2, 1, 2],
                progress=False)
  assert chosen.micro_batches == k
  assert [row.micro_batches for row in chosen.table] == [j for j in (1, 2, 4) if j <= k]


def test_the_chosen_step_runs_and_is_exact(mesh, plan4):
  """plan.step (k = 4, compiled by the planner) on real sharded arrays equals
  jax.value_and_grad on the whole batch followed by the same adam update."""
  params, data = host_params(), host_data()

  @jax.jit  # one device, the whole batch
  def reference(params, data):
    value, grads = jax.value_and_grad(loss)(params, data)
    updates, state = TX.update(grads, TX.init(params), params)
    return optax.apply_updates(params, updates), state, value

  ref_params, ref_state, value = reference(params, data)

  replicated, by_rows = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
  with jax.set_mesh(mesh):
    args = (jax.device_put(params, replicated), jax.device_put(TX.init(params), replicated),
            jax.device_put(data, by_rows))
    new_params, new_state, new_value = plan4.step(*args)
  assert_tree_close((new_params, new_state, new_value), (ref_params, ref_state, value))


def test_shape_dtype_structs_place_nothing_on_the_devices(mesh, abstract):
  """Abstract arguments with shardings: the planner compiles and allocates no array."""
  before = jax.live_arrays()
  chosen = plan(mesh, abstract, budget_bytes=1 << 40, progress=False)
  before_ids = {id(a) for a in before}
  assert [a for a in jax.live_arrays() if id(a) not in before_ids] == []
  assert chosen.micro_batches == 1 and len(chosen.table) == 1


def test_rows_per_device_come_from_the_sharding(mesh, abstract):
  """1024 rows over 8 devices are 128 per device: k = 256 divides the batch, not a
  device's rows. The same batch unsharded has 1024 rows on its one device."""
  with pytest.raises(ValueError, match=r"candidate\(s\) 256 do not divide the batch's 128 rows "
                                       r"per device"):
    plan(mesh, abstract, budget_bytes=1 << 40, candidates=[256])
  params, opt_state, _ = abstract
  with pytest.raises(ValueError, match="candidate\\(s\\) 3 do not divide the batch's 1024 rows"):
    plan(mesh, (params, opt_state, host_data()), budget_bytes=1 << 40, candidates=[3])


def test_without_tqdm_there_is_no_bar(mesh, abstract, monkeypatch, capsys):
  monkeypatch.setitem(sys.modules, "tqdm.auto", None)  # import fails as if not installed
  chosen = plan(mesh, abstract, budget_bytes=1 << 40)
  assert chosen.micro_batches == 1
  assert "plan_micro_batches" not in capsys.readouterr().err


def test_nothing_fits_names_the_budget_and_every_peak(mesh, abstract, peaks):
  with pytest.raises(ValueError, match="no candidate fits the budget of 1024 bytes") as err:
    plan(mesh, abstract, budget_bytes=1024, candidates=[1, 2], progress=False)
  message = str(err.value)
  for k in (1, 2):
    assert f"k={k}: {peaks[k]} bytes" in message, message
  assert "k=4" not in message and "try larger k (candidates=, e.g. [4, 8, 16]" in message


def test_no_budget_on_cpu_asks_for_one(mesh, abstract):
  with pytest.raises(ValueError, match=r"memory_stats\(\)\['bytes_limit'\].*budget_bytes="):
    plan(mesh, abstract)


@pytest.mark.parametrize("candidates, error, match", [
    ([0, 2], ValueError, "each of candidates must be a positive int, got 0"),
    ([-4], ValueError, "each of candidates must be a positive int, got -4"),
    ([2.0], TypeError, "each of candidates must be a positive int.*got 2.0 of type float"),
    (["4"], TypeError, "each of candidates must be a positive int.*got '4' of type str"),
    ([True], TypeError, "each of candidates must be a positive int, got the bool True"),
    (4, TypeError, r"an iterable of ints.*candidates=\[4\]"),
    ([], ValueError, "candidates is empty"),
    ([2, 3, 5], ValueError, r"candidate\(s\) 3, 5 do not divide the batch's 128 rows"),
])
def test_bad_candidates(mesh, abstract, candidates, error, match):
  with pytest.raises(error, match=match):
    plan(mesh, abstract, budget_bytes=1 << 40, candidates=candidates)


def test_make_step_must_be_jitted(mesh, abstract):
  with pytest.raises(TypeError, match=r"make_step\(1\) returned a 'function'.*jax\.jit"):
    with jax.set_mesh(mesh):
      fxaccum.plan_micro_batches(train_step, *abstract, budget_bytes=1 << 40,
                                 batch_argnums=2)


def test_a_failing_candidate_propagates_with_its_k(mesh, abstract):
  """An error building or compiling candidate k is raised as it is, with a note naming k."""

  def flaky(k):
    if k == 2:
      raise RuntimeError("out of ideas")
    return make_step(k)

  with pytest.raises(RuntimeError, match="out of ideas") as err:
    with jax.set_mesh(mesh):
      fxaccum.plan_micro_batches(flaky, *abstract, budget_bytes=1024, candidates=[1, 2, 4],
                                 batch_argnums=2, progress=False)
  assert any("micro_batches=2" in note for note in err.value.__notes__)

  def mismatched(k):  # a real compile-time error: the example batch is not what it takes
    return jax.jit(lambda params, opt_state, batch: batch["x"] @ batch["x"])

  with pytest.raises(TypeError, match="dot_general") as err:
    with jax.set_mesh(mesh):
      fxaccum.plan_micro_batches(mismatched, *abstract, budget_bytes=1 << 40, batch_argnums=2)
  assert any("micro_batches=1" in note for note in err.value.__notes__)
