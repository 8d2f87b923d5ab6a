"""Train a small Flax transformer LM with fxaccum's in-step gradient accumulation.

Runs on 8 simulated CPU devices with synthetic, padded sequences the script makes itself
(no downloads). Each step's global batch is split into ``--micro-batches`` micro-batches
inside the compiled step. At the end it prints a short proof and writes a loss-curve PNG:

* the accumulated gradient vs. the large-batch ``jax.value_and_grad`` gradient, next to a
  plain ``jit`` + ``lax.scan`` and to ``optax.MultiSteps`` (whose mean of micro-batch means
  is wrong when micro-batches hold different numbers of valid tokens);
* gradient reductions per optimizer step of each, read from the compiled HLO with
  ``fxaccum.diagnostics`` (MultiSteps: its ``k`` calls);
* the compiled temp memory of the train step against ``k``.

    python examples/train_lm.py                                  # 200 steps, k=4, mesh 8
    python examples/train_lm.py --steps 3 --micro-batches 8 --mesh 4x2 --plot /tmp/loss.png

``--mesh 4x2`` is a ``("data", "model")`` mesh: the batch is split over ``data`` and every
weight matrix over ``model`` (tensor parallel); gradients are reduced over ``data`` only.
"""

from __future__ import annotations

import argparse
import math
import os
import time

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import fxaccum  # noqa: E402

try:
  from tqdm import trange
except ImportError:  # tqdm is in the `examples` extra
  trange = range


class Block(nn.Module):
  width: int
  heads: int

  @nn.compact
  def __call__(self, x, mask):
    h = nn.LayerNorm()(x)
    x = x + nn.MultiHeadDotProductAttention(num_heads=self.heads)(h, h, mask=mask)
    h = nn.Dense(4 * self.width)(nn.LayerNorm()(x))
    return x + nn.Dense(self.width)(nn.gelu(h))


class TinyLM(nn.Module):
  vocab: int = 64
  width: int = 64
  heads: int = 4
  layers: int = 2

  @nn.compact
  def __call__(self, tokens):
    x = nn.Embed(self.vocab, self.width)(tokens)
    x = x + nn.Embed(tokens.shape[-1], self.width)(jnp.arange(tokens.shape[-1]))
    mask = nn.make_causal_mask(tokens)
    for _ in range(self.layers):
      x = Block(self.width, self.heads)(x, mask)
    return nn.Dense(self.vocab)(nn.LayerNorm()(x))


def synthetic_batch(rng: np.random.Generator, batch: int, seq: int, vocab: int):
  """Sequences t_{i+1} = (a * t_i + b) mod vocab, padded to random lengths."""
  a = rng.integers(1, 8, size=(batch, 1))
  b = rng.integers(0, vocab, size=(batch, 1))
  tokens = np.zeros((batch, seq + 1), np.int64)
  tokens[:, :1] = rng.integers(0, vocab, size=(batch, 1))
  for i in range(seq):
    tokens[:, i + 1] = (a[:, 0] * tokens[:, i] + b[:, 0]) % vocab
  lengths = rng.integers(seq // 4, seq + 1, size=batch)
  mask = (np.arange(seq)[None] < lengths[:, None]).astype(np.float32)
  return {"inputs": tokens[:, :-1].astype(np.int32), "targets": tokens[:, 1:].astype(np.int32),
          "mask": mask}


def token_loss(model: TinyLM):
  """The LM's loss as summed token cross-entropy and the valid-token count."""

  def loss_fn(params, batch):
    logits = model.apply(params, batch["inputs"])
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
    # Summed token losses and the token count: exact across micro-batches and devices.
    return fxaccum.Weighted(jnp.sum(batch["mask"] * losses), jnp.sum(batch["mask"]))

  return loss_fn


def data_mesh(shape: tuple[int, ...] | None = None) -> jax.sharding.Mesh:
  """A ``("data",)`` mesh, or ``("data", "model")`` for a 2-D ``shape``; all devices by
  default. Auto axes: linen's Embed cannot gather data-sharded indices on an Explicit mesh."""
  shape = shape or (jax.device_count(),)
  names = ("data", "model")[: len(shape)]
  return jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(shape))


def shard(batch, mesh):
  """Places every leaf of ``batch`` split over the mesh's data axis."""
  return jax.tree.map(lambda a: jax.device_put(a, NamedSharding(mesh, P("data"))), batch)


def shard_params(params, mesh):
  """Replicated, except that on a ``model`` axis each weight matrix's second dimension is
  split over it (a simple tensor-parallel layout; XLA adds the activation collectives)."""

  def place(x):
    split = "model" in mesh.axis_names and x.ndim >= 2 and x.shape[1] % mesh.shape["model"] == 0
    return jax.device_put(x, NamedSharding(mesh, P(None, "model") if split else P()))

  return jax.tree.map(place, params)


