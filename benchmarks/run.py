"""The benchmark suite: fxaccum vs. the alternatives, for k in {1, 2, 4, 8}, per layout.

Run from the repository root::

  python benchmarks/run.py            # full run: JSON, tables, PNG plots (~8 min on 2 cores)
  python benchmarks/run.py --quick    # tiny sizes, 1 repeat, outputs in a temp folder
  python benchmarks/run.py --study fsdp   # one of the other measurements (below)

``--study NAME`` runs one of the measurements other than the suite, each in its module
(``--quick`` and ``--out`` apply, and the options the module's ``study`` names):
``fsdp`` (fsdp.py: ``fsdp="auto"`` against each FSDP strategy), ``schedules``
(schedules.py: the pipeline schedules), ``plan`` (plan.py: ``fxaccum.plan_micro_batches``
at three budgets), ``one-device`` (one_device.py: fxaccum's loop against plain scan's on
one device, made for a GPU), ``crossstep-memory`` (crossstep_memory.py: the gated step's
compiled memory against ``optax.MultiSteps`` as flax users jit it), ``coverage``
(coverage.py: which primitives that jax.numpy, jax.nn, jax.random, optax's losses and
flax's layers emit have a rule in the view analysis) and ``contrastive`` (contrastive.py:
a CLIP loss over ``fxaccum.micro_batched`` towers against the large batch and a
``grad_cached``-style step) and ``tracing`` (tracing.py: trace + lower time of the in-step
step against plain scan's).

One Adam optimizer step on the same model and global batch, for every (layout, model) setup,
method and number ``k`` of micro-batches per optimizer step. Layouts (``common.LAYOUTS``):
replicated data parallel (Explicit, and Auto for the BatchNorm model), FSDP and data x
model (tensor parallel), on ``jax.devices()`` (8 simulated CPU devices when no accelerator
is present; the JSON and every plot name the device). Models: an MLP and a small LM (losses
that are means over examples: fxaccum's per-device view) and the MLP with BatchNorm in
train mode (a loss that mixes examples: fxaccum's global view; its reference for k > 1 is
the mean over the global micro-batches, and ``fxaccum_device`` forces the per-device view
to show what exactness costs). Methods:

* ``large_batch``: ``jax.value_and_grad`` on the whole batch (the reference; no ``k``);
* in-step, one jitted call per optimizer step: ``fxaccum`` (``fxaccum.value_and_grad(loss,
  micro_batches=k)``), ``fxaccum_zero1`` and ``fxaccum_zero2`` (FSDP only, ``fsdp="zero1"``
  / ``"zero2"``, the default choosing its own),
  ``plain_scan`` (``jit`` + ``lax.scan`` of ``jax.value_and_grad``) and ``micro_grad``
  (``optax.microbatching.micro_grad``, per-example gradients, MEAN);
* cross-step, ``k`` jitted calls of one micro-batch each: ``fxaccum_cross`` (deferred sync:
  ``accumulate(k, data_axes="data")`` fed ``value_and_unreduced_grad``),
  ``fxaccum_cross_reduced`` (FSDP only: ``accumulate(k)`` fed ``jax.value_and_grad``) and
  ``multisteps`` (``optax.MultiSteps(adam, k)``).

Per (setup, k), all methods are compiled first, then timed in turns (2 untimed warm-ups, then
5 rounds; the LM 3), so that load from other processes hits them alike.
Figures per (setup, method, k): median ms per optimizer step and its ratio to the large
batch and to fxaccum of the same mode; gradient-reduction bytes per optimizer step (data-axis
all-reduce / reduce-scatter, from ``fxaccum.diagnostics``) and the data-axis reductions
inside loops; compiled temp memory; the max relative error of the gradient Adam received
against the large batch's (flagged, not asserted, when >= 1e-5). A method that cannot run
on a layout is recorded as skipped, with the reason.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import os
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import common  # noqa: F401 - first: sets XLA_FLAGS before JAX starts
import jax
import jax.numpy as jnp
import numpy as np
import pipeline as bench_pipeline
from common import (
  DATA,
  LAYOUTS,
  LR,
  REL_FLOOR,
  bn_mlp_setup,
  compile_and_report,
  environment,
  errors,
  interleaved,
  layout_mesh,
  layout_specs,
  lm_setup,
  logger,
  md_header,
  md_row,
  measure,
  mlp_setup,
  n_params,
  ratio,
  write_json,
)
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from methods import (
  Method,
  adam_gradient,
  adam_step,
  fxaccum_cross,
  large_batch,
  micro_grad_value_and_grad,
  multisteps,
  optax_version_bug,
  plain_scan_value_and_grad,
  with_version_shim,
)

import fxaccum
from fxaccum import diagnostics

# --study NAME -> the module whose ``study(args)`` runs it (imported when chosen)
STUDIES = {"fsdp": "fsdp", "schedules": "schedules", "plan": "plan",
           "one-device": "one_device", "coverage": "coverage", "contrastive": "contrastive",
           "crossstep-memory": "crossstep_memory", "tracing": "tracing"}
PIPELINE = "pipeline"  # fxaccum.pipeline against the same model without one (pipeline.py)
SETUPS = ("replicated/mlp", "replicated/lm", "fsdp/mlp", "fsdp/lm", "data_x_model/mlp",
          "replicated/bn_mlp", "replicated_auto/bn_mlp")
# the lm compiles slowly
QUICK_SETUPS = ("replicated/mlp", "fsdp/mlp", "data_x_model/mlp", "replicated/bn_mlp")
WARMUPS = 2  # untimed windows per method: cross-step windows settle on the 2nd
ERR_LIMIT = 1e-5  # fxaccum's gradient must match the large batch's to this (flagged)
BIG = 64  # bytes: a reduction larger than this is a gradient, not a loss/weight scalar
IN_STEP = "in-step"
CROSS_STEP = "cross-step"
# method -> (mode, the fxaccum method its time is compared with, the layouts or models it
# runs on, or None for all)
METHODS = {
    "fxaccum": (IN_STEP, "fxaccum", None),
    "fxaccum_device": (IN_STEP, "fxaccum", ("bn_mlp",)),
    "fxaccum_zero1": (IN_STEP, "fxaccum", ("fsdp",)),
    "fxaccum_zero2": (IN_STEP, "fxaccum", ("fsdp",)),
    "plain_scan": (IN_STEP, "fxaccum", None),
    "micro_grad": (IN_STEP, "fxaccum", None),
    "fxaccum_cross": (CROSS_STEP, "fxaccum_cross", None),
    "fxaccum_cross_reduced": (CROSS_STEP, "fxaccum_cross_reduced", ("fsdp",)),
    "multisteps": (CROSS_STEP, "fxaccum_cross", None),
}


def builders(loss_fn: Callable, params: Any, batch_size: int,
             k: int) -> dict[str, Callable[[], Method]]:
  """Each method's factory for ``k`` micro-batches (built when called)."""
  micro_grad = with_version_shim(micro_grad_value_and_grad(loss_fn, k, batch_size))
  return {
      "fxaccum": lambda: adam_step(fxaccum.value_and_grad(loss_fn, micro_batches=k), params,
                                   "fxaccum.value_and_grad(loss, micro_batches=k)"),
      "fxaccum_device": lambda: adam_step(
          fxaccum.value_and_grad(loss_fn, micro_batches=k, view="device"), params,
          "view='device' forced: per-device batch statistics (fast, not the contract)"),
      "fxaccum_zero1": lambda: adam_step(
          fxaccum.value_and_grad(loss_fn, micro_batches=k, fsdp="zero1"), params,
          "fsdp='zero1': params gathered once, one reduce-scatter per step"),
      "fxaccum_zero2": lambda: adam_step(
          fxaccum.value_and_grad(loss_fn, micro_batches=k, fsdp="zero2"), params,
          "fsdp='zero2': params gathered once, one reduce-scatter per micro-batch"),
      "plain_scan": lambda: adam_step(plain_scan_value_and_grad(loss_fn, k), params,
                                      "jit + lax.scan over k strided micro-batches"),
      "micro_grad": lambda: adam_step(micro_grad, params,
                                      "optax.microbatching.micro_grad (per-example grads, "
                                      "MEAN), run with a jax-version shim (docs)"),
      "fxaccum_cross": lambda: fxaccum_cross(loss_fn, params, k, deferred=True),
      "fxaccum_cross_reduced": lambda: fxaccum_cross(loss_fn, params, k, deferred=False),
      "multisteps": lambda: multisteps(loss_fn, params, k),
  }


