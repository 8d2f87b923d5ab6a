"""The scenarios of tests/test_multihost.py, and one process of its 2-process runs.

    python tests/multihost_worker.py SCENARIO[,SCENARIO...] PROCESS_ID PORT OUT_DIR

Run as a script, each of the two processes owns 4 simulated CPU devices and
``jax.distributed.initialize`` joins them into one 8-device runtime (gloo collectives on
loopback), exactly as on a cluster of two hosts; the scenarios run one after the other in
that runtime, and process 0 writes each one's results to OUT_DIR/SCENARIO.npz. Imported by
the test, the same scenario functions run in the test process on its 8 local devices: the
single-process reference. Every scenario returns ``{name: numpy array}``, gathered to every
process.
"""

from __future__ import annotations

import functools
import os
import sys
import traceback

if __name__ == "__main__":  # before jax initializes its backend
  # The suite's other XLA flags (tests/helpers.subprocess_env) are kept.
  os.environ["XLA_FLAGS"] = " ".join(
      [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
      + ["--xla_force_host_platform_device_count=4"])
  os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import numpy as np  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from helpers import make_data, make_params, put, weighted_loss  # noqa: E402
from test_checkpoint import DATA, K, deferred_setup, micro_batch  # noqa: E402
from test_pipeline import report_of as pipeline_report  # noqa: E402
from test_pipeline import run as run_pipeline  # noqa: E402
from test_sp import AXES, per_rank_step, skewed_batch, weighted_per_rank  # noqa: E402
from test_sp import put as put_sp  # noqa: E402
from ulysses import make_params as ulysses_params  # noqa: E402

import fxaccum  # noqa: E402

CALLS, SAVE_AT = 2 * K, K + K // 2  # two windows; the checkpoint falls mid-window
LAYOUTS = {  # name: (mesh shape, axis names, param specs); the batch is sharded P("data")
    "dp": ((8,), ("data",), {}),
    "data_x_model": ((4, 2), ("data", "model"),
                     {"w1": P(None, "model"), "b1": P("model"), "w2": P("model", None)}),
}


def gathered(prefix: str, tree) -> dict[str, np.ndarray]:
  """Every leaf of ``tree`` as a host array on every process, keyed by ``prefix`` + path."""
  leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
  values = multihost_utils.process_allgather([leaf for _, leaf in leaves], tiled=True)
  return {prefix + jax.tree_util.keystr(path): np.asarray(value)
          for (path, _), value in zip(leaves, values, strict=True)}


def instep(out_dir: str) -> dict[str, np.ndarray]:
  """In-step accumulation over 4 skewed micro-batches on a DP and a data x model mesh."""
  del out_dir
  results = {}
  data, params = make_data(k=K), make_params()
  for name, (shape, names, param_specs) in LAYOUTS.items():
    mesh = jax.make_mesh(shape, names)
    step = jax.jit(fxaccum.value_and_grad(weighted_loss, micro_batches=K))
    with jax.set_mesh(mesh):
      args = put(params, mesh, param_specs), put(data, mesh, DATA)
      results |= gathered(f"{name}/", step(*args))
      report = fxaccum.diagnostics.report(step, *args)
    for place in ("loop", "top"):  # gradient reductions over the data axis, by place
      results[f"{name}/data_reductions_{place}"] = np.array(
          len(report.reductions(place, axes="data")))
  return results | planned(params, data)


def planned(params, data) -> dict[str, np.ndarray]:
  """plan_micro_batches from ShapeDtypeStructs (per-device figures of the SPMD program),
  and the chosen step's noise scale, on the 8-device data mesh."""
  mesh = jax.make_mesh((8,), ("data",))

  @functools.cache  # one compilation of k = 1 for both plans
  def make_step(k):
    return jax.jit(fxaccum.value_and_grad(lambda *a: (weighted_loss(*a), fxaccum.Statistics()),
                                          has_aux=True, micro_batches=k))

  with jax.set_mesh(mesh):
    args = put(params, mesh, {}), put(data, mesh, DATA)
    abstract = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), args)
    roomy = fxaccum.plan_micro_batches(make_step, *abstract, budget_bytes=1 << 40,
                                       candidates=[1], progress=False)
    plan = fxaccum.plan_micro_batches(make_step, *abstract, progress=False,
                                      budget_bytes=roomy.peak_bytes - 1)
    (_, stats), _ = plan.step(*args)
  return {"plan/k": np.array(plan.micro_batches),
          "plan/peaks": np.array([row.peak_bytes for row in plan.table]),
          **gathered("plan/noise", stats.noise_scale._asdict())}


