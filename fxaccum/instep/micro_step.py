"""One micro-step as the loop runs it: the loss on micro-batch ``i`` (rows ``i::k``) and its
gradients, traced once (:func:`trace_step`); the loop body runs its jaxpr. The decision
traces it where it decides from this very trace (one micro-batch; params typed
``reduced``), so that the loop runs what was decided on."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from fxaccum import meshes, reductions, split
from fxaccum.instep import gather as gather_lib
from fxaccum.instep import replay as replay_lib
from fxaccum.instep.call import Call, Config, LossKind, micro_loss

__all__ = ["MicroStep", "trace_step"]


class MicroStep(NamedTuple):
  """One micro-step traced (:func:`trace_step`).

  Attributes:
    closed: its closed jaxpr, which the loop body runs.
    shapes: its outputs' shapes, ``((total, (weight, aux, state, sown, kind)), grads)``.
  """

  closed: Any
  shapes: Any

  @property
  def aux(self) -> Any:
    """The aux traced (abstract, with its markers)."""
    return self.shapes[0][1][1]

  @property
  def kind(self) -> LossKind:
    """What the loss returned."""
    return self.shapes[0][1][4].value


def trace_step(config: Config, call: Call, axes: tuple[str, ...], whole: list[Any],
               gather_dims: Sequence[meshes.DataDims],
               traced: gather_lib.Traced | None = None,
               replay: replay_lib.Replayable | None = None) -> MicroStep:
  """The micro-step :func:`loop` runs, traced once on the params ``whole`` (concrete or
  abstract): its outputs (abstract, with the manual axes each varies over) shape the
  accumulators, and the loop body runs its jaxpr. With ``replay``, the loss and its
  gradients are that jaxpr run on the micro-batch (:mod:`fxaccum.instep.replay`), not
  the loss traced again."""
  step = _micro_step(config, call, axes, gather_dims, traced, replay)
  return MicroStep(*jax.make_jaxpr(step, return_shape=True)(whole, jnp.int32(0), call.state))


def _micro_step(config: Config, call: Call, axes: tuple[str, ...],
                gather_dims: Sequence[meshes.DataDims], traced: gather_lib.Traced | None,
                replay: replay_lib.Replayable | None) -> Callable[..., Any]:
  """One micro-step, ``(params, index, state) -> ((total, (weight, aux, state, sown, kind)),
  local gradients)``: FSDP leaves gathered (``gather_dims``) as the compiler places it,
  or (``traced``) where the loss uses them."""
  batch = call.batch(config)
  loss = micro_loss(config, call)

  def step(leaves, index, state):
    micro = split.micro_batch(batch, index, config.micro_batches)
    if traced is not None:  # the shards tied to the loop index: no gather is hoisted above
      leaves, _ = lax.optimization_barrier((leaves, index))  # the loop
      return gather_lib.value_and_grad(traced, leaves, micro, index, state)
    full = meshes.vary([reductions.gather(leaf, dims) for leaf, dims in zip(
        leaves, gather_dims, strict=True)], axes)  # still varying: local gradients
    if replay is not None:
      rows = jax.tree.leaves(micro)[0].shape[0]
      outs = replay_lib.evaluate(replay.closed, {replay_lib.ROWS: rows},
                                 *jax.tree.leaves((full, micro, index, state)),
                                 consts=replay.consts(call.argument_leaves()))
      return jax.tree.unflatten(jax.tree.structure(replay.shapes), outs)
    return jax.value_and_grad(loss, has_aux=True)(full, micro, index, state)

  return step
