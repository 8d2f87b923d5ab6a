"""Choosing k: ``fxaccum.plan_micro_batches`` on examples/train_lm.py's model at three budgets.

A study of ``benchmarks/run.py``; run from the repository root::

  python benchmarks/run.py --study plan        # about 40 s on 2 cores; prints markdown tables
  python benchmarks/run.py --study plan --budgets-mib 6,4,2.5 --batch 64 --seq 32

The model, loss and train step are examples/train_lm.py's (``TinyLM``, a ``Weighted`` token
cross-entropy, ``fxaccum.value_and_grad`` + adam, params and optimizer state donated),
imported from it; the batch is sharded over all devices on a ``("data",)`` mesh. For each
budget (tightest first) the planner gets the step's arguments as ``jax.ShapeDtypeStruct``s
with their shardings, so nothing is allocated, and compiles k = 1, 2, 4, ... (the divisors
of the rows per device) until one fits. JAX's caches are cleared before each plan, so each
plan's compile times are those of a fresh process. Figures per device, from
``compiled.memory_analysis()``: peak = temp + arguments + outputs - aliased.

Where the device reports memory statistics (GPU, TPU; CPU does not), the chosen step is run
once on real arrays and the device's ``memory_stats()["peak_bytes_in_use"]`` is printed
beside the predicted peak. That figure is the process's high-water mark since it started
(arrays made before the step included, e.g. the params' initialization), which is why the
budgets run tightest (smallest step) first: each measurement is at least the step's own.

Last, why the planner never bisects: the compiled temp memory of a small MLP (32 -> 256 ->
256 -> 1, tanh, adam, batch 512 over the devices) at k = 1, 2, 4, 8 is not monotone in k.

Writes ``benchmarks/results/plan.json`` (``--out``).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import common  # noqa: F401 - first: sets XLA_FLAGS before JAX starts
import jax
import jax.numpy as jnp
import numpy as np
import optax
from common import environment, md_header, md_row, write_json
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import fxaccum

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
import train_lm  # noqa: E402 - examples/train_lm.py: the model, loss, step and data

MiB = 2 ** 20
LR = 3e-3  # train_lm.py's default learning rate


def abstract(tree, sharding):
  """``tree``'s leaves as ShapeDtypeStructs with ``sharding``."""
  return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), tree)


def measured_peak(plan, model, tx, mesh, args) -> int | None:
  """The device's peak_bytes_in_use after one call of the chosen step on real arrays, the
  largest over the devices; None where the backend has no memory statistics (CPU)."""
  stats = jax.devices()[0].memory_stats()
  if not stats or "peak_bytes_in_use" not in stats:
    return None
  replicated, by_rows = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
  params = jax.device_put(
      model.init(jax.random.key(0), jnp.zeros((1, args.seq), jnp.int32)), replicated)
  opt_state = jax.device_put(tx.init(params), replicated)
  batch = jax.device_put(train_lm.synthetic_batch(np.random.default_rng(0), args.batch,
                                                  args.seq, model.vocab), by_rows)
  jax.block_until_ready(plan.step(params, opt_state, batch))
  return max(int(d.memory_stats()["peak_bytes_in_use"]) for d in mesh.devices.flat)


def mlp_temps(mesh, ks=(1, 2, 4, 8)) -> dict[int, int]:
  """Compiled temp bytes per device of an MLP train step against k (the batch of 512 rows
  sharded over the mesh's data axis, params replicated, adam, donated state)."""
  widths = (32, 256, 256, 1)

  def loss(params, batch):
    h = batch["x"]
    for w in params[:-1]:
      h = jnp.tanh(h @ w)
    return jnp.mean((h @ params[-1] - batch["y"]) ** 2)

  tx = optax.adam(LR)
  replicated, by_rows = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
  params = [jax.ShapeDtypeStruct(shape, jnp.float32, sharding=replicated)
            for shape in zip(widths[:-1], widths[1:], strict=True)]
  batch = {"x": jax.ShapeDtypeStruct((512, widths[0]), jnp.float32, sharding=by_rows),
           "y": jax.ShapeDtypeStruct((512, 1), jnp.float32, sharding=by_rows)}
  temps = {}
  for k in ks:
    grad_fn = fxaccum.grad(loss, micro_batches=k)

    def step(params, opt_state, batch, grad_fn=grad_fn):
      updates, opt_state = tx.update(grad_fn(params, batch), opt_state, params)
      return optax.apply_updates(params, updates), opt_state

    compiled = jax.jit(step, donate_argnums=(0, 1)).lower(
        params, jax.eval_shape(tx.init, params), batch).compile()
    temps[k] = int(compiled.memory_analysis().temp_size_in_bytes)
  return temps


