"""One micro-step analysed: the loss, its aux and state and its gradients, traced as each
view would run them, and what :mod:`fxaccum.analysis` reads from the traces (see
:func:`analyses`), for the decision (:mod:`fxaccum.instep.decision`)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from fxaccum import analysis as analysis_lib
from fxaccum import markers, meshes
from fxaccum.analysis import symbolic
from fxaccum.instep.additivity import Role
from fxaccum.instep.attempts import attempt
from fxaccum.instep.call import (
    Call,
    Config,
    LossKind,
    micro_batch_avals,
    micro_loss,
    traced_aux,
    traced_kind,
    written_leaves,
)
from fxaccum.instep.replay import ROWS
from fxaccum.markers import is_marker

__all__ = ["INDEX", "Analysed", "NoDeviceTrace", "analyses", "first_line"]


# The micro-batch index's type, an input of the traced micro-step.
INDEX = jax.ShapeDtypeStruct((), jnp.int32)


class NoDeviceTrace(Exception):
  """The micro-step does not trace on one device's rows (the message says why)."""


def _traced_for_every_size(step: Any, *args: Any) -> Any:
  """``make_jaxpr`` of ``step`` on arguments with a symbolic number of rows, or None
  where that is not the program every number of rows runs."""
  with symbolic.undecided_uses() as undecided:  # None: not traceable for any number of rows
    traced = attempt(jax.make_jaxpr(step, return_shape=True), *args).value
  # Undecided: e.g. `if x.shape[0] == 2`, `if n % 2`: not the program on 2 rows.
  return None if undecided else traced


class Analysed(NamedTuple):
  """One micro-step analysed (see :func:`analyses`).

  Attributes:
    analysis: what :func:`fxaccum.analysis.analyze` found.
    roles: each output's role (see :func:`fxaccum.instep.additivity.classify`).
    closed: the micro-step's closed jaxpr, ``(leaves, micro-batch, index, state) ->
      outputs``.
    shapes: its outputs' shapes (as :attr:`fxaccum.instep.micro_step.MicroStep.shapes`).
    every_size: whether ``closed`` is traced with a symbolic number of rows
      (:data:`fxaccum.instep.replay.ROWS`): the program every number of rows runs.
  """

  analysis: analysis_lib.Analysis
  roles: list[Role]
  closed: Any
  shapes: Any
  every_size: bool

  @property
  def aux(self) -> Any:
    """The aux traced (abstract, with its markers)."""
    return traced_aux(self.shapes)

  @property
  def kind(self) -> LossKind:
    """What the loss returned."""
    return traced_kind(self.shapes)


def analyses(config: Config, layout: meshes.Layout, call: Call,
             paired: bool) -> Iterator[Analysed]:
  """:func:`fxaccum.analysis.analyze` of one micro-step (the loss, its aux and state, and
  its gradients), each an :class:`Analysed`, generated lazily.

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

  def step(leaves, micro, index, state):
    return jax.value_and_grad(micro_loss(config, call), has_aux=True)(
        leaves, micro, index, state)

  def per_device(tree, new_rows: Any = None):
    """Abstract values as the device view types them, with ``new_rows`` rows."""
    def local(x):
      x = _gathered(x, axes, batch=True)
      if new_rows is None:
        return x
      return jax.ShapeDtypeStruct((new_rows, *x.shape[1:]), x.dtype, sharding=x.sharding)
    return jax.tree.map(local, tree)

  def analysis(traced, rows, partner=None) -> Analysed:
    closed, shapes = traced
    (_, (_, aux, state, sown, _)), _ = shapes
    return Analysed(analysis_lib.analyze(
        closed, rows=rows, batch_inputs=range(n_diff, n_diff + n_micro),
        param_inputs=range(n_diff), partner=partner,
        partner_rows=rows // devices if partner is not None else None,
        rows_seen=rows_seen), _roles(closed, aux, state, sown, written_leaves(*traced),
                                     n_diff, n_micro), closed, shapes,
                    not isinstance(rows, int))

  if paired:
    (symbol,) = jax.export.symbolic_shape(ROWS)
    with meshes.linen_rules_without(axes):
      traced = _traced_for_every_size(
          step, per_device(leaves), per_device(micro, symbol), INDEX, per_device(call.state))
    if traced is not None:
      result = analysis(traced, symbol)
      yield result
      if not result.analysis.sized_positions:  # concrete sizes would find the same
        return
  trace = jax.make_jaxpr(step, return_shape=True)
  traced, err = attempt(trace, leaves, micro, INDEX, call.state)
  if err is not None:  # retried without the data axes (an axis name the global view
    if not isinstance(err, NameError):  # leaves unbound stays so), else the error raised
      traced = attempt(trace, *per_device((leaves, micro)), INDEX,
                       per_device(call.state)).value
    if traced is None:
      raise err
  partner = None
  if paired:
    with meshes.linen_rules_without(axes):
      partner, err = attempt(jax.make_jaxpr(step), per_device(leaves),
                             per_device(micro, rows // devices), INDEX, per_device(call.state))
    if err is not None:  # the device view could not run it either
      raise NoDeviceTrace(f"the loss did not trace per device ({first_line(err)})") from err
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
  state_in = closed.jaxpr.invars[n_diff + n_micro + 1:]  # after the index
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
