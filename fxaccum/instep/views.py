"""Which view runs the loss, and the two views.

Per traced call: per device, inside a ``shard_map`` manual over the data axes, with the
gradients summed locally and reduced over the data axes once after the loop, where the
view analysis (:mod:`fxaccum.analysis`) proves the loss keeps its examples apart;
otherwise on the global micro-batch, as ``jax.value_and_grad`` runs it. In the
per-device view the FSDP strategy (:mod:`fxaccum.instep.fsdp`) is chosen here.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from fxaccum import analysis as analysis_lib
from fxaccum import markers, meshes, reductions, split
from fxaccum.analysis import symbolic
from fxaccum.instep import accumulators as acc
from fxaccum.instep import fsdp as fsdp_lib
from fxaccum.instep import gather as gather_lib
from fxaccum.instep import paths
from fxaccum.instep.call import (
  Call,
  Config,
  is_array,
  micro_batch_avals,
  micro_loss,
  written_leaves,
)
from fxaccum.instep.loop import loop
from fxaccum.markers import is_marker
from fxaccum.statistics import Statistics, noise_scale_of, unavailable_noise_scale

if TYPE_CHECKING:
  from fxaccum.integrations import nnx_modules

__all__ = ["run_call"]


# ---------------------------------------------------------------------------------------
# Which view


def run_call(config: Config, layout: meshes.Layout, kwargs: dict,
             modules: nnx_modules.Modules | None, packed: tuple[tuple, Any]) -> Any:
  """The whole accumulation for one layout; jit-traceable. ``packed`` is ``(args, state)``
  (module arguments split into their state); returns ``(result, (state, sown))``."""
  args, state = packed
  diff = tuple(args[i] for i in config.diff_argnums)
  diff_leaves, diff_def = jax.tree.flatten(diff)
  rest = tuple(None if i in config.diff_argnums else a for i, a in enumerate(args))
  call = Call(diff_leaves, diff_def, rest, kwargs, state, modules)
  if layout.manual:
    value_aux, grads, after = _per_rank(config, layout, call)
  elif (direct := _direct(config, layout, call)) is not None:
    value_aux, grads, after = direct
  elif not layout.data_axes:
    path = paths.Path("global", "the batch is not split over data-parallel devices", ())
    value_aux, grads, after = _global(config, layout, path, frozenset(), call)
  else:
    path, reducible, traced_aux, stacked, collectives = _decide(config, layout, call)
    value_aux = None
    if path.view == "device":
      try:
        value_aux, grads, after = _device(config, layout, path, call, traced_aux, stacked,
                                          collectives)
      except Exception as err:  # noqa: BLE001 - any failure to trace per device
        if config.view == "device":
          raise ValueError(
              f"view='device' could not run the loss per device: {_first_line(err)}. "
              "(A loss that runs on the global micro-batch, with no collective over the "
              "data axes, can take view='auto' or view='global' instead.)") from err
        path = dataclasses.replace(path, view="global", reason=_no_device_reason(err))
    if value_aux is None:
      _warn_gathered_by_the_compiler(config, layout, path)
      value_aux, grads, after = _global(config, layout, path, reducible, call)
  if config.single_argnum and not isinstance(grads, reductions.Unreduced):
    grads = grads[0]
  value, aux, stats = value_aux
  if stats is not None:
    aux = _with_statistics(aux, stats, grads)
  return ((value, aux) if config.has_aux else value, grads), after


def _with_statistics(aux: Any, stats: tuple[jax.Array, jax.Array | None], grads: Any) -> Any:
  """``aux`` with the step's :class:`fxaccum.Statistics` where the loss asked for them;
  ``stats`` is the loop's skipped count and summed :data:`NOISE_TERMS` (None: no noise
  scale for this step)."""
  skipped, terms = stats
  noise = (noise_scale_of(terms, grads) if terms is not None and
           not isinstance(grads, reductions.Unreduced) else unavailable_noise_scale())
  filled = Statistics(skipped=skipped, noise_scale=noise)
  return jax.tree.map(lambda m: filled if isinstance(m, Statistics) else m, aux,
                      is_leaf=is_marker)


def _warn_gathered_by_the_compiler(config: Config, layout: meshes.Layout,
                                   path: paths.Path) -> None:
  """An FSDP strategy named in ``fsdp=`` applies in the per-device view only."""
  if config.fsdp != "auto" and any(layout.param_dims):
    warnings.warn(
        f"fsdp='{config.fsdp}' has no effect on this step: it runs in the global view "
        f"({path.reason}), where the compiler places the FSDP gathers (above the "
        "micro-batch loop). view='device' runs the strategy, if the loss may run per "
        "device.", stacklevel=4)


def _direct(config: Config, layout: meshes.Layout, call: Call) -> Any:
  """One micro-batch (``view="auto"``, reduced): nothing to accumulate, and the compiler's
  reduction of ``jax.value_and_grad``'s program is already one per step, so that program
  runs, without a per-device region or a loop. None where it does not trace (code valid
  only per device, e.g. FSDP params beside a data-sharded batch on an Explicit mesh)."""
  if config.micro_batches != 1 or config.view != "auto" or not config.reduce:
    return None
  path = paths.Path("global", "one micro-batch: the step runs as jax.value_and_grad runs it",
                    layout.data_axes)
  try:  # (a loss asking for Statistics raises: its noise scale's small batches are the
    return _global(config, layout, path, frozenset(), call, direct=True)  # devices' rows)
  except Exception:  # noqa: BLE001 - not runnable on the global batch: decide as for k > 1
    return None


def _no_device_reason(err: BaseException) -> str:
  """Why the per-device region could not run the loss, with the fix where there is one."""
  if isinstance(err, NotImplementedError) and "Closing over inputs to shard_map" in str(err):
    return ("the loss closes over a traced value typed on an Explicit mesh, which JAX "
            "0.10.2 cannot take into the per-device region: pass it to the loss as an "
            "argument (or keyword argument) to take the fast path")
  return f"the loss did not trace per device ({_first_line(err)})"


def _first_line(err: BaseException) -> str:
  text = str(err).strip().splitlines()
  return f"{type(err).__name__}: {text[0] if text else ''}"


class _Decision(NamedTuple):
  """The view for a call, the leaves the global view may keep ``reduced``, the aux the
  analysis traced (abstract, with its markers; None where it traced none), and whether its
  micro-step scans over stacked FSDP params (:func:`fxaccum.instep.gather.per_layer`; None where
  it traced none); ``collectives``: the loss names the data axes in collectives (it runs
  only per device)."""

  path: paths.Path
  reducible: frozenset[int] = frozenset()
  aux: Any = None
  stacked: bool | None = None
  collectives: bool = False


def _decide(config: Config, layout: meshes.Layout, call: Call) -> _Decision:
  """The view for this call (see :class:`_Decision`)."""
  axes = layout.data_axes
  on_explicit = meshes.explicit(layout.mesh, axes)
  if config.view == "global" and not on_explicit:
    return _Decision(paths.Path("global", "view='global'", axes))
  problem: str | None = None
  reducible: frozenset[int] = frozenset()
  try:
    for analysis, roles, aux, jaxpr in _analyses(config, layout, call,
                                          paired=config.view == "auto"):
      reducible = analysis.reducible if on_explicit else frozenset()
      blockers = [*analysis.blockers,
                  *([layout.device_blocker] if layout.device_blocker else [])]
      if config.view == "device":
        if "param_update" in roles:
          raise ValueError(
              "view='device' cannot run this loss per device: it writes a differentiated "
              "variable (e.g. nnx.WeightNorm or nnx.SpectralNorm writing its normalized "
              "kernel into its nnx.Param), which each micro-batch must read as the "
              "previous one left it. Use view='auto' (the default) or view='global'.")
        if config.state_argnums:
          raise ValueError(
              "view='device' with state_argnums: each device would thread its own state "
              "through its rows, so the returned state would be per device. Use "
              "view='auto' (the default) or view='global' to thread one state through the "
              "global micro-batches.")
        if blockers:
          raise ValueError(
              f"view='device' cannot run this loss per device: {blockers[0]}. Use "
              "view='auto' (the default) or view='global'.")
        return _Decision(paths.Path("device", "view='device'", axes), reducible, aux,
                         gather_lib.per_layer(jaxpr, layout.param_dims))
      if config.view == "global":
        return _Decision(paths.Path("global", "view='global'", axes), reducible)
      found, what = paths.classify(analysis.outputs, roles, summed=call.kinds[-1] == "sum")
      # One device: how values scale is not read (no second size), and nothing differs.
      one = layout.data_devices == 1
      if not blockers and found is None:
        return _Decision(paths.Path(
            "device", paths.ONE_DEVICE if one else f"the loss is a {what} of per-example terms",
            axes), reducible, aux, gather_lib.per_layer(jaxpr, layout.param_dims))
      problem = problem or (blockers[0] if blockers else paths.ONE_DEVICE if one else found)
      if blockers:  # no other trace removes a blocker
        break
  except NameError as err:  # a collective over an axis that only the device view binds
    if config.view == "device":
      return _Decision(paths.Path("device", "view='device'", axes), collectives=True)
    raise ValueError(
        f"The loss does not run on the global micro-batch ({_first_line(err)}). A loss "
        "that names the data axes in collectives (e.g. flax BatchNorm(axis_name=...), "
        "jax.lax.pmean(x, 'data')) runs only per device: pass view='device'.") from err
  except _NoDeviceTrace as err:
    problem = problem or str(err)
  return _Decision(paths.Path(
      "global", problem or "no proof that per-device results add up", axes), reducible)


class _NoDeviceTrace(Exception):
  """The micro-step does not trace on one device's rows (the message says why)."""


