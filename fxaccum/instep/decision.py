"""The view decision: which view runs the loss, and why.

:func:`decide` traces one micro-step (:func:`analyses`), has :mod:`fxaccum.analysis` read
how each of its outputs depends on the examples, and takes the per-device view where
:func:`fxaccum.instep.additivity.classify` finds that per-device results add up to the
global ones, and nothing blocks it; otherwise the global view. Its :class:`Decision` is
what the executors (:mod:`fxaccum.instep.views`) run.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from fxaccum import analysis as analysis_lib
from fxaccum import markers, meshes
from fxaccum.analysis import symbolic
from fxaccum.instep import fsdp as fsdp_lib
from fxaccum.instep import gather as gather_lib
from fxaccum.instep import paths
from fxaccum.instep.additivity import Role, classify
from fxaccum.instep.attempts import attempt
from fxaccum.instep.call import Call, Config, micro_batch_avals, written_leaves
from fxaccum.markers import is_marker

__all__ = ["ONE_DEVICE", "Decision", "analyses", "decide", "first_line",
           "forced_zero3_refusal", "no_device_reason", "zero3_blocker"]

# The reason on a mesh whose data axes hold one device, for either view: true for every
# loss there (the analysis reads one size only, so how values scale is not known).
ONE_DEVICE = ("one data-parallel device: its rows are the global micro-batch, so the device "
              "and global views run the loss on the same rows (nothing is added up over "
              "devices)")


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
    fsdp: the per-device view's FSDP strategy, where it is chosen before the view runs
      (named in ``fsdp=``, or read from the analysis's micro-step); None where there is
      none to choose, or where only the loss's forward pass, traced in the view, says.
  """

  path: paths.Path
  reducible: frozenset[int] = frozenset()
  aux: Any = None
  stacked: bool | None = None
  collectives: bool = False
  fsdp: fsdp_lib.Choice | None = None


def decide(config: Config, layout: meshes.Layout, call: Call) -> Decision:
  """The view for this call (see :class:`Decision`)."""
  decision = _view(config, layout, call)
  blocker = zero3_blocker(call.diff_leaves, layout) if config.fsdp == "zero3" else None
  if decision.path.view != "device" or blocker is None:
    return _with_fsdp(config, layout, call, decision)
  if config.view == "device":
    raise ValueError(f"view='device' could not run the loss per device: "
                     f"{forced_zero3_refusal(blocker)}.")
  return Decision(dataclasses.replace(decision.path, view="global",
                                      reason=forced_zero3_refusal(blocker)),
                  decision.reducible)


