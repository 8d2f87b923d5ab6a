"""What a type checker sees of fxaccum's public API (checked by tests/test_typing.py, never
run). mypy must report the lines that end in a ``# error: why`` comment, and no others."""

from typing import Any, assert_type

import jax
import jax.numpy as jnp

import fxaccum


def loss(w: jax.Array, x: jax.Array) -> jax.Array:
  return jnp.mean(x @ w)


def loss_and_aux(w: jax.Array, x: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
  return jnp.mean(x @ w), {"norm": jnp.linalg.norm(w)}


w, x, flag = jnp.ones(3), jnp.ones((4, 3)), bool(jnp.ones(()))
# The result's structure follows has_aux; the returned function takes fun's parameters.
assert_type(fxaccum.value_and_grad(loss, micro_batches=2)(w, x), tuple[jax.Array, Any])
assert_type(fxaccum.value_and_grad(loss_and_aux, has_aux=True, micro_batches=2)(w, x),
            tuple[tuple[jax.Array, Any], Any])
assert_type(fxaccum.value_and_grad(loss_and_aux, 0, True, micro_batches=2)(w, x),
            tuple[tuple[jax.Array, Any], Any])
assert_type(fxaccum.value_and_grad(loss, has_aux=flag, micro_batches=2)(w, x), tuple[Any, Any])
# One result shape per has_aux, whatever else is asked for.
assert_type(fxaccum.value_and_grad(loss, micro_batches=fxaccum.MicroBatchSize(2))(w, x),
            tuple[jax.Array, Any])
assert_type(fxaccum.value_and_grad(loss, skip_nonfinite=True, fsdp="zero3", micro_batches=2)(
    w, x), tuple[jax.Array, Any])
assert_type(fxaccum.grad(loss, micro_batches=2)(w, x), Any)
assert_type(fxaccum.grad(loss_and_aux, has_aux=True, micro_batches=2)(w, x), tuple[Any, Any])
# Deferred sync is its own entry point, its gradients their own type.
assert_type(fxaccum.value_and_unreduced_grad(loss, micro_batches=2)(w, x),
            tuple[jax.Array, fxaccum.Unreduced])
assert_type(fxaccum.value_and_unreduced_grad(loss_and_aux, has_aux=True, micro_batches=2)(w, x),
            tuple[tuple[jax.Array, Any], fxaccum.Unreduced])
fxaccum.value_and_grad(loss, micro_batches=2)(w)  # error: x is missing
fxaccum.value_and_grad(loss, micro_batchez=2)  # error: a misspelt option
fxaccum.value_and_grad(loss)  # error: micro_batches is required
fxaccum.grad(loss, micro_batches=2, view="devices")  # error: not a view
fxaccum.grad(loss, micro_batches=2, fsdp="zero4")  # error: not a strategy
fxaccum.value_and_grad(loss, micro_batches=2, noise_scale=True)  # error: a removed option
fxaccum.value_and_unreduced_grad(loss, micro_batches=2, fsdp="auto")  # error: not taken here
