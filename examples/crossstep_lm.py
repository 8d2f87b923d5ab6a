"""Cross-step accumulation: a loader yields micro-batches, fxaccum.TrainState steps every k.

The same small transformer LM and synthetic data as ``train_lm.py``, on 8 simulated CPU
devices. Each call of the jitted step takes ONE micro-batch; gradients stay per-device
partial sums (``fxaccum.value_and_unreduced_grad``) until the k-th call of the window,
whose ``lax.cond`` branch reduces them once, runs Adam once and updates the params.

    python examples/crossstep_lm.py                 # defaults: 10 optimizer steps, k=4
    python examples/crossstep_lm.py --steps 2 --every-k 8
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np
import optax
from train_lm import TinyLM, data_mesh, shard, synthetic_batch, token_loss  # sets XLA_FLAGS

import fxaccum


def micro_batches(rng: np.random.Generator, size: int, seq: int, vocab: int) -> Iterator[dict]:
  """An endless loader of micro-batches of ``size`` sequences."""
  while True:
    yield synthetic_batch(rng, size, seq, vocab)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=10, help="optimizer steps")
  parser.add_argument("--every-k", type=int, default=4, help="micro-batches per step")
  parser.add_argument("--micro-batch", type=int, default=16, help="sequences per call")
  parser.add_argument("--seq", type=int, default=32)
  parser.add_argument("--layers", type=int, default=TinyLM.layers, help="the LM's blocks")
  parser.add_argument("--lr", type=float, default=3e-3)
  args = parser.parse_args()

  model, mesh = TinyLM(layers=args.layers), data_mesh()
  # Per-device partial sums until the window's last call: one gradient reduction per step.
  tx = optax.chain(fxaccum.accumulate(args.every_k, data_axes="data"), optax.adam(args.lr))
  grad_fn = fxaccum.value_and_unreduced_grad(token_loss(model), micro_batches=1)

  @jax.jit
  def train_step(state, batch):
    loss, grads = grad_fn(state.params, batch)  # fxaccum.Unreduced: no all-reduce here
    return state.apply_gradients(grads=grads), loss

  @jax.jit  # the state comes out with the types and layouts train_step returns: one compile
  def init_state(key):
    params = model.init(key, jnp.zeros((1, args.seq), jnp.int32))
    state = fxaccum.TrainState.create(apply_fn=model.apply, params=params, tx=tx)
    return state.replace(step=jnp.int32(0))  # create's step is a weakly typed Python 0

  loader = micro_batches(np.random.default_rng(0), args.micro_batch, args.seq, model.vocab)
  with jax.set_mesh(mesh):
    state = init_state(jax.random.key(0))
    window_losses = []
    for call in range(args.steps * args.every_k):
      state, loss = train_step(state, shard(next(loader), mesh))
      window_losses.append(float(loss))
      if fxaccum.is_boundary(state.opt_state):  # log real optimizer steps only
        print(f"step {int(state.step):3d}  call {call + 1:4d}  "
              f"loss {np.mean(window_losses):.4f}")
        window_losses = []
    report = fxaccum.diagnostics.report(train_step, state, shard(next(loader), mesh))

  grad_bytes = sum(x.nbytes for x in jax.tree.leaves(state.params))
  in_branch = report.bytes_per_call(fxaccum.diagnostics.REDUCTIONS, place="conditional")
  per_call = sum(c.bytes * c.executions for c in report.reductions()
                 if c.place != "conditional")
  print(f"\n{int(state.step)} optimizer steps from {args.steps * args.every_k} calls; "
        f"Adam count = {int(state.opt_state[1][0].count)}")
  print(f"gradient reduction: {in_branch / grad_bytes:.2f}x gradient bytes inside the "
        f"boundary branch; {per_call} bytes (the loss scalar) on every call")


if __name__ == "__main__":
  main()
