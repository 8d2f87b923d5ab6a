"""A two-tower CLIP whose contrastive loss is the large batch's, at micro-batch memory.

Two residual MLP towers (an image tower on float features, a text tower on tokens, their
layers run by ``lax.scan``) embed synthetic pairs; the CLIP loss with a learnable
temperature takes every pair of the batch as negatives. The towers are wrapped in
``fxaccum.micro_batched(tower, micro_batches=k)``: each runs on one micro-batch (rows
``i::k`` of each device's rows) at a time, forward and backward, and only the
embeddings are kept for the whole batch, so the loss sees all ``n - 1`` negatives.
``jax.value_and_grad`` of that loss is the large batch's, exactly.

It prints a proof, against ``jax.value_and_grad`` with plain towers on the whole batch
(8 simulated devices, the batch sharded over ``data``):

* the gradient error of ``micro_batched`` at each k, and of the mean of the micro-batch
  losses (what accumulating the loss itself with ``fxaccum.value_and_grad(clip_loss,
  micro_batches=k)``, MultiSteps or big_vision computes: ``n/k - 1`` negatives), which is
  another loss;
* the compiled peak memory per device, against k, next to the large batch and a
  ``grad_cached``-style step (``lax.scan`` + ``jax.checkpoint`` over contiguous chunks);
* data-axis reductions inside loops, and the time of a step against the large batch's.

    python examples/contrastive.py                        # batch 512, 8 layers of width 64
    python examples/contrastive.py --batch 2048 --layers 32 --width 128 --repeats 5
"""

from __future__ import annotations

import argparse
import functools
import os
import time

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import fxaccum  # noqa: E402

D_IMG, VOCAB, TOKENS, EMBED = 32, 64, 8, 32
MiB = 2 ** 20


def residual_tower(p: dict, x: jax.Array) -> jax.Array:
  """``x @ w_in``, then ``h + tanh(h @ w + b)`` per layer (a ``lax.scan``), then ``w_out``."""
  def layer(h, wb):
    return h + jnp.tanh(h @ wb[0] + wb[1]), None

  h, _ = lax.scan(layer, x @ p["w_in"], (p["w"], p["b"]))
  return h @ p["w_out"]


def image_tower(p: dict, images: jax.Array) -> jax.Array:
  return residual_tower(p, images)


def text_tower(p: dict, tokens: jax.Array) -> jax.Array:
  """The mean of the tokens' embeddings (one-hot), then a residual tower."""
  bag = jnp.mean(jax.nn.one_hot(tokens, VOCAB), axis=1) @ p["embed"]
  return residual_tower(p["mlp"], bag)


def init_params(*, layers: int, width: int, seed: int = 0) -> dict:
  rng = np.random.default_rng(seed)

  def dense(*shape):
    return (rng.normal(size=shape) / np.sqrt(shape[-2])).astype(np.float32)

  def tower(d_in):
    return {"w_in": dense(d_in, width), "w": dense(layers, width, width) / np.sqrt(layers),
            "b": np.zeros((layers, width), np.float32), "w_out": dense(width, EMBED)}

  return {"image": tower(D_IMG), "text": {"embed": dense(VOCAB, D_IMG), "mlp": tower(D_IMG)},
          "log_temperature": np.float32(np.log(10.0))}


def synthetic_pairs(n: int, seed: int = 1) -> dict:
  """Images that are noisy functions of their caption's tokens: pairs that match."""
  rng = np.random.default_rng(seed)
  tokens = rng.integers(0, VOCAB, size=(n, TOKENS)).astype(np.int32)
  codes = rng.normal(size=(VOCAB, D_IMG)).astype(np.float32)
  images = codes[tokens].mean(axis=1) + 0.1 * rng.normal(size=(n, D_IMG)).astype(np.float32)
  return {"images": images, "tokens": tokens}


def clip_loss(params: dict, batch: dict, towers=(image_tower, text_tower)) -> jax.Array:
  """The symmetric InfoNCE loss over every pair of the batch, learnable temperature."""
  def unit(z):
    return z / jnp.linalg.norm(z, axis=-1, keepdims=True)

  zi = unit(towers[0](params["image"], batch["images"]))
  zt = unit(towers[1](params["text"], batch["tokens"]))
  logits = jnp.exp(params["log_temperature"]) * zi @ zt.T
  labels = jnp.arange(logits.shape[0])
  return (optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
          + optax.softmax_cross_entropy_with_integer_labels(logits.T, labels).mean()) / 2


def grad_cached(tower, k: int):
  """GradCache's JAX form: ``lax.scan`` of a ``jax.checkpoint``-ed tower over contiguous
  chunks (rows ``i * n/k : (i + 1) * n/k``)."""
  @functools.wraps(tower)
  def chunked(p, x):
    body = jax.checkpoint(lambda xc: tower(p, xc))
    _, ys = lax.scan(lambda c, xc: (c, body(xc)), None, x.reshape(k, -1, *x.shape[1:]))
    return ys.reshape(-1, *ys.shape[2:])
  return chunked


