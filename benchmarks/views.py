"""What choosing the view costs: the analysis' share of tracing, the trace / lower / compile
time against plain scan for deep models, and the global-view fallback for a loss JAX 0.10.2
cannot run per device.

Run from the repository root::

  python benchmarks/views.py          # a few minutes on 2 cores; prints markdown tables
  python benchmarks/views.py --layers 8,32,96

1. Trace + lower time of ``jax.jit(fxaccum.value_and_grad(loss, micro_batches=k))`` and of
   ``jax.jit(jax.value_and_grad(loss))`` (the large batch), for the suite's replicated MLP
   and LM (best of 3). fxaccum's analysis traces one micro-step's value and gradients with
   a symbolic number of rows.
2. Trace, lower and compile times (seconds, best of 3 taken in turns, fresh functions)
   of fxaccum at k = 8 and of plain ``jit`` + ``lax.scan`` over the same micro-batches,
   for an MLP of L 256-wide layers, unrolled (a Python loop of ``nn.Dense``) and
   scanned (``nn.scan``); plain scan written per device inside ``shard_map`` (as
   fxaccum's per-device view runs its loop); and the trace alone of one micro-step's
   value and gradients at a symbolic number of rows, which any proof for every batch
   size needs.
3. A loss that closes over a traced value on an Explicit mesh (JAX 0.10.2: "Closing over
   inputs to shard_map where the input is sharded on Explicit axes is not implemented")
   runs in the global view; passed as a keyword argument instead, the same value takes
   the per-device view. ms per call of the replicated MLP at k = 8, interleaved (median
   of 5 after a warm-up), and each one's view.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import common  # noqa: F401 - first: sets XLA_FLAGS before JAX starts
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
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


class Unrolled(nn.Module):
  layers: int

  @nn.compact
  def __call__(self, x):
    for _ in range(self.layers):
      x = jnp.tanh(nn.Dense(x.shape[-1])(x))
    return x


class Layer(nn.Module):
  @nn.compact
  def __call__(self, x, _):
    return jnp.tanh(nn.Dense(x.shape[-1])(x)), None


class Scanned(nn.Module):
  layers: int

  @nn.compact
  def __call__(self, x):
    stack = nn.scan(Layer, variable_axes={"params": 0}, split_rngs={"params": True},
                    length=self.layers)
    return stack()(x, None)[0]


def plain_scan(loss, k: int):
  """jit + lax.scan of jax.value_and_grad over k strided micro-batches (users' baseline)."""
  def step(params, batch):
    micro = jax.tree.map(lambda a: a.reshape(a.shape[0] // k, k, *a.shape[1:]).swapaxes(0, 1),
                         batch)
    def body(acc, mb):
      value, grads = jax.value_and_grad(loss)(params, mb)
      return jax.tree.map(jnp.add, acc, (value, grads)), None
    zeros = (jnp.zeros(()), jax.tree.map(jnp.zeros_like, params))
    total, _ = jax.lax.scan(body, zeros, micro)
    return jax.tree.map(lambda t: t / k, total)
  return step


def plain_scan_per_device(loss, k: int):
  """``plain_scan`` written per device: inside ``shard_map`` over the data axis, the sums
  averaged over it once (the loop a user writes by hand for one reduction per step; a
  compiler that treats loops in manual regions differently shows here, without fxaccum)."""
  step = plain_scan(loss, k)

  def local(params, batch):
    return jax.tree.map(lambda a: jax.lax.pmean(a, DATA), step(params, batch))
  return jax.shard_map(local, in_specs=(P(), P(DATA)), out_specs=P(), check_vma=False)


def stage_seconds(make_fn, *args) -> tuple[float, float, float]:
  """(trace, lower, compile) seconds of ``jax.jit(make_fn())``, a fresh function."""
  fn = jax.jit(make_fn())
  t0 = time.perf_counter()
  traced = fn.trace(*args)
  t1 = time.perf_counter()
  lowered = traced.lower()
  t2 = time.perf_counter()
  lowered.compile()
  return t1 - t0, t2 - t1, time.perf_counter() - t2


def symbolic_trace_seconds(make_loss, params, batch) -> float:
  """Seconds of ``jax.make_jaxpr(jax.value_and_grad(loss))`` on a micro-batch with a
  symbolic number of rows: the trace a proof for every batch size needs, whatever else a
  design shares with it."""
  (rows,) = jax.export.symbolic_shape("rows")
  micro = jax.tree.map(lambda a: jax.ShapeDtypeStruct((rows, *a.shape[1:]), a.dtype), batch)
  plain_params = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), params)
  grad_fn = jax.value_and_grad(make_loss())
  start = time.perf_counter()
  jax.make_jaxpr(grad_fn)(plain_params, micro)
  return time.perf_counter() - start