def parse_mesh(text: str) -> tuple[int, ...]:
  """``"8"`` or ``"4x2"`` (data x model); the sizes must multiply to the device count."""
  try:
    shape = tuple(int(s) for s in text.lower().split("x"))
  except ValueError:
    raise argparse.ArgumentTypeError(f"--mesh wants DATA or DATAxMODEL, e.g. 8 or 4x2; "
                                     f"got {text!r}") from None
  if len(shape) > 2 or math.prod(shape) != jax.device_count() or min(shape) < 1:
    raise argparse.ArgumentTypeError(
        f"--mesh {text}: DATA or DATAxMODEL sizes must multiply to the "
        f"{jax.device_count()} devices, e.g. {jax.device_count()} or "
        f"{jax.device_count() // 2}x2.")
  return shape


def strided(batch, k: int, i: int):
  """Micro-batch ``i`` of ``k``: rows i, i+k, ... (the rows fxaccum's split gives it)."""
  return jax.tree.map(lambda a: a[i::k], batch)


def max_rel_error(grads, ref, sign: float = 1.0) -> float:
  """``max |sign * g - r|`` over all leaves, relative to the reference's largest entry: some
  leaves (the attention key bias) are exactly 0, so a per-leaf ratio would compare noise."""
  diff, scale = _max_abs(grads, ref, sign)
  return float(diff) / float(scale)


@jax.jit  # one program, not one per op and leaf shape
def _max_abs(grads, ref, sign):
  leaves = zip(jax.tree.leaves(grads), jax.tree.leaves(ref), strict=True)
  return (jnp.max(jnp.stack([jnp.max(jnp.abs(sign * g - r)) for g, r in leaves])),
          jnp.max(jnp.stack([jnp.max(jnp.abs(r)) for r in jax.tree.leaves(ref)])))


def reductions_per_step(report: fxaccum.diagnostics.Report, calls: int = 1) -> tuple[int, int]:
  """(data-axis gradient reductions run per optimizer step, bytes they reduce)."""
  found = report.reductions(axes="data")
  return (calls * sum(c.executions for c in found),
          calls * sum(c.bytes * c.executions for c in found))


def proof(args, model, loss_fn, params, mesh, rng) -> list[str]:
  """Compares fxaccum with the large batch, plain scan and MultiSteps on one new batch."""
  k = args.micro_batches
  batch_np = synthetic_batch(rng, args.batch, args.seq, model.vocab)
  batch = shard(batch_np, mesh)

  def large_batch(params, batch):  # the reference: no accumulation at all
    return jax.grad(lambda p: loss_fn(p, batch).value())(params)

  def fxaccum_grad(params, batch):
    return fxaccum.grad(loss_fn, micro_batches=k)(params, batch)

  def plain_scan(params, batch):
    """A careful hand-written jit + lax.scan: exact (sums, then one division), but
    XLA:CPU keeps each micro-batch's gradient all-reduce inside the loop."""
    micro = jax.tree.map(lambda a: a.reshape(-1, k, *a.shape[1:]).swapaxes(0, 1), batch)

    def total_and_weight(params, mb):
      loss = loss_fn(params, mb)
      return loss.total, loss.weight

    def body(carry, mb):
      grads, weight = carry
      g, w = jax.grad(total_and_weight, has_aux=True)(params, mb)
      return (jax.tree.map(jnp.add, grads, g), weight + w), None

    zeros = jax.tree.map(jnp.zeros_like, params)
    (grads, weight), _ = jax.lax.scan(body, (zeros, jnp.zeros(())), micro)
    return jax.tree.map(lambda g: g / jnp.maximum(weight, 1), grads)

  # MultiSteps as usually written: each call averages its micro-batch; the k-th call
  # applies the mean of the k means. Inner sgd(1) makes that update minus the gradient.
  multisteps = optax.MultiSteps(optax.sgd(1.0), every_k_schedule=k)

  def multisteps_call(params, state, micro):
    grads = jax.grad(lambda p: loss_fn(p, micro).value())(params)
    return multisteps.update(grads, state, params)

  with jax.set_mesh(mesh):
    ref = jax.jit(large_batch)(params, batch)
    errors = {"fxaccum": max_rel_error(jax.jit(fxaccum_grad)(params, batch), ref),
              "plain jit+scan": max_rel_error(jax.jit(plain_scan)(params, batch), ref)}
    call = jax.jit(multisteps_call)
    state = multisteps.init(params)
    for i in range(k):
      updates, state = jax.block_until_ready(call(params, state, shard(strided(batch_np, k, i),
                                                                        mesh)))
    errors["optax.MultiSteps"] = max_rel_error(updates, ref, sign=-1.0)  # sgd(1): -grads

    comm = {"fxaccum": reductions_per_step(
                fxaccum.diagnostics.report(jax.jit(fxaccum_grad), params, batch)),
            "plain jit+scan": reductions_per_step(
                fxaccum.diagnostics.report(jax.jit(plain_scan), params, batch)),
            "optax.MultiSteps": reductions_per_step(fxaccum.diagnostics.report(
                call, params, state, shard(strided(batch_np, k, 0), mesh)), calls=k)}

    # Temp memory of the whole train step (value_and_grad + Adam) against k.
    temp = {}
    per_device_rows = args.batch // mesh.shape["data"]
    for kk in (1, 2, 4, 8):
      if per_device_rows % kk == 0:
        step = jax.jit(train_step_fn(loss_fn, optax.adam(args.lr), kk))
        opt_state = optax.adam(args.lr).init(params)
        temp[kk] = fxaccum.diagnostics.report(step, params, opt_state, batch).memory.temp_bytes

  # Per device: under tensor parallelism each device reduces only its shard's gradient.
  grad_bytes = sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(params))
  names = list(errors)
  lines = [
      f"proof: k={k}, mesh {dict(mesh.shape)}, {jax.device_count()} {jax.devices()[0].platform} "
      f"devices, {grad_bytes / 2**20:.2f} MiB of gradients per device",
      f"  {'':<46}" + "".join(f"{n:>18}" for n in names),
      f"  {'max rel. gradient error vs large batch':<46}"
      + "".join(f"{errors[n]:>18.1e}" for n in names),
      f"  {'data-axis reductions per optimizer step':<46}"
      + "".join(f"{comm[n][0]:>18d}" for n in names),
      f"  {'reduced bytes per step / gradient bytes':<46}"
      + "".join(f"{comm[n][1] / grad_bytes:>18.2f}" for n in names),
      "  compiled temp memory of the train step vs k: "
      + ", ".join(f"k={kk}: {b / 2**20:.2f} MiB" for kk, b in temp.items()),
  ]
  return lines


