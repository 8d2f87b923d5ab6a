"""Flax train states built on the gate: linen ``TrainState`` and NNX ``Optimizer``.

``TrainState.step`` / ``Optimizer.step`` count **optimizer steps** (completed windows),
not calls; ``micro_step`` is the position inside the current window.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from flax.training import dynamic_scale as dynamic_scale_lib
from flax.training import train_state

from fxaccum import reductions
from fxaccum.crossstep import accumulation
from fxaccum.integrations.dynamic_scale import updated

__all__ = ["TrainState", "Optimizer"]


def _holds_variables(tree: Any) -> bool:
  is_variable = lambda x: isinstance(x, nnx.Variable)  # noqa: E731
  return any(map(is_variable, jax.tree.leaves(tree, is_leaf=is_variable)))


class TrainState(train_state.TrainState):
  """``flax.training.train_state.TrainState`` whose ``apply_gradients`` is a gate.

  Build ``tx`` as ``optax.chain(fxaccum.accumulate(k), ...)``. Each call of
  :meth:`apply_gradients` adds one micro-batch's gradient; every ``k``-th call runs the
  chain once on the mean and updates ``params``. ``step`` counts optimizer steps.

  Example:
    >>> import jax.numpy as jnp, optax, fxaccum
    >>> tx = optax.chain(fxaccum.accumulate(2), optax.sgd(0.5))
    >>> state = fxaccum.TrainState.create(apply_fn=None, params=jnp.zeros(1), tx=tx)
    >>> state = state.apply_gradients(grads=jnp.array([2.0]), weight=3)
    >>> int(state.step), int(state.micro_step), int(state.calls)
    (0, 1, 1)
    >>> state = state.apply_gradients(grads=jnp.array([6.0]), weight=1)  # mean: 3
    >>> state.params, int(state.step), int(state.micro_step)
    (Array([-1.5], dtype=float32), 1, 0)
  """

  def apply_gradients(self, *, grads: Any, weight: Any = None, **kwargs: Any) -> TrainState:
    """Accumulates ``grads`` (with ``weight``, default 1); steps on a window's last call.

    A subclass with a ``dynamic_scale`` field (flax's ``DynamicScale``, as flax's imagenet
    and wmt trainers have) gets fp16 loss scaling per optimizer step: pass each call's
    unscaled gradient (e.g. from ``state.dynamic_scale.value_and_grad``, whose own new
    scale is left unused); the window's mean gradient is checked once, a non-finite one
    ends the window without an optimizer step, and the scale is updated once per window.

    Args:
      grads: this call's gradient, or ``fxaccum.Unreduced``.
      weight: this call's weight, e.g. its valid-token count.
      **kwargs: dataclass fields to ``.replace()``, as in flax's TrainState.
    """
    scale = getattr(self, "dynamic_scale", None)
    if "dynamic_scale" in kwargs or not isinstance(scale, dynamic_scale_lib.DynamicScale):
      scale = None
    params, opt_state, boundary, finite = accumulation.gate(
        self.tx, grads, self.opt_state, self.params, weight=weight,
        check_finite=scale is not None)
    if scale is not None:  # once per window, on the window's gradient
      kwargs["dynamic_scale"] = jax.tree.map(lambda new, old: jnp.where(boundary, new, old),
                                             updated(scale, finite), scale)
    # `step + 1` as flax writes it: a weakly typed 0 from `create` stays weak, so the
    # train step's second call finds the first call's program (int32 would not).
    return self.replace(step=jnp.where(boundary, self.step + 1, self.step), params=params,
                        opt_state=opt_state, **kwargs)

  @property
  def micro_step(self) -> jax.Array:
    """Calls accumulated in the current window (0 right after an optimizer step)."""
    return accumulation.find_state(self.opt_state).micro_step

  @property
  def calls(self) -> jax.Array:
    """Calls of :meth:`apply_gradients` so far: a micro-step counter that never repeats,
    e.g. ``jax.random.fold_in(key, state.calls)`` for this call's dropout (``step``
    repeats within a window)."""
    return accumulation.find_state(self.opt_state).calls


class Optimizer(nnx.Optimizer):
  """``flax.nnx.Optimizer`` whose ``update`` is a gate.

  Build ``tx`` as ``optax.chain(fxaccum.accumulate(k), ...)``. Each :meth:`update` adds
  one micro-batch's gradient; every ``k``-th call runs the chain once on the mean and
  updates the model. ``step`` counts optimizer steps.

  Example:
    >>> import jax, jax.numpy as jnp, optax, fxaccum
    >>> from flax import nnx
    >>> model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
    >>> opt = fxaccum.Optimizer(model, optax.chain(fxaccum.accumulate(4), optax.adam(1e-3)),
    ...                         wrt=nnx.Param)
    >>> loss = lambda m, x: jnp.mean(m(x) ** 2)
    >>> for _ in range(4):
    ...   updates = opt.update(model, nnx.grad(loss)(model, jnp.ones((3, 2))))
    >>> int(opt.step[...]), int(opt.micro_step)
    (1, 0)
  """

  def update(self, model: Any, grads: Any, /, *, weight: Any = None, **kwargs: Any) -> Any:
    """Accumulates ``grads`` (with ``weight``, default 1); steps on a window's last call.

    Args:
      model: the model whose ``wrt`` variables are optimized.
      grads: this call's gradient (an ``nnx.State``, e.g. from ``nnx.grad``), or
        ``fxaccum.Unreduced`` over the ``wrt`` state.
      weight: this call's weight, e.g. its valid-token count.
      **kwargs: passed to ``tx.update`` on a window's last call.

    Returns:
      The updates applied to the ``wrt`` variables, as ``nnx.Optimizer.update`` returns
      them: the optimizer's step on a window's last call, zeros on the others.
    """
    def pure(tree):  # the wrt variables' values
      return nnx.as_pure(nnx.state(tree, self.wrt, graph=self.graph))

    params = pure(model)
    if not isinstance(grads, reductions.Unreduced):
      grads = pure(grads)
    elif _holds_variables(grads.total):  # from value_and_unreduced_grad of a module
      grads = dataclasses.replace(grads, total=pure(grads.total))
    new_params, new_opt_state, boundary, _ = accumulation.gate(
        self.tx, grads, nnx.as_pure(self.opt_state), params, weight=weight,
        **nnx.as_pure(kwargs))
    nnx.update(model, new_params)
    nnx.update(self.opt_state, nnx.state(new_opt_state, graph=self.graph))
    self.step[...] += boundary.astype(self.step.dtype)
    return jax.tree.map(jnp.subtract, new_params, params)

  @property
  def micro_step(self) -> jax.Array:
    """Calls accumulated in the current window (0 right after an optimizer step)."""
    return accumulation.find_state(nnx.as_pure(self.opt_state)).micro_step

  @property
  def calls(self) -> jax.Array:
    """Calls of :meth:`update` so far: a micro-step counter that never repeats."""
    return accumulation.find_state(nnx.as_pure(self.opt_state)).calls
