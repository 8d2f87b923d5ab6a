"""Shared test data, models and references (plain JAX, independent of fxaccum), and the
harness of the view analysis's rule tests (tests/test_rules*.py)."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import fxaccum
from fxaccum.analysis import analyze, mixing
from fxaccum.jaxprs import eqns_within

BATCH, TOKENS, DIM, HIDDEN = 64, 8, 8, 16


def version_tuple(text: str) -> tuple[int, ...]:
  """A release's major and minor numbers: "0.12.0.1" -> (0, 12)."""
  return tuple(int(part) for part in text.split(".")[:2])


JAX_VERSION = version_tuple(metadata.version("jax"))


def make_data(seed: int = 0, k: int = 4, batch: int = BATCH):
  """Token data with skewed masks: rows of micro-batch k-1 are all padding (k > 1), every
  5th row is empty, and a few rows hold many more tokens than the rest."""
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(batch, TOKENS, DIM)).astype(np.float32)
  y = rng.normal(size=(batch, TOKENS)).astype(np.float32)
  lengths = rng.integers(1, 3, size=batch)
  lengths[::7] = TOKENS  # a few long rows
  lengths[2::5] = 0  # empty examples
  if k > 1:
    # With fxaccum's strided split, global row r falls in micro-batch r % k on any mesh.
    lengths[np.arange(batch) % k == k - 1] = 0
  mask = (np.arange(TOKENS)[None, :] < lengths[:, None]).astype(np.float32)
  return {"x": x, "y": y, "mask": mask}


def make_params(seed: int = 1):
  rng = np.random.default_rng(seed)
  return {
      "w1": (rng.normal(size=(DIM, HIDDEN)) / np.sqrt(DIM)).astype(np.float32),
      "b1": (0.1 * rng.normal(size=(HIDDEN,))).astype(np.float32),
      "w2": (rng.normal(size=(HIDDEN, 1)) / np.sqrt(HIDDEN)).astype(np.float32),
  }


def row_parallel_matmul(h, w):
  """``h @ w``; on an Explicit mesh with ``w`` sharded over its contracted dimension JAX
  needs the output sharding spelled out (a plain-JAX rule, not fxaccum's)."""
  sharding = jax.typeof(w).sharding
  if sharding.spec and sharding.spec[0] is not None:
    spec = tuple(jax.typeof(h).sharding.spec)[:-1] + (None,)
    return jnp.matmul(h, w, out_sharding=P(*spec))
  return h @ w


def token_loss(params, batch):
  h = jnp.tanh(batch["x"] @ params["w1"] + params["b1"])
  pred = row_parallel_matmul(h, params["w2"])[..., 0]
  return (pred - batch["y"]) ** 2


def weighted_loss(params, batch):
  """fxaccum form: summed token losses and the number of valid tokens."""
  return fxaccum.Weighted(jnp.sum(batch["mask"] * token_loss(params, batch)),
                          jnp.sum(batch["mask"]))


def example_mean_loss(params, batch):
  """Mean over the examples of the (unmasked) per-example mean token loss."""
  return jnp.mean(token_loss(params, batch))


def reference_token_mean(params, batch):
  """The token mean on the full batch: sum(mask * l) / max(sum(mask), 1)."""
  return jnp.sum(batch["mask"] * token_loss(params, batch)) / jnp.maximum(
      jnp.sum(batch["mask"]), 1.0)


def naive_mean_of_means(params, batch, k):
  """The 2024 accumulation bug: average of per-micro-batch token means (0 if empty)."""
  means = []
  for i in range(k):
    micro = jax.tree.map(lambda a, i=i: a[i::k], batch)
    means.append(fxaccum.Weighted(
        jnp.sum(micro["mask"] * token_loss(params, micro)), jnp.sum(micro["mask"])).value())
  return jnp.mean(jnp.stack(means))


def global_micro_batch_reference(loss, params, batch, k):
  """The contract: the mean of jax.value_and_grad over the k global micro-batches."""
  step = jax.jit(jax.value_and_grad(loss))
  results = [step(params, jax.tree.map(lambda a, i=i: a[i::k], batch)) for i in range(k)]
  return jax.tree.map(lambda *xs: sum(xs) / k, *results)


def assert_tree_close(actual, expected, rtol=1e-5, floor=1e-3):
  """Every leaf within rtol, relative to the leaf's largest reference magnitude (floored at
  `floor` x the tree's, for leaves whose exact value is 0 and hold only rounding noise,
  e.g. an attention key bias)."""
  expected_leaves = jax.tree.leaves(expected)
  assert len(jax.tree.leaves(actual)) == len(expected_leaves)
  tree_scale = max(float(np.max(np.abs(np.asarray(b, np.float64)), initial=0))
                   for b in expected_leaves)
  actual_leaves = jax.tree_util.tree_flatten_with_path(actual)[0]
  for (path, a), b in zip(actual_leaves, expected_leaves, strict=True):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert a.shape == b.shape, (jax.tree_util.keystr(path), a.shape, b.shape)
    scale = max(np.max(np.abs(b), initial=0), floor * tree_scale, 1e-30)
    np.testing.assert_allclose(a, b, rtol=rtol, atol=rtol * scale,
                               err_msg=jax.tree_util.keystr(path))


