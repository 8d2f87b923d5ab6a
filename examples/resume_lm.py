"""Kill a cross-step training run mid-window, restart it, and get the same params.

Three runs of the same training (small LM, 8 simulated CPU devices, deferred sync,
``accumulate(4)``), each in its own process:

1. uninterrupted: all calls, no checkpoints, final params saved;
2. killed: saves a checkpoint after every call up to call ``--kill-at`` (mid-window) and
   dies with SIGKILL;
3. resumed: restores the latest checkpoint with ``fxaccum.checkpoint.restore`` and runs
   (and checkpoints) the remaining calls.

It then compares runs 1 and 3 bit for bit.

    python examples/resume_lm.py                       # 12 calls, killed after call 6
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

EVERY_K, MICRO_BATCH, SEQ = 4, 16, 32


def train(directory: Path, calls: int, kill_at: int | None, resume: bool,
          layers: int | None = None) -> None:
  """One process's share of the training. The killed and the resumed run checkpoint after
  every call; the uninterrupted one, the reference, never does. (JAX is imported here: the
  parent process only starts the three runs and compares their files.)"""
  import jax
  import jax.numpy as jnp
  import optax
  import orbax.checkpoint as ocp
  from train_lm import TinyLM, data_mesh, shard, synthetic_batch, token_loss  # XLA_FLAGS

  import fxaccum

  model, mesh = TinyLM() if layers is None else TinyLM(layers=layers), data_mesh()
  tx = optax.chain(fxaccum.accumulate(EVERY_K, data_axes="data"), optax.adam(3e-3))
  grad_fn = fxaccum.value_and_unreduced_grad(token_loss(model), micro_batches=1)

  @jax.jit
  def train_step(state, batch):
    return state.apply_gradients(grads=grad_fn(state.params, batch)[1])

  @jax.jit  # the state comes out with the types and layouts train_step returns: one compile
  def init_state(key):
    params = model.init(key, jnp.zeros((1, SEQ), jnp.int32))
    state = fxaccum.TrainState.create(apply_fn=model.apply, params=params, tx=tx)
    return state.replace(step=jnp.int32(0))  # create's step is a weakly typed Python 0

  manager = ocp.CheckpointManager(directory.absolute() / "checkpoints",
                                  options=ocp.CheckpointManagerOptions(max_to_keep=2))
  with jax.set_mesh(mesh):
    state = init_state(jax.random.key(0))
    start = 0
    if resume:
      start = manager.latest_step()
      state = fxaccum.checkpoint.restore(manager, start, state)
      print(f"resumed at call {start}: step {int(state.step)}, "
            f"micro_step {int(state.micro_step)} of {EVERY_K}")
    for call in range(start, calls):
      # Data of call i depends only on i, so a resumed run sees the same stream.
      batch = synthetic_batch(np.random.default_rng(call), MICRO_BATCH, SEQ, model.vocab)
      state = jax.block_until_ready(train_step(state, shard(batch, mesh)))
      if kill_at is not None or resume:
        fxaccum.checkpoint.save(manager, call + 1, state)
      if call + 1 == kill_at:
        manager.wait_until_finished()
        print(f"killed after call {kill_at} (micro_step {int(state.micro_step)})", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    manager.wait_until_finished()
  np.savez(directory / "final.npz", *[np.asarray(x) for x in jax.tree.leaves(state.params)])


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--calls", type=int, default=12)
  parser.add_argument("--kill-at", type=int, default=6, help="call after which to die")
  parser.add_argument("--phase", choices=["all", "uninterrupted", "killed", "resumed"],
                      default="all")
  parser.add_argument("--dir", type=Path, default=None)
  parser.add_argument("--layers", type=int, default=None,
                      help="the LM's blocks (default: TinyLM's, 2)")
  args = parser.parse_args()

  if args.phase != "all":
    train(args.dir, args.calls, args.kill_at if args.phase == "killed" else None,
          resume=args.phase == "resumed", layers=args.layers)
    return

  root = Path(tempfile.mkdtemp(prefix="fxaccum_resume_"))
  for phase, where in (("uninterrupted", "a"), ("killed", "b"), ("resumed", "b")):
    size = [] if args.layers is None else ["--layers", str(args.layers)]
    proc = subprocess.run([sys.executable, __file__, "--phase", phase, "--dir", str(root / where),
                           "--calls", str(args.calls), "--kill-at", str(args.kill_at), *size],
                          capture_output=True, text=True, timeout=600)
    expected = -signal.SIGKILL if phase == "killed" else 0
    if proc.returncode != expected:
      sys.exit(f"{phase} run exited with {proc.returncode}:\n{proc.stderr[-3000:]}")
    print(f"[{phase}] " + (proc.stdout.strip() or "done"))

  a, b = np.load(root / "a" / "final.npz"), np.load(root / "b" / "final.npz")
  identical = all(np.array_equal(a[key], b[key]) for key in a.files)
  print(f"params after {args.calls} calls, killed-and-resumed vs uninterrupted: "
        f"{'bit-identical' if identical else 'DIFFERENT'}")
  sys.exit(0 if identical else 1)


if __name__ == "__main__":
  main()