# ------------------------------------------------------------------------ measuring


def reduction_figures(rep: diagnostics.Report, calls: int, cond_runs: int) -> dict[str, Any]:
  """Per optimizer step of ``calls`` calls, from one call's diagnostics: reduction bytes over
  the data axis (gradients) and over other axes (tensor-parallel activations), loop
  reductions, big data-axis reductions outside conditionals, temp memory."""

  def per_step(axes):
    outside = sum(rep.bytes_per_call(diagnostics.REDUCTIONS, place=p, axes=axes)
                  for p in ("top", "loop"))
    inside = rep.bytes_per_call(diagnostics.REDUCTIONS, place="conditional", axes=axes)
    return calls * outside + cond_runs * inside

  data = rep.reductions(axes=DATA)
  grad_bytes = per_step(DATA)
  return {
      "grad_reduction_bytes_per_step": grad_bytes,
      "other_reduction_bytes_per_step": per_step(None) - grad_bytes,
      "reductions_per_call": len(rep.reductions()),
      "data_reductions_in_loops": len(rep.reductions(place="loop", axes=DATA)),
      "big_data_reductions_outside_cond": sum(
          1 for c in data if c.place != "conditional" and c.bytes > BIG),
      "unattributed_reductions": sum(1 for c in rep.reductions() if c.axes is None),
      "temp_bytes": rep.memory.temp_bytes if rep.memory else None,
      "peak_bytes": rep.memory.peak_bytes if rep.memory else None,
  }


