"""What the benchmark scripts share: models, layouts, timing, errors, metadata, markdown.

Imported by the scripts in this directory (run as ``python benchmarks/<script>.py``, which
puts this directory on ``sys.path``). Importing it first sets ``XLA_FLAGS`` for 8 simulated
host devices (unless ``XLA_FLAGS`` already sets a count), which must happen before JAX
starts: so the scripts ``import common`` ahead of ``import jax`` (isort keeps it there). The
flag only affects the CPU platform: with an accelerator, ``jax.devices()`` are its devices.
"""

from __future__ import annotations

import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (
      os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
  ).strip()

import json  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from collections.abc import Callable, Iterable  # noqa: E402
from typing import Any  # noqa: E402

import flax  # noqa: E402
import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import fxaccum  # noqa: E402
from fxaccum import diagnostics  # noqa: E402

DEVICES = 8  # the 1-D data-parallel mesh ("data",) every benchmark runs on
LR = 1e-3  # optax.adam's learning rate in every benchmark

# --------------------------------------------------------------------------- models


DATA = "data"  # the data-parallel mesh axis (FSDP shards params over it too)
MODEL = "model"  # the tensor-parallel mesh axis of the data x model layout


def spec_of(x: Any) -> tuple[Any, ...]:
  """``x``'s PartitionSpec entries, padded to its rank (the typed sharding: Explicit axes)."""
  spec = tuple(jax.typeof(x).sharding.spec.partitions)  # (a reduced spec refuses iter())
  return spec + (None,) * (x.ndim - len(spec))


def _axes(entry: Any) -> tuple[str, ...]:
  """The mesh axes of one PartitionSpec entry."""
  return () if entry is None else entry if isinstance(entry, tuple) else (entry,)


def _gathered(x: Any, axis: str) -> Any:
  """``x`` all-gathered over ``axis`` where its type says it is sharded over it."""
  spec = spec_of(x)
  if not any(axis in _axes(e) for e in spec):
    return x
  kept = [tuple(a for a in _axes(e) if a != axis) for e in spec]
  return jax.sharding.reshard(x, P(*(a[0] if len(a) == 1 else a or None for a in kept)))


class Dense(nn.Module):
  """``nn.Dense`` (same params, same init) for kernels sharded on an Explicit mesh.

  FSDP: a param sharded over ``DATA`` is all-gathered before use (``reshard``; its
  transpose reduce-scatters the gradient). Tensor parallel: a kernel whose input dimension
  is sharded (row-parallel) contracts over a sharded axis, so the output sharding is spelled
  out and JAX inserts the model-axis all-reduce. Replicated params: plain ``x @ kernel``.
  """

  features: int

  @nn.compact
  def __call__(self, x):
    kernel = self.param("kernel", nn.initializers.lecun_normal(), (x.shape[-1], self.features))
    bias = self.param("bias", nn.initializers.zeros, (self.features,))
    kernel, bias = _gathered(kernel, DATA), _gathered(bias, DATA)
    if spec_of(kernel)[0] is not None:  # row-parallel
      out_spec = P(*spec_of(x)[:-1], spec_of(kernel)[1])
      return jnp.matmul(x, kernel, out_sharding=out_spec) + bias
    return x @ kernel + bias


class MLP(nn.Module):
  """in -> width, ``depth`` x (width -> width), -> out, with gelu."""

  width: int
  depth: int
  out: int

  @nn.compact
  def __call__(self, x):
    x = nn.gelu(Dense(self.width)(x))
    for _ in range(self.depth):
      x = nn.gelu(Dense(self.width)(x))
    return Dense(self.out)(x)


class BatchNormMLP(nn.Module):
  """``MLP`` with BatchNorm (train mode) after every hidden layer: a loss that mixes the
  examples of its batch, so fxaccum runs it in the global view."""

  width: int
  depth: int
  out: int

  @nn.compact
  def __call__(self, x):
    for _ in range(self.depth + 1):
      x = nn.Dense(self.width, use_bias=False)(x)  # BatchNorm cancels a bias
      x = nn.gelu(nn.BatchNorm(use_running_average=False)(x))
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


def _regression(quick: bool, width: int | None = None
                ) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
  """The MLP problems' sizes (quick: one hidden layer, compiles fastest; still two layers
  for tensor parallelism; ``width`` overrides the hidden width) and their global batch
  (host arrays)."""
  default_width, depth, dim, batch = (64, 0, 8, 64) if quick else (1024, 4, 32, 512)
  width = width or default_width
  rng = np.random.default_rng(0)
  data = {"x": rng.normal(size=(batch, dim)).astype(np.float32),
          "y": rng.normal(size=(batch, dim)).astype(np.float32)}
  return {"width": width, "hidden_layers": depth, "in_out_dim": dim, "global_batch": batch}, data


