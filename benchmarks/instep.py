"""In-step gradient accumulation vs. the alternatives, as full Adam train steps.

Run from the repository root::

  python benchmarks/instep.py            # full run (a few minutes on 2 CPU cores)
  python benchmarks/instep.py --quick    # tiny sizes, smoke test

Every method runs on the same model and global batch, on an 8-device 1-D mesh
``("data",)`` (simulated CPU devices unless an accelerator is present) with params
replicated and the batch sharded ``P("data")``:

* ``large_batch``: ``jax.value_and_grad`` on the whole batch (no accumulation);
* ``fxaccum_k{k}``: ``fxaccum.value_and_grad(loss, micro_batches=k)``;
* ``plain_scan_k8``: a hand-written ``jit`` + ``lax.scan`` over 8 strided micro-batches;
* ``multisteps_k8``: ``optax.MultiSteps(adam, every_k_schedule=8)``, 8 jitted calls per
  optimizer step;
* ``optax_microbatch_k8``: ``optax.microbatching.microbatch`` over ``jax.value_and_grad``
  (a ``fori_loop`` over 8 micro-batches, MEAN accumulator);
* ``micro_grad_k8``: ``optax.microbatching.micro_grad`` (per-example gradients, vmapped
  within each of 8 micro-batches, MEAN accumulator);
* ``grad_only_large`` / ``grad_only_fxaccum_k8``: the gradient computations alone, with no
  optimizer, to separate "8 small matmuls cost more than 1 large one" from the rest.

For each method: median wall time per optimizer step, gradient-reduction bytes per
optimizer step and the number of reductions inside loops (from
:mod:`fxaccum.diagnostics`), compiled temp memory, and the max relative error of the
gradient against ``large_batch``'s (for MultiSteps, of its accumulated gradient; the errors
of the params and of the update after one Adam step are in the JSON too). Results go to a
markdown table on stdout and to a JSON file (``--out``).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import common  # noqa: F401 - first: sets XLA_FLAGS before JAX starts
import jax
import optax
from common import (
    DEVICES,
    LR,
    REL_FLOOR,
    compile_and_report,
    data_mesh,
    delta,
    diff,
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
    micro_grad_value_and_grad,
    optax_microbatch_value_and_grad,
    optax_version_bug,
    plain_scan_value_and_grad,
    trace_error,
    train_step,
    with_version_shim,
)

import fxaccum
from fxaccum import diagnostics

K_REF = 8  # micro-batches of the baselines (plain scan, MultiSteps, optax.microbatching)


# ------------------------------------------------------------------------ measuring


def comm_figures(rep: diagnostics.Report, calls: int = 1) -> dict[str, Any]:
  """Gradient-reduction bytes per optimizer step, loop reductions, temp memory."""
  reductions = rep.reductions()
  return {
      "reduction_bytes_per_step": calls * rep.bytes_per_call(diagnostics.REDUCTIONS),
      "reductions_per_call": len(reductions),
      "reductions_in_loops": len(rep.reductions(place="loop")),
      "temp_bytes": rep.memory.temp_bytes if rep.memory else None,
      "peak_bytes": rep.memory.peak_bytes if rep.memory else None,
  }


def run_model(name: str, setup: dict[str, Any], mesh: Any, ks: list[int], repeats: int,
              log: Callable[[str], None]) -> dict[str, Any]:
  """Every method on one model; a dict method -> figures (or a skip reason)."""
  loss_fn, batch_size = setup["loss"], setup["config"]["global_batch"]
  replicated, sharded = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
  params = jax.device_put(setup["params"], replicated)
  batch = jax.device_put(setup["batch"], sharded)
  tx = optax.adam(LR)
  opt_state = jax.jit(tx.init)(params)
  results: dict[str, Any] = {}

  def record(method: str, fn: Callable[[], dict[str, Any]]) -> None:
    results[method] = measure(fn)
    log(f"  {name}/{method}: {_brief(results[method])}")

  ref: dict[str, Any] = {}
  grad_programs: dict[str, tuple[Any, diagnostics.Report]] = {}  # method -> compiled grads

  def grad_method(value_and_grad: Callable, note: str = "",
                  method: str = "") -> Callable[[], dict[str, Any]]:
    """A train step built on ``value_and_grad`` (params, batch) -> (loss, grads)."""

    def measure():
      step, step_rep = compile_and_report(train_step(value_and_grad, tx), mesh,
                                          params, opt_state, batch)
      ms, times = time_ms(lambda: step(params, opt_state, batch), repeats)
      grads_fn, grads_rep = compile_and_report(value_and_grad, mesh, params, batch)
      grad_programs[method] = grads_fn, grads_rep
      loss, grads = grads_fn(params, batch)
      new_params, _, _ = step(params, opt_state, batch)
      out = {"ms_per_step": ms, "times_ms": times, **comm_figures(step_rep),
             "loss": float(loss), "note": note}
      if "grads" not in ref:  # the first method is large_batch, the reference
        ref.update(grads=grads, params=new_params, loss=float(loss))
      out.update(errors("grad", grads, ref["grads"]))
      out.update(errors("params", new_params, ref["params"]))
      out.update(errors("update", delta(new_params, params), delta(ref["params"], params)))
      out["rel_err"], out["rel_err_of"] = out["grad_rel_err"], "grads"
      return out

    return measure

  def grad_only(method: str) -> Callable[[], dict[str, Any]]:
    """The gradient program compiled for ``method`` alone, with no optimizer."""

    def measure():
      fn, rep = grad_programs[method]
      ms, times = time_ms(lambda: fn(params, batch), repeats)
      loss, grads = fn(params, batch)
      out = {"ms_per_step": ms, "times_ms": times, **comm_figures(rep), "loss": float(loss),
             **errors("grad", grads, ref["grads"]), "note": "gradients only, no optimizer"}
      out["rel_err"], out["rel_err_of"] = out["grad_rel_err"], "grads"
      return out

    return measure

  def multisteps():
    k = K_REF
    ms_tx = optax.MultiSteps(optax.adam(LR), every_k_schedule=k)
    ms_state = jax.jit(ms_tx.init)(params)
    micro = [jax.device_put(jax.tree.map(lambda a, i=i: a[i::k], setup["batch"]), sharded)
             for i in range(k)]

    def micro_step(params, state, micro_batch):
      loss, grads = jax.value_and_grad(loss_fn)(params, micro_batch)
      updates, state = ms_tx.update(grads, state, params)
      return optax.apply_updates(params, updates), state, loss

    step, rep = compile_and_report(micro_step, mesh, params, ms_state, micro[0])

    def optimizer_step():
      p, s = params, ms_state
      for m in micro:
        p, s, _ = step(p, s, m)
      return p, s

    ms, times = time_ms(optimizer_step, repeats)
    new_params, _ = optimizer_step()
    # The gradient MultiSteps hands to Adam: its running mean after k micro-steps (read
    # from a MultiSteps that would apply after k + 1, so the accumulator is not reset).
    probe_tx = optax.MultiSteps(optax.adam(LR), every_k_schedule=k + 1)
    probe = jax.jit(lambda p, s, m: probe_tx.update(jax.grad(loss_fn)(p, m), s, p)[1])
    state = jax.jit(probe_tx.init)(params)
    for m in micro:
      state = probe(params, state, m)
    out = {"ms_per_step": ms, "times_ms": times, **comm_figures(rep, calls=k),
           "calls_per_step": k,
           "note": f"{k} jitted calls per optimizer step; bytes = {k} x per call"}
    out.update(errors("grad", state.acc_grads, ref["grads"]))
    out.update(errors("params", new_params, ref["params"]))
    out.update(errors("update", delta(new_params, params), delta(ref["params"], params)))
    out["rel_err"], out["rel_err_of"] = out["grad_rel_err"], "grads (MultiSteps acc_grads)"
    return out

  record("large_batch", grad_method(jax.value_and_grad(loss_fn), method="large_batch"))
  for k in ks:
    record(f"fxaccum_k{k}", grad_method(fxaccum.value_and_grad(loss_fn, micro_batches=k),
                                        method=f"fxaccum_k{k}"))
  record(f"plain_scan_k{K_REF}", grad_method(plain_scan_value_and_grad(loss_fn, K_REF)))
  record(f"multisteps_k{K_REF}", multisteps)
  bug = optax_version_bug()
  for method, make, note in (
      (f"optax_microbatch_k{K_REF}", optax_microbatch_value_and_grad,
       "optax.microbatching.microbatch(jax.value_and_grad(loss), MEAN)"),
      (f"micro_grad_k{K_REF}", micro_grad_value_and_grad,
       "optax.microbatching.micro_grad (per-example grads, MEAN)")):
    fn = make(loss_fn, K_REF, batch_size)
    if bug:
      note += "; run with a jax-version shim (see optax_bug)"
    record(method, grad_method(with_version_shim(fn), note))
    if bug:
      results[method]["optax_bug"] = bug
      results[method]["unpatched_error"] = trace_error(fn, params, batch)
  record("grad_only_large", grad_only("large_batch"))
  if f"fxaccum_k{K_REF}" in grad_programs:
    record(f"grad_only_fxaccum_k{K_REF}", grad_only(f"fxaccum_k{K_REF}"))
  else:
    results[f"grad_only_fxaccum_k{K_REF}"] = {"skipped": f"{K_REF} not in --ks or it failed"}
  return results


def _brief(r: dict[str, Any]) -> str:
  if "skipped" in r:
    return f"SKIPPED ({r['skipped']})"
  return (f"{r['ms_per_step']:.1f} ms, {r['reduction_bytes_per_step'] / 2**20:.2f} MiB reduced, "
          f"temp {r['temp_bytes'] / 2**20:.1f} MiB, err {r['rel_err']:.1e}")


# -------------------------------------------------------------------------- report


def targets(results: dict[str, dict[str, Any]], ks: list[int]) -> dict[str, Any]:
  """The headline ratios (fxaccum_k8 vs the baselines; lm temp memory vs k)."""
  out: dict[str, Any] = {}
  f8 = f"fxaccum_k{K_REF}"
  for model, res in results.items():
    def get(method, key, res=res):
      r = res.get(method, {})
      return r.get(key)

    t = {
        "time_fxaccum_k8_over_plain_scan_k8": ratio(get(f8, "ms_per_step"),
                                                     get(f"plain_scan_k{K_REF}", "ms_per_step")),
        "time_fxaccum_k8_over_multisteps_k8": ratio(get(f8, "ms_per_step"),
                                                     get(f"multisteps_k{K_REF}", "ms_per_step")),
        "time_fxaccum_k8_over_large_batch": ratio(get(f8, "ms_per_step"),
                                                   get("large_batch", "ms_per_step")),
        "time_fxaccum_k8_over_optax_microbatch_k8": ratio(
            get(f8, "ms_per_step"), get(f"optax_microbatch_k{K_REF}", "ms_per_step")),
        "grad_only_time_fxaccum_k8_over_large": ratio(get(f"grad_only_fxaccum_k{K_REF}",
                                                           "ms_per_step"),
                                                       get("grad_only_large", "ms_per_step")),
        "bytes_fxaccum_k8_over_plain_scan_k8": ratio(
            get(f8, "reduction_bytes_per_step"),
            get(f"plain_scan_k{K_REF}", "reduction_bytes_per_step")),
        "bytes_fxaccum_k8_over_multisteps_k8": ratio(
            get(f8, "reduction_bytes_per_step"),
            get(f"multisteps_k{K_REF}", "reduction_bytes_per_step")),
        "bytes_fxaccum_k8_over_large_batch": ratio(
            get(f8, "reduction_bytes_per_step"), get("large_batch", "reduction_bytes_per_step")),
    }
    step_gap = diff(get(f8, "ms_per_step"), get("large_batch", "ms_per_step"))
    grad_gap = diff(get(f"grad_only_fxaccum_k{K_REF}", "ms_per_step"),
                     get("grad_only_large", "ms_per_step"))
    t["step_gap_ms_fxaccum_k8_minus_large"] = step_gap
    t["grad_only_gap_ms_fxaccum_k8_minus_large"] = grad_gap
    temps = {k: get(f"fxaccum_k{k}", "temp_bytes") for k in ks}
    t["temp_bytes_by_k"] = temps
    t["temp_bytes_large_batch"] = get("large_batch", "temp_bytes")
    if K_REF in ks and 1 in ks:
      t["temp_ratio_k8_over_k1"] = ratio(temps[K_REF], temps[1])
    t["temp_ratio_fxaccum_k8_over_large_batch"] = ratio(get(f8, "temp_bytes"),
                                                         get("large_batch", "temp_bytes"))
    out[model] = t
  return out


def markdown(results: dict[str, dict[str, Any]]) -> str:
  """One table over all models and methods."""
  lines = md_header(["model", "method", "ms / opt step", "reduced MiB / step",
                      "reductions in loops", "temp MiB", "max rel err vs large_batch"],
                     numeric_from=2)
  for model, res in results.items():
    for method, r in res.items():
      if "skipped" in r:
        lines.append(md_row([model, method, f"skipped: {r['skipped']}", "", "", "", ""]))
        continue
      temp = "n/a" if r["temp_bytes"] is None else f"{r['temp_bytes'] / 2**20:.2f}"
      lines.append(md_row([model, method, f"{r['ms_per_step']:.1f}",
                           f"{r['reduction_bytes_per_step'] / 2**20:.2f}",
                           r["reductions_in_loops"], temp, f"{r['rel_err']:.1e}"]))
  return "\n".join(lines)


NOTES = {
    "ms_per_step": "median wall time per optimizer step after 1 warm-up (MultiSteps: k calls)",
    "reduction_bytes_per_step": "bytes of all-reduce/reduce-scatter per optimizer step, "
                                "per device, loop trip counts included (fxaccum.diagnostics)",
    "reductions_in_loops": "number of reduction instructions inside while loops (per call)",
    "temp_bytes": "compiled temp memory per device (memory_analysis), of the jitted step",
    "rel_err": f"max over leaves of max|a-b| / max|b| vs large_batch's gradient, each leaf's "
               f"scale floored at {REL_FLOOR} x the tree's max|b| (an attention key bias has an "
               "exact gradient of 0 and holds only ~1e-10 rounding noise); *_raw is unfloored",
    "update_rel_err": "same, for the one-step Adam update; Adam's first step is ~lr*sign(g), so "
                      "coordinates whose gradient is rounding noise flip sign (~1-2 expected)",
}


def method_notes(results: dict[str, dict[str, Any]]) -> str:
  """The per-method notes (MultiSteps calls, optax workarounds, skips), one line each."""
  lines = []
  for model, res in results.items():
    for method, r in res.items():
      note = r.get("note") or r.get("skipped")
      if note and not method.startswith("grad_only"):
        lines.append(f"- {model}/{method}: {note}")
      if r.get("optax_bug"):
        lines.append(f"  - {r['optax_bug']}; unpatched: {r.get('unpatched_error')}")
  return "\n".join(lines)


def main() -> None:
  """Parses the flags, runs every model and method, prints and writes the results."""
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", default="benchmarks/results/instep.json", help="JSON path")
  parser.add_argument("--repeats", type=int, default=5, help="timed runs per method")
  parser.add_argument("--lm-repeats", type=int, default=None,
                      help="timed runs per method for the (slower) lm model; default --repeats")
  parser.add_argument("--quick", action="store_true", help="tiny sizes, 1 repeat")
  parser.add_argument("--ks", default="1,2,4,8", help="fxaccum micro-batch counts")
  parser.add_argument("--models", default="mlp,lm", help="comma-separated subset of mlp,lm")
  args = parser.parse_args()
  ks = [int(k) for k in args.ks.split(",") if k]
  repeats = 1 if args.quick else args.repeats
  lm_repeats = 1 if args.quick else (args.lm_repeats or args.repeats)
  started = time.perf_counter()
  log = logger(started)
  mesh = data_mesh()
  setups = {"mlp": (mlp_setup, repeats), "lm": (lm_setup, lm_repeats)}
  results: dict[str, dict[str, Any]] = {}
  configs: dict[str, Any] = {}
  with jax.set_mesh(mesh):
    for name in args.models.split(","):
      make, reps = setups[name]
      setup = make(args.quick)
      configs[name] = {**setup["config"], "params": n_params(setup["params"]), "repeats": reps}
      log(f"{name}: {configs[name]}")
      results[name] = run_model(name, setup, mesh, ks, reps, log)

  table = markdown(results)
  total = time.perf_counter() - started
  payload = {
      "benchmark": "instep",
      "command": "python benchmarks/instep.py" + (" --quick" if args.quick else ""),
      "quick": args.quick,
      "ks": ks,
      "k_baselines": K_REF,
      "optimizer": f"optax.adam({LR})",
      "mesh": {"shape": [DEVICES], "axes": ["data"], "params": "P()", "batch": "P('data')"},
      **environment(),
      "models": configs,
      "results": results,
      "targets": targets(results, ks),
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