@dataclasses.dataclass(frozen=True)
class Prepared:
  """A method compiled and ready to time: ``window()`` takes one optimizer step from the
  initial state; ``figures`` are those read from the compiled program."""

  window: Callable[[], Any]
  figures: dict[str, Any]
  steps: Callable[[Any], Any]


def prepare(m: Method, batches: list[Any], mesh: Any, donated: bool = False,
            quick: bool = False) -> Prepared:
  """Compiles ``m.call`` for ``len(batches)`` calls per optimizer step, timed as a training
  loop runs it: the state donated to each call and carried from window to window (the first
  window starts from ``m.state`` and returns a copy: the figures read it). ``donated`` adds
  the memory figures of the donated call. ``quick`` (a smoke run, timings unused) skips the
  second compile and runs the undonated call."""
  state = m.state
  jax.block_until_ready(state)
  call, rep = compile_and_report(m.call, mesh, state, batches[0])
  donating = call if quick else jax.jit(m.call, donate_argnums=0).lower(
      state, batches[0]).compile()
  carried = [jax.tree.map(jnp.copy, state)]

  def window():
    first = len(carried) == 1
    out, loss = carried[-1], None
    for b in batches:  # wait for each call: XLA:CPU's rendezvous (docs/performance.md)
      out, loss = jax.block_until_ready(donating(out, b))
    carried[-1:] = [out, out] if first else [out]
    return (jax.block_until_ready(jax.tree.map(jnp.copy, out)) if first else out), loss

  figures = {"calls_per_step": len(batches), **reduction_figures(rep, len(batches),
                                                                 m.cond_runs), "note": m.note}
  if donated:
    memory = diagnostics.from_compiled(donating).memory
    figures.update(donated_temp_bytes=memory.temp_bytes, donated_peak_bytes=memory.peak_bytes,
                   state_bytes=sum(math.prod(x.sharding.shard_shape(x.shape)) * x.itemsize
                                   for x in jax.tree.leaves(state)))
  return Prepared(window, figures, m.steps)


def grad_only(fn: Callable, params: Any, batch: Any, mesh: Any) -> Prepared:
  """The gradient computation alone (no optimizer): the compute floor of a method."""
  compiled, rep = compile_and_report(fn, mesh, params, batch)
  return Prepared(lambda: compiled(params, batch),
                  {"temp_bytes": rep.memory.temp_bytes if rep.memory else None}, lambda _: 0)


def model_setup(model: str, quick: bool, lm_seq: int | None = None,
                mlp_width: int | None = None) -> dict[str, Any]:
  """The problem named ``model`` (``mlp``, ``bn_mlp`` or ``lm``), with the LM's sequence
  length and the MLP's width where given."""
  return {"mlp": lambda: mlp_setup(quick, mlp_width), "bn_mlp": lambda: bn_mlp_setup(quick),
          "lm": lambda: lm_setup(quick, lm_seq)}[model]()