def _traced_for_every_size(step: Any, *args: Any) -> Any:
  """``make_jaxpr`` of ``step`` on arguments with a symbolic number of rows, or None
  where that is not the program every number of rows runs."""
  try:
    with symbolic.undecided_uses() as undecided:
      traced = jax.make_jaxpr(step, return_shape=True)(*args)
  except Exception:  # noqa: BLE001 - not traceable for any number of rows: pair two
    return None
  # Undecided: e.g. `if x.shape[0] == 2`, `if n % 2`: not the program on 2 rows.
  return None if undecided else traced


def _analyses(config: Config, layout: meshes.Layout, call: Call, paired: bool):
  """:func:`fxaccum.analysis.analyze` of one micro-step (the loss, its aux and state, and
  its gradients), with each output's role, the traced aux and the micro-step's jaxpr:
  ``(analysis, roles, aux, jaxpr)``, generated lazily.

  With ``paired``, the step is first traced with a *symbolic* number of rows: a proof on
  that jaxpr holds for every number of rows, so for the global micro-batch and for each
  device's share alike. Where that trace fails (the loss's Python code computes with the
  number of rows, e.g. ``max(n, 8)`` or a numpy array of ``n`` weights) or proves
  nothing (JAX spells a few operations differently for a symbolic size, e.g. a reversal
  as a gather), the step is traced on the global micro-batch and on one device's rows,
  and the two programs are compared (see :mod:`fxaccum.analysis`): the proof then holds
  for the two programs that run. Without ``paired`` only the global micro-batch is
  traced (to find mixing operations and reducible params, not how values scale).

  The global step is traced with the types the global view gives it; if that fails (code
  valid only per device, e.g. a gather of data-sharded indices on an Explicit mesh), with
  the data axes dropped from the types, as the per-device view sees them. Values, and so
  the analysis, do not depend on shardings.
  """
  axes = layout.data_axes
  micro = micro_batch_avals(config, call)
  leaves = [_gathered(leaf, axes) for leaf in call.diff_leaves]
  rows, devices = jax.tree.leaves(micro)[0].shape[0], layout.data_devices
  rows_seen = rows  # the global micro-batch's, where the analysis reads a symbolic size
  paired = paired and devices > 1
  n_diff, n_micro = len(call.diff_leaves), len(jax.tree.leaves(micro))

  def step(leaves, micro, state):
    def total(leaves):
      loss_total, weight, aux, state_out, sown = call.loss(config, leaves, micro, 0, state)
      return loss_total, (weight, aux, state_out, sown)
    return jax.value_and_grad(total, has_aux=True)(leaves)

  def per_device(tree, new_rows: Any = None):
    """Abstract values as the device view types them, with ``new_rows`` rows."""
    def local(x):
      x = _gathered(x, axes, batch=True)
      if new_rows is None:
        return x
      return jax.ShapeDtypeStruct((new_rows, *x.shape[1:]), x.dtype, sharding=x.sharding)
    return jax.tree.map(local, tree)

  def analysis(traced, rows, partner=None):
    closed, ((_, (_, aux, state, sown)), _) = traced
    return analysis_lib.analyze(
        closed, rows=rows, batch_inputs=range(n_diff, n_diff + n_micro),
        param_inputs=range(n_diff), partner=partner,
        partner_rows=rows // devices if partner is not None else None,
        rows_seen=rows_seen), _roles(closed, aux, state, sown, written_leaves(*traced),
                                     n_diff, n_micro), aux, closed.jaxpr

  if paired:
    (symbol,) = jax.export.symbolic_shape("rows")
    traced = _traced_for_every_size(
        step, per_device(leaves), per_device(micro, symbol), per_device(call.state))
    if traced is not None:
      result = analysis(traced, symbol)
      yield result
      if not result[0].sized_positions:  # concrete sizes would find the same
        return
  try:
    traced = jax.make_jaxpr(step, return_shape=True)(leaves, micro, call.state)
  except Exception as err:  # noqa: BLE001 - retried without data axes, else re-raised
    try:
      traced = jax.make_jaxpr(step, return_shape=True)(*per_device((leaves, micro,
                                                                    call.state)))
    except Exception:  # noqa: BLE001
      raise err from None
  partner = None
  if paired:
    try:
      partner = jax.make_jaxpr(step)(per_device(leaves), per_device(micro, rows // devices),
                                     per_device(call.state))
    except Exception as err:  # noqa: BLE001 - the device view could not run it either
      raise _NoDeviceTrace(f"the loss did not trace per device ({_first_line(err)})") from err
  yield analysis(traced, rows, partner)


def _roles(closed: Any, aux: Any, state: Any, sown: Any, written: tuple[bool, ...],
           n_diff: int, n_micro: int) -> list[paths.Role]:
  """The role of each output of a traced micro-step (see :func:`_analyses`); ``written``:
  :func:`~fxaccum.instep.call.written_leaves` of it."""
  roles: list[paths.Role] = ["total", "weight"]
  for marker in jax.tree.leaves(aux, is_leaf=is_marker):
    if isinstance(marker, markers.Weighted):
      roles.extend(["aux_total", "aux_weight"])
      continue
    by_marker: dict[type, paths.Role] = {
        markers.Sum: "aux_sum", markers.Concat: "aux_concat", markers.Max: "aux_max",
        markers.Min: "aux_min", markers.State: "state"}
    role = by_marker.get(type(marker), "aux")
    roles.extend([role] * len(jax.tree.leaves(marker)))
  # Threaded module state must pass through unchanged for the per-device view.
  state_in = closed.jaxpr.invars[n_diff + n_micro:]
  carried = len(jax.tree.leaves((state.modules, state.arguments)))
  state_out = closed.jaxpr.outvars[len(roles):len(roles) + carried]
  roles.extend("state" if v_out is v_in else "state_update"
               for v_in, v_out in zip(state_in, state_out, strict=True))
  # A param set again to the value it read passes through; another value is an update.
  roles.extend("param_update" if w else "state"
               for w, value in zip(written, state.params, strict=True) if value is not None)
  roles.extend(["sown"] * len(jax.tree.leaves(sown)))
  roles.extend(["grad"] * n_diff)
  return roles


def _gathered(leaf: Any, data_axes: tuple[str, ...], batch: bool = False) -> Any:
  """An abstract value like ``leaf``, with the data axes dropped from its type.

  Differentiated leaves enter the loss like this in either view (FSDP params typed
  sharded over data axes on an Explicit mesh are gathered before the loss); with
  ``batch=True`` any leaf, as the per-device view types it.
  """
  aval = jax.typeof(leaf)
  sharding = getattr(aval, "sharding", None)
  if not isinstance(sharding, NamedSharding) or not _named(sharding.spec) & set(data_axes):
    return leaf if not batch else jax.ShapeDtypeStruct(aval.shape, aval.dtype,
                                                      sharding=sharding)
  spec = P(*(tuple(a for a in meshes.spec_axes(e) if a not in data_axes) or None
             for e in sharding.spec))
  return jax.ShapeDtypeStruct(aval.shape, aval.dtype,
                              sharding=NamedSharding(sharding.mesh, spec))


# ---------------------------------------------------------------------------------------
# The two views


def _device(config: Config, layout: meshes.Layout, path: paths.Path, call: Call,
            traced_aux: Any = None, stacked: bool | None = None, collectives: bool = False):
  """Per-device view: a shard_map manual over the data axes, one reduction after the loop.
  ``traced_aux`` and ``stacked``: the aux as the view analysis traced it (its markers),
  and whether its micro-step scans over stacked FSDP params, if it traced one;
  ``collectives``: the loss names the data axes in collectives."""
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
    return _device_loop(config, layout, local_call(*args), chosen=chosen, stacked=stacked)

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
  def region(check_vma: bool):
    chosen.clear()
    return meshes.shard_map_keeping_axes(local, mesh=layout.mesh, in_specs=in_specs, out_specs=(
        (P(), aux_specs, P()), grad_specs, P()), axis_names=set(axes), check_vma=check_vma)(
            diff_leaves, rest, arrays, state)

  with jax.named_scope(scope := paths.record(path)):
    value_aux, grad_leaves, after = _typed_or_not(region, untyped_retry=not collectives)
  if chosen:
    paths.amend(scope, fsdp=f"{chosen[0].strategy}: {chosen[0].reason}")
  return value_aux, _package(config, call, grad_leaves), after


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


def _per_rank(config: Config, layout: meshes.Layout, call: Call):
  """Inside the caller's shard_map over the data axes (per-rank code): each device's loss
  is its shard of one global loss; local sums, one reduction over the axes after the loop."""
  if config.view == "global":
    raise ValueError(
        f"view='global' cannot run inside a shard_map that is manual over the data axes "
        f"{layout.data_axes}: there the loss sees only its device's shard. Call fxaccum "
        "outside the shard_map, or use view='auto'.")
  if config.view == "auto":
    try:
      total = next(_analyses(config, layout, call, paired=False))[0].outputs[0]
    except Exception:  # noqa: BLE001 - the check is best effort; the loop traces it again
      total = None
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
    value_aux, grad_leaves, after = _device_loop(config, layout, call, presummed=True)
  return value_aux, _package(config, call, grad_leaves), after


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
                 chosen: list[fsdp_lib.Choice] | None = None, stacked: bool | None = None):
  """Inside the data-manual region: local sums over the micro-batches, then reductions
  (``presummed``: see :func:`loop`). The FSDP strategy taken is appended to ``chosen``;
  ``stacked``: see :func:`_fsdp_choice`."""
  axes = layout.data_axes
  # Varying (per-device) params: jax.grad then returns local partial sums, no psum.
  shards = meshes.vary(list(call.diff_leaves), axes)
  strategy, traced = "zero2", None
  if any(layout.param_dims):
    choice, traced = _fsdp_choice(config, layout, call, shards, stacked)
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
  value_aux, grads, local_weight, after = loop(
      config, call, axes, whole, gather_in_loop, sums, presummed, traced=traced)
  if not config.reduce:  # each device's sums, one slot per device
    grads = ([total[None] for total in grads], meshes.vary(local_weight, axes)[None])
  return value_aux, grads, after