def sequence_parallel(out_dir: str) -> dict[str, np.ndarray]:
  """Per-rank Ulysses code in the caller's shard_map over (data 2, seq 4), fxaccum inside
  with data_axes=(data, seq): the data axis spans the two processes."""
  del out_dir
  mesh = jax.make_mesh((2, 4), AXES)
  params, batch = ulysses_params(), skewed_batch((2, 4))
  step = per_rank_step(mesh, weighted_per_rank, 2)
  with jax.set_mesh(mesh), jax.default_matmul_precision("highest"):
    args = (params, put_sp(batch, mesh))
    results = gathered("sp/", step(*args))
    report = fxaccum.diagnostics.report(step, *args)
  results["sp/reductions_loop"] = np.array(len(report.reductions("loop")))
  results["sp/reductions_top"] = np.array(len(report.reductions("top", axes=AXES)))
  return results


def pipeline(out_dir: str) -> dict[str, np.ndarray]:
  """fxaccum.pipeline over (data 2, stage 4), k = 4: the data axis spans the processes."""
  del out_dir
  (loss, grads), (step, args, mesh) = run_pipeline(4, 4)
  results = gathered("pipeline/", {"loss": loss, "grads": grads})
  report = pipeline_report(step, args, mesh)  # the program that ran
  for place in ("loop", "top"):
    results[f"pipeline/data_reductions_{place}"] = np.array(
        len(report.reductions(place, axes="data")))
  return results


@functools.cache
def deferred(mesh):
  """test_checkpoint.deferred_setup(mesh), once per mesh (the fresh state is immutable),
  its state typed and placed as the train step returns states (a step counter that is no
  weak-typed int, P(None) for P()): the scenarios that run in one process, and every call
  of the step in them, share one compilation."""
  state, train_step = deferred_setup(mesh)
  state = state.replace(step=np.int32(state.step))
  like = jax.eval_shape(train_step, state, put(micro_batch(0), mesh, DATA))
  return jax.device_put(state, jax.tree.map(
      lambda s: NamedSharding(mesh, s.sharding.spec), like)), train_step


def _run_calls(state, train_step, mesh, calls: range):
  for call in calls:  # one program at a time: see XLA:CPU's rendezvous note in docs
    state = jax.block_until_ready(train_step(state, put(micro_batch(call), mesh, DATA)))
  return state


def _state_results(state) -> dict[str, np.ndarray]:
  adam = state.opt_state[1][0]
  return {**gathered("params", state.params), **gathered("mu", adam.mu),
          **gathered("nu", adam.nu), "step": np.array(int(state.step))}


def crossstep(out_dir: str) -> dict[str, np.ndarray]:
  """Deferred-sync cross-step accumulation (``accumulate(K, data_axes="data")``), 2 windows."""
  del out_dir
  mesh = jax.make_mesh((8,), ("data",))
  with jax.set_mesh(mesh):
    state, train_step = deferred(mesh)
    return _state_results(_run_calls(state, train_step, mesh, range(CALLS)))


def checkpoint_save(out_dir: str) -> dict[str, np.ndarray]:
  """Runs to the middle of the second window and saves there with Orbax."""
  mesh = jax.make_mesh((8,), ("data",))
  with jax.set_mesh(mesh):
    state, train_step = deferred(mesh)
    state = _run_calls(state, train_step, mesh, range(SAVE_AT))
    manager = ocp.CheckpointManager(os.path.join(out_dir, "checkpoints"))
    assert fxaccum.checkpoint.save(manager, SAVE_AT, state)
    manager.wait_until_finished()
    return {"micro_step": np.array(int(state.micro_step))}


def checkpoint_resume(out_dir: str) -> dict[str, np.ndarray]:
  """Restores the mid-window checkpoint and finishes the two windows."""
  mesh = jax.make_mesh((8,), ("data",))
  with jax.set_mesh(mesh):
    like, train_step = deferred(mesh)
    manager = ocp.CheckpointManager(os.path.join(out_dir, "checkpoints"))
    state = fxaccum.checkpoint.restore(manager, SAVE_AT, like)
    return _state_results(_run_calls(state, train_step, mesh, range(SAVE_AT, CALLS)))


SCENARIOS = {f.__name__: f for f in (instep, crossstep, checkpoint_save, checkpoint_resume,
                                      sequence_parallel, pipeline)}


def main(scenarios: str, process_id: int, port: int, out_dir: str) -> None:
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2,
                             process_id=process_id, initialization_timeout=60)
  assert (jax.process_count(), jax.device_count(), jax.local_device_count()) == (2, 8, 4)
  for scenario in scenarios.split(","):
    results = SCENARIOS[scenario](out_dir)
    if process_id == 0:
      np.savez(os.path.join(out_dir, f"{scenario}.npz"), **results)
    # Neither process starts the next scenario (or exits) before the write.
    multihost_utils.sync_global_devices(f"{scenario} done")
    print(f"process {process_id}: {scenario} done", flush=True)
  jax.distributed.shutdown()


if __name__ == "__main__":
  try:
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
  except BaseException:
    traceback.print_exc()
    sys.stdout.flush()
    sys.stderr.flush()
    # Not the interpreter's exit, whose jax.distributed shutdown waits for the peer (stuck
    # in a collective) until the test's deadline: the test sees the failure now.
    os._exit(1)
