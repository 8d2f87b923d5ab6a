"""The decision: everything about how one traced call runs, made before anything runs.

:func:`decide` takes, from traces of one micro-step: the k = 1 shortcut (the step as
``jax.value_and_grad`` runs it); the view, where :mod:`fxaccum.analysis` reads how each
output of the micro-step depends on the examples (:func:`fxaccum.instep.analysed.analyses`)
and :func:`fxaccum.instep.additivity.classify` finds whether per-device results add up to
the global ones, and nothing blocks it; the per-device view's FSDP strategy; and the
global view's leaves kept ``reduced``. :func:`per_rank` decides for per-rank code, inside
the caller's ``shard_map``. A trace of the loss that fails in the loss's code is a fact
the decision records as its reason. Its :class:`Decision` is what the executors
(:mod:`fxaccum.instep.views`) run, without deciding, retrying or amending it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from fxaccum import analysis as analysis_lib
from fxaccum import meshes
from fxaccum.instep import fsdp as fsdp_lib
from fxaccum.instep import gather as gather_lib
from fxaccum.instep import paths
from fxaccum.instep import region as region_lib
from fxaccum.instep import replay as replay_lib
from fxaccum.instep.additivity import classify
from fxaccum.instep.analysed import Analysed, NoDeviceTrace, analyses, first_line
from fxaccum.instep.attempts import attempt
from fxaccum.instep.call import Call, Config, micro_batch_avals
from fxaccum.instep.micro_step import MicroStep, trace_step
from fxaccum.statistics import asks_statistics, takes_noise_scale

__all__ = ["CLOSURE", "ONE_DEVICE", "Decision", "decide", "forced_zero3_refusal",
           "global_specs", "per_rank", "zero3_blocker"]

# The reason on a mesh whose data axes hold one device, for either view: true for every
# loss there (the analysis reads one size only, so how values scale is not known).
ONE_DEVICE = ("one data-parallel device: its rows are the global micro-batch, so the device "
              "and global views run the loss on the same rows (nothing is added up over "
              "devices)")


# The reason where the loss closes over a value the per-device region cannot take.
CLOSURE = ("the loss closes over a traced value typed on an Explicit mesh, which JAX "
           "0.10.2 cannot take into the per-device region: pass it to the loss as an "
           "argument (or keyword argument) to take the fast path")


class Decision(NamedTuple):
  """The view decided for one call, and what the analysis found that the view runs with.

  Attributes:
    path: the view taken and why (recorded in the compiled program).
    reducible: the leaves the global view may keep ``reduced`` over the data axes.
    aux: the aux the analysis traced (abstract, with its markers; None where it traced
      none).
    stacked: whether its micro-step scans over stacked FSDP params
      (:func:`fxaccum.instep.gather.per_layer`; None where it traced none).
    collectives: the loss names the data axes in collectives (it runs only per device).
    fsdp: the per-device view's FSDP strategy (named in ``fsdp=``, or read from the
      micro-step); None where no param is sharded over a data axis.
    step: the global view's micro-step, where the decision traced it as the loop runs it
      (one micro-batch; params typed ``reduced``): the loop runs this jaxpr.
    zero3: per-rank code's forward pass on whole params, where the decision read zero3
      from it in the trace the loop runs in: the loop runs it on the shards.
    replay: the device view's micro-step as the analysis traced it (any number of rows),
      where the loop runs it instead of tracing the loss again
      (:mod:`fxaccum.instep.replay`); None: the loop traces the loss.
  """

  path: paths.Path
  reducible: frozenset[int] = frozenset()
  aux: Any = None
  stacked: bool | None = None
  collectives: bool = False
  fsdp: fsdp_lib.Choice | None = None
  step: MicroStep | None = None
  zero3: gather_lib.Traced | None = None
  replay: replay_lib.Replayable | None = None


def decide(config: Config, layout: meshes.Layout, call: Call) -> Decision:
  """How this call runs (see :class:`Decision`), outside a ``shard_map`` over the data
  axes (inside one: :func:`per_rank`)."""
  direct = _one_micro_batch(config, layout, call)
  if direct is not None:
    return direct
  if not layout.data_axes:
    return Decision(paths.Path(
        "global", "the batch is not split over data-parallel devices", ()))
  decision = _view(config, layout, call)
  if decision.path.view == "global":
    return _kept_reduced(config, layout, call, decision)
  blocker = zero3_blocker(call.diff_leaves, layout) if config.fsdp == "zero3" else None
  if blocker is None:
    return _with_fsdp(config, layout, call, decision)
  if config.view == "device":
    raise ValueError(f"view='device' could not run the loss per device: "
                     f"{forced_zero3_refusal(blocker)}.")
  return _kept_reduced(config, layout, call, Decision(dataclasses.replace(
      decision.path, view="global", reason=forced_zero3_refusal(blocker)), decision.reducible))


def _one_micro_batch(config: Config, layout: meshes.Layout, call: Call) -> Decision | None:
  """One micro-batch (``view="auto"``, reduced): nothing to accumulate, and the compiler's
  reduction of ``jax.value_and_grad``'s program is already one per step, so that program
  runs, without a per-device region or a loop. None (decided as for more micro-batches)
  where the step does not trace on the global batch (code valid only per device, e.g.
  FSDP params beside a data-sharded batch on an Explicit mesh), or asks for Statistics
  (its noise scale's small batches are the devices' rows)."""
  if config.micro_batches != 1 or config.view != "auto" or not config.reduce:
    return None
  leaves = list(call.diff_leaves)
  step = attempt(trace_step, config, call, (), leaves, [()] * len(leaves)).value
  if step is None or asks_statistics(step.aux):
    return None
  return Decision(paths.Path(
      "global", "one micro-batch: the step runs as jax.value_and_grad runs it",
      layout.data_axes), step=step)


def _kept_reduced(config: Config, layout: meshes.Layout, call: Call,
                  decision: Decision) -> Decision:
  """The global ``decision`` with the leaves it keeps ``reduced``: its reducible leaves,
  where the micro-step traces with them typed so (an operation without reduced/unreduced
  rules does not) and takes no noise scale (its squares need each micro-batch's reduced
  gradient); none otherwise, the reason saying why."""
  if not decision.reducible:
    return decision
  typed = global_specs(call, layout, decision.reducible)
  whole = [leaf if not reduced else jax.ShapeDtypeStruct(
      jnp.shape(leaf), jax.typeof(leaf).dtype,
      sharding=NamedSharding(layout.mesh, P(*spec, reduced=reduced)))
           for leaf, (spec, reduced) in zip(call.diff_leaves, typed, strict=True)]
  step, err = attempt(trace_step, config, call, (), whole, [()] * len(whole))
  why = (first_line(err) if err is not None else
         "the noise scale squares each micro-batch's reduced gradient"
         if takes_noise_scale(step.aux, reduced=config.reduce, summed=step.kind == "sum",
                              small_batches=True) else None)
  if why is None:
    return decision._replace(step=step)
  return Decision(dataclasses.replace(
      decision.path, reason=f"{decision.path.reason}; params not kept reduced ({why})"))


def global_specs(call: Call, layout: meshes.Layout,
                 reducible: frozenset[int]) -> list[tuple[tuple[Any, ...], frozenset[str]]]:
  """Per differentiated leaf, its PartitionSpec entries in the global view and the data
  axes it is typed ``reduced`` over there (those of ``reducible`` leaves that the spec
  does not name)."""
  hints = layout.param_specs or [None] * len(call.diff_leaves)
  specs = [_spec_of(leaf, hint) for leaf, hint in zip(call.diff_leaves, hints, strict=True)]
  return [(spec, frozenset(a for a in layout.data_axes if a not in meshes.named_axes(spec))
           if i in reducible else frozenset()) for i, spec in enumerate(specs)]


def _spec_of(leaf: Any, hint: P | None) -> tuple[Any, ...]:
  """The leaf's PartitionSpec entries, one per dimension (typed, else the hint)."""
  ndim = len(jnp.shape(leaf))
  spec = meshes.known_spec(leaf)
  if all(e is None for e in spec) and hint is not None:
    spec = tuple(hint) + (None,) * (ndim - len(hint))
  return tuple(spec)