def run_setup(name: str, quick: bool, ks: list[int], repeats: int,
              log: Callable[[str], None], lm_seq: int | None = None,
              mlp_width: int | None = None) -> dict[str, Any]:
  """Every method and k on one (layout, model) setup. Per k, the methods (and the large
  batch, again) are compiled first and then timed in turns. ``lm_seq`` / ``mlp_width``:
  the LM's sequence length and the MLP's width, if not their defaults."""
  layout_name, model = name.split("/")
  try:
    mesh = layout_mesh(layout_name)
  except ValueError as e:
    return {"skipped": str(e)}
  with jax.set_mesh(mesh):  # the LM's embedding lookup names its output sharding
    setup = model_setup(model, quick, lm_seq, mlp_width)
  specs = layout_specs(layout_name, setup["params"], mesh)
  batch_size = setup["config"]["global_batch"]
  device = describe_device()
  out: dict[str, Any] = {
      "layout": layout_name, "model": model, "layout_description": LAYOUTS[layout_name],
      "device": device,
      "mesh": {"shape": list(mesh.shape.values()), "axes": list(mesh.axis_names),
               "axis_types": [str(t) for t in mesh.axis_types]},
      "param_specs": jax.tree.map(str, specs),
      "config": {**setup["config"], "params": n_params(setup["params"]), "repeats": repeats},
      "gradient_bytes": int(sum(np.asarray(p).nbytes for p in jax.tree.leaves(setup["params"]))),
  }
  log(f"{name}: mesh {out['mesh']['shape']} {out['mesh']['axes']}, {out['config']}")
  with jax.set_mesh(mesh):
    params = jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)),
                          setup["params"], specs)
    batch = jax.device_put(setup["batch"], NamedSharding(mesh, P(DATA)))
    jax.block_until_ready((params, batch))
    loss_fn = setup["loss"]
    ref = prepare(large_batch(loss_fn, params), [batch], mesh, donated=not quick, quick=quick)
    ref_times: list[float] = []
    ref_grads = None
    results: dict[str, dict[str, Any]] = {
        m: {} for m, (_, _, where) in METHODS.items()
        if where is None or layout_name in where or model in where}
    mixes = setup.get("mixes_examples", False)
    for k in ks:
      micro = [jax.device_put(jax.tree.map(lambda a, i=i, k=k: a[i::k], setup["batch"]),
                              NamedSharding(mesh, P(DATA))) for i in range(k)]
      jax.block_until_ready(micro)
      # A loss that mixes examples: k micro-batches give the mean over the global
      # micro-batches (rows i::k) of jax.value_and_grad, not the large batch's.
      contract = micro_batch_reference(loss_fn, params, micro) if mixes else None
      factories = builders(loss_fn, params, batch_size, k)
      prepared: dict[str, Prepared] = {"large_batch": ref}
      for method in results:
        batches = [batch] if METHODS[method][0] == IN_STEP else micro
        donated = k == ks[-1] and not quick
        r = measure(lambda f=factories[method], b=batches, d=donated: {
            "result": prepare(f(), b, mesh, donated=d, quick=quick)})
        if "skipped" in r:
          results[method][str(k)] = {**r, "method": method, "k": k, "device": device}
        else:
          prepared[method] = r.pop("result")
      if k == ks[-1] and not quick:  # the compute floor: gradients alone
        prepared["grad_only_large_batch"] = grad_only(jax.value_and_grad(loss_fn), params,
                                                      batch, mesh)
        prepared[f"grad_only_fxaccum_k{k}"] = grad_only(
            fxaccum.value_and_grad(loss_fn, micro_batches=k), params, batch, mesh)
      timings = interleaved({m: p.window for m, p in prepared.items()}, repeats,
                            warmups=1 if quick else WARMUPS)
      ms_ref, times, (state, _) = timings.pop("large_batch")
      ref_times += times
      if ref_grads is None:
        ref_grads = adam_gradient(state)
        out["large_batch"] = {**ref.figures, "mode": "reference",
                              "optimizer_steps_after_window": int(ref.steps(state)),
                              **errors("grad", ref_grads, ref_grads)}
      for method, (ms, times, outputs) in timings.items():
        r = {"method": method, "k": k, "device": device, "ms_per_step": ms, "times_ms": times,
             "large_batch_ms_same_rounds": ms_ref, **prepared[method].figures}
        if method.startswith("grad_only"):
          out.setdefault("grad_only", {})[method.removeprefix("grad_only_")] = r
          continue
        state, loss = outputs
        r.update(mode=METHODS[method][0], loss=float(loss),
                 optimizer_steps_after_window=int(prepared[method].steps(state)),
                 **errors("grad", adam_gradient(state),
                          ref_grads if contract is None else contract))
        r["err_ok"] = r["grad_rel_err"] < ERR_LIMIT or (mixes and method in NOT_THE_CONTRACT)
        results[method][str(k)] = r
      for method in results:
        log(f"  {method} k={k}: {brief(results[method][str(k)])}")
    out["large_batch"].update(ms_per_step=statistics.median(ref_times), times_ms=ref_times,
                              device=device)
    log(f"  large_batch: {brief(out['large_batch'])}")
    for method, r in out.get("grad_only", {}).items():
      log(f"  gradients alone, {method}: {r['ms_per_step']:.1f} ms")
    add_ratios(results, out["large_batch"])
    out["results"] = results
  return out


