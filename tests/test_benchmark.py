"""The benchmark scripts run (quick sizes) and their non-timing claims hold.

Timings are never asserted: they are figures for docs/performance.md, not tests.
"""

import json

import pytest
from helpers import run_script


@pytest.mark.slow
def test_suite_quick_run(tmp_path):
  out = tmp_path / "suite.json"
  run_script("benchmarks/run.py", "--quick", "--ks", "8", "--out", str(out), "--images",
             str(tmp_path))
  payload = json.loads(out.read_text())
  assert payload["device"] and payload["versions"]["jax"]
  setups = payload["setups"]
  assert set(setups) == {"replicated/mlp", "fsdp/mlp", "data_x_model/mlp", "replicated/bn_mlp"}

  replicated = setups["replicated/mlp"]
  grad_bytes = replicated["large_batch"]["grad_reduction_bytes_per_step"]
  assert grad_bytes >= replicated["gradient_bytes"]
  for k in payload["ks"]:
    for method in ("fxaccum", "fxaccum_cross"):
      fx = replicated["results"][method][str(k)]
      assert fx["data_reductions_in_loops"] == 0
      # Gradients once per optimizer step, plus a few scalars (loss, weight) per call.
      assert grad_bytes <= fx["grad_reduction_bytes_per_step"] <= grad_bytes + 64 * k
    # Deferred sync: no gradient-sized reduction outside the boundary branch.
    assert replicated["results"]["fxaccum_cross"][str(k)]["big_data_reductions_outside_cond"] == 0
    assert replicated["results"]["fxaccum_cross"][str(k)]["optimizer_steps_after_window"] == 1
    for method in ("plain_scan", "multisteps"):
      ratio = replicated["results"][method][str(k)]["grad_bytes_over_large_batch"]
      assert abs(ratio - k) < 0.01, (method, k, ratio)

  for name, setup in setups.items():
    for method in ("fxaccum", "fxaccum_cross", "fxaccum_zero1", "fxaccum_zero2",
                   "fxaccum_cross_reduced"):
      for k, r in setup["results"].get(method, {}).items():
        if method == "fxaccum_cross" and name == "fsdp/mlp":
          assert "params replicated" in r["skipped"]  # documented: deferred sync needs them
          continue
        assert r["grad_rel_err"] < 1e-5, (name, method, k)
        assert r["err_ok"] and r["device"] == payload["device"]
  # The FSDP layout reduce-scatters (fxaccum.diagnostics attributes them to the data axis).
  fsdp = setups["fsdp/mlp"]["results"]
  assert fsdp["fxaccum_zero1"]["8"]["data_reductions_in_loops"] == 0
  assert fsdp["micro_grad"]["8"]["skipped"]  # recorded, not hidden
  # BatchNorm mixes examples: fxaccum's global view is exact to the global micro-batches
  # (asserted above) and, on this Explicit mesh, keeps the matmul kernels `reduced`:
  # fewer gradient bytes than plain scan's k all-reduces. Per-example gradients
  # (micro_grad) change the batch statistics: recorded, not flagged.
  bn = setups["replicated/bn_mlp"]["results"]
  assert bn["fxaccum"]["8"]["grad_bytes_over_large_batch"] < (
      bn["plain_scan"]["8"]["grad_bytes_over_large_batch"] / 2)
  assert bn["micro_grad"]["8"]["grad_rel_err"] > 1e-2 and bn["micro_grad"]["8"]["err_ok"]
  assert payload["skipped"] and not payload["flags"]
  for path in payload["images"]:
    with open(path, "rb") as f:
      assert f.read(8) == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_fsdp_strategies_quick_run(tmp_path):
  """benchmarks/fsdp.py at tiny sizes: every method exact against jax.value_and_grad on
  the whole batch, and the default takes zero3 on stacked, scanned layers (lax.scan and
  nn.scan), zero2 on unrolled ones. (The suite's LM, zero2: benchmarks/results/fsdp.json.)"""
  out = tmp_path / "fsdp.json"
  run_script("benchmarks/fsdp.py", "--quick", "--no-time", "--models",
             "scanned,nn_scan,unrolled", "--out", str(out))
  rows = json.loads(out.read_text())["rows"]
  assert {r["method"] for r in rows} == {"large batch", "plain scan", "default", "zero1",
                                         "zero2", "zero3"}
  for r in rows:
    assert "skipped" not in r and r["grad_rel_err"] < 3e-5, r  # f32, every method alike
  taken = {r["model"]: r["strategy"].split(":")[0] for r in rows if r["method"] == "default"}
  assert taken == {"scanned": "zero3", "nn_scan": "zero3", "unrolled": "zero2"}, taken