def _with_fsdp(config: Config, layout: meshes.Layout, call: Call,
               decision: Decision) -> Decision:
  """The per-device ``decision`` with its FSDP strategy, recorded in its path."""
  if not any(layout.param_dims):
    return decision
  if config.fsdp != "auto":
    choice = fsdp_lib.forced(config.fsdp)
  else:
    choice = fsdp_lib.choose(bool(decision.stacked), zero3_blocker(call.diff_leaves, layout))
  return decision._replace(fsdp=choice, path=dataclasses.replace(
      decision.path, fsdp=f"{choice.strategy}: {choice.reason}"))


def per_rank(config: Config, layout: meshes.Layout, call: Call) -> Decision:
  """Per-rank code, inside the caller's shard_map over the data axes: the device view, and
  its FSDP strategy read from the loss's forward pass, traced here (the loop's trace)."""
  if config.view == "global":
    raise ValueError(
        f"view='global' cannot run inside a shard_map that is manual over the data axes "
        f"{layout.data_axes}: there the loss sees only its device's shard. Call fxaccum "
        "outside the shard_map, or use view='auto'.")
  if config.view == "auto":
    # Best effort (None where it does not trace): the loop traces the loss again.
    total = attempt(lambda: next(analyses(config, layout, call, paired=False)
                                 ).analysis.outputs[0]).value
    if isinstance(total, analysis_lib.Stat) and total.ratio:
      raise ValueError(
          f"Inside a shard_map over {layout.data_axes} each device's loss is its shard of "
          "the global loss, but this loss divides by a statistic of its own shard (e.g. its "
          f"token count: {total.mixed}). Per-shard means do not combine into the global "
          "mean (DeepSpeed #5248). Return fxaccum.Weighted(jnp.sum(mask * loss), "
          "jnp.sum(mask)) instead.")
  decision = Decision(paths.Path(
      "device", "per-rank code inside a shard_map over the data axes: local sums, one "
      "reduction after the loop", layout.data_axes))
  blocker = zero3_blocker(call.diff_leaves, layout)
  if config.fsdp == "zero3" and blocker:
    raise ValueError(forced_zero3_refusal(blocker))
  if config.fsdp != "auto" or not any(layout.param_dims):
    return _with_fsdp(config, layout, call, decision)
  forward = region_lib.forward(config, layout, call)
  decision = _with_fsdp(config, layout, call, decision._replace(
      stacked=gather_lib.per_layer(forward.closed.jaxpr, layout.param_dims)))
  # zero3's loop runs this forward pass (traced where the loop runs: the caller's region)
  zero3 = decision.fsdp is not None and decision.fsdp.strategy == "zero3"
  return decision._replace(zero3=forward if zero3 else None)


