"""Two processes x 4 CPU devices on JAX's own distributed runtime == one process x 8 devices.

Select with ``pytest -m multihost``. A launch starts tests/multihost_worker.py twice
(process 0 and 1, gloo collectives on a free loopback port), which run several scenarios
one after the other. The module launches once (``LAUNCHES``) and each test compares what
process 0 wrote for its scenario with the same scenario run here on 8 local devices, and
with an independent large-batch reference. Workers always end: a deadline kills both
process groups, and a failure shows both workers' logs.
"""

from __future__ import annotations

import functools
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import optax
import pytest
import test_pipeline
import ulysses
from helpers import (
    assert_tree_close,
    make_data,
    make_params,
    reference_token_mean,
    subprocess_env,
)
from multihost_worker import CALLS, LAYOUTS, SAVE_AT, SCENARIOS
from test_checkpoint import K, micro_batch
from test_sp import reference, skewed_batch

pytestmark = [pytest.mark.multihost, pytest.mark.slow]

WORKER = Path(__file__).with_name("multihost_worker.py")
DEADLINE_S = 240  # a launch takes ~45 s here; a hang must not eat CI's budget
# What each launch of the two processes runs, in order: one launch, its processes' start
# (imports, the distributed runtime) paid once. The checkpoint saved mid-window is resumed
# after two other scenarios, by a new CheckpointManager into a fresh state (and by this
# process, which did not write it).
LAUNCHES = (("instep", "crossstep", "checkpoint_save", "sequence_parallel", "pipeline",
             "checkpoint_resume"),)


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def launch(scenarios: tuple[str, ...], out_dir: Path) -> dict[str, dict[str, np.ndarray]]:
  """Runs ``scenarios`` in turn on 2 processes and returns what process 0 saved for each."""
  env = subprocess_env()
  port, logs, procs = free_port(), [], []
  scenario = ",".join(scenarios)
  try:
    for process_id in range(2):
      log = open(out_dir / f"{'+'.join(scenarios)}.{process_id}.log", "w+")
      logs.append(log)
      procs.append(subprocess.Popen(
          [sys.executable, str(WORKER), scenario, str(process_id), str(port), str(out_dir)],
          stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True))
    deadline = time.monotonic() + DEADLINE_S
    # A worker that dies leaves its peer waiting in a collective: stop at the first failure.
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
      if any(p.returncode not in (None, 0) for p in procs):
        break
      time.sleep(0.2)
    codes = [p.poll() for p in procs]
  finally:
    for p in procs:
      if p.poll() is None:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
  if codes != [0, 0]:
    report = [f"{scenario}: exit codes {codes} (None: killed at the {DEADLINE_S} s deadline)"]
    for process_id, log in enumerate(logs):
      log.seek(0)
      report.append(f"--- process {process_id} log (last 4000 chars) ---\n{log.read()[-4000:]}")
    pytest.fail("\n".join(report), pytrace=False)
  for log in logs:
    log.close()
  results = {}
  for name in scenarios:
    with np.load(out_dir / f"{name}.npz") as saved:
      results[name] = dict(saved)
  return results


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory) -> tuple[Path, dict[str, dict[str, np.ndarray]]]:
  """The launches, once for the module: their shared directory, and what process 0 saved
  for every scenario."""
  out_dir = tmp_path_factory.mktemp("multihost")
  results = {}
  for scenarios in LAUNCHES:
    results |= launch(scenarios, out_dir)
  return out_dir, results


@functools.cache
def one_process(scenario: str, out_dir: Path) -> dict[str, np.ndarray]:
  """``scenario`` run here, on 8 local devices (once: crossstep is compared twice)."""
  return SCENARIOS[scenario](str(out_dir))


def assert_results_close(multi, single, rtol=1e-6):
  assert sorted(multi) == sorted(single)
  for name in single:
    np.testing.assert_allclose(multi[name], single[name], rtol=rtol, atol=rtol * max(
        np.max(np.abs(single[name]), initial=0), 1e-30), err_msg=name)


