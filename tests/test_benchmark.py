"""The benchmark script runs (quick sizes) and its non-timing claims hold.

Timings are never asserted: they are figures for docs/performance.md, not tests.
"""

import json

from helpers import run_script


def test_instep_benchmark_quick_run(tmp_path):
  out = tmp_path / "instep.json"
  run_script("benchmarks/instep.py", "--quick", "--models", "mlp", "--out", str(out))
  results = json.loads(out.read_text())["results"]["mlp"]
  grad_bytes = results["large_batch"]["reduction_bytes_per_step"]
  for k in (1, 2, 4, 8):
    fx = results[f"fxaccum_k{k}"]
    assert fx["reductions_in_loops"] == 0
    # The large batch reduces gradients + its loss; fxaccum adds only the weight scalar.
    assert grad_bytes <= fx["reduction_bytes_per_step"] <= grad_bytes + 64
    assert fx["grad_rel_err"] < 1e-5
  assert results["plain_scan_k8"]["reduction_bytes_per_step"] >= 8 * grad_bytes


def test_crossstep_benchmark_quick_run(tmp_path):
  out = tmp_path / "crossstep.json"
  run_script("benchmarks/crossstep.py", "--quick", "--models", "mlp", "--out", str(out))
  payload = json.loads(out.read_text())
  k, results = payload["k"], payload["results"]["mlp"]
  deferred, multisteps = results["fxaccum_deferred"], results["multisteps"]
  # Deferred sync: no gradient-sized reduction outside the boundary branch, and 1/k of
  # MultiSteps' reduction bytes (plus at most one small loss reduction per call).
  assert deferred["large_reductions_outside_cond"] == 0
  assert deferred["reduction_bytes_per_step"] <= (
      multisteps["reduction_bytes_per_step"] / k + 64 * k)
  assert deferred["params_rel_err"] < 1e-5
  assert deferred["grad_rel_err"] < 1e-5  # the window's mean gradient that Adam was handed
  assert deferred["optimizer_steps_after_window"] == 1