def mlp_setup(quick: bool, width: int | None = None) -> dict[str, Any]:
  """The MLP regression problem: model, loss, params and the global batch (host arrays);
  ``width`` overrides the hidden width (1024)."""
  config, data = _regression(quick, width)
  model = MLP(width=config["width"], depth=config["hidden_layers"], out=config["in_out_dim"])
  params = jax.jit(model.init)(jax.random.key(0), data["x"][:1])

  def loss_fn(params, batch):
    return jnp.mean((model.apply(params, batch["x"]) - batch["y"]) ** 2)

  return {"loss": loss_fn, "params": params, "batch": data, "config": config}


def bn_mlp_setup(quick: bool) -> dict[str, Any]:
  """``mlp_setup``'s problem with BatchNorm in train mode: each micro-batch's statistics
  enter the loss, so k micro-batches give the mean over the global micro-batches' losses
  (not the large batch's), and per-device statistics would give another result."""
  config, data = _regression(quick)
  model = BatchNormMLP(width=config["width"], depth=config["hidden_layers"],
                       out=config["in_out_dim"])
  variables = jax.jit(model.init)(jax.random.key(0), data["x"][:2])
  stats = variables["batch_stats"]

  def loss_fn(params, batch):
    out, _ = model.apply({"params": params, "batch_stats": stats}, batch["x"],
                         mutable=["batch_stats"])
    return jnp.mean((out - batch["y"]) ** 2)

  return {"loss": loss_fn, "params": variables["params"], "batch": data,
          "config": {**config, "batch_norm": True}, "mixes_examples": True}