def best_of(repeats: int, measures: dict[str, Callable[[], Any]]) -> dict[str, Any]:
  """Each measure's elementwise minimum over ``repeats`` rounds, the measures taken in
  turns (a slow first round or a busy moment does not fall on one method only)."""
  best: dict[str, Any] = {}
  for _ in range(repeats):
    for name, measure in measures.items():
      got = np.atleast_1d(measure())
      best[name] = got if name not in best else np.minimum(best[name], got)
  return best


def compile_measures(fresh, params, batch, k: int) -> dict[str, Callable[[], Any]]:
  """The compile table's measures of one model: plain scan's and fxaccum's (trace, lower,
  compile) seconds, and the proof's trace."""
  return {
      "plain scan": lambda: stage_seconds(lambda: plain_scan(fresh(), k), params, batch),
      "plain scan in shard_map": lambda: stage_seconds(
          lambda: plain_scan_per_device(fresh(), k), params, batch),
      "fxaccum": lambda: stage_seconds(
          lambda: fxaccum.value_and_grad(fresh(), micro_batches=k), params, batch),
      "proof": lambda: symbolic_trace_seconds(fresh, params, batch)}


def compile_table(layer_counts: list[int], k: int = 8) -> str:
  mesh = layout_mesh("replicated")
  rows = ["| model | layers | method | trace s | lower s | compile s | "
          "trace + lower ÷ plain scan |", "|---|---:|---|---:|---:|---:|---:|"]
  rng = np.random.default_rng(0)
  host = {"x": rng.normal(size=(64, 256)).astype(np.float32),
          "y": rng.normal(size=(64, 256)).astype(np.float32)}
  with jax.set_mesh(mesh):
    batch = jax.device_put(host, NamedSharding(mesh, P(DATA)))
    for name, cls in (("unrolled", Unrolled), ("scanned", Scanned)):
      for layers in layer_counts:
        model = cls(layers)
        params = jax.device_put(jax.jit(model.init)(jax.random.key(0), host["x"][:1]),
                                NamedSharding(mesh, P()))

        def fresh(model=model):
          return lambda p, b: jnp.mean((model.apply(p, b["x"]) - b["y"]) ** 2)

        best = best_of(3, compile_measures(fresh, params, batch, k))
        plain = best["plain scan"][0] + best["plain scan"][1]
        for method in ("plain scan", "plain scan in shard_map", "fxaccum"):
          t, lo, c = best[method]
          rows.append(f"| {name} | {layers} | {method} | {t:.2f} | {lo:.2f} | {c:.2f} | "
                      f"{(t + lo) / plain:.2f} |")
        proof = best["proof"][0]
        rows.append(f"| {name} | {layers} | one micro-step at symbolic rows (the proof's "
                    f"trace) | {proof:.2f} | | | {proof / plain:.2f} |")
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
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--layers", default="8,32", help="layer counts of the compile table")
  args = parser.parse_args()
  print(f"devices: {jax.device_count()} x {jax.devices()[0].platform}\n")
  print("Trace + lower (best of 3):\n")
  print(trace_table())
  print("\nTrace, lower, compile at k = 8 (best of 3, in turns):\n")
  print(compile_table([int(n) for n in args.layers.split(",")]))
  print("\nA traced value on an Explicit mesh, replicated MLP, k = 8:\n")
  print(closure_table())


if __name__ == "__main__":
  main()