def large_batch_adam(calls: int) -> dict:
  """Independent reference: Adam on the token-mean loss of each window's K micro-batches."""
  params, tx = make_params(), optax.adam(1e-2)
  opt_state = tx.init(params)
  for window in range(calls // K):
    batches = [micro_batch(c) for c in range(window * K, (window + 1) * K)]
    batch = {key: np.concatenate([b[key] for b in batches]) for key in batches[0]}
    updates, opt_state = tx.update(jax.grad(reference_token_mean)(params, batch), opt_state)
    params = optax.apply_updates(params, updates)
  return {"params": params, "mu": opt_state[0].mu, "nu": opt_state[0].nu}


def by_prefix(results: dict, prefix: str) -> dict:
  return {name: value for name, value in results.items() if name.startswith(prefix)}


def test_instep_two_processes_match_one(two_processes):
  out_dir, results = two_processes
  multi = results["instep"]
  assert_results_close(multi, one_process("instep", out_dir))

  ref_loss, ref_grads = jax.value_and_grad(reference_token_mean)(make_params(),
                                                                 make_data(k=K))
  for layout in LAYOUTS:
    assert_tree_close(multi[f"{layout}/[0]"], ref_loss)
    assert_tree_close({k: multi[f"{layout}/[1]['{k}']"] for k in ref_grads}, ref_grads)
    # Across hosts too: no reduction inside the micro-batch loop, one after it.
    assert multi[f"{layout}/data_reductions_loop"] == 0
    assert multi[f"{layout}/data_reductions_top"] == 1
  # The planner's per-device figures and choice, and the noise scale, as on one host.
  assert multi["plan/k"] > 1 and multi["plan/peaks"][-1] < multi["plan/peaks"][0]


def test_crossstep_two_processes_match_one(two_processes):
  out_dir, results = two_processes
  multi = results["crossstep"]
  assert_results_close(multi, one_process("crossstep", out_dir))
  assert multi["step"] == CALLS // K
  reference = large_batch_adam(CALLS)
  for part in ("params", "mu", "nu"):
    got = by_prefix(multi, part)
    assert_tree_close({k: got[f"{part}['{k}']"] for k in reference[part]}, reference[part])


def test_mid_window_checkpoint_two_processes(two_processes):
  """2 processes save mid-window to a shared dir; 2 processes resume == 1 process, no stop.

  The same checkpoint also resumes in this single process (8 local devices)."""
  out_dir, results = two_processes
  saved = results["checkpoint_save"]
  assert saved["micro_step"] == SAVE_AT % K  # really mid-window
  resumed = results["checkpoint_resume"]
  uninterrupted = one_process("crossstep", out_dir)
  assert_results_close(resumed, uninterrupted)

  assert_results_close(SCENARIOS["checkpoint_resume"](str(out_dir)), uninterrupted)


def test_sequence_parallel_per_rank_two_processes(two_processes):
  """Per-rank code over (data 2, seq 4), data across the processes: == 1 process, == the
  single-device token mean, and no reduction inside the micro-batch loop."""
  out_dir, results = two_processes
  multi = results["sequence_parallel"]
  assert_results_close(multi, one_process("sequence_parallel", out_dir))
  ref = reference(ulysses.make_params(), skewed_batch((2, 4)))
  assert_tree_close(multi["sp/[0]"], ref[0])
  grads = {k: v for k, v in multi.items() if k.startswith("sp/[1]")}
  assert len(grads) == len(jax.tree.leaves(ref[1]))
  flat = jax.tree_util.tree_flatten_with_path(ref[1])[0]
  assert_tree_close([grads[f"sp/[1]{jax.tree_util.keystr(p)}"] for p, _ in flat],
                    [v for _, v in flat])
  assert multi["sp/reductions_loop"] == 0 and multi["sp/reductions_top"] >= 1


def test_pipeline_two_processes(two_processes):
  """fxaccum.pipeline over (data 2, stage 4), data across the processes: == 1 process, ==
  the sequential model on one device, one data reduction after the loop."""
  out_dir, results = two_processes
  multi = results["pipeline"]
  assert_results_close(multi, one_process("pipeline", out_dir))
  ref_loss, ref_grads = test_pipeline.reference(test_pipeline.make_params(4),
                                                test_pipeline.make_batch(4))
  assert_tree_close(multi["pipeline/['loss']"], ref_loss)
  flat = jax.tree_util.tree_flatten_with_path(ref_grads)[0]
  assert_tree_close([multi[f"pipeline/['grads']{jax.tree_util.keystr(p)}"] for p, _ in flat],
                    [v for _, v in flat])
  assert multi["pipeline/data_reductions_loop"] == 0
  assert multi["pipeline/data_reductions_top"] >= 1
