"""The two views that run the loss, and :func:`run_call`, which runs the one decided.

Per traced call, the view the decision (:mod:`fxaccum.instep.decision`) took: per
device, inside a ``shard_map`` manual over the data axes, with the gradients summed
locally and reduced over the data axes once after the loop; or on the global
micro-batch, as ``jax.value_and_grad`` runs it. The per-device view takes the FSDP
strategy (:mod:`fxaccum.instep.fsdp`) the decision chose, or chooses it from the loss's
forward pass where the analysis traced no micro-step.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from fxaccum import analysis as analysis_lib
from fxaccum import markers, meshes, reductions, split
from fxaccum.instep import accumulators as acc
from fxaccum.instep import fsdp as fsdp_lib
from fxaccum.instep import gather as gather_lib
from fxaccum.instep import paths
from fxaccum.instep.attempts import attempt
from fxaccum.instep.call import Call, Config, is_array, micro_loss
from fxaccum.instep.decision import (
    analyses,
    decide,
    first_line,
    forced_zero3_refusal,
    no_device_reason,
    zero3_blocker,
)
from fxaccum.instep.loop import Looped, StatisticsPerDevice, loop
from fxaccum.markers import is_marker
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
  ran = _per_rank(config, layout, call) if layout.manual else _direct(config, layout, call)
  if ran is None and not layout.data_axes:
    path = paths.Path("global", "the batch is not split over data-parallel devices", ())
    ran = _global(config, layout, path, frozenset(), call)
  elif ran is None:
    decision = decide(config, layout, call)
    path = decision.path
    if path.view == "device":
      ran, err = attempt(_device, config, layout, path, call, decision.aux,
                         decision.stacked, decision.collectives, decision.fsdp)
      if err is not None:  # the loss did not trace per device
        if config.view == "device":
          raise ValueError(
              f"view='device' could not run the loss per device: {first_line(err)}. "
              "(A loss that runs on the global micro-batch, with no collective over the "
              "data axes, can take view='auto' or view='global' instead.)") from err
        path = dataclasses.replace(path, view="global", reason=no_device_reason(err))
    if ran is None:
      _warn_gathered_by_the_compiler(config, layout, path)
      ran = _global(config, layout, path, decision.reducible, call)
  grads = ran.grads
  if config.single_argnum and not isinstance(grads, reductions.Unreduced):
    grads = grads[0]
  aux = ran.aux
  if ran.statistics is not None:  # no noise scale of per-device sums
    skipped, terms = ran.statistics
    aux = with_statistics(aux, skipped, None if isinstance(
        grads, reductions.Unreduced) else terms, grads)
  return ((ran.value, aux) if config.has_aux else ran.value, grads), (ran.state, ran.sown)


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


def _direct(config: Config, layout: meshes.Layout, call: Call) -> Ran | None:
  """One micro-batch (``view="auto"``, reduced): nothing to accumulate, and the compiler's
  reduction of ``jax.value_and_grad``'s program is already one per step, so that program
  runs, without a per-device region or a loop. None where it does not trace (code valid
  only per device, e.g. FSDP params beside a data-sharded batch on an Explicit mesh)."""
  if config.micro_batches != 1 or config.view != "auto" or not config.reduce:
    return None
  path = paths.Path("global", "one micro-batch: the step runs as jax.value_and_grad runs it",
                    layout.data_axes)
  # None: not runnable on the global batch, decided as for k > 1 (so is a loss asking for
  # Statistics: its noise scale's small batches are the devices' rows)
  return attempt(_global, config, layout, path, frozenset(), call, True,
                 expected=(StatisticsPerDevice,)).value


# ---------------------------------------------------------------------------------------
# The two views


def _device(config: Config, layout: meshes.Layout, path: paths.Path, call: Call,
            traced_aux: Any = None, stacked: bool | None = None, collectives: bool = False,
            decided: fsdp_lib.Choice | None = None) -> Ran:
  """Per-device view: a shard_map manual over the data axes, one reduction after the loop.
  ``traced_aux`` and ``stacked``: the aux as the view analysis traced it (its markers),
  and whether its micro-step scans over stacked FSDP params, if it traced one;
  ``collectives``: the loss names the data axes in collectives; ``decided``: the FSDP
  strategy the decision chose (None: chosen here, and the path amended)."""
  axes = layout.data_axes
  batch_spec = P(axes)
  rest_specs = tuple(_specs_like(a, batch_spec if i in config.batch_argnums else P())
                     for i, a in enumerate(call.rest))
  param_specs = [layout.param_spec(i) for i in range(len(call.diff_leaves))]
  kw_leaves, kw_def = jax.tree.flatten(call.kwargs)
  kw_arrays = [i for i, leaf in enumerate(kw_leaves) if is_array(leaf)]
  conform = functools.partial(meshes.conform, data_axes=axes)
  diff_leaves = [conform(x, spec) for x, spec in zip(call.diff_leaves, param_specs, strict=True)]
  rest = jax.tree.map(conform, call.rest, rest_specs)
  arrays = [conform(kw_leaves[i], P()) for i in kw_arrays]
  state = jax.tree.map(lambda x: conform(x, P()), call.state)

  def local_call(diff_leaves, rest, arrays, state) -> Call:
    leaves = list(kw_leaves)
    for i, array in zip(kw_arrays, arrays, strict=True):
      leaves[i] = array
    return Call(diff_leaves, call.diff_def, rest, jax.tree.unflatten(kw_def, leaves), state,
                 call.modules)

  chosen: list[fsdp_lib.Choice] = []  # the FSDP strategy, chosen in the region

  def local(*args):
    return _device_loop(config, layout, local_call(*args), chosen=chosen, stacked=stacked,
                        decided=decided)

  in_specs = (param_specs, rest_specs, [P()] * len(arrays), P())
  grad_specs = param_specs if config.reduce else (
      [batch_spec] * len(diff_leaves), batch_spec)  # per-device sums and weights
  # Aux sums are reduced (invariant); Concat rows stay with their device, like the batch.
  aux_specs: Any = P()
  if config.has_aux and traced_aux is not None:
    aux_specs = _aux_specs(traced_aux, batch_spec)
  elif config.has_aux:
    found: dict[str, Any] = {}

    def probe(*args):  # the aux's markers, traced where the loss runs (it may name the
      local = local_call(*args)  # data axes in collectives)
      micro = split.micro_batch(local.batch(config), 0, config.micro_batches)
      full = [reductions.gather(x, dims) for x, dims in zip(local.diff_leaves, layout.param_dims,
                                                        strict=True)]
      found["specs"] = _aux_specs(local.loss(config, full, micro, 0, local.state)[2],
                                  batch_spec)
      return ()

    jax.eval_shape(meshes.shard_map_keeping_axes(
        probe, mesh=layout.mesh, in_specs=in_specs, out_specs=(), axis_names=set(axes)),
        diff_leaves, rest, arrays, state)
    aux_specs = found["specs"]
  def region(check_vma: bool) -> Ran:
    chosen.clear()
    return meshes.shard_map_keeping_axes(
        local, mesh=layout.mesh, in_specs=in_specs, axis_names=set(axes), check_vma=check_vma,
        out_specs=Ran(P(), aux_specs, P(), grad_specs, P(), P()))(diff_leaves, rest, arrays, state)

  with jax.named_scope(scope := paths.record(path)):
    ran = _typed_or_not(region, untyped_retry=not collectives)
  if chosen and decided is None:  # chosen in the region, from the loss's forward pass
    paths.amend(scope, fsdp=f"{chosen[0].strategy}: {chosen[0].reason}")
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


def _aux_specs(aux: Any, batch_spec: P) -> Any:
  """The region's out_specs of the aux: Concat rows stay with their device, like the batch;
  everything else is reduced (invariant)."""
  return jax.tree.map(lambda m: batch_spec if isinstance(m, markers.Concat) else P(), aux,
                      is_leaf=is_marker)


def _per_rank(config: Config, layout: meshes.Layout, call: Call) -> Ran:
  """Inside the caller's shard_map over the data axes (per-rank code): each device's loss
  is its shard of one global loss; local sums, one reduction over the axes after the loop."""
  if config.view == "global":
    raise ValueError(
        f"view='global' cannot run inside a shard_map that is manual over the data axes "
        f"{layout.data_axes}: there the loss sees only its device's shard. Call fxaccum "
        "outside the shard_map, or use view='auto'.")
  if config.view == "auto":
    # Best effort (None where it does not trace): the loop traces the loss again.
    total = attempt(lambda: next(analyses(config, layout, call, paired=False))[0].outputs[0]
                    ).value
    if isinstance(total, analysis_lib.Stat) and total.ratio:
      raise ValueError(
          f"Inside a shard_map over {layout.data_axes} each device's loss is its shard of "
          "the global loss, but this loss divides by a statistic of its own shard (e.g. its "
          f"token count: {total.mixed}). Per-shard means do not combine into the global "
          "mean (DeepSpeed #5248). Return fxaccum.Weighted(jnp.sum(mask * loss), "
          "jnp.sum(mask)) instead.")
  path = paths.Path("device", "per-rank code inside a shard_map over the data axes: "
                    "local sums, one reduction after the loop", layout.data_axes)
  with jax.named_scope(paths.record(path)):
    ran = _device_loop(config, layout, call, presummed=True)
  return ran._replace(grads=_package(config, call, ran.grads))


def _package(config: Config, call: Call, grad_leaves) -> Any:
  """The gradient leaves of the device loop as the differentiated arguments' trees, or
  ``fxaccum.Unreduced`` per-device sums (:func:`value_and_unreduced_grad`)."""
  if not config.reduce:
    grad_leaves, weight = grad_leaves
    return reductions.Unreduced(_unflatten_grads(config, call, grad_leaves), weight)
  return jax.tree.unflatten(call.diff_def, grad_leaves)


def _specs_like(tree: Any, spec: P) -> Any:
  return jax.tree.map(lambda _: spec, tree)


def _unflatten_grads(config: Config, call: Call, leaves: list[Any]) -> Any:
  grads = jax.tree.unflatten(call.diff_def, leaves)
  return grads[0] if config.single_argnum else grads


def _device_loop(config: Config, layout: meshes.Layout, call: Call, presummed: bool = False,
                 chosen: list[fsdp_lib.Choice] | None = None, stacked: bool | None = None,
                 decided: fsdp_lib.Choice | None = None) -> Ran:
  """Inside the data-manual region: local sums over the micro-batches, then reductions
  (``presummed``: see :func:`loop`). The FSDP strategy taken is appended to ``chosen``;
  ``stacked``: see :func:`_fsdp_choice`."""
  axes = layout.data_axes
  # Varying (per-device) params: jax.grad then returns local partial sums, no psum.
  shards = meshes.vary(list(call.diff_leaves), axes)
  strategy, traced = "zero2", None
  if any(layout.param_dims):
    choice, traced = _fsdp_choice(config, layout, call, shards, stacked, decided)
    strategy = choice.strategy
    if chosen is not None:
      chosen.append(choice)
  per_step = strategy == "zero1"
  # Leaves gathered inside the loop body (FSDP per micro-batch) vs. held whole locally.
  gather_in_loop = [dims if not per_step else () for dims in layout.param_dims]
  whole = meshes.vary([reductions.gather(leaf, dims) for leaf, dims in zip(
      call.diff_leaves, layout.param_dims, strict=True)], axes) if per_step else shards

  sums = acc.local_gradients(call.diff_leaves, whole, layout.param_dims, gather_in_loop, axes,
                             config.accumulator_dtype, reduced=config.reduce)
  looped = loop(config, call, axes, whole, gather_in_loop, sums, presummed, traced=traced)
  grads = looped.grads
  if not config.reduce:  # each device's sums, one slot per device
    grads = ([total[None] for total in grads], meshes.vary(looped.local_weight, axes)[None])
  return Ran.of(looped, grads)


def _fsdp_choice(config: Config, layout: meshes.Layout, call: Call, shards: list[Any],
                 stacked: bool | None, decided: fsdp_lib.Choice | None = None
                 ) -> tuple[fsdp_lib.Choice, gather_lib.Traced | None]:
  """The FSDP strategy of this step (:mod:`fxaccum.instep.fsdp`): ``decided`` where the
  decision chose it, and, for zero3, the loss traced on whole params, which its loop runs
  on the shards. ``stacked``: whether the view analysis's micro-step scans over stacked
  FSDP params (None: it traced none; the loss's forward pass is read instead)."""
  if config.fsdp in ("zero1", "zero2"):
    return fsdp_lib.forced(config.fsdp), None
  blocker = zero3_blocker(call.diff_leaves, layout)
  if config.fsdp == "zero3" and blocker:  # per-rank code (the decision saw the others)
    raise ValueError(forced_zero3_refusal(blocker))

  def traced() -> gather_lib.Traced:
    micro = split.micro_batch(call.batch(config), 0, config.micro_batches)
    return gather_lib.trace(micro_loss(config, call), shards, layout.param_dims, micro,
                            jnp.int32(0), call.state)

  if decided is not None or config.fsdp == "zero3":
    choice = decided or fsdp_lib.forced("zero3")
    return choice, traced() if choice.strategy == "zero3" else None
  forward = None
  if stacked is None:  # the view analysis traced no micro-step: read the forward pass
    forward = traced()
    stacked = gather_lib.per_layer(forward.closed.jaxpr, layout.param_dims)
  choice = fsdp_lib.choose(stacked, blocker)
  if choice.strategy != "zero3":
    return choice, None
  return choice, forward or traced()


def _global(config: Config, layout: meshes.Layout, path: paths.Path,
            reducible: frozenset[int], call: Call, direct: bool = False) -> Ran:
  """Global view: the loss on the global micro-batch; leaves in ``reducible`` are typed
  ``reduced`` over the data axes (Explicit meshes) so their gradients stay unreduced
  through the loop and are reduced once after it. ``direct``: see :func:`loop`."""
  if reducible:
    ran, err = attempt(_global_loop, config, layout, path, reducible, call)
    if err is None:
      return ran
    path = dataclasses.replace(  # e.g. an op without reduced/unreduced rules
        path, reason=f"{path.reason}; params not kept reduced ({first_line(err)})")
  return _global_loop(config, layout, path, frozenset(), call, direct)


def _global_loop(config: Config, layout: meshes.Layout, path: paths.Path,
                 reducible: frozenset[int], call: Call, direct: bool = False) -> Ran:
  axes = layout.data_axes
  specs = [_spec_of(leaf, hint) for leaf, hint in zip(
      call.diff_leaves, layout.param_specs or [None] * len(call.diff_leaves), strict=True)]
  reduced = [frozenset(a for a in axes if a not in meshes.named_axes(spec)) if i in reducible
             else frozenset() for i, spec in enumerate(specs)]
  whole = [jax.sharding.reshard(leaf, P(*spec, reduced=r)) if r else leaf
           for leaf, spec, r in zip(call.diff_leaves, specs, reduced, strict=True)]
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

  path = dataclasses.replace(path, reduced_leaves=sum(map(bool, reduced)), leaves=len(whole))
  with jax.named_scope(paths.record(path)):
    looped = loop(config, call, (), whole, [()] * len(whole),
                  dataclasses.replace(sums, finalize=finalize), direct=direct)
  return Ran.of(looped, looped.grads)


def _spec_of(leaf: Any, hint: P | None) -> tuple[Any, ...]:
  """The leaf's PartitionSpec entries, one per dimension (typed, else the hint)."""
  ndim = len(jnp.shape(leaf))
  spec = meshes.known_spec(leaf)
  if all(e is None for e in spec) and hint is not None:
    spec = tuple(hint) + (None,) * (ndim - len(hint))
  return tuple(spec)


def _as_unreduced(config: Config, layout: meshes.Layout, call: Call, sums, weight):
  """Global-view sums in the per-device form ``Unreduced`` gives them (the reduction
  already ran)."""
  sums, weight = reductions.in_first_slot((sums, weight.astype(jnp.float32)),
                                          layout.data_axes, layout.mesh)
  return reductions.Unreduced(_unflatten_grads(config, call, sums), weight)
