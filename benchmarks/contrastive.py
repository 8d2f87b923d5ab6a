"""Large-batch contrastive losses at micro-batch memory: ``fxaccum.micro_batched``.

examples/contrastive.py's two-tower CLIP (residual MLP towers, layers run by ``lax.scan``;
the CLIP loss with a learnable temperature), one ``jax.value_and_grad`` step on 8 devices
with the batch sharded over ``data``, per method and k: the towers wrapped in
``fxaccum.micro_batched``, the mean of the micro-batch losses
(``fxaccum.value_and_grad(clip_loss, micro_batches=k)``: another loss, shown for its
error) and a ``grad_cached``-style step (``lax.scan`` + ``jax.checkpoint`` over contiguous
chunks), against the large batch: the gradient's max relative error, the compiled peak per
device (temp + arguments + outputs - aliased), data-axis reductions inside loops, data
movements (all-gathers, permutes, all-to-alls) and the median ms per step.

  python benchmarks/run.py --study contrastive           # batch 2048, 32 layers of width 128
  python benchmarks/run.py --study contrastive --quick   # batch 256, 4 layers of width 32
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import tempfile
import time

from common import environment, md_header, md_row, write_json

# examples/contrastive.py (towers, loss, steps), by path: this module has its name
_SPEC = importlib.util.spec_from_file_location("contrastive_example", os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "..", "examples", "contrastive.py"))
assert _SPEC is not None and _SPEC.loader is not None
example = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(example)

FULL = {"batch": 2048, "layers": 32, "width": 128}
QUICK = {"batch": 256, "layers": 4, "width": 32}


def markdown(result: dict) -> str:
  """The table of docs/notes/contrastive.md."""
  large = next(r for r in result["rows"] if r["method"] == "large batch")
  lines = md_header(["method", "k", "grad. error", "peak MiB", "x large", "loop reductions",
                     "moves", "ms", "x large"], 1)
  for r in result["rows"]:
    times = ([f"{r['ms']:.0f}", f"{r['ms'] / large['ms']:.2f}"] if r["ms"] else ["", ""])
    lines.append(md_row([r["method"], r["k"] or "", f"{r['grad_error']:.1e}",
                         f"{r['peak_mib']:.1f}", f"{r['peak_mib'] / large['peak_mib']:.2f}",
                         r["loop_reductions"], r["moves"], *times]))
  return "\n".join(lines)


def study(args: argparse.Namespace) -> None:
  """``run.py --study contrastive``: ``--quick``, ``--repeats`` (3; quick 1), ``--no-time``
  (memory and errors only), ``--ks`` (4,8), ``--out`` (benchmarks/results/contrastive.json)."""
  sizes = QUICK if args.quick else FULL
  out = args.out or (os.path.join(tempfile.mkdtemp(), "contrastive.json") if args.quick
                     else "benchmarks/results/contrastive.json")
  ks = [int(k) for k in (args.ks or "4,8").split(",")]
  repeats = 0 if args.no_time else args.repeats or (1 if args.quick else 3)
  start = time.perf_counter()
  result = example.measure(**sizes, ks=ks, repeats=repeats)
  print(f"CLIP, two residual towers ({sizes['layers']} layers of width {sizes['width']}), "
        f"batch {sizes['batch']} over {result['devices']} x {result['device']}"
        + (f", median of {repeats} steps\n" if repeats else "\n"))
  print(markdown(result))
  write_json(out, {"environment": environment(), "command": " ".join(sys.argv),
                   "result": result})
  print(f"\nwrote {out} in {time.perf_counter() - start:.0f} s")
