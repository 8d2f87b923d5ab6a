"""Sequence parallelism (DeepSpeed-Ulysses) with fxaccum: the exact token mean over data x seq.

A small transformer LM whose tokens are sharded over a ``seq`` mesh axis and whose rows are
sharded over ``data``, written *per rank*: the whole train step runs inside one
``jax.shard_map`` over both axes, and attention trades the sequence shard for a heads
shard with an ``all_to_all`` over ``seq`` (and back). Each rank returns the sums of its
shard, ``fxaccum.Weighted(sum(mask * xent), sum(mask))``; ``fxaccum.value_and_grad(...,
data_axes=("data", "seq"))`` accumulates them locally over the micro-batches and reduces
once over data x seq after the loop: the global token mean over all valid tokens.

It trains on synthetic padded sequences for a few steps and prints a proof:

* the loss and gradient against the same model with ordinary attention on one device;
* gradient reductions per step over data and over seq, in and after the micro-batch loop,
  next to the same model written GSPMD-style (global arrays, the compiler's sequence
  sharding), where the sum over ``seq`` runs once per micro-batch;
* the DeepSpeed #5248 trap as the negative control: per-rank token means summed over
  ``seq`` are about the SP size too large.

    python examples/ulysses_sp.py                     # mesh (data 2, seq 4), k = 4, 20 steps
    python examples/ulysses_sp.py --steps 3 --micro-batches 2
"""

from __future__ import annotations

import argparse
import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import fxaccum  # noqa: E402

VOCAB, WIDTH, HEADS, SEQ, BATCH = 64, 32, 4, 16, 16
AXES, BATCH_SPEC = ("data", "seq"), P("data", "seq")


def init_params(seed: int = 0) -> dict:
  rng = np.random.default_rng(seed)

  def dense(*shape):
    return (rng.normal(size=shape) / np.sqrt(shape[0])).astype(np.float32)

  return {"embed": dense(VOCAB, WIDTH) * 4, "pos": dense(SEQ, WIDTH),
          "qkv": dense(WIDTH, 3, HEADS, WIDTH // HEADS), "out": dense(HEADS * WIDTH // HEADS,
                                                                      WIDTH),
          "mlp_in": dense(WIDTH, 4 * WIDTH), "mlp_out": dense(4 * WIDTH, WIDTH),
          "head": dense(WIDTH, VOCAB)}


def padded_batch(rng: np.random.Generator, seq_shards: int) -> dict:
  """Counting sequences right-padded to skewed lengths; some rows are empty and in every
  fourth row the last sequence shard is all padding."""
  start = rng.integers(0, VOCAB, size=(BATCH, 1))
  tokens = (start + np.arange(SEQ + 1)) % VOCAB
  lengths = rng.integers(1, SEQ + 1, size=BATCH)
  lengths[::5] = 0
  lengths[1::4] = np.minimum(lengths[1::4], SEQ - SEQ // seq_shards)
  mask = (np.arange(SEQ)[None] < lengths[:, None]).astype(np.float32)
  return {"inputs": tokens[:, :-1].astype(np.int32),
          "targets": tokens[:, 1:].astype(np.int32), "mask": mask}


def norm(x):
  return (x - x.mean(-1, keepdims=True)) * jax.lax.rsqrt(x.var(-1, keepdims=True) + 1e-5)


def attention(q, k, v, mask):
  """Causal attention over the whole sequence; padded keys are masked."""
  t = q.shape[1]
  scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1]).astype(np.float32)
  causal = np.tril(np.ones((t, t), bool))
  allowed = (causal[None] & (mask[:, None, :] > 0)) | np.eye(t, dtype=bool)
  scores = jnp.where(allowed[:, None], scores, -1e9)
  return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, -1), v)


def ulysses_attention(q, k, v, mask):
  """Per rank: (B, T/S, H, D) sequence shards -> heads shards over ``seq`` and back."""
  def to_heads(x):
    return jax.lax.all_to_all(x, "seq", split_axis=2, concat_axis=1, tiled=True)

  full_mask = jax.lax.all_gather(mask, "seq", axis=1, tiled=True)
  out = attention(to_heads(q), to_heads(k), to_heads(v), full_mask)
  return jax.lax.all_to_all(out, "seq", split_axis=1, concat_axis=2, tiled=True)


def token_sums(params, batch, attend, pos):
  """``(sum(mask * xent), sum(mask))`` of the tokens in ``batch``."""
  x = params["embed"][batch["inputs"]] + pos
  q, k, v = jnp.einsum("btd,dchk->cbthk", norm(x), params["qkv"])
  x = x + attend(q, k, v, batch["mask"]).reshape(*x.shape[:2], -1) @ params["out"]
  x = x + jax.nn.gelu(norm(x) @ params["mlp_in"]) @ params["mlp_out"]
  logp = jax.nn.log_softmax(norm(x) @ params["head"])
  xent = -jnp.take_along_axis(logp, batch["targets"][..., None], -1)[..., 0]
  return jnp.sum(batch["mask"] * xent), jnp.sum(batch["mask"])


