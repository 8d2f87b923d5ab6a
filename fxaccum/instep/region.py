"""The per-device view's region: a ``shard_map`` manual over the data axes, its inputs, and
the loss traced where it runs.

The batch enters split over the data axes, the params with their data-sharded dims (FSDP),
everything else whole; each device's loss sees a :class:`~fxaccum.instep.call.Call` of its
own. :func:`forward` traces one micro-step's forward pass on whole params, from which the
FSDP strategy is read (whether it scans over stacked layers) and which zero3's loop runs
on the shards (:mod:`fxaccum.instep.gather`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from fxaccum import markers, meshes, split
from fxaccum.instep import gather as gather_lib
from fxaccum.instep.call import Call, Config, is_array, micro_loss
from fxaccum.markers import is_marker

__all__ = ["Region", "aux_specs", "forward", "probe", "region_of"]


class Region(NamedTuple):
  """What the region takes.

  Attributes:
    args: its arguments, ``(diff_leaves, rest, arrays, state)``, each conformed to its spec
      (``arrays``: the array leaves of the keyword arguments).
    in_specs: their specs.
    local_call: the :class:`Call` each device sees, from the region's arguments.
  """

  args: tuple[Any, ...]
  in_specs: tuple[Any, ...]
  local_call: Callable[..., Call]

  def mapped(self, fun: Callable[[Call], Any], layout: meshes.Layout, out_specs: Any,
             check_vma: bool = True) -> Callable[..., Any]:
    """``fun`` of each device's :class:`Call` as a function of :attr:`args` that runs it in
    the region, its outputs laid out as ``out_specs``."""
    return meshes.shard_map_keeping_axes(
        lambda *args: fun(self.local_call(*args)), mesh=layout.mesh, in_specs=self.in_specs,
        out_specs=out_specs, axis_names=set(layout.data_axes), check_vma=check_vma)


def region_of(config: Config, layout: meshes.Layout, call: Call) -> Region:
  """The region's arguments and specs for ``call`` (see :class:`Region`)."""
  axes = layout.data_axes
  batch_spec = P(axes)
  rest_specs = tuple(_specs_like(a, batch_spec if i in config.batch_argnums else P())
                     for i, a in enumerate(call.rest))
  param_specs = [layout.param_spec(i) for i in range(len(call.diff_leaves))]
  kw_leaves, kw_def = jax.tree.flatten(call.kwargs)
  kw_arrays = [i for i, leaf in enumerate(kw_leaves) if is_array(leaf)]
  conform = functools.partial(meshes.conform, data_axes=axes)
  args = ([conform(x, spec) for x, spec in zip(call.diff_leaves, param_specs, strict=True)],
          jax.tree.map(conform, call.rest, rest_specs),
          [conform(kw_leaves[i], P()) for i in kw_arrays],
          jax.tree.map(lambda x: conform(x, P()), call.state))

  def local_call(diff_leaves, rest, arrays, state) -> Call:
    leaves = list(kw_leaves)
    for i, array in zip(kw_arrays, arrays, strict=True):
      leaves[i] = array
    return Call(diff_leaves, call.diff_def, rest, jax.tree.unflatten(kw_def, leaves), state,
                call.modules)

  return Region(args, (param_specs, rest_specs, [P()] * len(kw_arrays), P()), local_call)


def forward(config: Config, layout: meshes.Layout, call: Call) -> gather_lib.Traced:
  """One micro-step's loss traced on whole params, inside the region (``call`` is a
  device's): what zero3's loop runs on the shards, and what the FSDP strategy is read
  from where the view analysis traced no micro-step."""
  shards = meshes.vary(list(call.diff_leaves), layout.data_axes)
  micro = split.micro_batch(call.batch(config), 0, config.micro_batches)
  return gather_lib.trace(micro_loss(config, call), shards, layout.param_dims, micro,
                          jnp.int32(0), call.state)


def probe(config: Config, layout: meshes.Layout, call: Call) -> tuple[Any, bool]:
  """The aux (abstract, with its markers) and whether the micro-step scans over stacked
  FSDP params (:func:`fxaccum.instep.gather.per_layer`), read from :func:`forward` traced
  in the region: for a loss that names the data axes in collectives, which traces there
  only."""
  found = []

  def read(local: Call):
    traced = forward(config, layout, local)
    (_, (_, aux, *_)) = traced.out_shape
    found.append((aux, gather_lib.per_layer(traced.closed.jaxpr, layout.param_dims)))
    return ()

  region = region_of(config, layout, call)
  jax.eval_shape(region.mapped(read, layout, out_specs=()), *region.args)
  return found[0]


def _specs_like(tree: Any, spec: P) -> Any:
  return jax.tree.map(lambda _: spec, tree)


def aux_specs(aux: Any, layout: meshes.Layout) -> Any:
  """The region's out_specs of the aux: Concat rows stay with their device, like the batch;
  everything else is reduced (invariant)."""
  return jax.tree.map(lambda m: P(layout.data_axes) if isinstance(m, markers.Concat) else P(),
                      aux, is_leaf=is_marker)