def steps(k: int) -> dict:
  """The train steps (loss and gradients) the proof compares, by name."""
  micro = tuple(fxaccum.micro_batched(t, micro_batches=k) for t in (image_tower, text_tower))
  cached = (grad_cached(image_tower, k), grad_cached(text_tower, k))
  return {"micro_batched": jax.value_and_grad(functools.partial(clip_loss, towers=micro)),
          "mean of micro-batch losses": fxaccum.value_and_grad(clip_loss, micro_batches=k),
          "grad_cached-style": jax.value_and_grad(functools.partial(clip_loss, towers=cached))}


def max_rel_error(grads, ref) -> float:
  errors = jax.tree.map(lambda a, b: float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b))),
                        grads, ref)
  return max(jax.tree.leaves(errors))


def time_ms(fn, args, repeats: int) -> float:
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(1e3 * (time.perf_counter() - start))
  return float(np.median(times))


def measure(*, batch: int, layers: int, width: int, ks, repeats: int) -> dict:
  """Per method and k: gradient error, peak MiB per device, loop reductions, ms per step."""
  mesh = jax.make_mesh((jax.device_count(),), ("data",), axis_types=(AxisType.Auto,))
  params, pairs = init_params(layers=layers, width=width), synthetic_pairs(batch)
  rows = []
  with jax.set_mesh(mesh):
    args = (jax.device_put(params, NamedSharding(mesh, P())),
            jax.device_put(pairs, NamedSharding(mesh, P("data"))))
    large = jax.jit(jax.value_and_grad(clip_loss))
    ref_value, ref = large(*args)
    methods = [("large batch", None, large)] + [
        (name, k, jax.jit(step)) for k in ks for name, step in steps(k).items()]
    for name, k, fn in methods:
      rep = fxaccum.diagnostics.report(fn, *args)
      value, grads = fn(*args)
      rows.append({"method": name, "k": k, "grad_error": max_rel_error(grads, ref),
                   "loss_error": abs(float(value - ref_value)) / abs(float(ref_value)),
                   "peak_mib": rep.memory.peak_bytes / MiB,
                   "loop_reductions": len(rep.reductions(place="loop", axes="data")),
                   "moves": rep.count(("all-gather", "collective-permute", "all-to-all")),
                   "ms": time_ms(fn, args, repeats) if repeats else None})
  return {"batch": batch, "layers": layers, "width": width, "devices": jax.device_count(),
          "device": jax.devices()[0].device_kind, "rows": rows}


def table(result: dict) -> str:
  """The proof as a table; times relative to the large batch's."""
  large = next(r for r in result["rows"] if r["method"] == "large batch")
  lines = [f"{'method':<28}{'k':>3}{'grad err':>10}{'peak MiB':>10}{'x large':>8}"
           f"{'loop red.':>10}{'moves':>6}{'ms':>9}{'x large':>8}"]
  for r in result["rows"]:
    ms = f"{r['ms']:>9.1f}{r['ms'] / large['ms']:>8.2f}" if r["ms"] else ""
    lines.append(f"{r['method']:<28}{r['k'] or '':>3}{r['grad_error']:>10.1e}"
                 f"{r['peak_mib']:>10.2f}{r['peak_mib'] / large['peak_mib']:>8.2f}"
                 f"{r['loop_reductions']:>10}{r['moves']:>6}{ms}")
  return "\n".join(lines)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--batch", type=int, default=512)
  parser.add_argument("--layers", type=int, default=8)
  parser.add_argument("--width", type=int, default=64)
  parser.add_argument("--ks", default="4,8")
  parser.add_argument("--repeats", type=int, default=3, help="timed steps (0: no timing)")
  args = parser.parse_args()
  ks = [int(k) for k in args.ks.split(",")]
  result = measure(batch=args.batch, layers=args.layers, width=args.width, ks=ks,
                   repeats=args.repeats)
  print(f"CLIP, two residual towers ({args.layers} layers of width {args.width}), batch "
        f"{args.batch} over {result['devices']} devices, k = {args.ks}\n")
  print(table(result))
  rows = {(r["method"], r["k"]): r for r in result["rows"]}
  print("\nproof:")
  for k in ks:
    micro, mean = rows["micro_batched", k], rows["mean of micro-batch losses", k]
    large = rows["large batch", None]
    for label, value in (
        (f"max rel. gradient error vs large batch, micro_batched k={k}",
         f"{micro['grad_error']:.1e}"),
        (f"max rel. gradient error vs large batch, mean of micro-batch losses k={k}",
         f"{mean['grad_error']:.1e}"),
        (f"data-axis reductions in loops, micro_batched k={k}", micro["loop_reductions"]),
        (f"peak vs large batch, micro_batched k={k}",
         f"{micro['peak_mib'] / large['peak_mib']:.2f}")):
      print(f"  {label:<76}{value}")

if __name__ == "__main__":
  main()
