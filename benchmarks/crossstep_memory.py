"""Cross-step memory: fxaccum's gate against ``optax.MultiSteps``, as flax users jit a step.

A study of ``benchmarks/run.py``; run from the repository root::

  python benchmarks/run.py --study crossstep-memory            # about 1 minute on 2 cores
  python benchmarks/run.py --study crossstep-memory --quick    # width 256 (the test's size)

The model is a 4-layer MLP (``--mlp-width``, 1024 by default: 16 MiB of float32 params),
adam, one optimizer step every 4 calls, ``--rows`` rows per call (32). Each step is
compiled, never run, on one device, in three ways: flax NNX as NNX users write it
(``nnx.merge``, ``optimizer.update``, ``nnx.split``, under ``jax.jit``) without donation,
which is ``nnx.jit``'s default, and with the state donated; and linen's ``TrainState``
(``state.apply_gradients``) with the state donated. Methods: ``fxaccum.Optimizer`` /
``fxaccum.TrainState`` with ``optax.chain(fxaccum.accumulate(4), optax.adam(...))``, and
flax's own ``nnx.Optimizer`` / ``TrainState`` with ``optax.MultiSteps(optax.adam(...), 4)``.
Figures from ``compiled.memory_analysis()``: peak = temp + arguments + outputs - aliased.

Writes ``benchmarks/results/crossstep_memory.json`` (``--out``).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import common  # noqa: F401 - first: sets XLA_FLAGS before JAX starts
import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from common import environment, md_header, md_row, write_json
from flax import nnx
from flax.training import train_state

import fxaccum

MiB = 2 ** 20
LAYERS, EVERY_K, LR = 4, 4, 1e-3
CASES = ("NNX, no donation", "NNX, donated", "linen TrainState, donated")


class MLP(nnx.Module):
  """``LAYERS`` square ``nnx.Linear`` layers with relu."""

  def __init__(self, width: int, rngs: nnx.Rngs):
    self.layers = nnx.List([nnx.Linear(width, width, rngs=rngs) for _ in range(LAYERS)])

  def __call__(self, x):
    for layer in self.layers:
      x = jax.nn.relu(layer(x))
    return x


def loss(model: Any, x: jax.Array, y: jax.Array) -> jax.Array:
  """Mean squared error of an NNX model (or of ``model`` as a callable)."""
  return jnp.mean((model(x) - y) ** 2)


def figures(compiled: Any) -> dict[str, float]:
  """``memory_analysis()`` in MiB, with peak = temp + arguments + outputs - aliased."""
  m = compiled.memory_analysis()
  out = {"temp": m.temp_size_in_bytes, "arguments": m.argument_size_in_bytes,
         "outputs": m.output_size_in_bytes, "alias": m.alias_size_in_bytes}
  out["peak"] = out["temp"] + out["arguments"] + out["outputs"] - out["alias"]
  return {name: value / MiB for name, value in out.items()}


def nnx_step(width: int, batch: int, optimizer: Callable, tx: Any, donate: bool) -> Any:
  """The compiled NNX step: merge, ``optimizer.update``, split (``jax.jit``)."""
  model = MLP(width, nnx.Rngs(0))
  graphdef, state = nnx.split((model, optimizer(model, tx, wrt=nnx.Param)))

  def step(state, x, y):
    model, opt = nnx.merge(graphdef, state)
    opt.update(model, nnx.grad(loss)(model, x, y))
    return nnx.split((model, opt))[1]

  x = jnp.ones((batch, width))
  return jax.jit(step, donate_argnums=(0,) if donate else ()).lower(state, x, x).compile()


class LinenMLP(nn.Module):
  """The same MLP in flax linen."""

  width: int

  @nn.compact
  def __call__(self, x):
    for _ in range(LAYERS):
      x = jax.nn.relu(nn.Dense(self.width)(x))
    return x


def linen_step(width: int, batch: int, state_class: Any, tx: Any) -> Any:
  """The compiled linen step, ``state.apply_gradients``, the state donated."""
  model, x = LinenMLP(width), jnp.ones((batch, width))
  state = state_class.create(apply_fn=model.apply, params=model.init(jax.random.key(0), x),
                             tx=tx)

  def step(state, x, y):
    grads = jax.grad(lambda p: loss(lambda v: state.apply_fn(p, v), x, y))(state.params)
    return state.apply_gradients(grads=grads)

  return jax.jit(step, donate_argnums=(0,)).lower(state, x, x).compile()


def measure(width: int, batch: int) -> dict[str, dict[str, dict[str, float]]]:
  """Per case, per method (``fxaccum``, ``MultiSteps``): the figures."""
  gated = optax.chain(fxaccum.accumulate(EVERY_K), optax.adam(LR))
  multi = optax.MultiSteps(optax.adam(LR), EVERY_K)
  results: dict[str, dict[str, dict[str, float]]] = {}
  for case, donate in zip(CASES[:2], (False, True), strict=True):
    results[case] = {
        "fxaccum": figures(nnx_step(width, batch, fxaccum.Optimizer, gated, donate)),
        "MultiSteps": figures(nnx_step(width, batch, nnx.Optimizer, multi, donate))}
  results[CASES[2]] = {
      "fxaccum": figures(linen_step(width, batch, fxaccum.TrainState, gated)),
      "MultiSteps": figures(linen_step(width, batch, train_state.TrainState, multi))}
  return results


def table(results: dict[str, dict[str, dict[str, float]]]) -> str:
  """The markdown table: one row per case and method."""
  rows = md_header(["step", "method", "peak MiB", "temp", "arguments", "outputs", "aliased"],
                   2)
  for case, methods in results.items():
    for method, f in methods.items():
      rows.append(md_row([case, method] + [f"{f[n]:.1f}" for n in
                                           ("peak", "temp", "arguments", "outputs", "alias")]))
  return "\n".join(rows)


def study(args: argparse.Namespace) -> None:
  """``run.py --study crossstep-memory``: ``--mlp-width`` (1024; ``--quick``: 256),
  ``--rows`` per call (32), ``--out``."""
  width = args.mlp_width or (256 if args.quick else 1024)
  batch = args.rows
  out = args.out or "benchmarks/results/crossstep_memory.json"
  results = measure(width, batch)
  device = jax.devices()[0]
  print(f"{LAYERS}-layer MLP, width {width} (params {LAYERS * (width + 1) * width * 4 / MiB:.1f} "
        f"MiB), adam, a step every {EVERY_K} calls, {batch} rows per call, compiled for one "
        f"{device.device_kind} ({device.platform})\n")
  print(table(results))
  write_json(out, {"environment": environment(), "width": width, "batch": batch,
                   "layers": LAYERS, "every_k": EVERY_K, "results": results})
  print(f"\nwrote {out}")
