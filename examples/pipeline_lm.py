"""Pipeline parallelism with fxaccum: a transformer LM whose decoder blocks run as 4 stages.

The embedding and the head run data-parallel outside the pipeline; the 8 decoder blocks
are stacked into 4 stages of 2 blocks (``stage_params`` leaves with a leading dimension of
4, sharded over the ``stage`` mesh axis) and ``fxaccum.pipeline`` streams k micro-batches
through them, GPipe-style. The loss is the token mean over the valid tokens of padded
sequences, ``fxaccum.Weighted(sum(mask * xent), sum(mask))``.

The recipe for no redundant work per stage: take k a multiple of the 4 stages. Then
``fxaccum.pipeline`` hands each stage 1/4 of the batch's rows and streams them through,
and the output comes back sharded over ``(data, stage)``: under ``jax.jit`` on this
``Auto`` mesh the embedding before the pipeline and the head and loss after it run on
those shards, once across the stages rather than 4 times, and nothing activation-sized is
summed over ``stage`` (the proof prints it). On an ``Explicit`` mesh, give the
activations to the pipeline sharded ``P(("data", "stage"))`` (e.g. ``jax.sharding.reshard``)
and they come back sharded so.

It trains for a few steps with Adam and prints a proof:

* the loss and gradient against the same model without a pipeline, on one device;
* gradient reductions per step over ``data`` in and after the pipeline's loop, and the
  collective-permutes per iteration;
* the bubble fraction (S - 1) / (k + S - 1) and the compiled temp memory against k, with
  and without ``remat``.

    python examples/pipeline_lm.py                    # mesh (data 2, stage 4), k = 8
    python examples/pipeline_lm.py --steps 3 --micro-batches 4
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

jax.config.update("jax_default_matmul_precision", "highest")  # fp32 for the proof
VOCAB, WIDTH, HEADS, SEQ, BATCH = 64, 32, 4, 16, 32
STAGES, BLOCKS_PER_STAGE = 4, 2


def init_params(seed: int = 0) -> dict:
  rng = np.random.default_rng(seed)

  def dense(*shape):  # stacked (stage, block, in, out) leaves: fan-in is `in`
    fan_in = shape[2] if len(shape) > 3 else shape[0]
    return (rng.normal(size=shape) / np.sqrt(fan_in)).astype(np.float32)

  blocks = (STAGES, BLOCKS_PER_STAGE)
  return {"embed": dense(VOCAB, WIDTH) * 4, "pos": dense(SEQ, WIDTH),
          "stages": {"qkv": dense(*blocks, WIDTH, 3 * WIDTH),
                     "out": dense(*blocks, WIDTH, WIDTH),
                     "mlp_in": dense(*blocks, WIDTH, 4 * WIDTH),
                     "mlp_out": dense(*blocks, 4 * WIDTH, WIDTH)},
          "head": dense(WIDTH, VOCAB)}


def padded_batch(rng: np.random.Generator) -> dict:
  """Counting sequences right-padded to skewed lengths; every fifth row is empty."""
  start = rng.integers(0, VOCAB, size=(BATCH, 1))
  tokens = (start + np.arange(SEQ + 1)) % VOCAB
  lengths = rng.integers(1, SEQ + 1, size=BATCH)
  lengths[::5] = 0
  mask = (np.arange(SEQ)[None] < lengths[:, None]).astype(np.float32)
  return {"inputs": tokens[:, :-1].astype(np.int32),
          "targets": tokens[:, 1:].astype(np.int32), "mask": mask}


def norm(x):
  return (x - x.mean(-1, keepdims=True)) * jax.lax.rsqrt(x.var(-1, keepdims=True) + 1e-5)


def decoder_block(p, x):
  """Pre-norm causal self-attention and MLP, residual."""
  b, t, _ = x.shape
  q, k, v = jnp.split(norm(x) @ p["qkv"], 3, axis=-1)
  q, k, v = (a.reshape(b, t, HEADS, WIDTH // HEADS) for a in (q, k, v))
  scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(WIDTH // HEADS).astype(np.float32)
  scores = jnp.where(np.tril(np.ones((t, t), bool)), scores, -1e9)
  attended = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, -1), v)
  x = x + attended.reshape(b, t, WIDTH) @ p["out"]
  return x + jax.nn.gelu(norm(x) @ p["mlp_in"]) @ p["mlp_out"]


def stage(p, x):
  """One stage: its blocks in order (the leading dimension of ``p``)."""
  return jax.lax.scan(lambda h, p_block: (decoder_block(p_block, h), None), x, p)[0]


def token_sums(params, batch, decoder):
  x = params["embed"][batch["inputs"]] + params["pos"]
  logp = jax.nn.log_softmax(norm(decoder(params["stages"], x)) @ params["head"])
  xent = -jnp.take_along_axis(logp, batch["targets"][..., None], -1)[..., 0]
  return fxaccum.Weighted(jnp.sum(batch["mask"] * xent), jnp.sum(batch["mask"]))


def sequential(stages, x):
  """The same decoder without a pipeline: the blocks of every stage in turn, one scan."""
  return stage(jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]), stages), x)


def pipelined_loss(k: int, remat: bool = True):
  def loss(params, batch):
    return token_sums(params, batch, lambda stages, x: fxaccum.pipeline(
        stage, stages, x, micro_batches=k, remat=remat))
  return loss


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=20)
  parser.add_argument("--micro-batches", type=int, default=8)
  parser.add_argument("--memory-ks", default="1,2,4,8",
                      help="the k of the temp-memory table (one compile per k and remat)")
  args = parser.parse_args()
  k, memory_ks = args.micro_batches, [int(v) for v in args.memory_ks.split(",")]

  mesh = jax.make_mesh((2, STAGES), ("data", "stage"), axis_types=(AxisType.Auto,) * 2)
  tx = optax.adam(3e-3)
  grad_fn = fxaccum.value_and_grad(pipelined_loss(k), micro_batches=1)

  @jax.jit
  def train_step(params, opt_state, batch):
    loss, grads = grad_fn(params, batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  rng = np.random.default_rng(0)
  specs = jax.tree.map(lambda _: P(), init_params())
  specs["stages"] = jax.tree.map(lambda _: P("stage"), specs["stages"])
  probe = padded_batch(rng)
  with jax.set_mesh(mesh):
    params = jax.device_put(init_params(), jax.tree.map(lambda s: NamedSharding(mesh, s),
                                                        specs))
    opt_state = tx.init(params)
    data = NamedSharding(mesh, P("data"))
    for i in range(args.steps):
      params, opt_state, loss = train_step(params, opt_state,
                                           jax.device_put(padded_batch(rng), data))
      loss = float(jax.block_until_ready(loss))
      if i % 5 == 0 or i == args.steps - 1:
        print(f"step {i:3d}  token-mean loss {loss:.4f}")

    # The proof, on a fresh batch at the trained params.
    batch = jax.device_put(probe, data)
    compiled = jax.jit(grad_fn).lower(params, batch).compile()
    value, grads = compiled(params, batch)
    rep = fxaccum.diagnostics.from_compiled(compiled, mesh)
    temp = {(k, True): rep.memory.temp_bytes}
    for kk in memory_ks:
      for remat in (True, False):
        if (kk, remat) not in temp:
          temp[kk, remat] = fxaccum.diagnostics.report(jax.jit(fxaccum.value_and_grad(
              pipelined_loss(kk, remat), micro_batches=1)), params, batch).memory.temp_bytes

  host = jax.device_get(params)
  reference = jax.jit(jax.value_and_grad(lambda p: token_sums(p, probe, sequential).value()))
  ref_value, ref_grads = reference(host)  # one device, no pipeline
  rel_errors = jax.jit(lambda a, b: jax.tree.map(  # one program for all leaves
      lambda a, b: jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)), a, b))(grads, ref_grads)
  err = max(float(e) for e in jax.tree.leaves(rel_errors))
  loss_err = abs(float(value) - float(ref_value)) / abs(float(ref_value))
  iterations = k + STAGES - 1
  permutes = rep.select("collective-permute", axes="stage")
  print(f"\nproof: k={k}, mesh {dict(mesh.shape)}, {STAGES} stages of {BLOCKS_PER_STAGE} "
        f"blocks, {int(probe['mask'].sum())} valid tokens of {probe['mask'].size}")
  print(f"  {'max rel. gradient error vs one device':52}{err:>12.1e}")
  print(f"  {'rel. loss error vs one device':52}{loss_err:>12.1e}")
  for place, where in (("loop", "in"), ("top", "after")):
    found = [c for c in rep.reductions(place) if c.axes == ("data",)]
    label = f"stage-gradient reductions per step over data, {where} the loop"
    print(f"  {label:52}{sum(c.executions for c in found):>12}")
  # (Over (data, stage) are only the small gradients of the embedding and the head.)
  activations = sum(1 for c in rep.reductions() if c.axes == ("stage",) and c.bytes > 1024)
  print(f"  {'activation reductions over stage alone':52}{activations:>12}")
  per_iteration = sum(1 for c in permutes if c.executions == iterations)
  print(f"  {'collective-permutes per iteration (forward + backward)':52}{per_iteration:>12g}")
  print(f"  {'bubble (S - 1) / (k + S - 1)':52}"
        f"{fxaccum.diagnostics.bubble_fraction(STAGES, k):>12.3f}")
  print("\n  temp memory (KiB) against k:   " + "".join(f"{f'k={kk}':>8}" for kk in memory_ks))
  for remat in (True, False):
    print(f"  {f'remat={remat}':31}" + "".join(
        f"{temp[kk, remat] / 1024:>8.0f}" for kk in memory_ks))


if __name__ == "__main__":
  main()
