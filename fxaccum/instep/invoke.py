"""One call of the function an entry point returns.

Its arguments checked and split into what is differentiated, split, folded and threaded
(flax NNX modules into their state), the layout found (:func:`fxaccum.meshes.layout_of`),
a program compiled per layout for eager calls, the result assembled by
:func:`fxaccum.instep.views.run_call`, and the modules' new state written back.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from fxaccum import meshes, split
from fxaccum.instep import keys
from fxaccum.instep.call import Config, Threaded, is_array
from fxaccum.instep.views import run_call

__all__ = ["call", "nnx_loaded"]


def call(config: Config, compiled: dict, args: Sequence[Any], kwargs: dict) -> Any:
  """One call of the function ``value_and_grad`` returned."""
  _check_arity(config, args)
  module_args = args
  _check_graph_nodes(args, config)
  nnx_lib = nnx_loaded()
  args, state, sown, modules = (
      nnx_lib.Modules.split(args, config.diff_argnums, config.filters) if nnx_lib
      else (list(args), (), (), None))
  # Threaded: the NNX graph nodes' state, and the arguments at state_argnums.
  state = Threaded(state, tuple(args[i] for i in config.state_argnums))
  diff = [args[i] for i in config.diff_argnums]
  batch = [args[i] for i in config.batch_argnums]
  other = [a for i, a in enumerate(args)
           if i not in config.diff_argnums + config.batch_argnums]
  _check_differentiable(diff, config.diff_argnums)
  layout = meshes.layout_of(jax.tree.leaves(diff), jax.tree.leaves(batch),
                     jax.tree.leaves((other, state)), config.data_axes,
                     meshes.param_hints(diff, config.param_shardings))
  if config.micro_batch_size is not None:
    config = _sized(config, split.leading_size(batch, 1, layout.data_devices),
                    layout.data_devices)
  rows = split.leading_size(batch, config.micro_batches, layout.data_devices)
  _check_kwargs(kwargs, rows, config)
  if modules is not None:
    nnx_lib.check_decode_caches(module_args, rows // config.micro_batches,
                                config.micro_batches)
  keys.warn_shared_keys(
      config.fun, module_args, kwargs, micro_batches=config.micro_batches,
      batch_argnums=config.batch_argnums,
      named={*config.diff_argnums, *config.batch_argnums, *config.rng_argnums,
             *config.state_argnums, *(modules.positions if modules else ())})
  _check_unreduced(config, layout)
  # Keyword arguments reach `fun` as given (like jax.value_and_grad): not split, not
  # differentiated; an eager call compiles once per layout and static keyword values.
  kw_leaves, kw_def = jax.tree.flatten(kwargs)
  dynamic = [i for i, leaf in enumerate(kw_leaves) if is_array(leaf)]

  def run(packed, kw_arrays):
    leaves = list(kw_leaves)
    for i, array in zip(dynamic, kw_arrays, strict=True):
      leaves[i] = array
    return run_call(config, layout, jax.tree.unflatten(kw_def, leaves), modules, packed)

  kw_arrays = [kw_leaves[i] for i in dynamic]
  if _is_traced(args, kwargs, state):
    out, (state, new_sown) = run((args, state), kw_arrays)
  else:
    key = (layout, modules, kw_def, config.micro_batches,
           tuple((i, leaf) for i, leaf in enumerate(kw_leaves) if i not in dynamic))
    try:
      jitted = compiled.setdefault(key, jax.jit(run))
    except TypeError:  # an unhashable static keyword value: compile for this call only
      jitted = jax.jit(run)
    out, (state, new_sown) = jitted((args, state), kw_arrays)
  if modules is not None:  # as nnx.value_and_grad does: the modules' state, in place
    modules.update(module_args, state.modules, sown, new_sown)
    if state.params:  # the values the loss wrote into differentiated variables
      modules.write(module_args, config.diff_argnums, _written_values(diff, state.params))
  return out


def _written_values(diff: list[Any], written: tuple[Any, ...]) -> Any:
  """The differentiated arguments ``diff`` with the leaves the loss wrote (``written``,
  None where it wrote none) replaced by what it wrote."""
  leaves = [leaf if w is None else w for leaf, w in zip(
      jax.tree.leaves(diff), written, strict=True)]
  return jax.tree.unflatten(jax.tree.structure(diff), leaves)


def _check_unreduced(config: Config, layout: meshes.Layout) -> None:
  """``value_and_unreduced_grad`` keeps one full gradient per device: no FSDP params."""
  if not config.reduce and any(layout.param_dims):
    raise ValueError(
        "fxaccum.value_and_unreduced_grad keeps one full gradient per device, so it needs "
        "params replicated over the data axes, but some params are sharded over them "
        "(FSDP). Use fxaccum.value_and_grad with a cross-step accumulate() without "
        "data_axes."
    )


def _check_arity(config: Config, args: Sequence[Any]) -> None:
  highest = max((*config.diff_argnums, *config.batch_argnums, *config.rng_argnums,
                 *config.state_argnums))
  if highest >= len(args):
    raise TypeError(
        f"{getattr(config.fun, '__name__', 'fun')} was called with {len(args)} positional "
        f"arguments, but argnums/batch_argnums/rng_argnums/state_argnums refer to argument "
        f"{highest}. Pass the params and the batch positionally."
    )


def nnx_loaded() -> Any:
  """:mod:`fxaccum.integrations.nnx_modules` where flax NNX is loaded (an NNX graph node
  or ``DiffState`` can only exist then), else None: fxaccum loads no flax of its own."""
  if "flax.nnx" not in sys.modules:
    return None
  from fxaccum.integrations import nnx_modules  # imports flax, loaded already
  return nnx_modules


def _sized(config: Config, rows: int, devices: int) -> Config:
  """The config for a batch of ``rows`` rows with ``MicroBatchSize(m)``: ``k = rows // m``."""
  m = config.micro_batch_size
  assert m is not None
  if rows % m:
    raise ValueError(
        f"MicroBatchSize({m}) does not divide the batch's {rows} rows: pass a "
        f"MicroBatchSize that divides every batch size you train with (or a batch of a "
        f"multiple of {m} rows).")
  if m % devices:
    raise ValueError(
        f"MicroBatchSize({m}) splits a micro-batch over {devices} data devices, which "
        f"gives some of them less than one row: use a multiple of {devices} (at least "
        f"{devices}).")
  return dataclasses.replace(config, micro_batches=rows // m)


def _check_graph_nodes(args: Sequence[Any], config: Config) -> None:
  """NNX graph nodes (modules, ``nnx.Rngs``, Variables) are threaded through the
  micro-batches like module state: one cannot be the batch, nor a key to fold."""
  for name, argnums in (("batch_argnums", config.batch_argnums),
                        ("rng_argnums", config.rng_argnums),
                        ("state_argnums", config.state_argnums)):
    for i in argnums:
      if (nnx_lib := nnx_loaded()) and nnx_lib.is_graph_node(args[i]):
        raise TypeError(
            f"argument {i} is an {type(args[i]).__name__} (an NNX graph node), but "
            f"{name}={getattr(config, name)} names it. fxaccum threads NNX graph nodes "
            "through the micro-batches like module state (an nnx.Rngs advances once per "
            "micro-batch), and splits only the batch: pass the batch as an argument of "
            "its own and name it in batch_argnums, e.g. loss_fn(model, batch, rngs) with "
            "batch_argnums=1 (a batch the loss closes over is not split).")


def _check_kwargs(kwargs: dict, rows: int, config: Config) -> None:
  """Keyword arguments are shared by all micro-batches: one with the batch's rows on
  axis 0 is most likely batch data that would not be split."""
  for path, leaf in jax.tree_util.tree_flatten_with_path(kwargs)[0]:
    shape = jnp.shape(leaf) if is_array(leaf) else ()
    if rows > 1 and shape[:1] == (rows,):
      raise ValueError(
          f"Keyword argument {jax.tree_util.keystr(path)} has the batch's {rows} rows on "
          "axis 0, but keyword arguments are passed to every micro-batch whole, not split. "
          "Pass batch data positionally and list its position in batch_argnums (now "
          f"{config.batch_argnums}).")


def _is_traced(*trees: Any) -> bool:
  return any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree.leaves(trees))


def _check_differentiable(diff: Sequence[Any], diff_argnums: tuple[int, ...]) -> None:
  for argnum, tree in zip(diff_argnums, diff, strict=True):
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
      dtype = jnp.result_type(leaf)
      if not jnp.issubdtype(dtype, jnp.inexact):
        raise TypeError(
            f"fxaccum.value_and_grad requires float inputs at argnums, but argument "
            f"{argnum} has leaf {jax.tree_util.keystr(path) or '<root>'} of dtype {dtype}. "
            "Differentiate only float params: pass an NNX module itself (its nnx.Params are "
            "differentiated, its other state threaded through), or integer state in "
            "another argument."
        )
