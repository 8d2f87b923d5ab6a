"""Pipeline rows of the suite: ``fxaccum.pipeline`` against the same model without one.

The model: an embedding, ``STAGES * LAYERS`` residual MLP layers and a head, with a token
cross-entropy (``fxaccum.Weighted``). On the same devices:

* ``pipeline``: mesh (data D/S, stage S); the layers stacked into S stages, streamed in
  k micro-batches by ``fxaccum.pipeline`` (``remat=True``);
* ``data_parallel``: mesh (data D,); every device holds every layer, and
  ``fxaccum.value_and_grad(..., micro_batches=k)`` accumulates over k micro-batches.

Figures per k: median ms per step, the collectives by kind (bytes per step), temp memory,
parameter bytes per device, the bubble fraction and the gradient's max relative error
against the model on one device. (No FLOPs: XLA's cost analysis counts a loop body once,
whatever its trip count.) Simulated
CPU devices share the host's cores, so their times say little about a pipeline; on a host
with S or more accelerators, ``python benchmarks/run.py --setups pipeline`` times it there.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from common import errors, interleaved, md_header, md_row
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import fxaccum
from fxaccum import diagnostics

STAGES = 4
KINDS = ("all-reduce", "reduce-scatter", "all-gather", "collective-permute")


def config(quick: bool) -> dict[str, int]:
  width, vocab, seq = (32, 64, 16) if quick else (256, 512, 64)
  return {"stages": STAGES, "layers_per_stage": 2, "width": width, "vocab": vocab,
          "seq": seq, "global_batch": 64}


def init(cfg: dict[str, int]) -> tuple[dict, dict]:
  rng = np.random.default_rng(0)
  s, layers, w, v = cfg["stages"], cfg["layers_per_stage"], cfg["width"], cfg["vocab"]
  params = {
      "embed": rng.normal(size=(v, w)).astype(np.float32),
      "stages": {"w1": (rng.normal(size=(s, layers, w, 4 * w)) / math.sqrt(w)),
                 "w2": (rng.normal(size=(s, layers, 4 * w, w)) / math.sqrt(4 * w))},
      "head": (rng.normal(size=(w, v)) / math.sqrt(w)).astype(np.float32),
  }
  params["stages"] = jax.tree.map(lambda a: a.astype(np.float32), params["stages"])
  tokens = rng.integers(0, v, size=(cfg["global_batch"], cfg["seq"] + 1)).astype(np.int32)
  lengths = rng.integers(1, cfg["seq"] + 1, size=cfg["global_batch"])
  mask = (np.arange(cfg["seq"])[None] < lengths[:, None]).astype(np.float32)
  return params, {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "mask": mask}


def stage(p, x):
  """One stage: its residual MLP layers in order."""
  def layer(h, p_layer):
    return h + jax.nn.gelu(h @ p_layer["w1"]) @ p_layer["w2"], None
  return jax.lax.scan(layer, x, p)[0]


def sequential(stages, x):
  for s in range(jax.tree.leaves(stages)[0].shape[0]):
    x = stage(jax.tree.map(lambda a, s=s: a[s], stages), x)
  return x


def loss_with(decoder: Callable) -> Callable:
  def loss(params, batch):
    logits = decoder(params["stages"], params["embed"][batch["inputs"]]) @ params["head"]
    logp = jax.nn.log_softmax(logits)
    nll = -jnp.take_along_axis(logp, batch["targets"][..., None], -1)[..., 0]
    return fxaccum.Weighted(jnp.sum(nll * batch["mask"]), jnp.sum(batch["mask"]))
  return loss


def _collectives(rep: diagnostics.Report) -> dict[str, int]:
  return {kind: sum(c.bytes * c.executions for c in rep.select(kind)) for kind in KINDS}


def _method(name: str, k: int, params: dict, batch: dict, n: int) -> tuple[Any, dict, tuple]:
  """The compiled step of one method, its figures, and its placed arguments."""
  if name == "pipeline":
    mesh = jax.make_mesh((n // STAGES, STAGES), ("data", "stage"),
                         axis_types=(AxisType.Auto,) * 2)
    fn = fxaccum.value_and_grad(loss_with(lambda stages, x: fxaccum.pipeline(
        stage, stages, x, micro_batches=k)), micro_batches=1)
    specs = {"embed": P(), "head": P(), "stages": {"w1": P("stage"), "w2": P("stage")}}
  else:
    mesh = jax.make_mesh((n,), ("data",), axis_types=(AxisType.Auto,))
    fn = fxaccum.value_and_grad(loss_with(sequential), micro_batches=k)
    specs = jax.tree.map(lambda _: P(), params)
  with jax.set_mesh(mesh):
    args = (jax.tree.map(lambda a, s: jax.device_put(a, NamedSharding(mesh, s)), params, specs),
            jax.device_put(batch, NamedSharding(mesh, P("data"))))
    compiled = jax.jit(fn).lower(*args).compile()
  rep = diagnostics.from_compiled(compiled, mesh)
  param_bytes = sum(shard.data.nbytes for leaf in jax.tree.leaves(args[0])
                    for shard in leaf.addressable_shards[:1])
  figures = {"collective_bytes": _collectives(rep),
             "temp_bytes": rep.memory.temp_bytes, "param_bytes_per_device": param_bytes,
             "data_reductions_in_loop": len(rep.reductions("loop", axes="data"))}
  return compiled, figures, args


def run(quick: bool, ks: list[int], repeats: int, log: Callable[[str], None]) -> dict[str, Any]:
  """Both methods at every k: compiled, then timed in turns."""
  n = jax.device_count()
  if n < STAGES or n % STAGES:
    return {"skipped": f"the pipeline rows need a multiple of {STAGES} devices, found {n}"}
  cfg = config(quick)
  params, batch = init(cfg)
  reference = jax.jit(jax.grad(lambda p: loss_with(sequential)(p, batch).value()))
  with jax.default_matmul_precision("highest"):
    ref_grads = reference(params)
  out: dict[str, Any] = {"config": cfg, "devices": n, "by_k": {}}
  for k in ks:
    log(f"pipeline: k={k}")
    methods = {name: _method(name, k, params, batch, n)
               for name in ("pipeline", "data_parallel")}
    timed = interleaved({name: (lambda c=c, a=a: c(*a)) for name, (c, _, a) in methods.items()},
                        repeats)
    out["by_k"][str(k)] = {name: {
        "ms": timed[name][0], **figures,
        **errors("grad", jax.device_get(timed[name][2][1]), ref_grads),
        "bubble": fxaccum.diagnostics.bubble_fraction(STAGES, k) if name == "pipeline" else 0.0,
    } for name, (_, figures, _) in methods.items()}
  return out


def markdown(result: dict[str, Any]) -> str:
  """One row per (k, method)."""
  lines = md_header(["k", "method", "ms", "all-reduce KiB",
                     "all-gather KiB", "permute KiB", "temp KiB", "param KiB/device",
                     "bubble", "grad rel. err"], numeric_from=2)
  for k, by_method in result["by_k"].items():
    for name, r in by_method.items():
      c = r["collective_bytes"]
      lines.append(md_row([
          k, name, f"{r['ms']:.0f}",
          f"{(c['all-reduce'] + c['reduce-scatter']) / 1024:.0f}",
          f"{c['all-gather'] / 1024:.0f}", f"{c['collective-permute'] / 1024:.0f}",
          f"{r['temp_bytes'] / 1024:.0f}", f"{r['param_bytes_per_device'] / 1024:.0f}",
          f"{r['bubble']:.2f}", f"{r['grad_rel_err']:.1e}"]))
  return "\n".join(lines)
