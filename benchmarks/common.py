"""What the benchmark scripts share: models, problems, timing, errors, metadata, markdown.

Imported as ``from common import ...`` by the scripts in this directory (run as
``python benchmarks/<script>.py``, which puts this directory on ``sys.path``). Each script
sets ``XLA_FLAGS`` (8 simulated host devices) *before* importing this module, since
importing it imports JAX.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
import traceback
from collections.abc import Callable, Iterable
from typing import Any

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

import fxaccum
from fxaccum import diagnostics

DEVICES = 8  # the 1-D data-parallel mesh ("data",) every benchmark runs on
LR = 1e-3  # optax.adam's learning rate in every benchmark

# --------------------------------------------------------------------------- models


class MLP(nn.Module):
  """in -> width, ``depth`` x (width -> width), -> out, with gelu."""

  width: int
  depth: int
  out: int

  @nn.compact
  def __call__(self, x):
    x = nn.gelu(nn.Dense(self.width)(x))
    for _ in range(self.depth):
      x = nn.gelu(nn.Dense(self.width)(x))
    return nn.Dense(self.out)(x)


class Block(nn.Module):
  """Pre-LN causal self-attention + 4x MLP."""

  width: int
  heads: int

  @nn.compact
  def __call__(self, x, mask):
    x = x + nn.SelfAttention(num_heads=self.heads)(nn.LayerNorm()(x), mask=mask)
    h = nn.gelu(nn.Dense(4 * self.width)(nn.LayerNorm()(x)))
    return x + nn.Dense(self.width)(h)


class Embed(nn.Module):
  """Token embedding whose gather spells out its output sharding (Explicit meshes need it
  for a replicated table indexed by data-sharded tokens; ``nn.Embed`` leaves it out)."""

  vocab: int
  width: int

  @nn.compact
  def __call__(self, tokens):
    table = self.param("embedding", nn.initializers.normal(1.0), (self.vocab, self.width))
    spec = tuple(jax.typeof(tokens).sharding.spec)
    spec += (None,) * (tokens.ndim - len(spec))
    return table.at[tokens].get(out_sharding=P(*spec, None))


class LM(nn.Module):
  """A small causal transformer language model."""

  vocab: int
  width: int
  layers: int
  heads: int
  seq: int

  @nn.compact
  def __call__(self, tokens):
    x = Embed(self.vocab, self.width)(tokens)
    x = x + self.param("pos", nn.initializers.normal(0.02), (self.seq, self.width))
    mask = nn.make_causal_mask(tokens)
    for _ in range(self.layers):
      x = Block(self.width, self.heads)(x, mask)
    return nn.Dense(self.vocab)(nn.LayerNorm()(x))


def mlp_setup(quick: bool) -> dict[str, Any]:
  """The MLP regression problem: model, loss, params and the global batch (host arrays)."""
  width, depth, dim, batch = (64, 2, 8, 64) if quick else (1024, 4, 32, 512)
  model = MLP(width=width, depth=depth, out=dim)
  rng = np.random.default_rng(0)
  data = {"x": rng.normal(size=(batch, dim)).astype(np.float32),
          "y": rng.normal(size=(batch, dim)).astype(np.float32)}
  params = jax.jit(model.init)(jax.random.key(0), data["x"][:1])

  def loss_fn(params, batch):
    return jnp.mean((model.apply(params, batch["x"]) - batch["y"]) ** 2)

  config = {"width": width, "hidden_layers": depth, "in_out_dim": dim, "global_batch": batch}
  return {"loss": loss_fn, "params": params, "batch": data, "config": config}


def lm_setup(quick: bool) -> dict[str, Any]:
  """The LM problem: next-token cross-entropy (mean over tokens) on random tokens."""
  vocab, width, seq = (64, 32, 32) if quick else (256, 128, 256)
  layers, heads, batch = 2, 4, 64
  model = LM(vocab=vocab, width=width, layers=layers, heads=heads, seq=seq)
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, vocab, size=(batch, seq + 1)).astype(np.int32)
  data = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
  params = jax.jit(model.init)(jax.random.key(0), data["inputs"][:1])

  def loss_fn(params, batch):
    logits = model.apply(params, batch["inputs"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()

  config = {"vocab": vocab, "width": width, "layers": layers, "heads": heads, "seq": seq,
            "global_batch": batch}
  return {"loss": loss_fn, "params": params, "batch": data, "config": config}


def n_params(params: Any) -> int:
  """Number of scalars in a params tree."""
  return int(sum(np.size(p) for p in jax.tree.leaves(params)))


def data_mesh() -> Any:
  """The 1-D ``("data",)`` mesh over ``DEVICES`` devices (Explicit axis, make_mesh's
  default); exits if there are fewer devices."""
  if jax.device_count() < DEVICES:
    raise SystemExit(f"needs {DEVICES} devices, found {jax.device_count()}")
  return jax.make_mesh((DEVICES,), ("data",))


# ------------------------------------------------------------------------ measuring


REL_FLOOR = 1e-3


def rel_err(actual: Any, expected: Any, floor: float = REL_FLOOR) -> tuple[float, str]:
  """Max over leaves of max|a - b| / max|b| (float64), and the worst leaf's path.

  Each leaf's scale ``max|b|`` is floored at ``floor`` x the whole tree's max|b|: a leaf
  whose exact gradient is 0 (an attention key bias: softmax ignores a shift of the logits)
  holds only rounding noise (~1e-10), and any two summation orders differ there by ~100%.
  ``floor=0`` gives the unfloored per-leaf ratio.
  """
  pairs = [(jax.tree_util.keystr(path), np.asarray(a, np.float64), np.asarray(b, np.float64))
           for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(actual)[0],
                                   jax.tree.leaves(expected), strict=True)]
  tree_scale = max(float(np.max(np.abs(b), initial=0.0)) for _, _, b in pairs)
  worst, worst_leaf = 0.0, ""
  for path, a, b in pairs:
    scale = max(float(np.max(np.abs(b), initial=0.0)), floor * tree_scale, 1e-30)
    err = float(np.max(np.abs(a - b), initial=0.0)) / scale
    if err >= worst:
      worst, worst_leaf = err, path
  return worst, worst_leaf


def errors(prefix: str, actual: Any, expected: Any) -> dict[str, Any]:
  """``{prefix}_rel_err`` (floored), ``..._raw`` (unfloored) and ``..._worst_leaf``."""
  err, leaf = rel_err(actual, expected)
  raw, raw_leaf = rel_err(actual, expected, floor=0.0)
  return {f"{prefix}_rel_err": err, f"{prefix}_rel_err_worst_leaf": leaf,
          f"{prefix}_rel_err_raw": raw, f"{prefix}_rel_err_raw_worst_leaf": raw_leaf}


def delta(new: Any, old: Any) -> Any:
  """new - old per leaf, in float64 (the one-step update)."""
  return jax.tree.map(lambda a, b: np.asarray(a, np.float64) - np.asarray(b, np.float64),
                      new, old)


def compile_and_report(fn: Callable, mesh: Any, *args: Any) -> tuple[Any, diagnostics.Report]:
  """Compiles ``jax.jit(fn)`` once for ``args``; the executable and its diagnostics."""
  compiled = jax.jit(fn).lower(*args).compile()
  return compiled, diagnostics.from_compiled(compiled, mesh=mesh)


def time_ms(run: Callable[[], Any], repeats: int) -> tuple[float, list[float]]:
  """Median wall time of ``run()`` in ms over ``repeats`` runs, after one warm-up."""
  jax.block_until_ready(run())
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(run())
    times.append((time.perf_counter() - start) * 1e3)
  return statistics.median(times), times


def measure(fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
  """``fn()``'s figures plus ``bench_seconds``; a failure is reported (with its traceback
  on stderr) as ``{"skipped": reason}``, not raised."""
  start = time.perf_counter()
  try:
    out = fn()
  except Exception as e:  # noqa: BLE001 - a failing method is reported, not fatal
    traceback.print_exc()
    out = {"skipped": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
  out["bench_seconds"] = round(time.perf_counter() - start, 2)
  return out


def ratio(a: float | None, b: float | None) -> float | None:
  """a / b, or None when either is missing or b is 0."""
  return None if a is None or b is None or b == 0 else a / b


def diff(a: float | None, b: float | None) -> float | None:
  """a - b, or None when either is missing."""
  return None if a is None or b is None else a - b


# ------------------------------------------------------------------- run & report


def logger(started: float) -> Callable[[str], None]:
  """``log(msg)`` printing ``[seconds since started] msg``, flushed."""

  def log(msg: str) -> None:
    print(f"[{time.perf_counter() - started:7.1f}s] {msg}", flush=True)

  return log


def environment() -> dict[str, Any]:
  """Device kind / platform / count, host CPUs and library versions, for the JSON."""
  device = jax.devices()[0]
  return {
      "device_kind": device.device_kind,
      "platform": device.platform,
      "device_count": jax.device_count(),
      "host_cpus": os.cpu_count(),
      "versions": {"jax": jax.__version__, "flax": flax.__version__,
                   "optax": optax.__version__, "fxaccum": fxaccum.__version__,
                   "python": platform.python_version()},
  }


def write_json(path: str, payload: dict[str, Any]) -> None:
  """Writes ``payload`` to ``path`` (indent 2), creating its directory."""
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with open(path, "w") as f:
    json.dump(payload, f, indent=2, default=str)


def done_line(out: str, total: float) -> str:
  """The closing line: where the JSON went, total seconds, on which devices."""
  device = jax.devices()[0]
  return (f"\nwrote {out}; total {total:.1f} s on {jax.device_count()} x "
          f"{device.device_kind} ({device.platform})")


def figures_line(prefix: str, figures: dict[str, Any]) -> str:
  """``prefix: k=v, ...`` with floats to 3 significant digits."""
  return f"{prefix}: " + ", ".join(
      f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in figures.items())


def md_row(cells: Iterable[Any]) -> str:
  """One markdown table row; an empty cell is written as a single space."""
  return "|" + "|".join(f" {c} " if str(c) else " " for c in cells) + "|"


def md_header(titles: Iterable[str], numeric_from: int) -> list[str]:
  """The header row and the alignment row (columns from ``numeric_from`` on align right)."""
  titles = list(titles)
  return [md_row(titles),
          "|" + "|".join("---" if i < numeric_from else "---:" for i in range(len(titles))) + "|"]