def per_rank_loss(params, batch):
  """This rank's shard of the global token loss (inside the shard_map over data x seq)."""
  t = batch["inputs"].shape[1]
  pos = jax.lax.dynamic_slice_in_dim(params["pos"], jax.lax.axis_index("seq") * t, t)
  return fxaccum.Weighted(*token_sums(params, batch, ulysses_attention, pos))


def global_loss(params, batch):
  """The same model GSPMD-style: global arrays, ordinary attention."""
  return fxaccum.Weighted(*token_sums(params, batch, attention, params["pos"]))


def reductions(rep, place, axes) -> str:
  found = [c for c in rep.reductions(place=place) if c.axes is not None and c.axes == axes]
  return f"{sum(c.executions for c in found)}"


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=20)
  parser.add_argument("--micro-batches", type=int, default=4)
  args = parser.parse_args()
  k = args.micro_batches

  mesh = jax.make_mesh((2, 4), AXES, axis_types=(AxisType.Auto,) * 2)
  tx = optax.adam(3e-3)
  grad_fn = fxaccum.value_and_grad(per_rank_loss, micro_batches=k, data_axes=AXES)

  def train_step(params, opt_state, batch):  # the per-rank train step
    loss, grads = grad_fn(params, batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  rng = np.random.default_rng(0)
  probe = padded_batch(rng, mesh.shape["seq"])
  with jax.set_mesh(mesh):
    place = jax.jit(lambda b: b, out_shardings=NamedSharding(mesh, BATCH_SPEC))
    # Replicated on the mesh, as the step returns them: the step compiles once.
    params = jax.device_put(init_params(), NamedSharding(mesh, P()))
    opt_state = tx.init(params)
    step = jax.jit(jax.shard_map(train_step, mesh=mesh, in_specs=(P(), P(), BATCH_SPEC),
                                 out_specs=(P(), P(), P())))
    for i in range(args.steps):
      batch = place(padded_batch(rng, mesh.shape["seq"]))
      params, opt_state, loss = step(params, opt_state, batch)
      loss = float(jax.block_until_ready(loss))
      if i % 5 == 0 or i == args.steps - 1:
        print(f"step {i:3d}  token-mean loss {loss:.4f}")

    # The proof, on a fresh batch at the trained params.
    per_rank = jax.jit(jax.shard_map(grad_fn, mesh=mesh, in_specs=(P(), BATCH_SPEC),
                                     out_specs=P()))
    sharded = place(probe)
    with jax.default_matmul_precision("highest"):
      value, grads = per_rank(params, sharded)
      rep = fxaccum.diagnostics.report(per_rank, params, sharded)  # the same program
    gspmd = jax.jit(fxaccum.value_and_grad(global_loss, micro_batches=k))
    rep_gspmd = fxaccum.diagnostics.report(gspmd, params, sharded)

    def trap(params, batch):  # per-rank token means, summed over seq (DeepSpeed #5248)
      t = batch["inputs"].shape[1]
      pos = jax.lax.dynamic_slice_in_dim(params["pos"], jax.lax.axis_index("seq") * t, t)
      total, count = token_sums(params, batch, ulysses_attention, pos)
      return jax.lax.pmean(jax.lax.psum(total / jnp.maximum(count, 1.0), "seq"), "data")

    trapped = jax.jit(jax.shard_map(trap, mesh=mesh, in_specs=(P(), BATCH_SPEC),
                                    out_specs=P()))(params, sharded)

  with jax.default_matmul_precision("highest"):  # one device, ordinary attention
    ref_value, ref_grads = jax.jit(jax.value_and_grad(
        lambda p: (lambda t, c: t / c)(*token_sums(p, probe, attention, p["pos"]))))(
            jax.device_get(params))
  rel_errors = jax.jit(lambda a, b: jax.tree.map(  # one program for all leaves
      lambda a, b: jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)), a, b))(grads, ref_grads)
  err = max(float(e) for e in jax.tree.leaves(rel_errors))
  loss_err = abs(float(value) - float(ref_value)) / abs(float(ref_value))
  trap_err = abs(float(trapped) - float(ref_value)) / abs(float(ref_value))
  print(f"\nproof: k={k}, mesh {dict(mesh.shape)}, {jax.device_count()} devices, "
        f"{int(probe['mask'].sum())} valid tokens of {probe['mask'].size}")
  print(f"  {'':52}{'per-rank fxaccum':>18}{'GSPMD-style':>14}")
  print(f"  {'max rel. gradient error vs one device':52}{err:>18.1e}")
  print(f"  {'rel. loss error vs one device':52}{loss_err:>18.1e}")
  for where, axes in (("loop", ("data",)), ("loop", ("seq",)), ("loop", AXES),
                      ("top", ("data",)), ("top", ("seq",)), ("top", AXES)):
    label = (f"reductions per step over {'+'.join(axes)}, "
             f"{'in' if where == 'loop' else 'after'} the loop")
    print(f"  {label:52}{reductions(rep, where, axes):>18}"
          f"{reductions(rep_gspmd, where, axes):>14}")
  print(f"  DeepSpeed #5248 trap (per-rank means, psum over seq): rel. loss error "
        f"{trap_err:.2f} (about the SP size {mesh.shape['seq']} too large: "
        f"{float(trapped) / float(ref_value):.2f}x)")


if __name__ == "__main__":
  main()
