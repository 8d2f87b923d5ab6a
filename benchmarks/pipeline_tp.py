"""Tensor-parallel pipeline stages on Auto and Explicit meshes.

Run from the repository root::

  python benchmarks/pipeline_tp.py          # about a minute on 2 cores; a markdown table

Mesh (data 2, stage 2, model 2) on 8 simulated CPU devices; 2 stages of a residual MLP
512 wide (hidden 2048), its weights column- then row-parallel over ``model``; batch 64,
sequence 32, k = 8; ``jax.jit(jax.value_and_grad(loss))``. Per schedule and axis type: ms
per step (median, interleaved), all-gathers over ``model`` per step and their bytes,
compiled temp memory, and the gradient's max relative error against the same stages on
one device. On an ``Explicit`` mesh GPipe and the circular schedule run their vjp in a
region of its own, recomputing the forward scan (JAX 0.10.2 cannot differentiate through
a partially manual region that keeps ``model`` sharded); on an ``Auto`` mesh the compiler
partitions ``model`` inside the region.
"""

from __future__ import annotations

import argparse

import common  # noqa: F401 - first: sets XLA_FLAGS before JAX starts
import jax
import jax.numpy as jnp
import numpy as np
from common import interleaved, md_header, md_row, rel_err
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import fxaccum
from fxaccum import diagnostics

WIDTH, HIDDEN, BATCH, TOKENS, K = 512, 2048, 64, 32, 8


def row_parallel(h, w):
  """``h @ w`` with ``w`` sharded over its contracted dimension: on an Explicit mesh JAX
  needs the output sharding spelled out."""
  if jax.typeof(w).sharding.spec[0] is not None:
    return jnp.matmul(h, w, out_sharding=P(*jax.typeof(h).sharding.spec[:-1], None))
  return h @ w


def stage(p, h):
  return h + row_parallel(jnp.tanh(h @ p["w1"]), p["w2"])


def loss_fn(schedule: str):
  repeats = 2 if schedule == "circular" else 1

  def loss(stages, x):
    y = fxaccum.pipeline(stage, stages, x, micro_batches=K, schedule=schedule,
                         repeats=repeats)
    return jnp.mean(y.astype(jnp.float32) ** 2)
  return loss


def params_for(schedule: str, rng) -> dict:
  lead = (2, 2) if schedule == "circular" else (2,)  # circular: R = 2 rounds of S = 2
  return {"w1": (rng.normal(size=(*lead, WIDTH, HIDDEN)) / np.sqrt(WIDTH)).astype(np.float32),
          "w2": (rng.normal(size=(*lead, HIDDEN, WIDTH)) / np.sqrt(HIDDEN)).astype(np.float32)}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--repeats", type=int, default=5)
  args = parser.parse_args()
  rng = np.random.default_rng(0)
  x = rng.normal(size=(BATCH, TOKENS, WIDTH)).astype(np.float32)
  runs, figures = {}, {}
  for schedule in ("gpipe", "circular", "1f1b"):
    params = params_for(schedule, rng)
    flat = jax.tree.map(lambda a: a.reshape(-1, *a.shape[-2:]), params)
    with jax.default_matmul_precision("highest"):
      ref = jax.grad(lambda p: jnp.mean(_sequential(p, x) ** 2))(flat)
    lead = (None, "stage") if schedule == "circular" else ("stage",)
    specs = {"w1": P(*lead, None, "model"), "w2": P(*lead, "model", None)}
    for axis_type in (AxisType.Auto, AxisType.Explicit):
      mesh = jax.make_mesh((2, 2, 2), ("data", "stage", "model"), axis_types=(axis_type,) * 3)
      step = jax.jit(jax.value_and_grad(loss_fn(schedule)))
      with jax.set_mesh(mesh):
        placed = (jax.tree.map(lambda a, s, m=mesh: jax.device_put(a, NamedSharding(m, s)),
                               params, specs),
                  jax.device_put(x, NamedSharding(mesh, P("data"))))
        rep = diagnostics.report(step, *placed, mesh=mesh)
        _, grads = step(*placed)
      gathers = rep.select("all-gather", axes="model")
      name = f"{schedule} {axis_type.name}"
      error, _ = rel_err(jax.tree.map(lambda a: np.asarray(a).reshape(-1, *a.shape[-2:]),
                                      grads), ref)
      figures[name] = (len(gathers), sum(c.bytes * c.executions for c in gathers) / 2**20,
                       rep.memory.temp_bytes / 2**20, error)
      runs[name] = (lambda step=step, placed=placed, mesh=mesh: _timed(step, placed, mesh))
  times = interleaved(runs, args.repeats)
  print("\n".join(md_header(["schedule, mesh", "ms/step", "all-gathers over model",
                             "gathered MiB", "temp MiB", "grad rel. err"], 1)))
  for name, (count, mib, temp, error) in figures.items():
    print(md_row([name, f"{times[name][0]:.0f}", count, f"{mib:.2f}", f"{temp:.1f}",
                  f"{error:.1e}"]))


def _sequential(flat, x):
  h = x
  for s in range(flat["w1"].shape[0]):
    h = stage(jax.tree.map(lambda a, s=s: a[s], flat), h)
  return h


def _timed(step, placed, mesh):
  with jax.set_mesh(mesh):
    return jax.block_until_ready(step(*placed))


if __name__ == "__main__":
  main()
