"""One micro-step as the loop runs it: the loss on micro-batch ``i`` (rows ``i::k``) and its
gradients, traced once (:func:`trace_step`); the loop body runs its jaxpr. The decision
traces it where it decides from this very trace (one micro-batch; params typed
``reduced``), so that the loop runs what was decided on. Where the analysis's symbolic
trace serves (:mod:`fxaccum.instep.replay`), the loop body runs that jaxpr instead
(:func:`replayed_step`): the loss is not traced again."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend import core as jcore

from fxaccum import meshes, reductions, split
from fxaccum.instep import gather as gather_lib
from fxaccum.instep import replay as replay_lib
from fxaccum.instep.call import (
    Call,
    Config,
    LossKind,
    micro_batch_avals,
    micro_loss,
    traced_aux,
    traced_kind,
)

__all__ = ["MicroStep", "replayed_step", "trace_step"]


class MicroStep(NamedTuple):
  """One micro-step as the loop runs it (:func:`trace_step`, :func:`replayed_step`).

  Attributes:
    closed: its closed jaxpr, its first inputs the differentiated leaves: which outputs
      forward an input, which depend on the batch it closes over (a traced step's,
      ``(leaves, index, state) -> outputs``; a replayed one's is the analysis's,
      ``(leaves, micro-batch, index, state) -> outputs``).
    shapes: its outputs' shapes, ``((total, (weight, aux, state, sown, kind)), grads)``.
    out_avals: its outputs' abstract values where the loop runs it (flat).
    run: ``(leaves, index, state) -> flat outputs``, what the loop body calls.
  """

  closed: Any
  shapes: Any
  out_avals: list[Any]
  run: Callable[..., list[Any]]

  @property
  def aux(self) -> Any:
    """The aux traced (abstract, with its markers)."""
    return traced_aux(self.shapes)

  @property
  def kind(self) -> LossKind:
    """What the loss returned."""
    return traced_kind(self.shapes)


def trace_step(config: Config, call: Call, axes: tuple[str, ...], whole: list[Any],
               gather_dims: Sequence[meshes.DataDims],
               traced: gather_lib.Traced | None = None) -> MicroStep:
  """The micro-step :func:`loop` runs, traced once on the params ``whole`` (concrete or
  abstract): its outputs (abstract, with the manual axes each varies over) shape the
  accumulators, and the loop body runs its jaxpr."""
  step = _micro_step(config, call, axes, gather_dims, traced)
  closed, shapes = jax.make_jaxpr(step, return_shape=True)(whole, jnp.int32(0), call.state)
  run = jcore.jaxpr_as_fun(closed)
  return MicroStep(closed, shapes, closed.out_avals, lambda *tree: run(*jax.tree.leaves(tree)))


def replayed_step(config: Config, call: Call, axes: tuple[str, ...], whole: list[Any],
                  replay: replay_lib.Replayable) -> MicroStep:
  """The micro-step :func:`loop` runs as ``replay``, the analysis's jaxpr
  (:func:`fxaccum.instep.replay.evaluate`), where the loop body calls it: its outputs'
  abstract values are read from that jaxpr (:func:`fxaccum.instep.replay.out_types`),
  not from a trace of its own. No param is gathered (the decision replays none)."""
  batch = call.batch(config)
  rows = {replay_lib.ROWS: jax.tree.leaves(micro_batch_avals(config, call))[0].shape[0]}
  consts = replay.consts(call.argument_leaves())

  def run(leaves, index, state):
    micro = split.micro_batch(batch, index, config.micro_batches)
    full = meshes.vary(leaves, axes)  # still varying: local gradients
    return replay_lib.evaluate(replay.closed, rows, *jax.tree.leaves(
        (full, micro, index, state)), consts=consts)

  # The micro-batch varies as the batch does; the index over no axis.
  inputs = [*consts, *meshes.vary(whole, axes), *jax.tree.leaves(batch),
            jnp.int32(0), *jax.tree.leaves(call.state)]
  return MicroStep(replay.closed, replay.shapes,
                   replay_lib.out_types(replay.closed, rows, inputs), run)


def _micro_step(config: Config, call: Call, axes: tuple[str, ...],
                gather_dims: Sequence[meshes.DataDims],
                traced: gather_lib.Traced | None) -> Callable[..., Any]:
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
    return jax.value_and_grad(loss, has_aux=True)(full, micro, index, state)

  return step