# Methods whose result is knowingly another one for a loss that mixes examples: their error
# is a finding, not a flag (per-device or per-example batch statistics).
NOT_THE_CONTRACT = ("fxaccum_device", "micro_grad")


def micro_batch_reference(loss_fn: Callable, params: Any, micro: list[Any]) -> Any:
  """The mean of ``jax.grad`` over the global micro-batches: fxaccum's contract."""
  grad = jax.jit(jax.grad(loss_fn))  # one program for the k micro-batches (same shapes)
  grads = [grad(params, b) for b in micro]
  return jax.tree.map(lambda *g: sum(g) / len(g), *grads)


def add_ratios(results: dict[str, dict[str, Any]], ref: dict[str, Any]) -> None:
  """Time over the large batch's and over the same-mode fxaccum method's (same k), and
  gradient-reduction bytes over the large batch's."""
  for method, by_k in results.items():
    versus = METHODS[method][1]
    if versus not in results or all("skipped" in r for r in results[versus].values()):
      versus = "fxaccum_cross_reduced" if "fxaccum_cross_reduced" in results else versus
    for k, r in by_k.items():
      if "skipped" in r:
        continue
      other = results.get(versus, {}).get(k, {})
      r["time_over_large_batch"] = ratio(r["ms_per_step"], r["large_batch_ms_same_rounds"])
      r["compared_with"] = versus
      r["time_over_fxaccum"] = ratio(r["ms_per_step"], other.get("ms_per_step"))
      r["grad_bytes_over_large_batch"] = ratio(r["grad_reduction_bytes_per_step"],
                                               ref["grad_reduction_bytes_per_step"])


def describe_device() -> str:
  """``"8 x cpu (cpu)"``: how many of which device produced a figure."""
  d = jax.devices()[0]
  return f"{jax.device_count()} x {d.device_kind} ({d.platform})"


def brief(r: dict[str, Any]) -> str:
  """One log line of a record."""
  if "skipped" in r:
    return f"SKIPPED ({r['skipped']})"
  flag = "" if r.get("err_ok", True) else "  <-- ERROR >= 1e-5"
  return (f"{r['ms_per_step']:.1f} ms/step, {r['grad_reduction_bytes_per_step'] / 2**20:.2f} "
          f"MiB grad-reduced, {r['data_reductions_in_loops']} in loops, temp "
          f"{(r['temp_bytes'] or 0) / 2**20:.2f} MiB, err {r['grad_rel_err']:.1e}{flag}")


# -------------------------------------------------------------------------- report


def _cells(by_k: dict[str, Any], ks: list[int], fmt: Callable[[dict[str, Any]], str]) -> str:
  return " / ".join("skip" if "skipped" in by_k[str(k)] else fmt(by_k[str(k)]) for k in ks)