def _with_fsdp(config: Config, layout: meshes.Layout, call: Call,
               decision: Decision) -> Decision:
  """``decision`` with its FSDP strategy, where it can be chosen before the per-device
  view runs (else the view chooses it from the loss's forward pass and amends the path)."""
  if decision.path.view != "device" or not any(layout.param_dims):
    return decision
  if config.fsdp != "auto":
    choice = fsdp_lib.forced(config.fsdp)
  elif decision.stacked is not None:
    choice = fsdp_lib.choose(decision.stacked, zero3_blocker(call.diff_leaves, layout))
  else:
    return decision
  return decision._replace(fsdp=choice, path=dataclasses.replace(
      decision.path, fsdp=f"{choice.strategy}: {choice.reason}"))


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
    for analysis, roles, aux, jaxpr in analyses(config, layout, call,
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
        return Decision(paths.Path("device", "view='device'", axes), reducible, aux,
                         gather_lib.per_layer(jaxpr, layout.param_dims))
      if config.view == "global":
        return Decision(paths.Path("global", "view='global'", axes), reducible)
      found, what = classify(analysis.outputs, roles, summed=call.kinds[-1] == "sum")
      # One device: how values scale is not read (no second size), and nothing differs.
      one = layout.data_devices == 1
      if not blockers and found is None:
        return Decision(paths.Path(
            "device", ONE_DEVICE if one else f"the loss is a {what} of per-example terms",
            axes), reducible, aux, gather_lib.per_layer(jaxpr, layout.param_dims))
      problem = problem or (blockers[0] if blockers else ONE_DEVICE if one else found)
      if blockers:  # no other trace removes a blocker
        break
  except NameError as err:  # a collective over an axis that only the device view binds
    if config.view == "device":
      return Decision(paths.Path("device", "view='device'", axes), collectives=True)
    raise ValueError(
        f"The loss does not run on the global micro-batch ({first_line(err)}). A loss "
        "that names the data axes in collectives (e.g. flax BatchNorm(axis_name=...), "
        "jax.lax.pmean(x, 'data')) runs only per device: pass view='device'.") from err
  except _NoDeviceTrace as err:
    problem = problem or str(err)
  return Decision(paths.Path(
      "global", problem or "no proof that per-device results add up", axes), reducible)


class _NoDeviceTrace(Exception):
  """The micro-step does not trace on one device's rows (the message says why)."""


def _traced_for_every_size(step: Any, *args: Any) -> Any:
  """``make_jaxpr`` of ``step`` on arguments with a symbolic number of rows, or None
  where that is not the program every number of rows runs."""
  with symbolic.undecided_uses() as undecided:  # None: not traceable for any number of rows
    traced = attempt(jax.make_jaxpr(step, return_shape=True), *args).value
  # Undecided: e.g. `if x.shape[0] == 2`, `if n % 2`: not the program on 2 rows.
  return None if undecided else traced


def analyses(config: Config, layout: meshes.Layout, call: Call, paired: bool):
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
  trace = jax.make_jaxpr(step, return_shape=True)
  traced, err = attempt(trace, leaves, micro, call.state)
  if err is not None:  # retried without the data axes, else the first error raised
    traced = attempt(trace, *per_device((leaves, micro, call.state))).value
    if traced is None:
      raise err
  partner = None
  if paired:
    partner, err = attempt(jax.make_jaxpr(step), per_device(leaves),
                           per_device(micro, rows // devices), per_device(call.state))
    if err is not None:  # the device view could not run it either
      raise _NoDeviceTrace(f"the loss did not trace per device ({first_line(err)})") from err
  yield analysis(traced, rows, partner)


def _roles(closed: Any, aux: Any, state: Any, sown: Any, written: tuple[bool, ...],
           n_diff: int, n_micro: int) -> list[Role]:
  """The role of each output of a traced micro-step (see :func:`analyses`); ``written``:
  :func:`~fxaccum.instep.call.written_leaves` of it."""
  roles: list[Role] = ["total", "weight"]
  for marker in jax.tree.leaves(aux, is_leaf=is_marker):
    if isinstance(marker, markers.Weighted):
      roles.extend(["aux_total", "aux_weight"])
      continue
    by_marker: dict[type, Role] = {
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
  if (not isinstance(sharding, NamedSharding)
      or not meshes.named_axes(sharding.spec) & set(data_axes)):
    return leaf if not batch else jax.ShapeDtypeStruct(aval.shape, aval.dtype,
                                                      sharding=sharding)
  spec = P(*(tuple(a for a in meshes.spec_axes(e) if a not in data_axes) or None
             for e in sharding.spec))
  return jax.ShapeDtypeStruct(aval.shape, aval.dtype,
                              sharding=NamedSharding(sharding.mesh, spec))


def first_line(err: BaseException) -> str:
  """An error's type and first line, to quote in a view's reason or a message."""
  text = str(err).strip().splitlines()
  return f"{type(err).__name__}: {text[0] if text else ''}"


def no_device_reason(err: BaseException) -> str:
  """Why the per-device region could not run the loss, with the fix where there is one."""
  if isinstance(err, NotImplementedError) and "Closing over inputs to shard_map" in str(err):
    return ("the loss closes over a traced value typed on an Explicit mesh, which JAX "
            "0.10.2 cannot take into the per-device region: pass it to the loss as an "
            "argument (or keyword argument) to take the fast path")
  return f"the loss did not trace per device ({first_line(err)})"
