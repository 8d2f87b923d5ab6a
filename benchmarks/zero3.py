"""FSDP gathering: ``fsdp_gather="per_step"`` (gathered once, hoisted above the loop) against
``"per_micro_batch"`` (ZeRO-3: gathered where used, again in the backward pass).

Run from the repository root::

  python benchmarks/zero3.py                 # about 3 minutes on 2 cores; a markdown table
  python benchmarks/zero3.py --layers 8,16,32 --k 8

For a deep MLP of L 512-wide layers (f32), every kernel and bias FSDP-sharded over 8
devices along its last dimension, batch 256, k micro-batches, written two ways: unrolled
(a Python loop of ``nn.Dense``) and scanned (``nn.scan`` over stacked layers, as large
flax models write them). Per device, from the compiled program: peak bytes (temp +
arguments + outputs - aliased), temp bytes, all-gather bytes per step; ms per step
(median of 5, the two gathers interleaved); the largest gradient error against
``jax.value_and_grad`` on the whole batch.
"""

from __future__ import annotations

import argparse

import common  # noqa: F401 - first: sets XLA_FLAGS before JAX starts
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from common import fsdp_spec, interleaved, md_header, md_row
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import fxaccum
from fxaccum import diagnostics

WIDTH, BATCH = 512, 256
MiB = 2 ** 20


class Unrolled(nn.Module):
  layers: int

  @nn.compact
  def __call__(self, x):
    for _ in range(self.layers):
      x = nn.gelu(nn.Dense(WIDTH)(x))
    return nn.Dense(8)(x)


class Block(nn.Module):
  @nn.compact
  def __call__(self, x, _):
    return nn.gelu(nn.Dense(WIDTH)(x)), None


class Scanned(nn.Module):
  layers: int

  @nn.compact
  def __call__(self, x):
    x, _ = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True},
                   length=self.layers)()(x, None)
    return nn.Dense(8)(x)


def fsdp(a, mesh):
  """Sharded over `data` along the last dimension it divides (replicated if none)."""
  return jax.device_put(a, NamedSharding(mesh, fsdp_spec(a.shape, mesh.shape["data"],
                                                         along="last")))


def row(model, layers, k, mesh):
  rng = np.random.default_rng(0)
  x = rng.normal(size=(BATCH, WIDTH)).astype(np.float32)
  y = rng.normal(size=(BATCH, 8)).astype(np.float32)
  params = jax.jit(model.init)(jax.random.key(0), x[:1])

  def loss(p, b):
    return jnp.mean((model.apply(p, b["x"]) - b["y"]) ** 2)

  ref = jax.jit(jax.grad(loss))(params, {"x": x, "y": y})
  args = (jax.tree.map(lambda a: fsdp(a, mesh), params),
          jax.device_put({"x": x, "y": y}, NamedSharding(mesh, P("data"))))
  runs, figures = {}, {}
  for gather in ("per_step", "per_micro_batch"):
    step = jax.jit(fxaccum.value_and_grad(loss, micro_batches=k, fsdp_gather=gather))
    compiled = step.lower(*args).compile()
    m = compiled.memory_analysis()
    peak = (m.temp_size_in_bytes + m.argument_size_in_bytes + m.output_size_in_bytes
            - m.alias_size_in_bytes)
    rep = diagnostics.from_compiled(compiled, mesh=mesh)
    _, grads = compiled(*args)
    err = max(float(jnp.max(jnp.abs(a - b)) / (jnp.max(jnp.abs(b)) + 1e-30))
              for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref), strict=True))
    figures[gather] = (peak, m.temp_size_in_bytes, rep.bytes_per_call("all-gather"), err)
    runs[gather] = lambda compiled=compiled: compiled(*args)
  times = interleaved(runs, repeats=5)
  param_mib = sum(a.nbytes for a in jax.tree.leaves(params)) / MiB
  lines = []
  for gather, (peak, temp, gathered, err) in figures.items():
    lines.append(md_row([
        type(model).__name__.lower(), layers, f"{param_mib:.1f}", gather, f"{peak / MiB:.1f}",
        f"{temp / MiB:.1f}", f"{gathered / MiB:.1f}", f"{times[gather][0]:.0f}",
        f"{err:.1e}"]))
  return lines


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--layers", default="8,16,32")
  parser.add_argument("--k", type=int, default=8)
  args = parser.parse_args()
  mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
  lines = md_header(["model", "layers", "params MiB", "fsdp_gather", "peak MiB/device",
                     "temp MiB", "gathered MiB/step", "ms/step", "max rel err"], 1)
  with jax.set_mesh(mesh):
    for make in (Unrolled, Scanned):
      for layers in (int(n) for n in args.layers.split(",")):
        lines += row(make(layers), layers, args.k, mesh)
        print("\n".join(lines[-2:]), flush=True)
  print(f"\nk = {args.k}, batch {BATCH}, width {WIDTH}, {jax.device_count()} devices "
        f"({jax.devices()[0].platform})\n")
  print("\n".join(lines))


if __name__ == "__main__":
  main()
