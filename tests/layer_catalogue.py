"""flax's layer catalogue in train mode, through fxaccum (issue 40, item 2).

One tiny model per stateful (or stateful-looking) flax layer, NNX and linen, each used in a
loss in train mode. A case runs ``fxaccum.value_and_grad(loss, micro_batches=k)`` under one
``nnx.jit`` (NNX) or ``jax.jit`` (linen) on 8 devices, the batch sharded ``P("data")`` on an
Auto or Explicit mesh, and compares it with the independent reference: ``nnx.value_and_grad``
/ ``jax.value_and_grad`` called on the k global micro-batches (rows ``i::k``) one after
another, on the same module (NNX) or threading ``batch_stats`` by hand (linen), jitted once
per micro-batch shape. Compared: the value, the gradients and the state after the step
(every NNX variable, Params that a layer writes included; linen's threaded ``batch_stats``
and its averaged plain aux).

A layer whose semantics fxaccum cannot reproduce must be refused with an error naming it:
such a case names the pattern the error must match (``Case.refuses``).

``python -m tests.layer_catalogue`` (from the repository root) prints the table: the largest
relative error over value, gradients and state per layer, mesh and k, and the view fxaccum
took (``fxaccum.diagnostics.paths``).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import sys
import warnings
from collections.abc import Callable
from typing import Any

if __name__ == "__main__":  # before JAX starts: the suite's 8 CPU devices (tests/conftest.py)
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0"
                             " --xla_force_host_platform_device_count=8").strip()
  os.environ.setdefault("JAX_PLATFORMS", "cpu")

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import fxaccum
from fxaccum import diagnostics

ROWS, FEATURES, TIME, MAX_LEN = 32, 8, 4, 4
KS = (1, 2, 4)
MESHES = {"Auto": AxisType.Auto, "Explicit": AxisType.Explicit}


# ---------------------------------------------------------------------------------------------
# Data


def vectors(seed: int = 0) -> dict[str, np.ndarray]:
  """Rows of FEATURES features and a scalar target."""
  rng = np.random.default_rng(seed)
  return {"x": rng.normal(size=(ROWS, FEATURES)).astype(np.float32),
          "y": rng.normal(size=(ROWS,)).astype(np.float32)}


def sequences(seed: int = 0) -> dict[str, np.ndarray]:
  """Rows of TIME steps of FEATURES // 2 features and a scalar target (RNNs)."""
  rng = np.random.default_rng(seed)
  return {"x": rng.normal(size=(ROWS, TIME, FEATURES // 2)).astype(np.float32),
          "y": rng.normal(size=(ROWS,)).astype(np.float32)}


def tokens(seed: int = 0) -> dict[str, np.ndarray]:
  """One decoding position per row, (ROWS, 1, FEATURES) (attention with a decode cache)."""
  rng = np.random.default_rng(seed)
  return {"x": rng.normal(size=(ROWS, 1, FEATURES)).astype(np.float32),
          "y": rng.normal(size=(ROWS,)).astype(np.float32)}


def micro(batch, i: int, k: int):
  """Global micro-batch ``i``: rows ``i, i + k, i + 2k, ...``."""
  return jax.tree.map(lambda a: a[i::k], batch)


def mse(pred, y):
  return jnp.mean((pred - y) ** 2)


# ---------------------------------------------------------------------------------------------
# NNX models (each built fresh and deterministically by ``make(k)``)


class Head(nnx.Module):
  """``body`` -> tanh -> Linear(FEATURES, 1); ``body`` is the layer under test."""

  def __init__(self, body: Callable[[Any], Any], rngs: nnx.Rngs):
    self.body = body
    self.out = nnx.Linear(FEATURES, 1, rngs=rngs)

  def __call__(self, x):
    return self.out(jnp.tanh(self.body(x)))[..., 0]


def nnx_loss(model, batch):
  return mse(model(batch["x"]), batch["y"])


def batch_norm(k):
  rngs = nnx.Rngs(0)
  return Head(nnx.Sequential(nnx.Linear(FEATURES, FEATURES, use_bias=False, rngs=rngs),
                             nnx.BatchNorm(FEATURES, momentum=0.8, rngs=rngs)), rngs)


def spectral_norm(k):
  rngs = nnx.Rngs(0)
  return Head(nnx.SpectralNorm(nnx.Linear(FEATURES, FEATURES, rngs=rngs), rngs=rngs), rngs)


def weight_norm(k):
  rngs = nnx.Rngs(0)
  # A scale away from 1 so that the written kernel (columns of norm 1.5) differs from the
  # initial one at every call, not only the first.
  return Head(nnx.WeightNorm(nnx.Linear(FEATURES, FEATURES, rngs=rngs), rngs=rngs,
                             scale_init=nnx.initializers.constant(1.5)), rngs)


def dropout(k):
  rngs = nnx.Rngs(0, dropout=1)
  return Head(nnx.Sequential(nnx.Linear(FEATURES, FEATURES, rngs=rngs),
                             nnx.Dropout(0.5, rngs=rngs)), rngs)


class Decoder(nnx.Module):
  """Self-attention decoding one position per call (``decode=True``): the cache of keys and
  values and its index advance on every call, as in a decode loop."""

  def __init__(self, cache_rows: int, rngs: nnx.Rngs):
    self.attention = nnx.MultiHeadAttention(num_heads=2, in_features=FEATURES,
                                            qkv_features=FEATURES, decode=True, rngs=rngs)
    self.attention.init_cache((cache_rows, MAX_LEN, FEATURES))
    mesh = jax.sharding.get_abstract_mesh()
    if "data" in mesh.axis_names:
      # Under a mesh the cache's rows are sharded like the batch's: on an Explicit mesh
      # dynamic_update_slice requires it (plain JAX, with or without fxaccum).
      for cache in (self.attention.cached_key, self.attention.cached_value):
        cache.set_value(jax.device_put(cache.get_value(), P("data")))
    self.out = nnx.Linear(FEATURES, 1, rngs=rngs)

  def __call__(self, x):
    return self.out(jnp.tanh(self.attention(x)))[:, 0, 0]


def decode_cache_per_micro_batch(k):
  return Decoder(ROWS // k, nnx.Rngs(0))


def decode_cache_whole_batch(k):
  return Decoder(ROWS, nnx.Rngs(0))


class Recurrent(nnx.Module):
  """nnx.RNN over TIME steps (its carry RngStream advances per call), last output -> Linear."""

  def __init__(self, cell: type, rngs: nnx.Rngs):
    self.rnn = nnx.RNN(cell(FEATURES // 2, FEATURES, rngs=rngs), rngs=rngs)
    self.out = nnx.Linear(FEATURES, 1, rngs=rngs)

  def __call__(self, x):
    return self.out(self.rnn(x)[:, -1])[..., 0]


def bidirectional(k):
  rngs = nnx.Rngs(0)
  model = Recurrent(nnx.GRUCell, rngs)
  half = FEATURES // 2
  model.rnn = nnx.Bidirectional(nnx.RNN(nnx.GRUCell(half, half, rngs=rngs), rngs=rngs),
                                nnx.RNN(nnx.GRUCell(half, half, rngs=rngs), rngs=rngs))
  return model


def lora(k):
  rngs = nnx.Rngs(0)
  base = nnx.Linear(FEATURES, FEATURES, rngs=rngs)
  return Head(nnx.LoRA(FEATURES, 2, FEATURES, base_module=base, rngs=rngs), rngs)


def lora_linear(k):
  rngs = nnx.Rngs(0)
  return Head(nnx.LoRALinear(FEATURES, FEATURES, lora_rank=2, rngs=rngs), rngs)


class Sower(nnx.Module):
  """Sows the hidden mean (``nnx.Intermediate``) once per call."""

  def __init__(self, rngs: nnx.Rngs):
    self.up = nnx.Linear(FEATURES, FEATURES, rngs=rngs)
    self.out = nnx.Linear(FEATURES, 1, rngs=rngs)

  def __call__(self, x):
    h = jnp.tanh(self.up(x))
    self.sow(nnx.Intermediate, "hidden_mean", jnp.mean(h))
    return self.out(h)[..., 0]


# ---------------------------------------------------------------------------------------------
# linen models: ``loss(params, state, batch, key) -> (value, aux)``, state threaded as
# ``fxaccum.State`` where the layer has one.


class LinenBatchNorm(nn.Module):
  @nn.compact
  def __call__(self, x):
    dense = nn.Dense(FEATURES, use_bias=False)  # BatchNorm cancels a bias
    h = nn.BatchNorm(use_running_average=False, momentum=0.8)(dense(x))
    return nn.Dense(1)(jnp.tanh(h))[..., 0]


class LinenDropout(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = nn.Dropout(0.5, deterministic=False)(nn.Dense(FEATURES)(x))
    return nn.Dense(1)(jnp.tanh(h))[..., 0]


class LinenSpectralNorm(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = nn.SpectralNorm(nn.Dense(FEATURES))(x, update_stats=True)
    return nn.Dense(1)(jnp.tanh(h))[..., 0]


class LinenWeightNorm(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = nn.WeightNorm(nn.Dense(FEATURES))(x)
    return nn.Dense(1)(jnp.tanh(h))[..., 0]


class LinenRNN(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(1)(nn.RNN(nn.LSTMCell(FEATURES))(x)[:, -1])[..., 0]


class LinenSow(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = jnp.tanh(nn.Dense(FEATURES)(x))
    self.sow("intermediates", "hidden_mean", jnp.mean(h))
    return nn.Dense(1)(h)[..., 0]


def linen_loss(module: nn.Module, mutable: tuple[str, ...] = ()):
  """The loss of a linen module: ``batch_stats`` (if mutable) threaded via fxaccum.State,
  other mutable collections (sown values) returned as plain aux, averaged."""

  def loss(params, state, batch, key):
    variables = {"params": params, **({"batch_stats": state} if state is not None else {})}
    pred, updates = module.apply(variables, batch["x"], rngs={"dropout": key},
                                 mutable=list(mutable))
    aux = {name: value for name, value in updates.items() if name != "batch_stats"}
    if state is not None:
      aux["state"] = fxaccum.State(updates["batch_stats"])
    return mse(pred, batch["y"]), aux

  return loss


# ---------------------------------------------------------------------------------------------
# The table


@dataclasses.dataclass(frozen=True)
class Case:
  """One layer in train mode. ``make(k)`` builds the NNX module (``kind="nnx"``) or the linen
  module (``kind="linen"``); ``data`` the batch. ``refuses``: a regex the error fxaccum
  raises must match, for the k where it applies (``refuses_from``), None if reproducible.
  ``explicit_error``: on an Explicit mesh flax itself fails (plain nnx.value_and_grad /
  jax.value_and_grad on the sharded batch, without fxaccum, raises it too): the regex of
  that error, which fxaccum must pass through unchanged."""

  name: str
  kind: str
  make: Callable[[int], Any]
  data: Callable[[], dict[str, np.ndarray]] = vectors
  mutable: tuple[str, ...] = ()
  wrt: Any = nnx.Param
  refuses: str | None = None
  refuses_from: int = 2
  explicit_error: str | None = None
  doc: str = ""

  def refused(self, k: int) -> str | None:
    return self.refuses if self.refuses is not None and k >= self.refuses_from else None


#: flax's recurrent layers on an Explicit mesh: the zero initial carry is replicated, the
#: carry the cell returns is sharded like the batch.
SCAN_CARRY = r"scan body function carry input and carry output must have equal types"

CASES = [
    Case("nnx.BatchNorm", "nnx", batch_norm,
         doc="train-mode batch statistics; running mean/var threaded micro-batch by micro-batch"),
    Case("nnx.SpectralNorm", "nnx", spectral_norm,
         doc="power iteration state (u, sigma) threaded; the kernel it writes threaded and "
             "written back"),
    Case("nnx.WeightNorm", "nnx", weight_norm,
         doc="the normalized kernel it writes is what the next micro-batch reads and "
             "differentiates"),
    Case("nnx.Dropout", "nnx", dropout,
         doc="the module's own Rngs advance once per micro-batch: distinct masks, count k"),
    Case("nnx.MultiHeadAttention decode (cache per micro-batch)", "nnx",
         decode_cache_per_micro_batch, data=tokens,
         doc="decode=True with a cache sized for one micro-batch: cache and index advance "
             "once per micro-batch, as k decode calls would"),
    Case("nnx.MultiHeadAttention decode (cache for the whole batch)", "nnx",
         decode_cache_whole_batch, data=tokens,
         refuses=r"MultiHeadAttention",
         doc="a cache with the whole batch's rows cannot take a micro-batch: k=1 is exact, "
             "k>1 must be refused naming the layer"),
    Case("nnx.RNN(LSTMCell)", "nnx", lambda k: Recurrent(nnx.LSTMCell, nnx.Rngs(0)),
         data=sequences, explicit_error=SCAN_CARRY,
         doc="scan over time; the RNN's carry RngStream count advances per call"),
    Case("nnx.RNN(GRUCell)", "nnx", lambda k: Recurrent(nnx.GRUCell, nnx.Rngs(0)),
         data=sequences, explicit_error=SCAN_CARRY, doc="as LSTMCell with a GRU cell"),
    Case("nnx.Bidirectional(RNN(GRUCell))", "nnx", bidirectional, data=sequences,
         explicit_error=SCAN_CARRY,
         doc="two RNNs, one reversed; both carry RNG counts advance"),
    Case("nnx.LoRA (grads of LoRAParam only)", "nnx", lora,
         wrt=nnx.LoRAParam, doc="argnums=nnx.DiffState(0, nnx.LoRAParam): base frozen"),
    Case("nnx.LoRALinear", "nnx", lora_linear, doc="all Params, LoRAParam included"),
    Case("sow (nnx.Intermediate)", "nnx", lambda k: Sower(nnx.Rngs(0)),
         doc="one sown value appended per micro-batch, in order"),
    Case("nn.BatchNorm", "linen", lambda k: LinenBatchNorm(), mutable=("batch_stats",),
         doc="batch_stats through state_argnums + fxaccum.State"),
    Case("nn.Dropout", "linen", lambda k: LinenDropout(),
         explicit_error=r"select `which` must be scalar or have the same sharding",
         doc="rng_argnums: fold_in(key, i) per micro-batch"),
    Case("nn.SpectralNorm", "linen", lambda k: LinenSpectralNorm(), mutable=("batch_stats",),
         doc="u and sigma in batch_stats, threaded through state_argnums"),
    Case("nn.WeightNorm", "linen", lambda k: LinenWeightNorm(), doc="stateless reparametrization"),
    Case("nn.RNN(LSTMCell)", "linen", lambda k: LinenRNN(), data=sequences,
         doc="scan over time, no state; runs per device (device view), so unlike plain "
             "jax.value_and_grad it also runs on an Explicit mesh"),
    Case("sow (mutable=['intermediates'])", "linen", lambda k: LinenSow(),
         mutable=("intermediates",), doc="sown values come back as plain aux: averaged"),
]
BY_NAME = {case.name: case for case in CASES}


# ---------------------------------------------------------------------------------------------
# State, errors


def to_numpy(tree):
  """Leaves as float64/int numpy; PRNG keys as their key data."""
  def leaf(a):
    if isinstance(a, jax.Array) and jnp.issubdtype(a.dtype, jax.dtypes.prng_key):
      a = jax.random.key_data(a)
    return np.asarray(a)
  return jax.tree.map(leaf, tree)


def nnx_state(model):
  """Every variable of the module (Params included: WeightNorm and SpectralNorm write theirs)."""
  return to_numpy(nnx.to_pure_dict(nnx.state(model)))


def max_rel_error(actual, expected, floor: float = 1e-3) -> float:
  """Largest |a - b| over every leaf, relative to the leaf's largest reference magnitude
  (floored at ``floor`` x the tree's, as helpers.assert_tree_close); inf if the trees differ."""
  actual, expected = to_numpy(actual), to_numpy(expected)
  if jax.tree.structure(actual) != jax.tree.structure(expected):
    return float("inf")
  pairs = list(zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True))
  if not pairs:
    return 0.0
  tree_scale = max(float(np.max(np.abs(b.astype(np.float64)), initial=0)) for _, b in pairs)
  worst = 0.0
  for a, b in pairs:
    if a.shape != b.shape:
      return float("inf")
    a, b = a.astype(np.float64), b.astype(np.float64)
    scale = max(float(np.max(np.abs(b), initial=0)), floor * tree_scale, 1e-30)
    worst = max(worst, float(np.max(np.abs(a - b), initial=0)) / scale)
  return worst


# ---------------------------------------------------------------------------------------------
# The reference (independent of fxaccum; shared by both meshes)


def nnx_argnums(case: Case):
  return 0 if case.wrt is nnx.Param else nnx.DiffState(0, case.wrt)


@functools.cache
def reference(name: str, k: int):
  """(value, grads, state) of the layer's loss called on the k micro-batches one after
  another: nnx.value_and_grad on one module (NNX), jax.value_and_grad threading batch_stats
  and folding the key per micro-batch (linen); jitted once per micro-batch shape."""
  case = BY_NAME[name]
  batch = case.data()
  values, grads = [], []
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)  # Module.sow
    if case.kind == "nnx":
      model = case.make(k)
      step = nnx.jit(nnx.value_and_grad(nnx_loss, argnums=nnx_argnums(case)))
      for i in range(k):
        value, g = step(model, micro(batch, i, k))
        values.append(value)
        grads.append(nnx.to_pure_dict(g))
      state = nnx_state(model)
    else:
      params, stats, key = linen_init(case, k)
      loss = linen_loss(case.make(k), case.mutable)
      step = jax.jit(jax.value_and_grad(loss, has_aux=True))
      auxes = []
      for i in range(k):
        (value, aux), g = step(params, stats, micro(batch, i, k), jax.random.fold_in(key, i))
        if stats is not None:
          stats = aux.pop("state").value
        values.append(value)
        grads.append(g)
        auxes.append(aux)
      state = {"batch_stats": stats, "aux": jax.tree.map(lambda *a: np.mean(a, axis=0), *auxes)}
  mean = jax.tree.map(lambda *a: np.mean(np.stack(a), axis=0), *grads)
  return float(np.mean(values)), to_numpy(mean), to_numpy(state)


def linen_init(case: Case, k: int):
  """(params, batch_stats or None, dropout key) of a linen case."""
  x = case.data()["x"][:2]
  variables = case.make(k).init({"params": jax.random.key(0), "dropout": jax.random.key(1)}, x)
  stats = variables.get("batch_stats") if "batch_stats" in case.mutable else None
  return variables["params"], stats, jax.random.key(2)


# ---------------------------------------------------------------------------------------------
# fxaccum


@dataclasses.dataclass
class Result:
  """Max relative errors against the reference, the view(s) fxaccum took, or its error."""

  value: float = float("nan")
  grads: float = float("nan")
  state: float = float("nan")
  views: tuple[str, ...] = ()
  error: BaseException | None = None

  @property
  def worst(self) -> float:
    return max(self.value, self.grads, self.state)


def sharded(batch, mesh):
  return jax.tree.map(lambda a: jax.device_put(a, NamedSharding(mesh, P("data"))), batch)


def run_case(case: Case, k: int, axis_type: AxisType, views: bool = False) -> Result:
  """fxaccum's step for ``case`` at ``k`` on an 8-device data mesh of ``axis_type``, compared
  with the reference. An exception from fxaccum is returned in ``Result.error``. ``views``:
  also record the view each fxaccum call took (diagnostics.paths; traces the step again)."""
  mesh = jax.make_mesh((8,), ("data",), axis_types=(axis_type,))
  result = Result()
  try:
    with warnings.catch_warnings(), jax.set_mesh(mesh):
      warnings.simplefilter("ignore", DeprecationWarning)  # Module.sow
      batch = sharded(case.data(), mesh)
      if case.kind == "nnx":
        model = case.make(k)
        grad_fn = fxaccum.value_and_grad(nnx_loss, argnums=nnx_argnums(case), micro_batches=k)
        if views:
          result.views = tuple(p.view for p in diagnostics.paths(
              nnx.jit(grad_fn), nnx.clone(model), batch))
        value, grads = nnx.jit(grad_fn)(model, batch)
        state = nnx_state(model)
      else:
        params, stats, key = linen_init(case, k)
        grad_fn = fxaccum.value_and_grad(
            linen_loss(case.make(k), case.mutable), has_aux=True, micro_batches=k,
            batch_argnums=2, rng_argnums=3, state_argnums=1 if stats is not None else ())
        if views:
          result.views = tuple(p.view for p in diagnostics.paths(
              jax.jit(grad_fn), params, stats, batch, key))
        (value, aux), grads = jax.jit(grad_fn)(params, stats, batch, key)
        if stats is not None:
          stats = aux.pop("state")
        state = {"batch_stats": stats, "aux": aux}
  except Exception as error:  # noqa: BLE001 - reported, and checked by the tests
    result.error = error
    return result
  want_value, want_grads, want_state = reference(case.name, k)
  result.value = max_rel_error(np.float32(value), np.float32(want_value))
  result.grads = max_rel_error(nnx.to_pure_dict(grads) if isinstance(grads, nnx.State)
                               else grads, want_grads)
  result.state = max_rel_error(state, want_state)
  return result


def first_line(error: BaseException, width: int = 160) -> str:
  text = f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error) else ''}"
  return text if len(text) <= width else text[:width - 3] + "..."


def table() -> str:
  """The markdown table: max relative error (or the error) per layer, mesh and k."""
  head = ["layer"] + [f"{mesh} k={k}" for mesh in MESHES for k in KS] + ["view (Auto, k=2)"]
  lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  errors = []
  for case in CASES:
    cells, view = [], ""
    for axis_type in MESHES.values():
      for k in KS:
        result = run_case(case, k, axis_type, views=(axis_type is AxisType.Auto and k == 2))
        if result.views:
          view = ", ".join(result.views)
        if result.error is not None:
          errors.append((case.name, k, axis_type.name, result.error))
          flax = (axis_type is AxisType.Explicit and case.explicit_error is not None
                  and re.search(case.explicit_error, str(result.error)))
          cells.append(f"{'flax error' if flax else 'error'} ({len(errors)})")
        else:
          cells.append(f"{result.worst:.1e}")
      print(f"  {case.name}: {cells[-3:]}", file=sys.stderr, flush=True)
    lines.append("| " + " | ".join([case.name, *cells, view or "-"]) + " |")
  lines.append("")
  for n, (name, k, mesh, error) in enumerate(errors, 1):
    lines.append(f"({n}) {name}, {mesh} k={k}: `{re.sub(r'`', '', first_line(error))}`  ")
  return "\n".join(lines)


if __name__ == "__main__":
  print(table())