def markdown(setup: dict[str, Any], ks: list[int]) -> str:
  """The setup's reference line, one row per method (columns over k), and the skips."""
  ref = setup["large_batch"]
  mib = 2**20
  kk = ks[-1]
  floor = setup.get("grad_only", {})
  floor = (f"; gradients alone (no optimizer): large batch "
           f"{floor['large_batch']['ms_per_step']:.1f} ms, fxaccum k={kk} "
           f"{floor[f'fxaccum_k{kk}']['ms_per_step']:.1f} ms" if len(floor) == 2 else "")
  lines = [f"Large batch (the reference): {ref['ms_per_step']:.1f} ms per step, "
           f"{ref['grad_reduction_bytes_per_step'] / mib:.2f} MiB gradient reduction, temp "
           f"{_fmt(ratio(ref['temp_bytes'], mib))} MiB (peak with the state donated: "
           f"{_fmt(ratio(ref.get('donated_peak_bytes'), mib))} MiB){floor}. "
           f"On {setup['device']}.", ""]
  lines += md_header(["method", "mode", *[f"ms k={k}" for k in ks], f"÷ large k={kk}",
                      f"÷ fxaccum k={kk}", "grad-reduced ÷ large, k=" + "/".join(map(str, ks)),
                      f"data reductions in loops k={kk}", "temp MiB, k=" + "/".join(map(str, ks)),
                      f"peak MiB k={kk}, state donated", "max grad err"], numeric_from=2)
  skipped = []
  for method, by_k in setup["results"].items():
    run = [r for r in by_k.values() if "skipped" not in r]
    if not run:
      reason = next(iter(by_k.values()))["skipped"].replace("](", "] (")  # not a link
      skipped.append(f"- `{method}` skipped: {reason}")
      lines.append(md_row([method, METHODS[method][0], "skipped", *[""] * (len(ks) + 6)]))
      continue
    last = by_k[str(kk)]
    worst = max(r["grad_rel_err"] for r in run)
    err = f"{worst:.1e}" if worst < ERR_LIMIT else f"**{worst:.1e}** (≥ 1e-5)"
    lines.append(md_row([
        method, METHODS[method][0],
        *["skip" if "skipped" in by_k[str(k)] else f"{by_k[str(k)]['ms_per_step']:.1f}"
          for k in ks],
        _fmt(last.get("time_over_large_batch")), _fmt(last.get("time_over_fxaccum")),
        _cells(by_k, ks, lambda r: _fmt(r["grad_bytes_over_large_batch"])),
        last.get("data_reductions_in_loops", "skip"),
        _cells(by_k, ks, lambda r: _fmt(ratio(r["temp_bytes"], mib))),
        _fmt(ratio(last.get("donated_peak_bytes"), mib)), err]))
  return "\n".join(lines + ([""] + skipped if skipped else []))


def _fmt(x: float | None) -> str:
  return "-" if x is None else f"{x:.2f}"


def flags(setups: dict[str, Any]) -> list[str]:
  """Every record whose gradient error is >= ERR_LIMIT (fxaccum's must not be)."""
  return [f"{name}/{method}/k={k}: grad_rel_err {r['grad_rel_err']:.2e} "
          f"(worst leaf {r['grad_rel_err_worst_leaf']})"
          for name, s in setups.items() for method, by_k in s.get("results", {}).items()
          for k, r in by_k.items() if "skipped" not in r and not r["err_ok"]]


def skips(setups: dict[str, Any]) -> list[str]:
  """Every skipped setup or (method, k), with its reason."""
  out = [f"{name}: {s['skipped']}" for name, s in setups.items() if "skipped" in s]
  for name, s in setups.items():
    for method, by_k in s.get("results", {}).items():
      reasons = {r["skipped"] for r in by_k.values() if "skipped" in r}
      ks = [k for k, r in by_k.items() if "skipped" in r]
      out += [f"{name}/{method} k={','.join(ks)}: {reason}" for reason in sorted(reasons)]
  return out


NOTES = {
    "ms_per_step": "median wall time of one optimizer step (in-step: 1 jitted call on the "
                   "whole batch; cross-step: k calls of one micro-batch each), after 1 warm-up",
    "time_over_fxaccum": "ms_per_step over that of the fxaccum method of the same mode and k "
                         "(compared_with: fxaccum for in-step, fxaccum_cross for cross-step, "
                         "fxaccum_cross_reduced where deferred sync cannot run)",
    "grad_reduction_bytes_per_step": "bytes of all-reduce / reduce-scatter over the data axis "
                                     "per optimizer step and device (a reduce-scatter counts "
                                     "its unscattered size), from fxaccum.diagnostics of one "
                                     "call: calls x (top level + loops, with trip counts) + "
                                     "cond_runs x (conditional branches)",
    "other_reduction_bytes_per_step": "the same over other axes (the model axis: tensor-"
                                      "parallel activations) and unattributed reductions",
    "data_reductions_in_loops": "data-axis reduction instructions inside while loops (one call)",
    "big_data_reductions_outside_cond": f"data-axis reductions of more than {BIG} bytes at top "
                                        "level or in loops of one call (run on every call)",
    "temp_bytes": "compiled temp memory per device (memory_analysis) of one jitted call",
    "donated_peak_bytes": "at the largest k: temp + arguments + outputs - aliased bytes per "
                          "device of the call compiled with its state donated "
                          "(donate_argnums=0); state_bytes: that state per device",
    "grad_rel_err": f"the gradient Adam was handed (its first moment / (1 - b1) after the "
                    f"step) vs the large batch's: max over leaves of max|a-b| / max|b|, each "
                    f"leaf's scale floored at {REL_FLOOR} x the tree's max|b| (an attention key "
                    "bias has an exact gradient of 0: rounding noise only); *_raw unfloored; "
                    f"err_ok: < {ERR_LIMIT}",
    "grad_only": "the gradient computation alone (no optimizer) at the largest k: the compute "
                 "floor that accumulation cannot beat",
}