def _fsdp_choice(config: Config, layout: meshes.Layout, call: Call, shards: list[Any],
                 stacked: bool | None) -> tuple[fsdp_lib.Choice, gather_lib.Traced | None]:
  """The FSDP strategy of this step (:mod:`fxaccum.instep.fsdp`) and, for zero3, the loss traced
  on whole params, which its loop runs on the shards. ``stacked``: whether the view
  analysis's micro-step scans over stacked FSDP params (None: it traced none; the loss's
  forward pass is read instead)."""
  if config.fsdp in ("zero1", "zero2"):
    return fsdp_lib.forced(config.fsdp), None
  blocker = _zero3_blocker(call.diff_leaves, layout)
  if config.fsdp == "zero3" and blocker:
    raise ValueError(f"fsdp='zero3' cannot run this step: {blocker}; fsdp='auto' gathers "
                     "such a param once per step")

  def traced() -> gather_lib.Traced:
    micro = split.micro_batch(call.batch(config), 0, config.micro_batches)
    return gather_lib.trace(micro_loss(config, call), shards, layout.param_dims, micro,
                            jnp.int32(0), call.state)

  if config.fsdp == "zero3":
    return fsdp_lib.forced("zero3"), traced()
  forward = None
  if stacked is None:  # the view analysis traced no micro-step: read the forward pass
    forward = traced()
    stacked = gather_lib.per_layer(forward.closed.jaxpr, layout.param_dims)
  choice = fsdp_lib.choose(stacked, blocker)
  if choice.strategy != "zero3":
    return choice, None
  return choice, forward or traced()