def study(args: argparse.Namespace) -> None:
  """``run.py --study plan``: ``--budgets-mib`` (6,4,2.5), ``--batch`` (64), ``--seq``
  (32), ``--mlp-ks`` (1,2,4,8), ``--out`` (benchmarks/results/plan.json)."""
  out = args.out or "benchmarks/results/plan.json"
  budgets = sorted(int(float(b) * MiB) for b in args.budgets_mib.split(","))

  model, tx = train_lm.TinyLM(), optax.adam(LR)
  loss_fn = train_lm.token_loss(model)
  mesh = train_lm.data_mesh()

  def make_step(k):
    return jax.jit(train_lm.train_step_fn(loss_fn, tx, k), donate_argnums=(0, 1))

  replicated, by_rows = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
  params = abstract(jax.eval_shape(model.init, jax.random.key(0),
                                   jnp.zeros((1, args.seq), jnp.int32)), replicated)
  example = (params, abstract(jax.eval_shape(tx.init, params), replicated),
             abstract(jax.eval_shape(lambda: train_lm.synthetic_batch(
                 np.random.default_rng(0), args.batch, args.seq, model.vocab)), by_rows))

  device = jax.devices()[0]
  print(f"examples/train_lm.py's TinyLM, batch {args.batch} x {args.seq} tokens over "
        f"{jax.device_count()} x {device.device_kind} ({device.platform}), adam, donated "
        "params and optimizer state\n")
  results = []
  with jax.set_mesh(mesh):
    for budget in budgets:
      jax.clear_caches()
      start = time.perf_counter()
      plan = fxaccum.plan_micro_batches(make_step, *example, budget_bytes=budget,
                                        batch_argnums=2, progress=False)
      seconds = time.perf_counter() - start
      results.append({
          "budget_bytes": budget, "micro_batches": plan.micro_batches,
          "planner_seconds": seconds,
          "table": [row._asdict() for row in plan.table],
          "measured_peak_bytes": measured_peak(plan, model, tx, mesh, args),
      })
    temps = mlp_temps(mesh, [int(k) for k in args.mlp_ks.split(",")])

  lines = md_header(["budget (MiB)", "k", "peak (MiB)", "temp (MiB)", "compile (s)", "fits"], 0)
  for result in results:
    for row in result["table"]:
      lines.append(md_row([f"{result['budget_bytes'] / MiB:.2f}", row["micro_batches"],
                           f"{row['peak_bytes'] / MiB:.2f}", f"{row['temp_bytes'] / MiB:.2f}",
                           f"{row['compile_seconds']:.1f}", "yes" if row["fits"] else "no"]))
  lines += ["", *md_header(["budget (MiB)", "chosen k", "compiles", "planner (s)",
                            "predicted peak (MiB)", "measured peak (MiB)"], 1)]
  for result in results:
    measured = result["measured_peak_bytes"]
    lines.append(md_row([
        f"{result['budget_bytes'] / MiB:.2f}", result["micro_batches"], len(result["table"]),
        f"{result['planner_seconds']:.1f}", f"{result['table'][-1]['peak_bytes'] / MiB:.2f}",
        "n/a (no memory_stats())" if measured is None else f"{measured / MiB:.2f}"]))
  lines += ["", "Compiled temp memory of the 32-256-256-1 MLP train step (adam, batch 512) "
            "against k:", "", *md_header(["k", *temps], 1),
            md_row(["temp (MiB)", *(f"{t / MiB:.3f}" for t in temps.values())])]
  print("\n".join(lines))
  write_json(out, {"environment": environment(), "batch": args.batch, "seq": args.seq,
                   "results": results, "mlp_temp_bytes": temps})
  print(f"\nwrote {out}")