def mesh_of(shape, names, axis_type):
  return jax.make_mesh(shape, names, axis_types=(axis_type,) * len(names))


def put(tree, mesh, specs):
  """device_put every leaf with the PartitionSpec of the same key in `specs`."""
  return {k: jax.device_put(v, NamedSharding(mesh, specs.get(k, P()))) for k, v in tree.items()}


AXIS_TYPES = (AxisType.Auto, AxisType.Explicit)

#: make_data's batch sharded over `data` (for `put`).
DATA = {"x": P("data"), "y": P("data"), "mask": P("data")}


ROOT = Path(__file__).resolve().parents[1]


def subprocess_env() -> dict[str, str]:
  """The test environment for a subprocess that sets its own device count: XLA_FLAGS
  without the suite's, its other flags (tests/conftest.py) kept."""
  flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
           if not f.startswith("--xla_force_host_platform_device_count")]
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  if flags:
    env["XLA_FLAGS"] = " ".join(flags)
  return env


def run_script(path: str, *args: str, env: dict[str, str] | None = None) -> str:
  """Runs a repository script (it sets up its own 8 CPU devices) and returns its stdout;
  `env` adds environment variables."""
  done = subprocess.run([sys.executable, str(ROOT / path), *args], capture_output=True,
                        text=True, timeout=300, env={**subprocess_env(), **(env or {})})
  assert done.returncode == 0, (f"{path} {' '.join(args)} exited with {done.returncode}:\n"
                                f"{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
  return done.stdout


# The rule harness: one rule of the view analysis at a time, on `jax.make_jaxpr` of a tiny
# `fun(batch, param)`, no mesh.
ROWS = 8  # the examples of the harness's batch
X = jax.ShapeDtypeStruct((ROWS, 4), jnp.float32)  # the batch: ROWS examples of 4 features
W = jax.ShapeDtypeStruct((4, 4), jnp.float32)  # a param
IDS = jax.ShapeDtypeStruct((ROWS,), jnp.int32)  # per-example indices (or counts)


@dataclasses.dataclass(frozen=True)
class Case:
  """``fun(batch, param)`` must be accepted (or refused); its jaxpr holds ``primitive``."""

  primitive: str
  accept: bool
  fun: Callable[..., Any]
  batch: Any = X
  param: Any = W
  symbolic: bool = False  # traced with a symbolic number of rows
  reason: str = ""  # refused: a part of the reason
  axis_env: tuple[tuple[str, int], ...] = ()


def ok(name: str, fun: Callable[..., Any], **kw) -> Case:
  """A case the rule for primitive `name` must accept: no output mixes examples."""
  return Case(name, True, fun, **kw)


def no(name: str, fun: Callable[..., Any], **kw) -> Case:
  """A case the rule for primitive `name` must refuse: an output mixes examples."""
  return Case(name, False, fun, **kw)


def case_id(case: Case) -> str:
  """The test id of a case: its primitive and "ok" or "no"."""
  return f"{case.primitive}-{'ok' if case.accept else 'no'}"


def analyze_case(case: Case):
  """The case's closed jaxpr and the view analysis of it (batch input 0, param input 1);
  with `case.symbolic`, traced with a symbolic number of rows."""
  batch = case.batch
  rows: Any = ROWS if batch.shape[0] == ROWS else batch.shape[0]
  if case.symbolic:
    (rows,) = jax.export.symbolic_shape("rows")
    batch = jax.ShapeDtypeStruct((rows, *batch.shape[1:]), batch.dtype)
  closed = jax.make_jaxpr(case.fun, axis_env=list(case.axis_env))(batch, case.param)
  return closed, analyze(closed, rows=rows, batch_inputs=[0], param_inputs=[1])


def kinds_of(fun: Callable[..., Any], **kw) -> tuple:
  """The kinds the view analysis gives the outputs of `fun(batch, param)` (`Case` fields
  in `kw`)."""
  return analyze_case(Case("", True, fun, **kw))[1].outputs


def primitives_of(closed) -> set[str]:
  """The names of the primitives in a closed jaxpr, sub-jaxprs included."""
  return {e.primitive.name for eqn in closed.jaxpr.eqns for e in eqns_within(eqn)}


def check_case(case: Case) -> None:
  """The case's jaxpr holds its primitive, and the analysis accepts it (no output mixes
  examples) or refuses it (an output mixes them, for a reason that holds `case.reason`)."""
  closed, analysis = analyze_case(case)
  assert case.primitive in primitives_of(closed), closed
  reasons = [mixing(k) for k in analysis.outputs]
  if case.accept:
    assert reasons == [None] * len(reasons), analysis.outputs
  else:
    assert any(reasons), analysis.outputs
    assert any(case.reason in r for r in reasons if r), reasons