def _zero3_blocker(leaves: Sequence[Any], layout: meshes.Layout) -> str | None:
  """Why zero3 cannot gather a param in the loop: JAX 0.10.2 cannot differentiate an
  all_gather over a manual data axis of a value also sharded over an ``Explicit`` non-data
  axis (an AssertionError in its sharding rule, without fxaccum too; docs/sharding.md)."""
  for i, (leaf, dims) in enumerate(zip(leaves, layout.param_dims, strict=True)):
    other = {a for entry in jax.typeof(leaf).sharding.spec for a in meshes.spec_axes(entry)}
    other -= set(layout.data_axes)
    if dims and meshes.explicit(layout.mesh, sorted(other)):
      return (f"param leaf {i} is sharded over the Explicit axes {sorted(other)} too, and "
              f"JAX {jax.__version__} fails to differentiate its gather inside the loop")
  return None


def _global(config: Config, layout: meshes.Layout, path: paths.Path,
            reducible: frozenset[int], call: Call, direct: bool = False):
  """Global view: the loss on the global micro-batch; leaves in ``reducible`` are typed
  ``reduced`` over the data axes (Explicit meshes) so their gradients stay unreduced
  through the loop and are reduced once after it. ``direct``: see :func:`loop`."""
  if reducible:
    try:
      return _global_loop(config, layout, path, reducible, call)
    except Exception as err:  # noqa: BLE001 - an op without reduced/unreduced rules
      path = dataclasses.replace(
          path, reason=f"{path.reason}; params not kept reduced ({_first_line(err)})")
  return _global_loop(config, layout, path, frozenset(), call, direct)


