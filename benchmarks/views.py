"""What choosing the view costs: the analysis' share of tracing, and the global-view
fallback for a loss JAX 0.10.2 cannot run per device.

Run from the repository root::

  python benchmarks/views.py          # ~1 min on 2 cores; prints two markdown tables

1. Trace + lower time of ``jax.jit(fxaccum.value_and_grad(loss, micro_batches=k))`` and of
   ``jax.jit(jax.value_and_grad(loss))`` (the large batch), for the suite's replicated MLP
   and LM (best of 3). fxaccum's analysis traces one micro-step's value and gradients with
   a symbolic number of rows.
2. A loss that closes over a traced value on an Explicit mesh (JAX 0.10.2: "Closing over
   inputs to shard_map where the input is sharded on Explicit axes is not implemented")
   runs in the global view; passed as a keyword argument instead, the same value takes
   the per-device view. ms per call of the replicated MLP at k = 8, interleaved (median
   of 5 after a warm-up), and each one's view.
"""

from __future__ import annotations

import time

import common  # noqa: F401 - first: sets XLA_FLAGS before JAX starts
import jax
import jax.numpy as jnp
from common import DATA, interleaved, layout_mesh, lm_setup, mlp_setup
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import fxaccum
from fxaccum import diagnostics


def trace_lower_ms(make_fn, *args, repeats: int = 3) -> float:
  """Best of ``repeats`` trace + lower times of ``jax.jit(make_fn())``, each a function
  built afresh (JAX caches the traces of one function object)."""
  best = float("inf")
  for _ in range(repeats):
    fn = make_fn()
    start = time.perf_counter()
    jax.jit(fn).lower(*args)
    best = min(best, time.perf_counter() - start)
  return best * 1e3


def placed(setup, mesh):
  params = jax.device_put(setup["params"], NamedSharding(mesh, P()))
  return params, jax.device_put(setup["batch"], NamedSharding(mesh, P(DATA)))


def trace_table() -> str:
  mesh = layout_mesh("replicated")
  rows = ["| model | large batch | fxaccum k=1 | fxaccum k=8 |", "|---|---:|---:|---:|"]
  with jax.set_mesh(mesh):
    for name, make in (("MLP", mlp_setup), ("LM", lm_setup)):
      setup = make(False)
      params, batch = placed(setup, mesh)
      def fresh(loss=setup["loss"]):  # a new function object: no cached trace
        return lambda p, b: loss(p, b)
      cells = [trace_lower_ms(lambda: jax.value_and_grad(fresh()), params, batch)]
      cells += [trace_lower_ms(lambda k=k: fxaccum.value_and_grad(fresh(), micro_batches=k),
                               params, batch) for k in (1, 8)]
      rows.append(f"| {name} | " + " | ".join(f"{c:.0f} ms" for c in cells) + " |")
  return "\n".join(rows)


def closure_table(k: int = 8) -> str:
  mesh = layout_mesh("replicated")  # Explicit axes
  setup = mlp_setup(False)
  loss = setup["loss"]

  def scaled(params, batch, *, scale):
    return scale * loss(params, batch)

  @jax.jit
  def closing_over(params, batch):
    scale = 1.0 + 0.0 * jnp.sum(params["params"]["Dense_0"]["bias"])  # traced
    grad_fn = fxaccum.value_and_grad(lambda p, b: scaled(p, b, scale=scale), micro_batches=k)
    return grad_fn(params, batch)

  @jax.jit
  def as_argument(params, batch):
    scale = 1.0 + 0.0 * jnp.sum(params["params"]["Dense_0"]["bias"])
    return fxaccum.value_and_grad(scaled, micro_batches=k)(params, batch, scale=scale)

  rows = ["| the traced value is | view | ms per call |", "|---|---|---:|"]
  with jax.set_mesh(mesh):
    params, batch = placed(setup, mesh)
    runs = {"closed over": lambda: closing_over(params, batch),
            "a keyword argument": lambda: as_argument(params, batch)}
    timed = interleaved(runs, repeats=5, warmups=2)
    for name, fn in (("closed over", closing_over), ("a keyword argument", as_argument)):
      (path,) = diagnostics.paths(fn, params, batch)
      rows.append(f"| {name} | {path.view} | {timed[name][0]:.0f} |")
  return "\n".join(rows)


def main() -> None:
  print(f"devices: {jax.device_count()} x {jax.devices()[0].platform}\n")
  print("Trace + lower (best of 3):\n")
  print(trace_table())
  print("\nA traced value on an Explicit mesh, replicated MLP, k = 8:\n")
  print(closure_table())


if __name__ == "__main__":
  main()
