"""Trace + lower time of fxaccum's in-step step against plain ``jit`` + ``lax.scan``'s.

A study of ``benchmarks/run.py``; run from the repository root::

  python benchmarks/run.py --study tracing            # 12-layer LM, about 1 minute
  python benchmarks/run.py --study tracing --quick    # 2 layers (the test's run)

The suite's LM (``common.LM``: causal transformer blocks, ``--layers`` 12, width 128,
sequence 64, vocabulary 256, batch 64) on the replicated layout (``("data",)`` over every
device, Explicit), k = 4 (``--ks``): seconds to ``jax.jit(step).lower(params, batch)``
(tracing, fxaccum's analysis, lowering to StableHLO; not XLA's compile) of ``--repeats``
(3) fresh step functions each, the two steps in turn (plain, fxaccum, plain, ...): the
fastest of each, the median of the ratios pair by pair (which holds where the machine's
speed drifts during the run), and how many times each traces the loss. Writes
``benchmarks/results/tracing.json`` (``--out``).
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import common  # noqa: F401 - first: sets XLA_FLAGS before JAX starts
import jax
import numpy as np
import optax
from common import LM, environment, layout_mesh, md_header, md_row, write_json
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from methods import plain_scan_value_and_grad

import fxaccum

FULL = {"layers": 12, "width": 128, "seq": 64, "vocab": 256, "batch": 64}
QUICK = {"layers": 2, "width": 32, "seq": 16, "vocab": 64, "batch": 32}


def lm_problem(layers: int, width: int, seq: int, vocab: int, batch: int, mesh: Any):
  """``(loss, params, batch)`` of the LM, placed on ``mesh`` (params replicated, the batch
  sharded over ``data``)."""
  model = LM(vocab=vocab, width=width, layers=layers, heads=4, seq=seq)
  tokens = np.random.default_rng(0).integers(0, vocab, size=(batch, seq + 1)).astype(np.int32)
  data = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
  params = jax.jit(model.init)(jax.random.key(0), data["inputs"][:1])

  def loss(params, batch):
    logits = model.apply(params, batch["inputs"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()

  return (loss, jax.device_put(params, NamedSharding(mesh, P())),
          jax.device_put(data, NamedSharding(mesh, P("data"))))


def lower_once(make_step: Callable[[Callable], Callable], loss: Callable,
               args: tuple) -> tuple[float, int]:
  """Seconds to ``jax.jit(step).lower(*args)`` of a fresh step (no trace cache), and the
  loss's traces in it."""
  count = [0]

  def counted(*a):
    count[0] += 1
    return loss(*a)

  step = make_step(counted)
  jax.clear_caches()  # as a program's first lower: nothing traced before is reused
  gc.collect()  # nor the previous lower's garbage collected in this one
  start = time.perf_counter()
  jax.jit(step).lower(*args)
  return time.perf_counter() - start, count[0]


def study(args: argparse.Namespace) -> None:
  """``run.py --study tracing``: ``--quick``, ``--ks`` (4), ``--repeats`` (3),
  ``--out``."""
  sizes = QUICK if args.quick else FULL
  k = int((args.ks or "4").split(",")[0])
  repeats = args.repeats or 3
  out = args.out or (os.path.join(tempfile.mkdtemp(), "tracing.json") if args.quick
                     else "benchmarks/results/tracing.json")
  mesh = layout_mesh("replicated")
  with jax.set_mesh(mesh):
    loss, params, batch = lm_problem(**sizes, mesh=mesh)
    methods = {"plain scan": lambda f: plain_scan_value_and_grad(f, k),
               "fxaccum": lambda f: fxaccum.value_and_grad(f, micro_batches=k)}
    runs = [{name: lower_once(make, loss, (params, batch)) for name, make in methods.items()}
            for _ in range(repeats)]  # the two in turn
  ratios = [run["fxaccum"][0] / run["plain scan"][0] for run in runs]
  rows = {name: {"seconds": min(run[name][0] for run in runs),
                 "traces": max(run[name][1] for run in runs)} for name in methods}
  lines = md_header(["step", "trace + lower s, fastest", "x plain scan, median pair",
                     "loss traces"], 1)
  for name, row in rows.items():
    ratio = 1.0 if name == "plain scan" else statistics.median(ratios)
    lines.append(md_row([name, f"{row['seconds']:.2f}", f"{ratio:.2f}", row["traces"]]))
  print(f"LM, {sizes['layers']} layers of width {sizes['width']}, k = {k}, replicated over "
        f"{jax.device_count()} devices; {repeats} lowers each, in turn (pair ratios "
        f"{min(ratios):.2f} to {max(ratios):.2f})\n")
  print("\n".join(lines))
  write_json(out, {"environment": environment(), "sizes": sizes, "k": k, "rows": rows,
                   "pair_ratios": ratios})
  print(f"\nwrote {out}")