def compare(before: dict[str, Any], after: dict[str, Any]) -> str:
  """Markdown: fxaccum's time over plain scan's and over MultiSteps' (its own mode's
  fxaccum method vs MultiSteps' cross-step time), per setup and k, in two suite runs."""
  lines = md_header(["setup", "k", "fxaccum ÷ plain scan, before", "after",
                     "fxaccum ÷ MultiSteps, before", "after", "cross-step ÷ MultiSteps, "
                     "before", "after"], numeric_from=1)
  for name, setup in after["setups"].items():
    old = before["setups"].get(name, {}).get("results")
    if old is None or "results" not in setup:
      continue
    for k in map(str, after["ks"]):
      def cell(results, method, versus, k=k):
        a, b = results.get(method, {}).get(k, {}), results.get(versus, {}).get(k, {})
        return _fmt(ratio(a.get("ms_per_step"), b.get("ms_per_step")))
      cross = "fxaccum_cross_reduced" if "fxaccum_cross_reduced" in setup["results"] else (
          "fxaccum_cross")
      lines.append(md_row([name, k, *(cell(r, m, v) for m, v in (
          ("fxaccum", "plain_scan"), ("fxaccum", "multisteps"), (cross, "multisteps"))
          for r in (old, setup["results"]))]))
  return "\n".join(lines)


def hlo_digests(names: list[str], ks: list[int]) -> dict[str, str]:
  """A digest of fxaccum's compiled in-step program per setup and k, source locations and
  instruction numbering left out: equal digests in two checkouts mean the same program."""
  def normalized(text: str) -> str:
    text = re.sub(r"metadata=\{[^}]*\}|, stack_frame_id=\d+|fxaccum_path_\d+", "", text)
    text = re.sub(r"\.\d+\b", "", text)
    text = re.sub(r"region_\d+", "region", text)  # computations' numbering, not content
    tables = ("FileNames", "FunctionNames", "FileLocations", "StackFrames")
    return "\n".join(line for line in text.splitlines()
                     if not re.match(r"^\s*\d+ ", line) and not any(t in line for t in tables))

  out = {}
  for name in names:
    layout_name, model = name.split("/")
    mesh = layout_mesh(layout_name)
    with jax.set_mesh(mesh):
      setup = model_setup(model, quick=False)
      specs = layout_specs(layout_name, setup["params"], mesh)
      params = jax.tree.map(lambda x, s, m=mesh: jax.device_put(x, NamedSharding(m, s)),
                            setup["params"], specs)
      batch = jax.device_put(setup["batch"], NamedSharding(mesh, P(DATA)))
      for k in ks:
        text = jax.jit(fxaccum.value_and_grad(setup["loss"], micro_batches=k)).lower(
            params, batch).compile().as_text()
        out[f"{name} k={k}"] = hashlib.sha1(normalized(text).encode()).hexdigest()[:12]
  return out


