"""The ways to take one Adam optimizer step that the benchmarks compare.

Imported as ``from methods import ...`` by the scripts in this directory (see common.py).
Gradient functions ``(params, batch) -> (loss, grads)``: the in-step baselines (plain
``jit`` + ``lax.scan``, ``optax.microbatching``). :class:`Method`: a whole optimizer step
as ``k`` jitted calls (cross-step) or one (in-step, large batch), so that one measuring
loop serves every method.
"""

from __future__ import annotations

import dataclasses
import inspect
import types
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from common import LR
from jax import lax
from jax.sharding import PartitionSpec as P
from optax.microbatching import _microbatching

import fxaccum

B1 = 0.9  # optax.adam's default b1

# ------------------------------------------------------------------ gradient methods


def plain_scan_value_and_grad(loss_fn: Callable, k: int) -> Callable:
  """What users write today: strided split, ``lax.scan`` of ``jax.value_and_grad``, mean."""

  def split(x):
    spec = jax.typeof(x).sharding.spec
    rest = (None,) * (x.ndim - 1)
    x = jnp.reshape(x, (x.shape[0] // k, k, *x.shape[1:]),
                    out_sharding=P(spec[0] if spec else None, None, *rest))
    return jnp.swapaxes(x, 0, 1)  # micro-batch i = rows i::k

  def value_and_grad(params, batch):
    def body(carry, micro):
      loss, grads = jax.value_and_grad(loss_fn)(params, micro)
      total, acc = carry
      return (total + loss, jax.tree.map(jnp.add, acc, grads)), None

    init = (jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, params))
    (total, acc), _ = lax.scan(body, init, jax.tree.map(split, batch))
    return total / k, jax.tree.map(lambda g: g / k, acc)

  return value_and_grad


class _JaxShim(types.ModuleType):
  """``jax`` as optax.microbatching sees it, with a version string that compares right."""

  def __getattr__(self, name):
    return getattr(jax, name)


def optax_version_bug() -> str | None:
  """Why optax.microbatching fails on an Explicit mesh with this jax, or None.

  optax 0.2.8 compares ``jax.__version__ < '0.7.0'`` as strings; ``'0.10.2' < '0.7.0'`` is
  True, so it reshapes the batch without ``out_sharding``, which an Explicit mesh rejects.
  """
  source = inspect.getsource(_microbatching)
  numeric = tuple(int(p) for p in jax.__version__.split(".")[:2])
  if "jax.__version__ < '0.7.0'" in source and jax.__version__ < "0.7.0" and numeric >= (0, 7):
    return (f"optax {optax.__version__} compares jax.__version__ as strings "
            f"('{jax.__version__}' < '0.7.0' is True), so reshape_batch_axis takes the pre-0.7 "
            "path without out_sharding and raises ShardingTypeError on an Explicit mesh")
  return None


def with_version_shim(fn: Callable) -> Callable:
  """``fn`` tracing optax.microbatching with a jax version string of 0.9.99 (see above)."""
  if optax_version_bug() is None:
    return fn
  shim = _JaxShim("jax")
  shim.__version__ = "0.9.99"

  def wrapped(*args, **kwargs):
    saved, _microbatching.jax = _microbatching.jax, shim
    try:
      return fn(*args, **kwargs)
    finally:
      _microbatching.jax = saved

  return wrapped


def optax_microbatch_value_and_grad(loss_fn: Callable, k: int, batch_size: int) -> Callable:
  """``optax.microbatching.microbatch`` over ``jax.value_and_grad`` (mean of k means)."""
  mean = optax.microbatching.AccumulationType.MEAN
  return optax.microbatching.microbatch(
      jax.value_and_grad(loss_fn), argnums=1, microbatch_size=batch_size // k,
      accumulator=mean)


def micro_grad_value_and_grad(loss_fn: Callable, k: int, batch_size: int) -> Callable:
  """``optax.microbatching.micro_grad``: per-example grads, averaged, k micro-batches."""
  fn = optax.microbatching.micro_grad(
      loss_fn, argnums=0, batch_argnums=1, microbatch_size=batch_size // k,
      accumulator=optax.microbatching.AccumulationType.MEAN)

  def value_and_grad(params, batch):
    grads, aux = fn(params, batch)
    return jnp.mean(aux.values), grads

  return value_and_grad


def trace_error(fn: Callable, *args: Any) -> str | None:
  """The error tracing ``fn`` raises (first line), or None."""
  try:
    jax.eval_shape(fn, *args)
  except Exception as e:  # noqa: BLE001
    return f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
  return None