def forced_zero3_refusal(blocker: str) -> str:
  """Why ``fsdp="zero3"``, asked for, cannot run: ``blocker`` (:func:`zero3_blocker`)."""
  return (f"fsdp='zero3' cannot run this step: {blocker}; fsdp='auto' gathers such a "
          "param once per step")


def zero3_blocker(leaves: Sequence[Any], layout: meshes.Layout) -> str | None:
  """Why zero3 cannot gather a param in the loop: JAX 0.10.2 cannot differentiate an
  all_gather over a manual data axis of a value also sharded over an ``Explicit`` non-data
  axis (an AssertionError in its sharding rule, without fxaccum too;
  docs/notes/jax_workarounds.md)."""
  for i, (leaf, dims) in enumerate(zip(leaves, layout.param_dims, strict=True)):
    other = meshes.named_axes(jax.typeof(leaf).sharding.spec) - set(layout.data_axes)
    if dims and meshes.explicit(layout.mesh, sorted(other)):
      return (f"param leaf {i} is sharded over the Explicit axes {sorted(other)} too, and "
              f"JAX {jax.__version__} fails to differentiate its gather inside the loop")
  return None


def _view(config: Config, layout: meshes.Layout, call: Call) -> Decision:
  """The view the loss's jaxpr allows (see :class:`Decision`)."""
  axes = layout.data_axes
  on_explicit = meshes.explicit(layout.mesh, axes)
  if config.view == "global" and not on_explicit:
    return Decision(paths.Path("global", "view='global'", axes))
  problem: str | None = None
  reducible: frozenset[int] = frozenset()
  try:
    for analysed in analyses(config, layout, call, paired=config.view == "auto"):
      analysis, roles, closed, aux = (analysed.analysis, analysed.roles, analysed.closed,
                                      analysed.aux)
      reducible = analysis.reducible if on_explicit else frozenset()
      blockers = [*analysis.blockers,
                  *([layout.device_blocker] if layout.device_blocker else []),
                  *_closures(closed, call)]
      if config.view == "device":
        _check_forced_device(config, roles, blockers)
        return Decision(paths.Path("device", "view='device'", axes), reducible, aux,
                         gather_lib.per_layer(closed.jaxpr, layout.param_dims))
      if config.view == "global":
        return Decision(paths.Path("global", "view='global'", axes), reducible)
      found, what = classify(analysis.outputs, roles, summed=analysed.kind == "sum")
      # One device: how values scale is not read (no second size), and nothing differs.
      one = layout.data_devices == 1
      if not blockers and found is None:
        failure = _per_device_failure(config, layout, call, analysed)
        if failure is None:
          return Decision(paths.Path(
              "device", ONE_DEVICE if one else f"the loss is a {what} of per-example terms",
              axes), reducible, aux, gather_lib.per_layer(closed.jaxpr, layout.param_dims),
              replay=_replayable(config, layout, call, analysed))
        blockers.append(failure)
      problem = problem or (blockers[0] if blockers else ONE_DEVICE if one else found)
      if blockers:  # no other trace removes a blocker
        break
  except NameError as err:  # a collective over an axis that only the device view binds
    if config.view == "device":  # read where it runs, as needed: its aux, its FSDP layers
      aux, stacked = region_lib.probe(config, layout, call) if config.has_aux or (
          any(layout.param_dims) and config.fsdp == "auto") else (None, None)
      return Decision(paths.Path("device", "view='device'", axes), aux=aux, stacked=stacked,
                      collectives=True)
    raise ValueError(
        f"The loss does not run on the global micro-batch ({first_line(err)}). A loss "
        "that names the data axes in collectives (e.g. flax BatchNorm(axis_name=...), "
        "jax.lax.pmean(x, 'data')) runs only per device: pass view='device'.") from err
  except NoDeviceTrace as err:
    problem = problem or str(err)
  return Decision(paths.Path(
      "global", problem or "no proof that per-device results add up", axes), reducible)


