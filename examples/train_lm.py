"""Train a small Flax transformer LM with fxaccum's in-step gradient accumulation.

Runs on 8 simulated CPU devices (a data-parallel mesh) with synthetic, padded sequences the
script makes itself, and ends with a short proof: the accumulated gradient vs. the
large-batch one, and gradient reductions per step (fxaccum vs. a plain jit + lax.scan).

    python examples/train_lm.py                # defaults: 40 steps, k=4
    python examples/train_lm.py --steps 3 --micro-batches 8
"""

from __future__ import annotations

import argparse
import os

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


def data_mesh() -> jax.sharding.Mesh:
  """All devices on one data axis (Auto: linen's Embed cannot gather data-sharded indices
  on an Explicit mesh)."""
  return jax.make_mesh((jax.device_count(),), ("data",), axis_types=(AxisType.Auto,))


def shard(batch, mesh):
  """Places every leaf of ``batch`` split over the mesh's data axis."""
  return jax.tree.map(lambda a: jax.device_put(a, NamedSharding(mesh, P("data"))), batch)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=40)
  parser.add_argument("--micro-batches", type=int, default=4)
  parser.add_argument("--batch", type=int, default=64, help="global batch (sequences)")
  parser.add_argument("--seq", type=int, default=32)
  parser.add_argument("--lr", type=float, default=3e-3)
  args = parser.parse_args()

  model = TinyLM()
  mesh = data_mesh()
  rng = np.random.default_rng(0)
  loss_fn = token_loss(model)

  tx = optax.adam(args.lr)
  grad_fn = fxaccum.value_and_grad(loss_fn, micro_batches=args.micro_batches)

  @jax.jit
  def train_step(params, opt_state, batch):
    loss, grads = grad_fn(params, batch)  # compute-grad: k micro-batches, one reduction
    updates, opt_state = tx.update(grads, opt_state, params)  # apply-grad: once
    return optax.apply_updates(params, updates), opt_state, loss

  with jax.set_mesh(mesh):
    params = model.init(jax.random.key(0), jnp.zeros((1, args.seq), jnp.int32))
    opt_state = tx.init(params)
    losses = []
    for _ in trange(args.steps):
      batch = shard(synthetic_batch(rng, args.batch, args.seq, model.vocab), mesh)
      params, opt_state, loss = train_step(params, opt_state, batch)
      losses.append(float(loss))
    print(f"loss: first {losses[0]:.4f} -> last {losses[-1]:.4f}")

    # Proof 1: accumulated gradient == large-batch gradient on the same batch.
    batch = shard(synthetic_batch(rng, args.batch, args.seq, model.vocab), mesh)
    _, grads = jax.jit(grad_fn)(params, batch)
    _, ref = jax.jit(jax.value_and_grad(lambda p, b: loss_fn(p, b).value()))(params, batch)
    # Relative to the gradient's largest entry: some leaves (the attention key bias) are
    # exactly 0 in exact arithmetic, so a per-leaf ratio would compare rounding noise.
    scale = max(float(jnp.max(jnp.abs(r))) for r in jax.tree.leaves(ref))
    error = max(float(jnp.max(jnp.abs(g - r)))
                for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref), strict=True)) / scale

    # Proof 2: where the gradient reductions run, from the compiled HLO.
    report = fxaccum.diagnostics.report(jax.jit(grad_fn), params, batch)
    k = args.micro_batches

    def plain_scan(params, batch):
      micro = jax.tree.map(lambda a: a.reshape(-1, k, *a.shape[1:]).swapaxes(0, 1), batch)

      def body(acc, mb):
        g = jax.grad(lambda p: loss_fn(p, mb).total)(params)
        return jax.tree.map(jnp.add, acc, g), None

      return jax.lax.scan(body, jax.tree.map(jnp.zeros_like, params), micro)[0]

    naive = fxaccum.diagnostics.report(jax.jit(plain_scan), params, batch)

  grad_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
  print(f"\nproof (k={k}, {jax.device_count()} devices, {grad_bytes / 2**20:.2f} MiB of grads)")
  print(f"  max relative gradient error vs large batch: {error:.2e}")
  for name, rep in (("fxaccum", report), ("plain jit+scan", naive)):
    in_loop = len(rep.reductions(place="loop"))
    per_step = rep.bytes_per_call(fxaccum.diagnostics.REDUCTIONS) / grad_bytes
    print(f"  {name:<15} reductions in loop body: {in_loop}, "
          f"reduced bytes per step: {per_step:.2f}x gradient size")


if __name__ == "__main__":
  main()