def train_step(value_and_grad: Callable, tx: optax.GradientTransformation) -> Callable:
  """(params, opt_state, batch) -> (params, opt_state, loss), unjitted."""

  def step(params, opt_state, batch):
    loss, grads = value_and_grad(params, batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  return step


# ---------------------------------------------------------------- optimizer steps


@dataclasses.dataclass(frozen=True)
class Method:
  """One way to take an optimizer step.

  Attributes:
    state: the initial state (params + optimizer state) passed to ``call``.
    call: ``(state, batch) -> (state, loss)``, unjitted; one jitted call per batch.
    params: ``state -> params``.
    steps: ``state -> optimizer steps taken``.
    cond_runs: how often one window runs the program's conditional branches (fxaccum:
      the boundary branch, once; MultiSteps: its skip-update ``lax.cond``, every call).
    note: a line for the notes.
  """

  state: Any
  call: Callable[[Any, Any], tuple[Any, Any]]
  params: Callable[[Any], Any]
  steps: Callable[[Any], Any]
  cond_runs: int
  note: str


def optax_method(value_and_grad: Callable, params: Any, tx: optax.GradientTransformation,
                 note: str, cond_runs: int = 1) -> Method:
  """``value_and_grad`` then ``tx.update`` per call; state ``(params, opt_state)``."""

  def call(state, batch):
    params, opt_state = state
    loss, grads = value_and_grad(params, batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state), loss

  steps = ((lambda s: s[1].gradient_step) if isinstance(tx, optax.MultiSteps)
           else (lambda s: adam_state(s).count))
  return Method((params, jax.jit(tx.init)(params)), call, lambda s: s[0], steps,
                cond_runs=cond_runs, note=note)


ADAM = optax.adam(LR)  # one instance: jax.jit(ADAM.init) compiles once per params layout


def adam_step(value_and_grad: Callable, params: Any, note: str) -> Method:
  """One call per optimizer step: ``value_and_grad`` on the whole batch, then Adam."""
  return optax_method(value_and_grad, params, ADAM, note)


def large_batch(loss_fn: Callable, params: Any) -> Method:
  """The reference: ``jax.value_and_grad`` on the whole batch, one Adam step."""
  return adam_step(jax.value_and_grad(loss_fn), params,
                   "1 call per optimizer step on the whole batch (the reference)")


def multisteps(loss_fn: Callable, params: Any, k: int) -> Method:
  """``optax.MultiSteps(adam, k)``, one micro-batch per call."""
  tx = optax.MultiSteps(optax.adam(LR), every_k_schedule=k)
  return optax_method(jax.value_and_grad(loss_fn), params, tx, cond_runs=k,
                      note=f"{k} calls per optimizer step; inner Adam runs (masked) on every "
                           "call; bytes = k x all (its skip-update cond runs every call)")


def fxaccum_cross(loss_fn: Callable, params: Any, k: int, deferred: bool) -> Method:
  """``optax.chain(fxaccum.accumulate(k), adam)`` through ``fxaccum.TrainState``; deferred:
  ``value_and_unreduced_grad`` gradients and ``accumulate(k, data_axes="data")``."""
  value_and_grad = (fxaccum.value_and_unreduced_grad(loss_fn, micro_batches=1)
                    if deferred else jax.value_and_grad(loss_fn))

  def call(state, batch):
    loss, grads = value_and_grad(state.params, batch)
    return state.apply_gradients(grads=grads), loss

  tx = optax.chain(fxaccum.accumulate(k, data_axes="data" if deferred else None),
                   optax.adam(LR))
  state = fxaccum.TrainState.create(apply_fn=None, params=params, tx=tx)
  # A typed step counter, so that the compiled call's output types equal its inputs'.
  state = state.replace(step=jnp.zeros((), jnp.int32))
  note = (f"{k} calls per optimizer step; per-device partial sums, one gradient "
          "all-reduce inside the boundary branch" if deferred else
          f"{k} calls per optimizer step; gradients reduced by XLA on every call")
  return Method(state, call, lambda s: s.params, lambda s: s.step, cond_runs=1, note=note)


def adam_state(state: Any) -> optax.ScaleByAdamState:
  """The one ``ScaleByAdamState`` inside a method's state."""
  found = [x for x in jax.tree.leaves(state, is_leaf=lambda x: isinstance(
      x, optax.ScaleByAdamState)) if isinstance(x, optax.ScaleByAdamState)]
  assert len(found) == 1, f"expected one ScaleByAdamState, found {len(found)}"
  return found[0]


def adam_gradient(state: Any) -> Any:
  """The gradient Adam was handed on its first step: its first moment is then exactly
  ``mu = (1 - b1) g`` (``mu`` starts at 0), so ``g = mu / (1 - b1)`` (in float64)."""
  return jax.tree.map(lambda m: np.asarray(m, np.float64) / (1 - B1), adam_state(state).mu)
