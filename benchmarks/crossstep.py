"""Cross-step gradient accumulation vs. optax.MultiSteps, as full Adam optimizer steps.

Run from the repository root::

  python benchmarks/crossstep.py            # full run (a few minutes on 2 CPU cores)
  python benchmarks/crossstep.py --quick    # tiny sizes, smoke test

Cross-step accumulation takes one micro-batch per jitted call and updates the params on
every ``k``-th call. Every method runs on the same model and global batch as
``benchmarks/instep.py`` (the 4.2M-param MLP with 512 rows; optionally the small LM), on an
8-device 1-D mesh ``("data",)`` (simulated CPU devices unless an accelerator is present)
with params replicated and each call's batch sharded ``P("data")``. The global batch is
split into ``k`` strided micro-batches (rows ``i::k``), one per call:

* ``large_batch``: one Adam step with ``jax.value_and_grad`` on the whole batch, one call
  (the reference);
* ``multisteps``: ``optax.MultiSteps(optax.adam(lr), every_k_schedule=k)``; per call
  ``jax.value_and_grad`` on the micro-batch, ``tx.update``, ``optax.apply_updates``;
* ``fxaccum_reduced``: ``optax.chain(fxaccum.accumulate(k), optax.adam(lr))`` with
  ``fxaccum.TrainState``; per call ``jax.value_and_grad`` then ``state.apply_gradients``
  (XLA all-reduces the gradient on every call);
* ``fxaccum_deferred``: ``optax.chain(fxaccum.accumulate(k, data_axes="data"), ...)``; per
  call ``fxaccum.value_and_grad(loss, micro_batches=1, reduce=False)`` (per-device partial
  sums) then ``state.apply_gradients``: the only gradient all-reduce runs inside the
  ``lax.cond`` branch taken on the window's last call.

For each method: median wall time of one optimizer step (``k`` consecutive calls, blocked
on at the end) after one warm-up window; the median time of each call position (an
accumulate-only call vs. the window's last call); gradient-reduction bytes per optimizer
step from :mod:`fxaccum.diagnostics` of one call, as ``k x (bytes at top level and in
loops) + (bytes inside conditionals) x (times a window runs them)``; the number of
reductions larger than 64 bytes outside conditionals; compiled temp memory; and the max
relative error, against ``large_batch``, of the params after one optimizer step (also of
the update and of the mean gradient Adam was handed). Results go to a markdown table on
stdout and to a JSON file (``--out``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import common  # noqa: F401 - first: sets XLA_FLAGS before JAX starts
import jax
from common import (
    DEVICES,
    LR,
    REL_FLOOR,
    compile_and_report,
    data_mesh,
    delta,
    done_line,
    environment,
    errors,
    figures_line,
    lm_setup,
    logger,
    md_header,
    md_row,
    measure,
    mlp_setup,
    n_params,
    ratio,
    time_ms,
    write_json,
)
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from methods import (
    Method,
    adam_gradient,
    adam_state,
    fxaccum_cross,
    large_batch,
    multisteps,
)

from fxaccum import diagnostics

BIG = 64  # bytes: a reduction larger than this is a gradient, not a loss/weight scalar
TIME_TARGET = 0.5  # fxaccum_deferred's time per optimizer step over multisteps', at most

# How often the inner optimizer (Adam) runs per window of k calls: by construction, not
# measured. MultiSteps runs ``inner.update`` on every call and keeps its result only on
# the last (``jnp.where``); the fxaccum gate runs the chain once, in the boundary branch.
INNER_UPDATES = {"large_batch": "1", "multisteps": "k", "fxaccum_reduced": "1",
                 "fxaccum_deferred": "1"}


def methods(loss_fn: Callable, params: Any, k: int) -> dict[str, Callable[[], Method]]:
  """The four methods for ``loss_fn`` (a mean over its batch's examples), each built (its
  initial state computed) when its factory is called."""
  return {"large_batch": lambda: large_batch(loss_fn, params),
          "multisteps": lambda: multisteps(loss_fn, params, k),
          "fxaccum_reduced": lambda: fxaccum_cross(loss_fn, params, k, deferred=False),
          "fxaccum_deferred": lambda: fxaccum_cross(loss_fn, params, k, deferred=True)}


# ------------------------------------------------------------------------ measuring


def comm_figures(rep: diagnostics.Report, calls: int, cond_runs: int) -> dict[str, Any]:
  """Reduction bytes per optimizer step (``calls`` calls), big reductions outside the
  conditional, temp memory; from the diagnostics of one call."""
  outside = (rep.bytes_per_call(diagnostics.REDUCTIONS, place="top")
             + rep.bytes_per_call(diagnostics.REDUCTIONS, place="loop"))
  inside = rep.bytes_per_call(diagnostics.REDUCTIONS, place="conditional")
  return {
      "reduction_bytes_per_step": calls * outside + cond_runs * inside,
      "reduction_bytes_per_call_outside_cond": outside,
      "reduction_bytes_per_call_in_cond": inside,
      "cond_runs_per_step": cond_runs,
      "reductions_per_call": len(rep.reductions()),
      "reductions_in_cond": len(rep.reductions(place="conditional")),
      "large_reductions_outside_cond": sum(
          1 for c in rep.reductions() if c.place != "conditional" and c.bytes > BIG),
      "temp_bytes": rep.memory.temp_bytes if rep.memory else None,
      "peak_bytes": rep.memory.peak_bytes if rep.memory else None,
  }


def call_ms(run_call: Callable[[Any, Any], Any], state: Any, batches: list[Any],
            repeats: int) -> list[float]:
  """Median wall time (ms) of each call position of a window, blocking after each call."""
  times: list[list[float]] = [[] for _ in batches]
  for _ in range(repeats):
    for i, batch in enumerate(batches):
      start = time.perf_counter()
      state, _ = jax.block_until_ready(run_call(state, batch))
      times[i].append((time.perf_counter() - start) * 1e3)
  return [statistics.median(t) for t in times]


def run_model(name: str, setup: dict[str, Any], mesh: Any, k: int, repeats: int,
              log: Callable[[str], None]) -> dict[str, Any]:
  """Every method on one model; a dict method -> figures (or a skip reason)."""
  loss_fn = setup["loss"]
  sharded = NamedSharding(mesh, P("data"))
  params = jax.device_put(setup["params"], NamedSharding(mesh, P()))
  batch = jax.device_put(setup["batch"], sharded)
  micro = [jax.device_put(jax.tree.map(lambda a, i=i: a[i::k], setup["batch"]), sharded)
           for i in range(k)]
  ref: dict[str, Any] = {}
  results: dict[str, Any] = {}

  def measure_method(method: str, build: Callable[[], Method]) -> Callable[[], dict[str, Any]]:
    batches = [batch] if method == "large_batch" else micro

    def run():
      m = build()
      # Every independent dispatch is blocked on before the next one: XLA:CPU's in-process
      # collectives can deadlock when programs with collectives that do not depend on each
      # other are in flight together (seen with back-to-back eager reductions).
      jax.block_until_ready(m.state)
      step, rep = compile_and_report(m.call, mesh, m.state, batches[0])

      def window():
        state, loss = m.state, None
        for b in batches:
          state, loss = step(state, b)
        return state, loss

      ms, times = time_ms(window, repeats)
      per_call = call_ms(step, m.state, batches, repeats)
      state, loss = jax.block_until_ready(window())
      new_params, grads = m.params(state), adam_gradient(state)
      if method == "large_batch":
        ref.update(params=new_params, grads=grads)
      out = {"ms_per_step": ms, "times_ms": times, "calls_per_step": len(batches),
             "call_ms": per_call,
             "accumulate_call_ms": statistics.median(per_call[:-1]) if len(per_call) > 1
             else None,
             "boundary_call_ms": per_call[-1],
             **comm_figures(rep, len(batches), m.cond_runs),
             "inner_updates_per_step": INNER_UPDATES[method],
             "optimizer_steps_after_window": int(m.steps(state)),
             "adam_count_after_window": int(adam_state(state).count),
             "loss_last_call": float(loss), "note": m.note}
      out.update(errors("grad", grads, ref["grads"]))
      out.update(errors("params", new_params, ref["params"]))
      out.update(errors("update", delta(new_params, params), delta(ref["params"], params)))
      out["rel_err"], out["rel_err_of"] = out["params_rel_err"], "params after one step"
      return out

    return run

  for method, build in methods(loss_fn, params, k).items():
    results[method] = measure(measure_method(method, build))
    log(f"  {name}/{method}: {_brief(results[method])}")
    if method == "large_batch" and "skipped" in results[method]:
      raise SystemExit("large_batch (the reference) failed; see the traceback above")
  return results


def _brief(r: dict[str, Any]) -> str:
  if "skipped" in r:
    return f"SKIPPED ({r['skipped']})"
  calls = ", ".join(f"{t:.1f}" for t in r["call_ms"])
  return (f"{r['ms_per_step']:.1f} ms/step (calls: {calls} ms), "
          f"{r['reduction_bytes_per_step'] / 2**20:.2f} MiB reduced, "
          f"{r['large_reductions_outside_cond']} big reductions outside cond, "
          f"temp {r['temp_bytes'] / 2**20:.2f} MiB, params err {r['params_rel_err']:.1e}, "
          f"grad err {r['grad_rel_err']:.1e}")


# -------------------------------------------------------------------------- report


def targets(results: dict[str, dict[str, Any]], k: int) -> dict[str, Any]:
  """The headline ratios (fxaccum_deferred vs multisteps) and whether they meet targets."""
  out: dict[str, Any] = {}
  for model, res in results.items():
    def get(method, key, res=res):
      return res.get(method, {}).get(key)

    def time_over(a, b):
      return ratio(get(a, "ms_per_step"), get(b, "ms_per_step"))

    def bytes_over(a, b):
      return ratio(get(a, "reduction_bytes_per_step"), get(b, "reduction_bytes_per_step"))

    t: dict[str, Any] = {}
    t["time_fxaccum_deferred_over_multisteps"] = time_over("fxaccum_deferred", "multisteps")
    t["time_target"] = f"<= {TIME_TARGET}"
    t["time_target_met"] = (None if t["time_fxaccum_deferred_over_multisteps"] is None
                            else t["time_fxaccum_deferred_over_multisteps"] <= TIME_TARGET)
    t["bytes_fxaccum_deferred_over_multisteps"] = bytes_over("fxaccum_deferred", "multisteps")
    t["bytes_target"] = f"1/k = {1 / k:.4g}"
    deferred, ms = (get("fxaccum_deferred", "reduction_bytes_per_step"),
                    get("multisteps", "reduction_bytes_per_step"))
    # k x MultiSteps' gradient bytes / k, plus at most one small (loss) reduction per call.
    t["bytes_target_met"] = (None if deferred is None or ms is None
                             else deferred <= ms / k + BIG * k)
    t["time_fxaccum_deferred_over_fxaccum_reduced"] = time_over("fxaccum_deferred",
                                                                "fxaccum_reduced")
    t["time_fxaccum_reduced_over_multisteps"] = time_over("fxaccum_reduced", "multisteps")
    t["time_fxaccum_deferred_over_large_batch"] = time_over("fxaccum_deferred", "large_batch")
    t["time_multisteps_over_large_batch"] = time_over("multisteps", "large_batch")
    t["bytes_fxaccum_reduced_over_multisteps"] = bytes_over("fxaccum_reduced", "multisteps")
    t["bytes_fxaccum_deferred_over_large_batch"] = bytes_over("fxaccum_deferred",
                                                              "large_batch")
    out[model] = t
  return out


def markdown(results: dict[str, dict[str, Any]]) -> str:
  """One table over all models and methods."""
  lines = md_header(["model", "method", "ms / opt step", "ms / accumulate call",
                     "ms / boundary call", "reduced MiB / step", "reductions > 64 B outside cond",
                     "inner Adam runs / step", "temp MiB", "params max rel err vs large_batch",
                     "grad max rel err"], numeric_from=2)
  for model, res in results.items():
    for method, r in res.items():
      if "skipped" in r:
        lines.append(md_row([model, method, f"skipped: {r['skipped']}", *[""] * 8]))
        continue
      acc = "-" if r["accumulate_call_ms"] is None else f"{r['accumulate_call_ms']:.1f}"
      temp = "n/a" if r["temp_bytes"] is None else f"{r['temp_bytes'] / 2**20:.2f}"
      lines.append(md_row([
          model, method, f"{r['ms_per_step']:.1f}", acc, f"{r['boundary_call_ms']:.1f}",
          f"{r['reduction_bytes_per_step'] / 2**20:.2f}", r["large_reductions_outside_cond"],
          r["inner_updates_per_step"], temp, f"{r['params_rel_err']:.1e}",
          f"{r['grad_rel_err']:.1e}"]))
  return "\n".join(lines)


NOTES = {
    "ms_per_step": "median wall time of one optimizer step (k consecutive jitted calls, "
                   "large_batch: 1), blocked on at the end, after one warm-up window",
    "call_ms": "median wall time of each call position of a window, blocking after every "
               "call (a separate run); accumulate_call_ms is the median over the first k-1, "
               "boundary_call_ms the last (the one that updates the params)",
    "reduction_bytes_per_step": "bytes of all-reduce/reduce-scatter per optimizer step, per "
                                "device (fxaccum.diagnostics of one call): calls_per_step x "
                                "(top + loop) + cond_runs_per_step x (inside conditionals)",
    "large_reductions_outside_cond": f"reductions of more than {BIG} bytes at top level or in "
                                     "loops of one call (gradient-sized, run every call)",
    "inner_updates_per_step": "how often the inner Adam update runs per window of k calls, "
                              "by construction (not measured): MultiSteps computes it every "
                              "call and masks it, the fxaccum gate runs it once",
    "temp_bytes": "compiled temp memory per device (memory_analysis) of one jitted call",
    "params_rel_err": f"params after one optimizer step vs large_batch's: max over leaves of "
                      f"max|a-b| / max|b|, each leaf's scale floored at {REL_FLOOR} x the "
                      "tree's max|b|; *_raw is unfloored. Adam's first step is ~lr*sign(g), so "
                      "coordinates whose gradient is near 0 amplify rounding differences",
    "grad_rel_err": "the (mean) gradient Adam was handed vs large_batch's, same measure; "
                    "recovered from Adam's first moment after the step, mu = (1 - b1) g",
    "update_rel_err": "the one-step params update vs large_batch's, same measure",
    "targets": f"time_fxaccum_deferred_over_multisteps <= {TIME_TARGET}; "
               "bytes_fxaccum_deferred_over_multisteps = 1/k (met when deferred bytes <= "
               f"multisteps' / k + {BIG} x k: one scalar loss reduction per call is allowed)",
}


def method_notes(results: dict[str, dict[str, Any]]) -> str:
  """The per-method notes and skips, one line each."""
  return "\n".join(f"- {model}/{method}: {r.get('note') or r.get('skipped')}"
                   for model, res in results.items() for method, r in res.items())


def main() -> None:
  """Parses the flags, runs every model and method, prints and writes the results."""
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", default="benchmarks/results/crossstep.json", help="JSON path")
  parser.add_argument("--repeats", type=int, default=5, help="timed windows per method")
  parser.add_argument("--quick", action="store_true", help="tiny sizes, 1 repeat")
  parser.add_argument("--k", type=int, default=8, help="calls (micro-batches) per step")
  parser.add_argument("--models", default="mlp,lm", help="comma-separated subset of mlp,lm")
  args = parser.parse_args()
  k = args.k
  repeats = 1 if args.quick else args.repeats
  started = time.perf_counter()
  log = logger(started)
  mesh = data_mesh()
  setups = {"mlp": mlp_setup, "lm": lm_setup}
  results: dict[str, dict[str, Any]] = {}
  configs: dict[str, Any] = {}
  with jax.set_mesh(mesh):
    for name in args.models.split(","):
      setup = setups[name](args.quick)
      batch = setup["config"]["global_batch"]
      if batch % (k * DEVICES):
        raise SystemExit(f"{name}: global batch {batch} is not a multiple of k x devices "
                         f"= {k * DEVICES}")
      configs[name] = {**setup["config"], "micro_batch": batch // k,
                       "params": n_params(setup["params"]), "repeats": repeats}
      log(f"{name}: {configs[name]}")
      results[name] = run_model(name, setup, mesh, k, repeats, log)

  table = markdown(results)
  total = time.perf_counter() - started
  command = " ".join(["python", "benchmarks/crossstep.py", *sys.argv[1:]])
  payload = {
      "benchmark": "crossstep",
      "command": command,
      "quick": args.quick,
      "k": k,
      "optimizer": f"optax.adam({LR})",
      "mesh": {"shape": [DEVICES], "axes": ["data"], "params": "P()",
               "batch": "P('data'), one micro-batch of global_batch / k rows per call"},
      **environment(),
      "models": configs,
      "inner_updates_per_window": {m: (k if v == "k" else int(v))
                                   for m, v in INNER_UPDATES.items()},
      "results": results,
      "targets": targets(results, k),
      "total_seconds": round(total, 1),
      "table_markdown": table,
      "notes": NOTES,
  }
  write_json(args.out, payload)
  print()
  print(table)
  print()
  print(method_notes(results))
  print()
  for model, t in payload["targets"].items():
    print(figures_line(f"{model} targets", t))
  print(done_line(args.out, total))


if __name__ == "__main__":
  main()