def train_step_fn(loss_fn, tx, micro_batches: int):
  grad_fn = fxaccum.value_and_grad(loss_fn, micro_batches=micro_batches)

  def train_step(params, opt_state, batch):
    loss, grads = grad_fn(params, batch)  # compute-grad: k micro-batches, one reduction
    updates, opt_state = tx.update(grads, opt_state, params)  # apply-grad: once
    return optax.apply_updates(params, updates), opt_state, loss

  return train_step


def plot(losses: list[float], path: str, title: str) -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, ax = plt.subplots(figsize=(6, 3.5))
  ax.plot(np.arange(1, len(losses) + 1), losses)
  ax.set(xlabel="optimizer step", ylabel="token cross-entropy", title=title)
  ax.grid(alpha=0.3)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def main() -> None:
  parser = argparse.ArgumentParser(
      description=__doc__.splitlines()[0],
      formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  parser.add_argument("--steps", type=int, default=200, help="optimizer steps")
  parser.add_argument("--micro-batches", type=int, default=4, help="k, per optimizer step")
  parser.add_argument("--mesh", type=parse_mesh, default=None,
                      help="DATA or DATAxMODEL, e.g. 8 or 4x2 (default: all devices on data)")
  parser.add_argument("--batch", type=int, default=64, help="global batch (sequences)")
  parser.add_argument("--seq", type=int, default=32, help="tokens per sequence")
  parser.add_argument("--layers", type=int, default=TinyLM.layers, help="transformer blocks")
  parser.add_argument("--lr", type=float, default=3e-3)
  parser.add_argument("--plot", default="train_lm_loss.png", help="loss-curve PNG path")
  args = parser.parse_args()
  started = time.perf_counter()

  model = TinyLM(layers=args.layers)
  mesh = data_mesh(args.mesh)
  rng = np.random.default_rng(0)
  loss_fn = token_loss(model)
  tx = optax.adam(args.lr)
  train_step = jax.jit(train_step_fn(loss_fn, tx, args.micro_batches), donate_argnums=(0, 1))

  with jax.set_mesh(mesh):
    params = shard_params(
        jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, args.seq), jnp.int32)), mesh)
    opt_state = tx.init(params)
    losses = []
    bar = trange(args.steps)
    for _ in bar:
      batch = shard(synthetic_batch(rng, args.batch, args.seq, model.vocab), mesh)
      params, opt_state, loss = train_step(params, opt_state, batch)
      losses.append(float(loss))
      if hasattr(bar, "set_postfix"):
        bar.set_postfix(loss=f"{losses[-1]:.3f}", refresh=False)
  print(f"loss: first {losses[0]:.4f} -> last {losses[-1]:.4f}")

  lines = proof(args, model, loss_fn, params, mesh, rng)
  plot(losses, args.plot, f"TinyLM, k={args.micro_batches}, mesh {dict(mesh.shape)}")
  print("\n".join(["", *lines, f"  loss curve: {args.plot}",
                   f"  total time: {time.perf_counter() - started:.0f} s"]))


if __name__ == "__main__":
  main()
