"""The micro-batch loop both views share: one ``lax.scan`` over the micro-batches, an
accumulator per output (gradients, loss total and weight, each aux marker, the step's
statistics), the module state threaded through in order, and the reductions after it."""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from fxaccum import analysis as analysis_lib
from fxaccum import meshes, reductions
from fxaccum.instep import accumulators as acc
from fxaccum.instep import gather as gather_lib
from fxaccum.instep.attempts import attempt
from fxaccum.instep.call import (
  Call,
  Config,
  LossKind,
  micro_batch_avals,
  written_leaves,
)
from fxaccum.instep.micro_step import MicroStep, trace_step
from fxaccum.markers import (
  Concat,
  Max,
  Min,
  State,
  all_finite,
  highest,
  is_marker,
  lowest,
  safe_divide,
)
from fxaccum.statistics import NOISE_TERMS, asks_statistics, noise_terms, sq_norm, takes_noise_scale

__all__ = ["Looped", "loop"]


# ---------------------------------------------------------------------------------------
# The micro-batch loop, shared by both views


class Looped(NamedTuple):
  """What :func:`loop` returns.

  Attributes:
    value: the loss's value over the micro-batches (normalized by the summed weight, or a
      ``Sum``'s sum).
    aux: the aux outputs, each combined as its marker says.
    statistics: None, or the skipped count and the summed :data:`NOISE_TERMS` (None where
      the step has no noise scale).
    grads: the gradients, as the gradients' accumulator's ``finalize`` gives them.
    local_weight: this device's share of the summed loss weight (the shares add up to it
      over the loop's manual axes).
    state: the threaded state after the last micro-batch.
    sown: the values sown per micro-batch, stacked.
  """

  value: Any
  aux: Any
  statistics: Any
  grads: Any
  local_weight: Any
  state: Any
  sown: Any


def loop(config: Config, call: Call, axes: tuple[str, ...], whole: list[Any],
          gather_dims: Sequence[meshes.DataDims], grads: acc.Accumulator,
          presummed: bool = False, traced: gather_lib.Traced | None = None,
          step: MicroStep | None = None) -> Looped:
  """The micro-batch loop: ``grads`` sums the gradients, and one accumulator each the loss
  totals, weights and aux outputs, while the module state is threaded through in order;
  ``axes`` are the manual axes the sums are reduced over afterwards.

  With ``presummed`` (per-rank code in the caller's shard_map), a loss total, weight or aux
  leaf that depends on the batch but does not vary over some of those axes was summed over
  them by the loss itself (its ``psum``) and is not summed again; the gradients always are.
  With ``traced`` (``fsdp="zero3"``), the loss traced on whole params runs on the shards
  ``whole``, gathering each where it is used. ``step``: the micro-step as
  :func:`trace_step` traced it, where the decision did (else traced here).

  A differentiated leaf the loss writes (:attr:`~fxaccum.instep.call.Threaded.params`)
  is carried through the loop like module state: each micro-batch reads, and is
  differentiated at, the value the previous one wrote.

  Returns a :class:`Looped`.
  """
  step = step or trace_step(config, call, axes, whole, gather_dims, traced)
  sums = _Sums.of(config, call, step, axes, presummed, grads, micro_gradients=traced is None)
  _warn_batch_shaped(config, call, whole, gather_dims, sums.markers)
  init = (sums.accumulator.init(), call.state._replace(
      params=_written_params(step.closed, step.shapes, whole, gather_dims)))
  body = _loop_body(config, step.run, jax.tree.structure(step.shapes), sums, init, whole,
                    gather_dims, axes, zero3=traced is not None)
  if config.micro_batches == 1:  # one micro-batch: no loop, the step as jax.value_and_grad
    (carry, state), sown = body(init, jnp.int32(0))  # runs it
    sown = jax.tree.map(lambda x: x[None], sown)
  else:
    (carry, state), sown = lax.scan(body, init, jnp.arange(config.micro_batches))
  with jax.named_scope("fxaccum_reduce"):
    value, aux, statistics, grad_values, local_weight = sums.finalize(carry, axes)
  return Looped(value, aux, statistics, grad_values, local_weight, state, sown)