def lm_setup(quick: bool, seq: int | None = None) -> dict[str, Any]:
  """The LM problem: next-token cross-entropy (mean over tokens) on random tokens;
  ``seq`` overrides the sequence length (256; 32 with ``quick``)."""
  vocab, width, default_seq = (64, 32, 32) if quick else (256, 128, 256)
  seq = seq or default_seq
  layers, heads, batch = 2, 4, 64
  model = LM(vocab=vocab, width=width, layers=layers, heads=heads, seq=seq)
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, vocab, size=(batch, seq + 1)).astype(np.int32)
  data = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
  params = jax.jit(model.init)(jax.random.key(0), data["inputs"][:1])

  def loss_fn(params, batch):
    # FSDP on an Explicit mesh: the params flax's own layers use are gathered first, as a
    # user writes it (a no-op for replicated params and inside fxaccum's device view).
    params = jax.tree.map(lambda p: _gathered(p, DATA), params)
    logits = model.apply(params, batch["inputs"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()

  config = {"vocab": vocab, "width": width, "layers": layers, "heads": heads, "seq": seq,
            "global_batch": batch}
  return {"loss": loss_fn, "params": params, "batch": data, "config": config}


def n_params(params: Any) -> int:
  """Number of scalars in a params tree."""
  return int(sum(np.size(p) for p in jax.tree.leaves(params)))


# ------------------------------------------------------------------------- layouts

LAYOUTS = {
    "replicated": "data parallel: mesh ('data',) over all devices, params replicated",
    "replicated_auto": "the replicated layout on an Auto mesh (axis_types=(AxisType.Auto,)): "
                       "no sharding in types, so no reduced/unreduced types either",
    "fsdp": "FSDP: mesh ('data',) over all devices, each param's largest dimension that "
            "divides evenly sharded over 'data' (gathered in the model, see Dense)",
    "data_x_model": "data x model: mesh ('data', 'model') = (devices / 2, 2), Dense kernels "
                    "alternately column- (P(None, 'model')) and row-parallel "
                    "(P('model', None)), Megatron style",
}


def layout_mesh(name: str) -> Any:
  """The mesh of layout ``name`` on all devices (Explicit axes, ``jax.make_mesh``'s
  default); raises ValueError when the devices cannot hold it."""
  n = jax.device_count()
  if name in ("fsdp", "data_x_model") and n < 2:
    raise ValueError(f"the {name} layout needs at least 2 devices, found {n}")
  if name == "data_x_model":
    if n % 2:
      raise ValueError(f"the data_x_model layout needs an even device count, found {n}")
    return jax.make_mesh((n // 2, 2), (DATA, MODEL))
  if name == "replicated_auto":
    return jax.make_mesh((n,), (DATA,), axis_types=(jax.sharding.AxisType.Auto,))
  return jax.make_mesh((n,), (DATA,))


def layout_specs(name: str, params: Any, mesh: Any) -> Any:
  """The PartitionSpec of every param under layout ``name`` (see ``LAYOUTS``)."""
  if name in ("replicated", "replicated_auto"):
    return jax.tree.map(lambda _: P(), params)
  if name == "data_x_model":
    layers = sorted(params["params"], key=lambda m: int(m.rsplit("_", 1)[1]))
    return {"params": {m: {"kernel": P(None, MODEL), "bias": P(MODEL)} if i % 2 == 0 else
                       {"kernel": P(MODEL, None), "bias": P()}
                       for i, m in enumerate(layers)}}
  return jax.tree.map(lambda leaf: fsdp_spec(leaf.shape, mesh.shape[DATA]), params)


def fsdp_spec(shape: tuple[int, ...], devices: int, *, along: str = "largest") -> Any:
  """FSDP: sharded over ``DATA`` along the ``"largest"`` (or the ``"last"``: never the
  stacked layers' dimension 0 of a scanned kernel) dimension that ``devices`` divides;
  replicated if none does."""
  dims = [d for d in range(len(shape)) if shape[d] % devices == 0]
  if not dims:
    return P()
  dim = max(dims, key=lambda d: shape[d]) if along == "largest" else dims[-1]
  return P(*(DATA if d == dim else None for d in range(dim + 1)))


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
  """``{prefix}_rel_err`` (floored), ``..._raw`` (unfloored), ``..._worst_leaf`` and
  ``..._global`` (max|a - b| over the whole tree / its max|b|: a leaf's floor of 1)."""
  err, leaf = rel_err(actual, expected)
  raw, raw_leaf = rel_err(actual, expected, floor=0.0)
  whole, _ = rel_err(actual, expected, floor=1.0)
  return {f"{prefix}_rel_err": err, f"{prefix}_rel_err_worst_leaf": leaf,
          f"{prefix}_rel_err_raw": raw, f"{prefix}_rel_err_raw_worst_leaf": raw_leaf,
          f"{prefix}_rel_err_global": whole}


def delta(new: Any, old: Any) -> Any:
  """new - old per leaf, in float64 (the one-step update)."""
  return jax.tree.map(lambda a, b: np.asarray(a, np.float64) - np.asarray(b, np.float64),
                      new, old)


def compile_and_report(fn: Callable, mesh: Any, *args: Any) -> tuple[Any, diagnostics.Report]:
  """Compiles ``jax.jit(fn)`` once for ``args``; the executable and its diagnostics."""
  compiled = jax.jit(fn).lower(*args).compile()
  return compiled, diagnostics.from_compiled(compiled, mesh=mesh)


def interleaved(runs: dict[str, Callable[[], Any]], repeats: int,
                warmups: int = 1) -> dict[str, tuple[float, list[float], Any]]:
  """Per run: median wall time in ms over ``repeats`` runs, the times, and the output of
  its first (untimed) warm-up run. The runs take turns, so that load from other processes
  on a shared machine hits all of them alike; each is waited for before the next starts."""
  outs = {name: jax.block_until_ready(run()) for name, run in runs.items()}
  for _ in range(warmups - 1):  # e.g. the allocator settling on large fresh buffers
    for run in runs.values():
      jax.block_until_ready(run())
  times: dict[str, list[float]] = {name: [] for name in runs}
  for _ in range(repeats):
    for name, run in runs.items():
      start = time.perf_counter()
      jax.block_until_ready(run())
      times[name].append((time.perf_counter() - start) * 1e3)
  return {name: (statistics.median(times[name]), times[name], outs[name]) for name in runs}


def time_ms(run: Callable[[], Any], repeats: int) -> tuple[float, list[float]]:
  """Median wall time of ``run()`` in ms over ``repeats`` runs, after one warm-up."""
  ms, times, _ = interleaved({"run": run}, repeats)["run"]
  return ms, times


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
  """Device kind / platform / count, host CPUs, f32 matmul precision and library versions,
  for the JSON. The precision matters on GPU: XLA:GPU's default (None) multiplies f32 in
  TF32, whose rounding shows in the error columns (``JAX_DEFAULT_MATMUL_PRECISION=highest``
  for full f32)."""
  device = jax.devices()[0]
  return {
      "device_kind": device.device_kind,
      "platform": device.platform,
      "device_count": jax.device_count(),
      "host_cpus": os.cpu_count(),
      "matmul_precision": jax.config.jax_default_matmul_precision,
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
