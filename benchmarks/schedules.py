"""Pipeline schedules: GPipe, circular and 1F1B on the same 8-layer model.

A study of ``benchmarks/run.py``; run from the repository root::

  python benchmarks/run.py --study schedules    # a few minutes on 2 cores; markdown tables
  python benchmarks/run.py --study schedules --ks 4,8 --repeats 7

The model of ``benchmarks/pipeline.py`` (an embedding, 8 residual MLP layers 256 wide, a
head, a ``Weighted`` token loss, batch 64, sequence 64) on 8 simulated CPU devices, mesh
(data 2, stage 4). ``gpipe`` and ``1f1b``: 4 stages of 2 layers. ``circular``,
``repeats=2``: 8 virtual stages of 1 layer, 2 per device (virtual stage ``v`` is layer
``v``, the same model). Per k: ms per step of ``jax.jit(jax.value_and_grad(loss))``
(median, the schedules interleaved), compiled temp memory, collective-permute bytes per
step, the bubble fraction, and the gradient's max relative error against the 8 layers on
one device.

Then the activation memory at a *fixed* micro-batch size (4 rows per data device, so the
batch grows with k): compiled temp bytes of ``jax.jit`` of the pipeline's vjp with respect
to the stage params (one 256-wide residual MLP per stage), ``x`` and the output
cotangent passed in sharded over ``data``, per schedule and k.
"""

from __future__ import annotations

import argparse

import common  # noqa: F401 - first: sets XLA_FLAGS before JAX starts
import jax
import jax.numpy as jnp
import numpy as np
from common import errors, interleaved, md_header, md_row
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from pipeline import STAGES, config, init, loss_with, sequential, stage

import fxaccum
from fxaccum import diagnostics

REPEATS = 2
SCHEDULES = ("gpipe", "circular", "1f1b")


def circular_layout(stages: dict) -> dict:
  """(S, L, ...) stage-major layers -> (R, S, 1, ...): leaf[r, s] is layer r * S + s."""
  def relaid(a):
    layers = a.reshape(-1, *a.shape[2:])  # layer g = s * L + l, in model order
    return layers.reshape(REPEATS, STAGES, 1, *a.shape[2:])
  return jax.tree.map(relaid, stages)


def compiled_step(schedule: str, k: int, params: dict, batch: dict, mesh):
  repeats = REPEATS if schedule == "circular" else 1
  lead = (None, "stage") if schedule == "circular" else ("stage",)
  loss = loss_with(lambda stages, x: fxaccum.pipeline(
      stage, stages, x, micro_batches=k, schedule=schedule, repeats=repeats))
  if schedule == "circular":
    params = {**params, "stages": circular_layout(params["stages"])}
  specs = {"embed": P(), "head": P(), "stages": {"w1": P(*lead), "w2": P(*lead)}}
  with jax.set_mesh(mesh):
    args = (jax.tree.map(lambda a, s: jax.device_put(a, NamedSharding(mesh, s)), params, specs),
            jax.device_put(batch, NamedSharding(mesh, P("data"))))
    compiled = jax.jit(jax.value_and_grad(lambda p, b: loss(p, b).value())).lower(
        *args).compile()
  return compiled, args