@dataclasses.dataclass(frozen=True)
class _Sums:
  """The loop's accumulators: the gradients', the loss total and weight, each aux marker's,
  the skipped count and (where the step has one) the noise scale's terms, and all of them
  together (``accumulator``, over lists of the values in that order)."""

  grads: acc.Accumulator
  total: acc.Accumulator
  weight: acc.Accumulator
  aux: acc.Accumulator
  skipped: acc.Accumulator
  noise: acc.Accumulator | None
  total_aval: Any
  aux_def: Any  # the aux's tree structure, its markers as leaves
  markers: list[Any]
  weight_axes: frozenset[str]
  kind: LossKind
  statistics: bool  # whether the aux asks for Statistics
  rows_per_weight: int  # the examples a unit of loss weight stands for (noise scale)

  @property
  def accumulator(self) -> acc.Accumulator:
    return acc.combined([self.grads, self.total, self.weight, self.aux, self.skipped,
                         *([self.noise] if self.noise else [])])

  @staticmethod
  def of(config: Config, call: Call, step: MicroStep, axes: tuple[str, ...],
         presummed: bool, grads: acc.Accumulator, micro_gradients: bool) -> _Sums:
    """The accumulators of ``step``; ``micro_gradients``: whether it returns each
    micro-batch's gradient before any reduction (not zero3's)."""
    out_def = jax.tree.structure(step.shapes)
    (total_aval, (weight_aval, aux_avals, _, _, loss_kind)), _ = jax.tree.unflatten(
        out_def, step.out_avals)
    summed = _summed_over(step, axes, call.batch(config), presummed)
    (total_axes, (weight_axes, aux_axes, _, _, _)), _ = jax.tree.unflatten(
        out_def, [frozenset(axes) if s is None else s for s in summed])
    (_, (constant_weight, *_)), _ = jax.tree.unflatten(out_def, [s is None for s in summed])
    if constant_weight:  # the same on every device (a scalar loss's 1): summed like the total
      weight_axes = total_axes
    markers = jax.tree.leaves(aux_avals, is_leaf=is_marker)
    kind = loss_kind.value
    # Small batches: each device's share of a micro-batch (or the global micro-batch), its
    # gradient before any reduction (not zero3's), weighed on every device alike.
    noise = takes_noise_scale(aux_avals, reduced=config.reduce, summed=kind == "sum",
                              small_batches=micro_gradients and set(weight_axes) == set(axes))
    batch_rows = jax.tree.leaves(call.batch(config))[0].shape[0]
    return _Sums(
        grads=grads,
        total=acc.summed(total_aval, _ordered(axes, total_axes),
                         jnp.promote_types(total_aval.dtype, jnp.float32)),
        weight=acc.summed(weight_aval, _ordered(axes, weight_axes)),
        aux=acc.combined([
            acc.for_aux(m, jax.tree.map(functools.partial(_ordered, axes), m_axes),
                        config.micro_batches)
            for m, m_axes in zip(markers, jax.tree.leaves(aux_axes, is_leaf=is_marker),
                                 strict=True)]),
        skipped=acc.summed(jax.ShapeDtypeStruct((), jnp.int32), axes),
        noise=acc.summed(jax.ShapeDtypeStruct((len(NOISE_TERMS),), jnp.float32), axes)
        if noise else None,
        total_aval=total_aval, aux_def=jax.tree.structure(aux_avals, is_leaf=is_marker),
        markers=markers, weight_axes=weight_axes, kind=kind,
        statistics=asks_statistics(aux_avals),
        # A mean loss weighs 1 and stands for the micro-batch's rows; a Weighted one
        # counts its own items.
        rows_per_weight=1 if kind == "weighted" else batch_rows // config.micro_batches)

  def finalize(self, carry: list[Any], axes: tuple[str, ...]):
    """``(value, aux, statistics, grads, local_weight)`` of the summed ``carry`` (see
    :class:`Looped`)."""
    grad_sums, total_sum, weight_sum, aux_sums, skipped_sum, *noise_sums = carry
    shared = [a for a in axes if a not in self.weight_axes]
    local_weight = weight_sum.astype(jnp.float32) / math.prod(
        lax.axis_size(a) for a in shared)
    summed_weight = self.weight.finalize(weight_sum, None)
    # The aux is averaged with the loss weights; the value and gradients are normalized
    # by them, or (a Sum loss) left as sums over the micro-batches.
    norm = jnp.ones_like(summed_weight) if self.kind == "sum" else summed_weight
    aux = jax.tree.unflatten(self.aux_def, self.aux.finalize(aux_sums, summed_weight))
    value = safe_divide(self.total.finalize(total_sum, norm), norm).astype(
        self.total_aval.dtype)
    statistics = None
    if self.statistics:
      statistics = (self.skipped.finalize(skipped_sum, summed_weight),
                    self.noise.finalize(noise_sums[0], None) if self.noise else None)
    return value, aux, statistics, self.grads.finalize(grad_sums, norm), local_weight


def _loop_body(config: Config, run_step: Callable[..., Any], out_def: Any, sums: _Sums,
               init: Any, whole: list[Any], gather_dims: Sequence[meshes.DataDims],
               axes: tuple[str, ...], zero3: bool) -> Callable[..., Any]:
  """The scan body over micro-batch indices: ``((sums, state), index) -> ((sums, state),
  sown)``, its carry typed like ``init``."""
  accumulator = sums.accumulator

  def body(carry, index):
    sums_carry, old_state = carry
    # Written params enter as the differentiated leaves they replace.
    read = [x if w is None else w for x, w in zip(
        whole, old_state.params or [None] * len(whole), strict=True)]
    # A jaxpr output that is a literal (a Python number in the aux) comes back as one.
    outs = [x if isinstance(x, jax.Array) else jnp.asarray(x)
            for x in run_step(read, index, old_state._replace(params=()))]
    (loss_total, (loss_weight, aux_values, state, sown, _)), grad_values = jax.tree.unflatten(
        out_def, outs)
    # Carried on: the params written another value (a value set again passes through).
    state = state._replace(params=tuple(
        None if carried is None else new
        for new, carried in zip(state.params, old_state.params, strict=True)
    ) if old_state.params else ())
    # This device's (or, global view, the micro-batch's) gradient, before any reduction.
    micro_sq_norm = sq_norm(grad_values) if sums.noise else 0.0
    if any(gather_dims) and not zero3:  # local gradients, reduce-scattered in buckets
      grad_values = reductions.reduce_leaves(
          grad_values, [(dims, ()) for dims in gather_dims], reductions.BUCKET_BYTES)
    values = [grad_values, loss_total, loss_weight,
              jax.tree.leaves(aux_values, is_leaf=is_marker), jnp.zeros((), jnp.int32)]
    if config.skip_nonfinite:  # a non-finite micro-batch contributes nothing
      good = all_finite((loss_total, grad_values))
      if zero3 and axes:  # reduce-scattered gradients mix the devices' shares: all skip
        good = lax.pmin(good.astype(jnp.int32), axes).astype(bool)
      values, state = _drop_unless(good, values, state, old_state)
      loss_weight = values[2]
    if sums.noise:  # after the skip: a skipped micro-batch weighs 0
      values.append(noise_terms(micro_sq_norm, loss_weight, sums.rows_per_weight))
    threaded = iter(state[1])  # a State aux is the threaded value the loop carries on
    values[3] = [State(next(threaded)) if isinstance(m, State) else m for m in values[3]]
    carry = (accumulator.update(sums_carry, values, index, loss_weight), state)
    return _retyped(carry, like=init, axes=axes), sown

  return body


def _written_params(closed: Any, shapes: Any, whole: list[Any],
                    gather_dims: Sequence[meshes.DataDims]) -> tuple[Any, ...]:
  """The loop's initial :attr:`~fxaccum.instep.call.Threaded.params`: the leaves the
  micro-step traced as ``closed`` (its outputs ``shapes``) wrote another value into, as
  the loss reads them first; None for the others, a leaf set again to the value it read
  (``nnx.remat`` writes back what it was given) included; ``()`` where it wrote none."""
  written = written_leaves(closed, shapes)
  if not any(written):
    return ()
  if any(w and dims for w, dims in zip(written, gather_dims, strict=True)):
    raise ValueError(
        "The loss writes a differentiated variable (e.g. nnx.WeightNorm or "
        "nnx.SpectralNorm writing its kernel) that is sharded over a data axis (FSDP) and "
        "gathered per device: fxaccum cannot thread a written shard. Replicate that "
        "param over the data axes, or call fxaccum outside your shard_map.")
  return tuple(x if w else None for x, w in zip(whole, written, strict=True))


def _summed_over(step: MicroStep, axes: tuple[str, ...], batch: Any,
                 presummed: bool) -> list[frozenset[str] | None]:
  """Per output of one micro-step, the manual axes to sum it over after the loop: all,
  but (``presummed``) those a value fed by the batch or by a collective (``psum(n)``) does
  not vary over: the loss summed it over them. None (``presummed``): a value fed by
  neither, the same on every device (a weight of 1), for the caller to place. (Per-rank
  code traces its micro-step in the loop's region: ``step.closed`` closes over the batch.)"""
  if not (presummed and meshes.tracks_varying(axes)):
    return [frozenset(axes)] * len(step.out_avals)
  depends = analysis_lib.depends_on(step.closed, jax.tree.leaves(batch), _REDUCING_COLLECTIVES)
  return [frozenset(a for a in axes if a in meshes.varying_axes(aval)) if dep
          else None for aval, dep in zip(step.out_avals, depends, strict=True)]


# Collectives whose result no longer varies over their axes: a value computed from one
# was reduced over them by the loss.
_REDUCING_COLLECTIVES = frozenset({"psum", "psum_invariant", "pmax", "pmin", "all_gather"})


def _retyped(carry: Any, *, like: Any, axes: tuple[str, ...]) -> Any:
  """``carry`` cast to vary over the manual axes each leaf of ``like`` (the loop's initial
  carry) varies over, as ``lax.scan`` requires of its body."""
  leaves = [meshes.vary(x, _ordered(axes, meshes.varying_axes(init)))
            for x, init in zip(jax.tree.leaves(carry), jax.tree.leaves(like), strict=True)]
  return jax.tree.unflatten(jax.tree.structure(carry), leaves)


def _drop_unless(good: jax.Array, values: list[Any], state: Any,
                 old_state: Any) -> tuple[list[Any], Any]:
  """A micro-batch's ``[grads, total, weight, aux, skipped]`` and module state, or nothing
  from it unless ``good``: zeros (Concat rows are kept, in place), a skip counted, and the
  state it started from."""
  grads, total, weight, aux, _ = values

  def zero(x):
    return jnp.where(good, x, jnp.zeros_like(x))

  def keep_old(new, old):
    if jnp.issubdtype(jnp.result_type(new), jax.dtypes.prng_key):
      return new  # keys are not advanced by a call; their counts are
    return jnp.where(good, new, old)

  def dropped(a):  # what the skipped micro-batch adds: nothing to each accumulator
    if isinstance(a, Concat):
      return a
    if isinstance(a, (Max, Min)):
      identity = lowest if isinstance(a, Max) else highest
      return type(a)(jnp.where(good, a.value, identity(jnp.result_type(a.value))))
    return jax.tree.map(zero, a)

  aux = [dropped(a) for a in aux]
  values = [[zero(g) for g in grads], zero(total), zero(weight), aux,
            (~good).astype(jnp.int32)]
  return values, jax.tree.map(keep_old, state, old_state)


def _ordered(axes: tuple[str, ...], subset: frozenset[str]) -> tuple[str, ...]:
  return tuple(a for a in axes if a in subset)


def _warn_batch_shaped(config: Config, call: Call, whole: list[Any],
                       gather_dims: Sequence[meshes.DataDims], markers: list[Any]) -> None:
  """Warns about plain aux leaves that hold one value per example: averaged over the
  micro-batches, they would come back as one averaged micro-batch. A leaf only shaped
  like that (e.g. 8 BatchNorm channels, 8 rows) is checked against the loss's jaxpr."""
  micro = micro_batch_avals(config, call)
  rows = jax.tree.leaves(micro)[0].shape[0]
  if rows < 2 or not any(not is_marker(m) and m.shape[:1] == (rows,) for m in markers):
    return

  def aux_leaves(leaves, micro, state):
    full = [reductions.gather(leaf, dims) for leaf, dims in zip(leaves, gather_dims, strict=True)]
    return jax.tree.leaves(call.loss(config, full, micro, 0, state)[2])

  def aux_kinds():
    closed = jax.make_jaxpr(aux_leaves)(whole, micro, call.state)
    return analysis_lib.analyze(closed, rows=rows, batch_inputs=range(
        len(whole), len(whole) + len(jax.tree.leaves(micro))), param_inputs=()).outputs

  kinds = attempt(aux_kinds).value  # None: no jaxpr to read, go by the shape
  position = 0
  for marker in markers:
    kind = kinds[position] if kinds is not None else None
    position += len(jax.tree.leaves(marker))
    per_example = kind is None or (isinstance(kind, analysis_lib.Rows) and kind.dim == 0)
    if not is_marker(marker) and marker.shape[:1] == (rows,) and per_example:
      warnings.warn(
          f"An aux output of shape {tuple(marker.shape)} holds one value per example of "
          "the micro-batch: plain aux leaves are averaged over the micro-batches, so "
          "per-example values would come back as one averaged micro-batch. Wrap "
          "per-example outputs in fxaccum.Concat(...) to get them for the whole batch, "
          "in order.", stacklevel=4)
