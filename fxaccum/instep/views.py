"""The two views that run the loss, and :func:`run_call`, which runs the one decided.

Per traced call, the view the decision (:mod:`fxaccum.instep.decision`) took: per
device, inside a ``shard_map`` manual over the data axes, with the gradients summed
locally and reduced over the data axes once after the loop; or on the global
micro-batch, as ``jax.value_and_grad`` runs it. The per-device view takes the FSDP
strategy (:mod:`fxaccum.instep.fsdp`) the decision chose. Neither decides, retries or
falls back: what they run was decided before.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from fxaccum import meshes, reductions
from fxaccum.instep import accumulators as acc
from fxaccum.instep import decision as decision_lib
from fxaccum.instep import paths
from fxaccum.instep import region as region_lib
from fxaccum.instep.call import Call, Config
from fxaccum.instep.decision import Decision, decide, global_specs
from fxaccum.instep.loop import Looped, loop
from fxaccum.instep.micro_step import replayed_step
from fxaccum.statistics import with_statistics

if TYPE_CHECKING:
  from fxaccum.integrations import nnx_modules

__all__ = ["run_call"]


# ---------------------------------------------------------------------------------------
# Running the view decided


def run_call(config: Config, layout: meshes.Layout, kwargs: dict,
             modules: nnx_modules.Modules | None, packed: tuple[tuple, Any]) -> Any:
  """The whole accumulation for one layout; jit-traceable. ``packed`` is ``(args, state)``
  (module arguments split into their state); returns ``(result, (state, sown))``."""
  args, state = packed
  diff = tuple(args[i] for i in config.diff_argnums)
  diff_leaves, diff_def = jax.tree.flatten(diff)
  rest = tuple(None if i in config.diff_argnums else a for i, a in enumerate(args))
  call = Call(diff_leaves, diff_def, rest, kwargs, state, modules)
  ran = (_per_rank(config, layout, call) if layout.manual
         else _run(config, layout, call, decide(config, layout, call)))
  grads = ran.grads
  if config.single_argnum and not isinstance(grads, reductions.Unreduced):
    grads = grads[0]
  aux = ran.aux
  if ran.statistics is not None:  # no noise scale of per-device sums
    skipped, terms = ran.statistics
    aux = with_statistics(aux, skipped, None if isinstance(
        grads, reductions.Unreduced) else terms, grads)
  return ((ran.value, aux) if config.has_aux else ran.value, grads), (ran.state, ran.sown)


def _run(config: Config, layout: meshes.Layout, call: Call, decision: Decision) -> Ran:
  """The view ``decision`` took, run."""
  if decision.path.view == "device":
    return _device(config, layout, call, decision)
  _warn_gathered_by_the_compiler(config, layout, decision.path)
  return _global(config, layout, decision, call)


class Ran(NamedTuple):
  """What a view returns: the loss's ``value``, its ``aux``, the step's ``statistics``
  (see :class:`~fxaccum.instep.loop.Looped`), the ``grads`` (the differentiated
  arguments' trees, or ``fxaccum.Unreduced``), and the threaded ``state`` and ``sown``
  values."""

  value: Any
  aux: Any
  statistics: Any
  grads: Any
  state: Any
  sown: Any

  @classmethod
  def of(cls, looped: Looped, grads: Any) -> Ran:
    return cls(looped.value, looped.aux, looped.statistics, grads, looped.state,
               looped.sown)


def _warn_gathered_by_the_compiler(config: Config, layout: meshes.Layout,
                                   path: paths.Path) -> None:
  """An FSDP strategy named in ``fsdp=`` applies in the per-device view only."""
  if config.fsdp != "auto" and any(layout.param_dims):
    warnings.warn(
        f"fsdp='{config.fsdp}' has no effect on this step: it runs in the global view "
        f"({path.reason}), where the compiler places the FSDP gathers (above the "
        "micro-batch loop). view='device' runs the strategy, if the loss may run per "
        "device.", stacklevel=4)


# ---------------------------------------------------------------------------------------
# The two views


def _device(config: Config, layout: meshes.Layout, call: Call, decision: Decision) -> Ran:
  """Per-device view: a shard_map manual over the data axes, one reduction after the loop."""
  region = region_lib.region_of(config, layout, call)
  param_specs, batch_spec = region.in_specs[0], P(layout.data_axes)
  grad_specs = param_specs if config.reduce else (
      [batch_spec] * len(param_specs), batch_spec)  # per-device sums and weights
  # Aux sums are reduced (invariant); Concat rows stay with their device, like the batch.
  aux_specs = region_lib.aux_specs(decision.aux, layout) if config.has_aux else P()

  def run(check_vma: bool) -> Ran:
    return region.mapped(lambda local: _device_loop(config, layout, local, decision), layout,
                         Ran(P(), aux_specs, P(), grad_specs, P(), P()), check_vma)(*region.args)

  with jax.named_scope(paths.record(decision.path)):
    ran = _typed_or_not(run, untyped_retry=not decision.collectives)
  return ran._replace(grads=_package(config, call, ran.grads))


def _typed_or_not(region: Callable[[bool], Any], *, untyped_retry: bool) -> Any:
  """``region(check_vma=True)``; where that fails only because a loop's carry starts
  invariant and becomes varying over the data axes (flax ``nn.RNN`` starts its carry from
  zeros: each device's carry then follows its rows), ``region(check_vma=False)``, if
  ``untyped_retry``: the loss names the data axes in no collective (it traced on the
  global micro-batch), so the types that ``check_vma`` checks change no value (the
  region's own reductions are after the loop). A loss with such collectives keeps the
  error."""
  try:
    return region(True)
  except TypeError as err:
    if not untyped_retry or "manual axis types do not match" not in str(err):
      raise
  return region(False)


def _per_rank(config: Config, layout: meshes.Layout, call: Call) -> Ran:
  """Inside the caller's shard_map over the data axes (per-rank code): each device's loss
  is its shard of one global loss; local sums, one reduction over the axes after the loop."""
  decision = decision_lib.per_rank(config, layout, call)
  with jax.named_scope(paths.record(decision.path)):
    ran = _device_loop(config, layout, call, decision, presummed=True)
  return ran._replace(grads=_package(config, call, ran.grads))


def _package(config: Config, call: Call, grad_leaves) -> Any:
  """The gradient leaves of the device loop as the differentiated arguments' trees, or
  ``fxaccum.Unreduced`` per-device sums (:func:`value_and_unreduced_grad`)."""
  if not config.reduce:
    grad_leaves, weight = grad_leaves
    return reductions.Unreduced(_unflatten_grads(config, call, grad_leaves), weight)
  return jax.tree.unflatten(call.diff_def, grad_leaves)


def _unflatten_grads(config: Config, call: Call, leaves: list[Any]) -> Any:
  grads = jax.tree.unflatten(call.diff_def, leaves)
  return grads[0] if config.single_argnum else grads


def _device_loop(config: Config, layout: meshes.Layout, call: Call, decision: Decision,
                 presummed: bool = False) -> Ran:
  """Inside the data-manual region: local sums over the micro-batches with the decided FSDP
  strategy, then reductions (``presummed``: see :func:`loop`)."""
  axes = layout.data_axes
  # Varying (per-device) params: jax.grad then returns local partial sums, no psum.
  shards = meshes.vary(list(call.diff_leaves), axes)
  strategy = decision.fsdp.strategy if decision.fsdp else None
  # zero3: the loss traced on whole params, which the loop runs on the shards.
  traced = (decision.zero3 or region_lib.forward(config, layout, call)
            ) if strategy == "zero3" else None
  per_step = strategy == "zero1"
  # Leaves gathered inside the loop body (FSDP per micro-batch) vs. held whole locally.
  gather_in_loop = [dims if not per_step else () for dims in layout.param_dims]
  whole = meshes.vary([reductions.gather(leaf, dims) for leaf, dims in zip(
      call.diff_leaves, layout.param_dims, strict=True)], axes) if per_step else shards

  sums = acc.local_gradients(call.diff_leaves, whole, layout.param_dims, gather_in_loop, axes,
                             config.accumulator_dtype, reduced=config.reduce)
  step = replayed_step(config, call, axes, whole, decision.replay
                       ) if decision.replay else None  # the analysis's trace, run
  looped = loop(config, call, axes, whole, gather_in_loop, sums, presummed, traced=traced,
                step=step)
  grads = looped.grads
  if not config.reduce:  # each device's sums, one slot per device
    grads = ([total[None] for total in grads], meshes.vary(looped.local_weight, axes)[None])
  return Ran.of(looped, grads)


def _global(config: Config, layout: meshes.Layout, decision: Decision, call: Call) -> Ran:
  """Global view: the loss on the global micro-batch; the decision's reducible leaves are
  typed ``reduced`` over the data axes (Explicit meshes) so their gradients stay unreduced
  through the loop and are reduced once after it."""
  axes = layout.data_axes
  typed = global_specs(call, layout, decision.reducible)
  specs = [spec for spec, _ in typed]
  reduced = [r for _, r in typed]
  whole = [jax.sharding.reshard(leaf, P(*spec, reduced=r)) if r else leaf
           for leaf, (spec, r) in zip(call.diff_leaves, typed, strict=True)]
  # Auto meshes: accumulators and gradients kept sharded like the params (FSDP).
  hints = None if layout.mesh is None or meshes.explicit(layout.mesh, axes) else [
      None if hint is None else NamedSharding(layout.mesh, hint)
      for hint in layout.param_specs or (None,) * len(whole)]
  sums = acc.global_gradients(call.diff_leaves, specs, reduced, hints,
                              config.accumulator_dtype, reduced_result=config.reduce)

  def finalize(sums_carry, weight):
    grads = sums.finalize(sums_carry, weight)
    if not config.reduce:
      return _as_unreduced(config, layout, call, grads, weight)
    return jax.tree.unflatten(call.diff_def, grads)

  path = dataclasses.replace(decision.path, reduced_leaves=sum(map(bool, reduced)),
                             leaves=len(whole))
  with jax.named_scope(paths.record(path)):
    looped = loop(config, call, (), whole, [()] * len(whole),
                  dataclasses.replace(sums, finalize=finalize), step=decision.step)
  return Ran.of(looped, looped.grads)


def _as_unreduced(config: Config, layout: meshes.Layout, call: Call, sums, weight):
  """Global-view sums in the per-device form ``Unreduced`` gives them (the reduction
  already ran)."""
  sums, weight = reductions.in_first_slot((sums, weight.astype(jnp.float32)),
                                          layout.data_axes, layout.mesh)
  return reductions.Unreduced(_unflatten_grads(config, call, sums), weight)