def _check_forced_device(config: Config, roles: Sequence[str], blockers: Sequence[str]) -> None:
  """Raises where ``view='device'`` cannot run the loss per device."""
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


def _per_device_failure(config: Config, layout: meshes.Layout, call: Call,
                        analysed: Analysed) -> str | None:
  """Why the micro-step does not trace per device, where its jaxpr cannot tell
  (:func:`fxaccum.instep.replay.data_sharding`: a sharding over the data axes): its
  forward pass is traced in the per-device region to find out. None where it traces."""
  if replay_lib.data_sharding(analysed.closed, layout.data_axes) is None:
    return None
  err = attempt(region_lib.probe, config, layout, call).error
  return None if err is None else f"the loss did not trace per device ({first_line(err)})"


def _replayable(config: Config, layout: meshes.Layout, call: Call,
                analysed: Analysed) -> replay_lib.Replayable | None:
  """The analysed micro-step, for the device view's loop to run instead of tracing the
  loss again, where it is the program for every number of rows, the evaluation covers
  its equations (:func:`fxaccum.instep.replay.blocker`) and no param is gathered (FSDP)
  before the loss reads it. Not for one row per device: there JAX's tracing spells a
  broadcast along the rows as numpy does a size-1 one, so the program it would trace
  differs (in form, not in value) from the one for every number of rows."""
  rows = jax.tree.leaves(micro_batch_avals(config, call))[0].shape[0]
  if (not analysed.every_size or any(layout.param_dims) or rows == layout.data_devices
      or replay_lib.blocker(analysed.closed, layout.data_axes) is not None):
    return None
  return replay_lib.replayable(analysed.closed, analysed.shapes, call.argument_leaves())


def _closures(closed: Any, call: Call) -> list[str]:
  """Why the per-device region cannot run a micro-step traced as ``closed``: it closes over
  a value typed on an ``Explicit`` mesh that is none of the call's arguments (those enter
  the region as its arguments), which JAX 0.10.2 cannot take into a ``shard_map``
  (``NotImplementedError: Closing over inputs to shard_map ...``)."""
  passed = {id(x) for x in jax.tree.leaves((call.rest, call.kwargs))}
  for const in closed.consts:
    mesh = getattr(getattr(jax.typeof(const), "sharding", None), "mesh", None)
    if (id(const) not in passed and mesh is not None
        and meshes.axes_of_type(mesh, AxisType.Explicit)):
      return [CLOSURE]
  return []