def main() -> None:
  """Parses the flags, runs every setup, writes the JSON, tables and plots."""
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true",
                      help="tiny sizes, 1 repeat; outputs in a temp folder unless given")
  parser.add_argument("--out", default=None,
                      help="JSON path (default benchmarks/results/suite.json)")
  parser.add_argument("--images", default=None, help="PNG folder (default docs/images)")
  parser.add_argument("--repeats", type=int, default=None,
                      help="timed runs per mlp method (default 5; a study's own default)")
  parser.add_argument("--lm-repeats", type=int, default=3, help="timed runs per lm method")
  parser.add_argument("--ks", default=None,
                      help="micro-batches per optimizer step (default 1,2,4,8)")
  parser.add_argument("--lm-seq", type=int, default=None,
                      help="the LM's sequence length (default 256; issue 22 measured 64)")
  parser.add_argument("--mlp-width", type=int, default=None,
                      help="the MLP's hidden width (default 1024; issue 22's bench B: 512)")
  parser.add_argument("--setups", default=None,
                      help=f"comma-separated subset of {','.join(SETUPS)},pipeline "
                           f"(default: all; --quick: {','.join(QUICK_SETUPS)})")
  parser.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"), default=None,
                      help="print fxaccum's time ratios of two suite JSONs; run nothing")
  parser.add_argument("--hlo-digest", action="store_true",
                      help="print a digest of fxaccum's compiled in-step program per setup "
                           "and k (compare two checkouts); run nothing else")
  study = parser.add_argument_group("studies (--study NAME)")
  study.add_argument("--study", choices=STUDIES, default=None,
                     help="run this measurement instead of the suite")
  study.add_argument("--models", default=None, help="fsdp: the models (default all)")
  study.add_argument("--layers", default="8,16", help="fsdp: layer counts")
  study.add_argument("--no-time", action="store_true",
                     help="fsdp, contrastive: memory and errors only")
  study.add_argument("--render", metavar="JSON", help="fsdp: print a saved run's tables")
  study.add_argument("--budgets-mib", default="6,4,2.5", help="plan: budgets per device")
  study.add_argument("--batch", type=int, default=64, help="plan: global batch (sequences)")
  study.add_argument("--seq", type=int, default=32, help="plan: tokens per sequence")
  study.add_argument("--mlp-ks", default="1,2,4,8", help="plan: the k of the MLP temp table")
  study.add_argument("--rounds", type=int, default=None, help="one-device: timed rounds")
  study.add_argument("--calls", type=int, default=None, help="one-device: calls per round")
  study.add_argument("--profile", action="store_true", help="one-device: time per kernel")
  study.add_argument("--variants", default=None, help="one-device: variants (default all)")
  study.add_argument("--rows", type=int, default=32,
                     help="crossstep-memory: rows per call")
  study.add_argument("--child", help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.study:
    import importlib

    importlib.import_module(STUDIES[args.study]).study(args)
    return
  args.ks = args.ks or "1,2,4,8"
  args.repeats = args.repeats or 5
  if args.hlo_digest:
    ks = [int(k) for k in args.ks.split(",") if k]
    names = args.setups.split(",") if args.setups else list(SETUPS)
    for key, digest in hlo_digests(names, ks).items():
      print(f"{key}: {digest}")
    return
  if args.compare:
    before, after = (json.loads(open(path).read()) for path in args.compare)
    print(compare(before, after))
    return
  scratch = os.path.join(tempfile.gettempdir(), "fxaccum-bench-quick")
  out_path = args.out or (os.path.join(scratch, "suite.json") if args.quick
                          else "benchmarks/results/suite.json")
  images = args.images or (scratch if args.quick else "docs/images")
  ks = [int(k) for k in args.ks.split(",") if k]
  started = time.perf_counter()
  log = logger(started)
  log(f"devices: {describe_device()}")
  setups: dict[str, Any] = {}
  names = (args.setups.split(",") if args.setups else QUICK_SETUPS if args.quick
           else (*SETUPS, PIPELINE))
  pipeline_rows = None
  for name in names:
    if name == PIPELINE:
      pipeline_rows = bench_pipeline.run(args.quick, ks, 1 if args.quick else args.repeats, log)
      continue
    if name not in SETUPS:
      raise SystemExit(f"unknown setup {name!r}; choose from {(*SETUPS, PIPELINE)}")
    repeats = 1 if args.quick else args.lm_repeats if name.endswith("/lm") else args.repeats
    setups[name] = run_setup(name, args.quick, ks, repeats, log, args.lm_seq, args.mlp_width)

  tables = {name: markdown(s, ks) for name, s in setups.items() if "skipped" not in s}
  if pipeline_rows and "skipped" not in pipeline_rows:
    tables[PIPELINE] = bench_pipeline.markdown(pipeline_rows)
  payload = {
      "benchmark": "suite",
      "command": " ".join(["python", "benchmarks/run.py", *sys.argv[1:]]),
      "quick": args.quick,
      "ks": ks,
      "optimizer": f"optax.adam({LR})",
      "device": describe_device(),
      "optax_microbatching_shim": optax_version_bug(),
      **environment(),
      "setups": setups,
      "pipeline": pipeline_rows,
      "flags": flags(setups),
      "skipped": skips(setups),
      "tables_markdown": tables,
      "notes": NOTES,
  }
  import plots  # matplotlib only after the measurements

  payload["images"] = plots.plot_all(payload, images)
  payload["total_seconds"] = round(time.perf_counter() - started, 1)
  write_json(out_path, payload)
  for name, table in tables.items():
    print(f"\n### {name}\n\n{table}")
  print("\nskipped:\n" + "\n".join(f"- {s}" for s in payload["skipped"]))
  print("\nflagged (grad error >= 1e-5):\n" + "\n".join(f"- {s}" for s in payload["flags"]))
  print(f"\nwrote {out_path} and {', '.join(payload['images'])}; total "
        f"{payload['total_seconds']} s on {describe_device()}")


if __name__ == "__main__":
  main()
