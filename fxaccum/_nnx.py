"""flax NNX modules as arguments of ``fxaccum.value_and_grad``, the ``nnx.value_and_grad`` way.

A module at a differentiated position contributes its ``wrt`` variables (``nnx.Param`` by
default, or the filter of an ``nnx.DiffState``) as the differentiated argument; every other
variable of every module argument (BatchNorm statistics, RNG counts and keys, user
variables) is *threaded* through the micro-batch loop: micro-batch ``i`` sees the state
micro-batch ``i - 1`` left, exactly as ``nnx.value_and_grad`` called on the micro-batches
one after another would. Values sown with ``Module.sow`` during a micro-batch are collected
per micro-batch and appended in order. At the end the modules are updated in place.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
from flax import nnx

__all__ = ["Modules", "argnums_and_filters"]

# nnx.split's return is typed as a variadic tuple, which cannot be unpacked into names.
_split_module: Callable[..., Any] = nnx.split


def argnums_and_filters(argnums: Any) -> tuple[Any, dict[int, Any]]:
  """``argnums`` with ``nnx.DiffState(argnum, filter)`` entries replaced by their argnum,
  and the filters they name."""
  items = argnums if isinstance(argnums, (tuple, list)) else (argnums,)
  filters = {d.argnum: d.filter for d in items if isinstance(d, nnx.DiffState)}
  plain = tuple(d.argnum if isinstance(d, nnx.DiffState) else d for d in items)
  return (plain if isinstance(argnums, (tuple, list)) else plain[0]), filters


@dataclasses.dataclass(frozen=True)
class Modules:
  """How to rebuild the module arguments of one call from their states.

  Attributes:
    positions: the positional arguments that are ``nnx.Module``s.
    graphdefs: their graph definitions.
    wrt: per position, the filter of the differentiated variables (None: not
      differentiated, all its state is threaded).
  """

  positions: tuple[int, ...]
  graphdefs: tuple[Any, ...]
  wrt: tuple[Any, ...]

  @staticmethod
  def split(args: Sequence[Any], diff_argnums: Sequence[int], filters: dict[int, Any]
            ) -> tuple[list[Any], Any, Any, Modules | None]:
    """``(args, state, sown, modules)``: the modules in ``args`` replaced by their
    differentiated state (or None), their threaded state, and their sown values."""
    positions = tuple(i for i, a in enumerate(args) if isinstance(a, nnx.Module))
    if not positions:
      return list(args), (), (), None
    args = list(args)
    graphdefs, wrt, states, sown = [], [], [], []
    for i in positions:
      target = filters.get(i, nnx.Param) if i in diff_argnums else None
      if target is None:
        graphdef, intermediates, rest = _split_module(args[i], nnx.Intermediate, ...)
        args[i] = None
      else:
        graphdef, args[i], intermediates, rest = _split_module(args[i], target,
                                                           nnx.Intermediate, ...)
      graphdefs.append(graphdef)
      wrt.append(target)
      states.append(rest)
      sown.append(intermediates)
    return args, tuple(states), tuple(sown), Modules(positions, tuple(graphdefs), tuple(wrt))

  def merged(self, call_args: list[Any], states: Any) -> tuple[list[Any], Callable]:
    """``call_args`` with the modules rebuilt (without sown values), and a function that
    returns their ``(state, sown)`` after the call."""
    call_args = list(call_args)
    # Fresh Variables, created where the loss runs: NNX lets a Variable change only in the
    # trace it was created in (the carried state comes from the loop's trace).
    states = jax.tree.map(lambda x: x, states)
    modules = []
    for i, graphdef, wrt, state in zip(self.positions, self.graphdefs, self.wrt, states,
                                       strict=True):
      parts = (call_args[i], state) if wrt is not None else (state,)
      module = nnx.merge(graphdef, *parts)
      call_args[i] = module
      modules.append(module)

    def after() -> tuple[Any, Any]:
      new_states, sown = [], []
      for module, wrt, old in zip(modules, self.wrt, states, strict=True):
        filters = (wrt, nnx.Intermediate, ...) if wrt is not None else (nnx.Intermediate, ...)
        *_, intermediates, rest = _split_module(module, *filters)
        if jax.tree.structure(rest) != jax.tree.structure(old):  # type: ignore[operator]
          raise ValueError(
              "The loss created or removed module state other than sown values while it "
              f"ran ({jax.tree.structure(old)} -> {jax.tree.structure(rest)}); fxaccum "
              "threads a fixed set of variables through the micro-batches. Create the "
              "variables before calling it (e.g. run the model once).")
        new_states.append(rest)
        sown.append(intermediates)
      return tuple(new_states), tuple(sown)

    return call_args, after

  def update(self, args: Sequence[Any], states: Any, sown_before: Any, sown: Any) -> None:
    """Writes the final state into the modules, with each micro-batch's sown values
    (stacked on a leading micro-batch axis) appended to those they held before."""
    for i, state, before, stacked in zip(self.positions, states, sown_before, sown,
                                         strict=True):
      nnx.update(args[i], state)
      if jax.tree.leaves(stacked):
        nnx.update(args[i], _appended(before, stacked))


def _appended(before: nnx.State, stacked: nnx.State) -> nnx.State:
  """Sown tuples of ``before`` followed by the per-micro-batch tuples in ``stacked``."""
  def join(old, new):
    steps = jax.tree.leaves(new)[0].shape[0]
    entries = [value[step] for step in range(steps) for value in new]
    return (*(old or ()), *entries)

  flat_before = dict(nnx.to_flat_state(before)) if jax.tree.leaves(before) else {}
  out = []
  for path, variable in nnx.to_flat_state(stacked):
    old = flat_before.get(path)
    out.append((path, variable.replace(
        join(old.get_value() if old is not None else None, variable.get_value()))))
  return nnx.from_flat_state(out)