def study(args: argparse.Namespace) -> None:
  """``run.py --study schedules``: ``--ks`` (4,8,16,32), ``--repeats`` (5)."""
  ks = [int(k) for k in (args.ks or "4,8,16,32").split(",")]
  rounds = args.repeats or 5  # timed rounds (``repeats`` is the circular schedule's)
  cfg = config(quick=args.quick)
  params, batch = init(cfg)
  with jax.default_matmul_precision("highest"):
    ref = jax.jit(jax.grad(lambda p: loss_with(sequential)(p, batch).value()))(params)
  mesh = jax.make_mesh((jax.device_count() // STAGES, STAGES), ("data", "stage"),
                       axis_types=(AxisType.Auto,) * 2)
  lines = md_header(["k", "schedule", "ms/step", "temp MiB", "permute MiB/step", "bubble",
                     "max grad err"], 2)
  for k in ks:
    steps = {s: compiled_step(s, k, params, batch, mesh) for s in SCHEDULES}
    timed = interleaved({s: (lambda c=c, a=a: c(*a)) for s, (c, a) in steps.items()},
                        rounds)
    for schedule, (compiled, _) in steps.items():
      rep = diagnostics.from_compiled(compiled, mesh)
      grads = jax.device_get(timed[schedule][2][1])
      if schedule == "circular":  # back to the stage-major layout of the reference
        grads["stages"] = jax.tree.map(
            lambda a: a.reshape(-1, *a.shape[3:]).reshape(STAGES, -1, *a.shape[3:]),
            grads["stages"])
      err = errors("grad", grads, ref)["grad_rel_err"]
      repeats = REPEATS if schedule == "circular" else 1
      bubble = diagnostics.bubble_fraction(STAGES, k, schedule=schedule, repeats=repeats)
      lines.append(md_row([
          k, schedule + (f", repeats={repeats}" if repeats > 1 else ""),
          f"{timed[schedule][0]:.1f}", f"{rep.memory.temp_bytes / 2**20:.2f}",
          f"{rep.bytes_per_call('collective-permute') / 2**20:.2f}",
          f"{bubble:.3f}",
          f"{err:.1e}"]))
      print(lines[-1], flush=True)
  print(f"\n{cfg}, mesh (data {jax.device_count() // STAGES}, stage {STAGES}), "
        f"{jax.device_count()} x {jax.devices()[0].platform}\n")
  print("\n".join(lines))
  sizes = {"width": cfg["width"], "seq": cfg["seq"]} if args.quick else {}
  if len(ks) > 1:  # memory against k needs two k at least
    print("\n" + memory_table(ks, mesh, **sizes))
    print("\n" + growth_table(ks, mesh, **sizes))


def mlp_stages(rng, width: int) -> dict:
  """The params of one residual MLP ``width`` wide per stage (``stage_fn``), stage-major."""
  return {"w1": rng.normal(size=(STAGES, width, 4 * width)).astype(np.float32) / 16,
          "w2": rng.normal(size=(STAGES, 4 * width, width)).astype(np.float32) / 32}


def stage_fn(p, h):
  return h + jnp.tanh(h @ p["w1"]) @ p["w2"]


def memory_table(ks: list[int], mesh, rows: int = 4, width: int = 256, seq: int = 64) -> str:
  """Temp MiB of the vjp with respect to the stage params at ``rows`` rows per
  micro-batch per data device."""
  rng = np.random.default_rng(0)
  params = mlp_stages(rng, width)

  data = mesh.shape["data"]
  lines = md_header(["schedule", *(f"temp MiB k={k}" for k in ks), f"k={ks[-1]} ÷ k={ks[0]}"],
                    1)
  for schedule in ("gpipe", "1f1b"):
    temps = []
    for k in ks:
      x = rng.normal(size=(data * k * rows, seq, width)).astype(np.float32)

      def vjp(p, x, dy, k=k, schedule=schedule):
        return jax.vjp(lambda p: fxaccum.pipeline(stage_fn, p, x, micro_batches=k,
                                                  schedule=schedule), p)[1](dy)[0]

      with jax.set_mesh(mesh):
        args = (jax.device_put(params, NamedSharding(mesh, P("stage"))),
                *jax.device_put((x, x), NamedSharding(mesh, P("data"))))
        compiled = jax.jit(vjp).lower(*args).compile()
      temps.append(compiled.memory_analysis().temp_size_in_bytes / 2**20)
    lines.append(md_row([schedule, *(f"{t:.1f}" for t in temps), f"{temps[-1] / temps[0]:.2f}"]))
  return "\n".join(lines)


def growth_table(ks: list[int], mesh, rows: int = 4, width: int = 256, seq: int = 64) -> str:
  """Argument + temp bytes per device of the vjp with respect to the stage params and
  ``x``, ``x`` and the output cotangent passed in typed ``P(("data", "stage"))`` on an
  ``Explicit`` mesh like ``mesh`` (streamed: 1F1B streams only an ``x`` known to be
  sharded so), at ``rows`` rows per micro-batch per data device; the growth per extra
  micro-batch in units of one micro-batch's activations on a data device."""
  mesh = jax.make_mesh(tuple(mesh.shape.values()), mesh.axis_names,
                       axis_types=(AxisType.Explicit,) * len(mesh.axis_names))
  rng = np.random.default_rng(0)
  params = mlp_stages(rng, width)

  data = mesh.shape["data"]
  activation = rows * seq * width * 4  # one micro-batch's activations per data device
  lines = md_header(["schedule", *(f"MiB k={k}" for k in ks),
                     f"growth per micro-batch, k={ks[0]}..{ks[-1]}"], 1)
  for schedule in ("gpipe", "1f1b"):
    totals = []
    for k in ks:
      x = rng.normal(size=(data * k * rows, seq, width)).astype(np.float32)

      def vjp(p, x, dy, k=k, schedule=schedule):
        return jax.vjp(lambda p, x: fxaccum.pipeline(stage_fn, p, x, micro_batches=k,
                                                     schedule=schedule), p, x)[1](dy)

      with jax.set_mesh(mesh):
        args = (jax.device_put(params, NamedSharding(mesh, P("stage"))),
                *jax.device_put((x, x), NamedSharding(mesh, P(("data", "stage")))))
        memory = jax.jit(vjp).lower(*args).compile().memory_analysis()
      totals.append(memory.argument_size_in_bytes + memory.temp_size_in_bytes)
    growth = (totals[-1] - totals[0]) / (ks[-1] - ks[0]) / activation
    lines.append(md_row([schedule, *(f"{t / 2**20:.1f}" for t in totals), f"{growth:.2f}"]))
  return "\n".join(lines)

