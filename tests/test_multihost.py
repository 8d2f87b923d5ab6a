"""Two processes x 4 CPU devices on JAX's own distributed runtime == one process x 8 devices.

Select with ``pytest -m multihost``. Each run launches tests/multihost_worker.py twice
(process 0 and 1, gloo collectives on a free loopback port) and compares what process 0
wrote with the same scenario run here on 8 local devices, and with an independent
large-batch reference. Workers always end: a deadline kills both process groups, and a
failure shows both workers' logs.
"""

from __future__ import annotations

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
DEADLINE_S = 240  # a 2-process run takes ~20 s here; a hang must not eat CI's budget


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def launch(scenario: str, out_dir: Path) -> dict[str, np.ndarray]:
  """Runs ``scenario`` on 2 processes and returns what process 0 saved."""
  env = subprocess_env()
  port, logs, procs = free_port(), [], []
  try:
    for process_id in range(2):
      log = open(out_dir / f"{scenario}.{process_id}.log", "w+")
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
  with np.load(out_dir / f"{scenario}.npz") as saved:
    return dict(saved)


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


def test_instep_two_processes_match_one(tmp_path):
  multi = launch("instep", tmp_path)
  assert_results_close(multi, SCENARIOS["instep"](str(tmp_path)))

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


def test_crossstep_two_processes_match_one(tmp_path):
  multi = launch("crossstep", tmp_path)
  assert_results_close(multi, SCENARIOS["crossstep"](str(tmp_path)))
  assert multi["step"] == CALLS // K
  reference = large_batch_adam(CALLS)
  for part in ("params", "mu", "nu"):
    got = by_prefix(multi, part)
    assert_tree_close({k: got[f"{part}['{k}']"] for k in reference[part]}, reference[part])


def test_mid_window_checkpoint_two_processes(tmp_path):
  """2 processes save mid-window to a shared dir; 2 processes resume == 1 process, no stop.

  The same checkpoint also resumes in this single process (8 local devices)."""
  saved = launch("checkpoint_save", tmp_path)
  assert saved["micro_step"] == SAVE_AT % K  # really mid-window
  resumed = launch("checkpoint_resume", tmp_path)
  uninterrupted = SCENARIOS["crossstep"](str(tmp_path))
  assert_results_close(resumed, uninterrupted)

  assert_results_close(SCENARIOS["checkpoint_resume"](str(tmp_path)), uninterrupted)


def test_sequence_parallel_per_rank_two_processes(tmp_path):
  """Per-rank code over (data 2, seq 4), data across the processes: == 1 process, == the
  single-device token mean, and no reduction inside the micro-batch loop."""
  multi = launch("sequence_parallel", tmp_path)
  assert_results_close(multi, SCENARIOS["sequence_parallel"](str(tmp_path)))
  ref = reference(ulysses.make_params(), skewed_batch((2, 4)))
  assert_tree_close(multi["sp/[0]"], ref[0])
  grads = {k: v for k, v in multi.items() if k.startswith("sp/[1]")}
  assert len(grads) == len(jax.tree.leaves(ref[1]))
  flat = jax.tree_util.tree_flatten_with_path(ref[1])[0]
  assert_tree_close([grads[f"sp/[1]{jax.tree_util.keystr(p)}"] for p, _ in flat],
                    [v for _, v in flat])
  assert multi["sp/reductions_loop"] == 0 and multi["sp/reductions_top"] >= 1


def test_pipeline_two_processes(tmp_path):
  """fxaccum.pipeline over (data 2, stage 4), data across the processes: == 1 process, ==
  the sequential model on one device, one data reduction after the loop."""
  multi = launch("pipeline", tmp_path)
  assert_results_close(multi, SCENARIOS["pipeline"](str(tmp_path)))
  ref_loss, ref_grads = test_pipeline.reference(test_pipeline.make_params(4),
                                                test_pipeline.make_batch(4))
  assert_tree_close(multi["pipeline/['loss']"], ref_loss)
  flat = jax.tree_util.tree_flatten_with_path(ref_grads)[0]
  assert_tree_close([multi[f"pipeline/['grads']{jax.tree_util.keystr(p)}"] for p, _ in flat],
                    [v for _, v in flat])
  assert multi["pipeline/data_reductions_loop"] == 0
  assert multi["pipeline/data_reductions_top"] >= 1
