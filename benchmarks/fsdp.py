"""FSDP strategies: ``fsdp="auto"`` (the default) against each strategy, the large batch and
plain ``jit`` + ``lax.scan``.

A study of ``benchmarks/run.py``; run from the repository root::

  python benchmarks/run.py --study fsdp       # about 20 minutes on 2 cores; markdown tables
  python benchmarks/run.py --study fsdp --models scanned --no-time
  python benchmarks/run.py --study fsdp --quick   # tiny sizes, one timed round (the test's)

Models, every param FSDP-sharded over ``data`` on 8 devices (an ``Explicit`` mesh):

* ``scanned``: a deep MLP, width 1024, layers stacked ``(L, 1024, 1024)`` and run by
  ``lax.scan`` over the layers, each layer gathering its params with
  ``jax.sharding.reshard`` (as Explicit meshes require), tanh, mean-squared error, batch 64;
  every kernel and bias sharded along its width (the layout large models are written in);
* ``nn_scan``: the same written with flax ``nn.scan`` over a dense block, width 512, batch
  256 (``common.Dense``: ``nn.Dense`` that gathers its FSDP kernel before use);
* ``unrolled``: a Python loop of such dense layers, width 512, batch 256;
* ``suite_mlp``, ``suite_lm``: the benchmark suite's FSDP MLP and LM (``common.py``,
  ``fsdp_spec`` along the largest dimension).

``python benchmarks/run.py --study fsdp --render benchmarks/results/fsdp.json`` prints the
tables of a saved run (docs/performance.md, "FSDP strategies").

Per (model, layers, method), from the compiled program: peak bytes per device (temp +
arguments + outputs - aliased); ms per call (median of interleaved rounds); the largest
gradient error relative to ``jax.value_and_grad`` on the whole batch; for the default, the
strategy it took (``fxaccum.diagnostics.paths``).
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import common  # noqa: F401 - first: sets XLA_FLAGS before JAX starts
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from common import (
  DATA,
  Dense,
  environment,
  fsdp_spec,
  interleaved,
  layout_mesh,
  layout_specs,
  lm_setup,
  md_header,
  md_row,
  mlp_setup,
  rel_err,
  write_json,
)
from jax import lax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from methods import plain_scan_value_and_grad

import fxaccum
from fxaccum import diagnostics

MiB = 2 ** 20
K = 8
MODELS = "scanned,nn_scan,unrolled,suite_mlp,suite_lm"  # --models' default
STRATEGIES = ("zero1", "zero2", "zero3")


class Block(nn.Module):
  width: int

  @nn.compact
  def __call__(self, x, _):
    return nn.gelu(Dense(self.width)(x)), None


class NNScan(nn.Module):
  layers: int
  width: int

  @nn.compact
  def __call__(self, x):
    x, _ = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True},
                   length=self.layers)(self.width)(x, None)
    return Dense(8)(x)


class Unrolled(nn.Module):
  layers: int
  width: int

  @nn.compact
  def __call__(self, x):
    for _ in range(self.layers):
      x = nn.gelu(Dense(self.width)(x))
    return Dense(8)(x)


def scanned(layers: int, quick: bool) -> dict[str, Any]:
  """The deep MLP of stacked, scanned layers (issue 32's layout)."""
  width, batch = (64, 64) if quick else (1024, 64)
  rng = np.random.default_rng(0)
  params = {"w": (rng.normal(size=(layers, width, width)) / np.sqrt(width)).astype(np.float32),
            "b": np.zeros((layers, width), np.float32)}
  batch_data = {"x": rng.normal(size=(batch, width)).astype(np.float32),
                "y": rng.normal(size=(batch, width)).astype(np.float32)}

  def loss(p, b):
    def layer(h, wb):
      w, bias = (jax.sharding.reshard(v, P()) for v in wb)
      return jnp.tanh(h @ w + bias), None
    h, _ = lax.scan(layer, b["x"], (p["w"], p["b"]))
    return jnp.mean((h - b["y"]) ** 2)

  return {"loss": loss, "params": params, "batch": batch_data,
          "specs": {"w": P(None, None, DATA), "b": P(None, DATA)}}


def flax_model(model_cls: type, layers: int, quick: bool) -> dict[str, Any]:
  """``model_cls`` (``NNScan`` or ``Unrolled``), params sharded along their last dimension."""
  width, batch = (64, 64) if quick else (512, 256)
  model = model_cls(layers, width)
  rng = np.random.default_rng(0)
  batch_data = {"x": rng.normal(size=(batch, width)).astype(np.float32),
                "y": rng.normal(size=(batch, 8)).astype(np.float32)}
  params = jax.jit(model.init)(jax.random.key(0), batch_data["x"][:1])

  def loss(p, b):
    return jnp.mean((model.apply(p, b["x"]) - b["y"]) ** 2)

  specs = jax.tree.map(lambda a: fsdp_spec(a.shape, 8, along="last"), params)
  return {"loss": loss, "params": params, "batch": batch_data, "specs": specs}


def suite(model: str, quick: bool) -> dict[str, Any]:
  """The benchmark suite's FSDP MLP or LM."""
  mesh = layout_mesh("fsdp")
  with jax.set_mesh(mesh):
    setup = mlp_setup(quick) if model == "suite_mlp" else lm_setup(quick)
  return {**setup, "specs": layout_specs("fsdp", setup["params"], mesh)}


def setup_of(model: str, layers: int, quick: bool) -> dict[str, Any]:
  if model == "scanned":
    return scanned(layers, quick)
  if model in ("nn_scan", "unrolled"):
    return flax_model(NNScan if model == "nn_scan" else Unrolled, layers, quick)
  return suite(model, quick)


def measure(model: str, layers: int, quick: bool, timed: bool, repeats: int) -> list[dict]:
  """Every method on one model: its figures, one dict each."""
  setup = setup_of(model, layers, quick)
  loss = setup["loss"]
  mesh = jax.make_mesh((8,), (DATA,), axis_types=(AxisType.Explicit,))
  methods = {"large batch": jax.value_and_grad(loss),
             "plain scan": plain_scan_value_and_grad(loss, K),
             "default": fxaccum.value_and_grad(loss, micro_batches=K),
             **{s: fxaccum.value_and_grad(loss, micro_batches=K, fsdp=s) for s in STRATEGIES}}
  with jax.set_mesh(mesh):
    params = jax.tree.map(lambda a, s: jax.device_put(a, NamedSharding(mesh, s)),
                          setup["params"], setup["specs"])
    batch = jax.device_put(setup["batch"], NamedSharding(mesh, P(DATA)))
    reference = jax.jit(jax.grad(loss))(setup["params"], setup["batch"])  # unsharded
    rows, runs = [], {}
    param_mib = sum(np.asarray(a).nbytes for a in jax.tree.leaves(setup["params"])) / MiB
    for name, fn in methods.items():
      row = {"model": model, "layers": layers, "method": name, "params_mib": param_mib}
      try:
        compiled = jax.jit(fn).lower(params, batch).compile()
      except Exception as e:  # noqa: BLE001 - recorded, not fatal
        rows.append({**row, "skipped": f"{type(e).__name__}: {str(e).splitlines()[0]}"})
        continue
      report = diagnostics.from_compiled(compiled)
      (_, grads) = jax.block_until_ready(compiled(params, batch))
      rows.append({**row, "peak_mib": report.memory.peak_bytes / MiB,
                   "grad_rel_err": rel_err(grads, reference)[0],
                   "strategy": report.paths[0].fsdp if report.paths else ""})
      runs[name] = lambda compiled=compiled: compiled(params, batch)
    times = interleaved(runs, repeats) if timed else {}
  for row in rows:
    row["ms"] = times[row["method"]][0] if row["method"] in times else None
  return rows


METHODS = ("large batch", "plain scan", "default", *STRATEGIES)


def markdown(rows: list[dict]) -> str:
  """Two tables, one row per (model, layers): the compiled peak of every method, and its
  time, with the strategy the default took and the ratios issue 32 bounds."""
  setups: dict[tuple[str, int], dict[str, dict]] = {}
  for r in rows:
    setups.setdefault((r["model"], r["layers"]), {})[r["method"]] = r

  def cell(r: dict | None, key: str, fmt: str) -> str:
    return "failed" if r is None or "skipped" in r else (
        "" if r.get(key) is None else format(r[key], fmt))

  peak = md_header(["model", "layers", "params MiB", *METHODS, "default takes",
                    "default ÷ large", "default ÷ lowest strategy"], 2)
  time_ = md_header(["model", "layers", *METHODS, "default ÷ faster of zero2 / zero3"], 2)
  for (model, layers), by in setups.items():
    default = by.get("default", {})
    strategies = [by[s]["peak_mib"] for s in STRATEGIES if "peak_mib" in by.get(s, {})]
    ratios = ["", ""]
    if "peak_mib" in default and "peak_mib" in by.get("large batch", {}) and strategies:
      ratios = [f"{default['peak_mib'] / by['large batch']['peak_mib']:.2f}",
                f"{default['peak_mib'] / min(strategies):.2f}"]
    params = next(iter(by.values()))["params_mib"]
    peak.append(md_row([model, layers or "", f"{params:.1f}",
                        *(cell(by.get(m), "peak_mib", ".1f") for m in METHODS),
                        default.get("strategy", "").split(":")[0], *ratios]))
    fastest = [by[s]["ms"] for s in ("zero2", "zero3") if by.get(s, {}).get("ms")]
    ratio = f"{default['ms'] / min(fastest):.2f}" if default.get("ms") and fastest else ""
    time_.append(md_row([model, layers or "", *(cell(by.get(m), "ms", ".0f") for m in METHODS),
                         ratio]))
  return ("Compiled peak, MiB per device (temp + arguments + outputs - aliased):\n\n"
          + "\n".join(peak) + "\n\nms per call (median of interleaved rounds):\n\n"
          + "\n".join(time_))


def study(args: argparse.Namespace) -> None:
  """``run.py --study fsdp``: ``--models``, ``--layers``, ``--repeats`` (9), ``--no-time``,
  ``--quick``, ``--out`` (benchmarks/results/fsdp.json), ``--render JSON``."""
  if args.render:
    print(markdown(json.load(open(args.render))["rows"]))
    return
  out = args.out or "benchmarks/results/fsdp.json"
  started = time.perf_counter()
  rows = []
  for model in (args.models or MODELS).split(","):
    layer_counts = [0] if model.startswith("suite") else [int(n) for n in
                                                          args.layers.split(",")]
    for layers in ([2] if args.quick and layer_counts != [0] else layer_counts):
      rows += measure(model, layers, args.quick, not args.no_time,
                      1 if args.quick else args.repeats or 9)
      print(markdown(rows[-len(METHODS):]), flush=True)
  table = markdown(rows)
  print(f"\nk = {K}, {jax.device_count()} {jax.devices()[0].platform} devices\n\n{table}")
  write_json(out, {"benchmark": "fsdp", "command": "python benchmarks/run.py --study fsdp",
                   "k": K, "quick": args.quick, **environment(), "rows": rows,
                   "table_markdown": table, "total_seconds": time.perf_counter() - started})