def _global_loop(config: Config, layout: meshes.Layout, path: paths.Path,
                 reducible: frozenset[int], call: Call, direct: bool = False):
  axes = layout.data_axes
  specs = [_spec_of(leaf, hint) for leaf, hint in zip(
      call.diff_leaves, layout.param_specs or [None] * len(call.diff_leaves), strict=True)]
  reduced = [frozenset(a for a in axes if a not in _named(spec)) if i in reducible
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
    value_aux, grads, _, after = loop(config, call, (), whole, [()] * len(whole),
                                       dataclasses.replace(sums, finalize=finalize),
                                       direct=direct)
  return value_aux, grads, after


def _spec_of(leaf: Any, hint: P | None) -> tuple[Any, ...]:
  """The leaf's PartitionSpec entries, one per dimension (typed, else the hint)."""
  ndim = len(jnp.shape(leaf))
  spec = meshes.known_spec(leaf)
  if all(e is None for e in spec) and hint is not None:
    spec = tuple(hint) + (None,) * (ndim - len(hint))
  return tuple(spec)


def _named(spec: Any) -> set[str]:
  return {a for entry in spec for a in meshes.spec_axes(entry)}


def _as_unreduced(config: Config, layout: meshes.Layout, call: Call, sums, weight):
  """Global-view sums in the per-device form ``Unreduced`` gives them (the reduction
  already ran)."""
  sums, weight = reductions.in_first_slot((sums, weight.astype(jnp.float32)),
                                          layout.data_axes, layout.mesh)
  return reductions.Unreduced(_unflatten_grads(config, call, sums), weight)
