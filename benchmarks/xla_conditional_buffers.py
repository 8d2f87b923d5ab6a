"""XLA gives a conditional's results buffers of their own (docs/performance.md, cross-step).

A minimal reproducer, JAX only: a step that adds its gradient to an accumulator and
updates the params every k-th call, gated by ``lax.cond`` (as fxaccum's ``accumulate``)
or by a select (as ``optax.MultiSteps``), not donated. With the select the activations
live in the step's output buffers, still free while they are in use; a conditional's
results share their buffers with no other value, so with the cond they need temp memory.

  python benchmarks/xla_conditional_buffers.py
"""
import jax
import jax.numpy as jnp
from jax import lax


def loss(ws, x):
  for w in ws:
    x = jnp.tanh(x @ w)
  return jnp.sum(x ** 2)


def gated(select: bool):
  """The step: the accumulator every call, the params every k-th (``boundary``)."""
  def step(ws, acc, x, boundary):
    acc = [a + g for a, g in zip(acc, jax.grad(loss)(ws, x), strict=True)]

    def updated():
      return [w - 0.1 * a for w, a in zip(ws, acc, strict=True)]

    if select:
      ws = [jnp.where(boundary, n, w) for n, w in zip(updated(), ws, strict=True)]
    else:
      ws = lax.cond(boundary, updated, lambda: ws)
    return ws, acc
  return step


def main() -> None:
  ws = [jnp.ones((512, 512))] * 4
  for rows in (32, 256, 1024):
    x = jnp.ones((rows, 512))
    temps = [jax.jit(gated(select)).lower(ws, ws, x, True).compile().memory_analysis()
             .temp_size_in_bytes / 2 ** 20 for select in (False, True)]
    print(f"rows {rows:5d}: activations {4 * rows * 512 * 4 / 2 ** 20:5.2f} MiB; temp with "
          f"lax.cond {temps[0]:5.2f} MiB, with a select {temps[1]:5.2f} MiB")


if __name__ == "__main__":
  main()
