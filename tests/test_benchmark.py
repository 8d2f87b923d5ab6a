"""The benchmark scripts run (quick sizes) and their non-timing claims hold.

Timings are never asserted: they are figures for docs/performance.md, not tests.
"""

import json
import re

import pytest
from helpers import ROOT, run_script

from fxaccum.analysis.registry import CALL_RULES, RULES


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
  """run.py --study fsdp at tiny sizes: every method exact against jax.value_and_grad on
  the whole batch, and the default takes zero3 on stacked, scanned layers (lax.scan and
  nn.scan), zero2 on unrolled ones. (The suite's LM, zero2: benchmarks/results/fsdp.json.)"""
  out = tmp_path / "fsdp.json"
  run_script("benchmarks/run.py", "--study", "fsdp", "--quick", "--no-time", "--models",
             "scanned,nn_scan,unrolled", "--out", str(out))
  rows = json.loads(out.read_text())["rows"]
  assert {r["method"] for r in rows} == {"large batch", "plain scan", "default", "zero1",
                                         "zero2", "zero3"}
  for r in rows:
    assert "skipped" not in r and r["grad_rel_err"] < 3e-5, r  # f32, every method alike
  taken = {r["model"]: r["strategy"].split(":")[0] for r in rows if r["method"] == "default"}
  assert taken == {"scanned": "zero3", "nn_scan": "zero3", "unrolled": "zero2"}, taken


@pytest.mark.slow
def test_one_device_quick_run(tmp_path):
  """run.py --study one-device at tiny sizes on one CPU device (each variant in its own
  process): every loop exact against the large batch, one loop body in each loop's
  program, every method timed."""
  out = tmp_path / "one_device.json"
  run_script("benchmarks/run.py", "--study", "one-device", "--quick", "--variants",
             "default", "--out", str(out))
  result = json.loads(out.read_text())["default"]
  assert result["environment"]["device_count"] == 1 and result["k"] == 8
  for method in ("large batch", "fxaccum", "plain scan", "plain scan, sliced in the loop"):
    assert result[method]["max_grad_abs_err"] < 1e-5, (method, result[method])
    assert result[method]["ms_per_call"]["median"] > 0
    loops = result[method]["loop_body_instructions"]
    assert len(loops) == (0 if method == "large batch" else 1), (method, loops)


@pytest.mark.slow
def test_pipeline_schedules_quick_run():
  """run.py --study schedules at tiny sizes: every schedule's gradient matches the 8 layers
  run on one device, at each k, and the bubble is the schedule's formula."""
  out = run_script("benchmarks/run.py", "--study", "schedules", "--quick", "--ks", "4",
                   "--repeats", "1")  # one k: the suite's time; tests/test_pipeline.py sweeps k
  table = out[out.index("| k | schedule |"):].split("\n\n")[0].splitlines()[2:]
  rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in table]
  assert {(r[0], r[1].split(",")[0]) for r in rows} == {
      ("4", s) for s in ("gpipe", "circular", "1f1b")}, rows
  for k, schedule, _, _, _, bubble, err in rows:
    assert float(err) < 1e-5, (k, schedule, err)
    stages, repeats = 4, 2 if schedule.startswith("circular") else 1
    expected = (stages - 1) / (int(k) * repeats + stages - 1)
    assert abs(float(bubble) - expected) < 1e-3, (k, schedule, bubble)


@pytest.mark.slow
def test_plan_study_run(tmp_path):
  """run.py --study plan on a small LM batch: the planner's choice is the first candidate
  that fits, and it fits."""
  out = tmp_path / "plan.json"
  run_script("benchmarks/run.py", "--study", "plan", "--budgets-mib", "4", "--batch", "16",
             "--seq", "8", "--mlp-ks", "1", "--out", str(out))
  (result,) = json.loads(out.read_text())["results"]
  table = result["table"]
  assert [row["fits"] for row in table] == [False] * (len(table) - 1) + [True]
  assert table[-1]["micro_batches"] == result["micro_batches"]
  assert table[-1]["peak_bytes"] <= result["budget_bytes"] == 4 * 2**20


@pytest.mark.slow
def test_crossstep_memory_study_quick_run(tmp_path):
  """run.py --study crossstep-memory --quick: every case compiled for both methods, and
  fxaccum's donated peaks at most MultiSteps' (tests/test_crossstep_memory.py has the
  bounds)."""
  out = tmp_path / "crossstep_memory.json"
  run_script("benchmarks/run.py", "--study", "crossstep-memory", "--quick", "--rows", "8",
             "--out", str(out), env={"PYTHONPATH": str(ROOT)})
  results = json.loads(out.read_text())["results"]
  assert set(results) == {"NNX, no donation", "NNX, donated", "linen TrainState, donated"}
  for case, methods in results.items():
    if "donated" in case:
      assert methods["fxaccum"]["peak"] <= methods["MultiSteps"]["peak"], results


def test_coverage_study_quick_run():
  """run.py --study coverage --quick: the counts add up, every primitive it says has a
  rule is in the analysis's registry, and every one in its table is not."""
  # the registry of this checkout, wherever fxaccum is installed from
  out = run_script("benchmarks/run.py", "--study", "coverage", "--quick",
                   env={"PYTHONPATH": str(ROOT)})
  seen, ruled, without = map(int, re.search(
      r"primitives seen: (\d+), with a rule: (\d+), without: (\d+)", out).groups())
  assert seen == ruled + without and ruled > 0, out
  with_rule = out.split("with a rule: ")[-1].splitlines()[0].split(", ")
  assert len(with_rule) == ruled and set(with_rule) <= set(RULES) | set(CALL_RULES), out
  table = [line.split("|")[1].strip().strip("`") for line in out.splitlines()
           if line.startswith("| `")]
  assert len(table) == without, out
  assert not set(table) & (set(RULES) | set(CALL_RULES)), table
  assert {"dot_general", "reduce_sum"} <= set(with_rule), with_rule


@pytest.mark.slow
def test_contrastive_study_quick_run(tmp_path):
  """run.py --study contrastive --quick: micro_batched towers are exact, reduce nothing
  inside a loop and take less memory than the large batch; the mean of the micro-batch
  losses is another loss."""
  out = tmp_path / "contrastive.json"
  run_script("benchmarks/run.py", "--study", "contrastive", "--quick", "--ks", "4",
             "--no-time", "--out", str(out))
  rows = {r["method"]: r for r in json.loads(out.read_text())["result"]["rows"]}
  micro, large = rows["micro_batched"], rows["large batch"]
  assert micro["grad_error"] < 1e-5 and micro["loop_reductions"] == 0, rows
  assert micro["peak_mib"] < large["peak_mib"], rows
  assert rows["mean of micro-batch losses"]["grad_error"] > 1e-2, rows
  assert rows["grad_cached-style"]["grad_error"] < 1e-5, rows


@pytest.mark.slow
def test_tracing_study_quick_run(tmp_path):
  """run.py --study tracing --quick: both steps lower, plain scan traces the loss once and
  fxaccum at most twice (the times are figures, not checked)."""
  out = tmp_path / "tracing.json"
  run_script("benchmarks/run.py", "--study", "tracing", "--quick", "--repeats", "1",
             "--out", str(out), env={"PYTHONPATH": str(ROOT)})
  rows = json.loads(out.read_text())["rows"]
  assert rows["plain scan"]["traces"] == 1 and 1 <= rows["fxaccum"]["traces"] <= 2, rows
  assert all(r["seconds"] > 0 for r in rows.values()), rows
