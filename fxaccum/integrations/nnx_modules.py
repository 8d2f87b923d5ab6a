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

__all__ = ["Modules", "argnums_and_filters", "check_decode_caches", "is_graph_node"]

# nnx.split's return is typed as a variadic tuple, which cannot be unpacked into names.
_split_module: Callable[..., Any] = nnx.split


def is_graph_node(x: Any) -> bool:
  """Whether ``x`` is an NNX graph node (a module, ``nnx.Rngs``, a ``Variable``...)."""
  return nnx.graph.is_graph_node(x)


def argnums_and_filters(argnums: Any) -> tuple[Any, dict[int, Any]]:
  """``argnums`` with ``nnx.DiffState(argnum, filter)`` entries replaced by their argnum,
  and the filters they name."""
  items = argnums if isinstance(argnums, (tuple, list)) else (argnums,)
  filters = {d.argnum: d.filter for d in items if isinstance(d, nnx.DiffState)}
  plain = tuple(d.argnum if isinstance(d, nnx.DiffState) else d for d in items)
  return (plain if isinstance(argnums, (tuple, list)) else plain[0]), filters


@dataclasses.dataclass(frozen=True)
class Modules:
  """How to rebuild the NNX arguments of one call from their states.

  Every positional argument that is an NNX graph node (an ``nnx.Module``, ``nnx.Rngs``,
  any ``nnx.Pytree`` or ``Variable``) is taken the ``nnx.value_and_grad`` way. They are
  split together, so a variable that two of them share stays one variable.

  Attributes:
    positions: the positional arguments that are NNX graph nodes.
    graphdef: the graph definition of the tuple of them.
    wrt: per position, the filter of the differentiated variables (None: not
      differentiated, all its state is threaded).
  """

  positions: tuple[int, ...]
  graphdef: Any
  wrt: tuple[Any, ...]

  @staticmethod
  def split(args: Sequence[Any], diff_argnums: Sequence[int], filters: dict[int, Any]
            ) -> tuple[list[Any], Any, Any, Modules | None]:
    """``(args, state, sown, modules)``: the graph nodes in ``args`` replaced by their
    differentiated state (or None), their threaded state, and their sown values."""
    positions = tuple(i for i, a in enumerate(args) if is_graph_node(a))
    if not positions:
      return list(args), (), (), None
    wrt = tuple(filters.get(i, nnx.Param) if i in diff_argnums else None for i in positions)
    graphdef, diff, sown, state = _split_module(
        tuple(args[i] for i in positions), _differentiated(wrt), nnx.Intermediate, ...)
    if nnx.to_flat_state(sown):
      # Sown values the nodes hold already are set aside (and put back in front of the
      # new ones at the end): the nodes run without them, as freshly built ones would.
      clone = nnx.merge(graphdef, diff, sown, state)
      nnx.pop(clone, nnx.Intermediate)
      graphdef, diff, state = _split_module(clone, _differentiated(wrt), ...)
    args = list(args)
    for j, i in enumerate(positions):
      args[i] = (diff[j] if j in diff else nnx.State({})) if wrt[j] is not None else None
    return args, state, sown, Modules(positions, graphdef, wrt)

  def merged(self, call_args: list[Any], state: Any, diff_argnums: Sequence[int]
             ) -> tuple[list[Any], Callable]:
    """``call_args`` with the graph nodes rebuilt (holding no sown values yet), and a
    function that returns their ``(state, sown, read, written)`` after the call: ``read``
    and ``written`` are the leaves of the differentiated arguments (in ``diff_argnums``
    order) as the loss read them and as it left them: a layer that writes its own ``nnx.Param``
    (``nnx.WeightNorm``) leaves another value there."""
    call_args = list(call_args)
    # Fresh Variables, created where the loss runs: NNX lets a Variable change only in the
    # trace it was created in (the carried state comes from the loop's trace).
    state = jax.tree.map(lambda x: x, state)
    diff = nnx.State({j: call_args[i] for j, (i, wrt) in enumerate(zip(
        self.positions, self.wrt, strict=True)) if wrt is not None})
    nodes = nnx.merge(self.graphdef, diff, state)
    for j, i in enumerate(self.positions):
      call_args[i] = nodes[j]
    read = self._differentiated_leaves(nodes, call_args, diff_argnums)

    def after() -> tuple[Any, Any, list[Any], list[Any]]:
      _, diff_after, sown, new_state = _split_module(nodes, _differentiated(self.wrt),
                                                     nnx.Intermediate, ...)
      for before, now in ((diff, diff_after), (state, new_state)):
        if _paths(now) != _paths(before):
          raise ValueError(
              "The loss created or removed module state other than sown values while it "
              f"ran ({jax.tree.structure(before)} -> {jax.tree.structure(now)}); "
              "fxaccum threads a fixed set of variables through the micro-batches. Create "
              "the variables before calling it (e.g. run the model once).")
      return (new_state, sown, read,
              self._differentiated_leaves(nodes, call_args, diff_argnums))

    return call_args, after

  def _differentiated_leaves(self, nodes: tuple[Any, ...], call_args: list[Any],
                             diff_argnums: Sequence[int]) -> list[Any]:
    """The leaves of the differentiated arguments as the nodes hold them now (a graph
    node's differentiated state; any other argument as it is in ``call_args``)."""
    _, diff, _ = _split_module(nodes, _differentiated(self.wrt), ...)
    by_position = {i: diff[j] if j in diff else nnx.State({})
                   for j, i in enumerate(self.positions)}
    return jax.tree.leaves([by_position.get(i, call_args[i]) for i in diff_argnums])

  def update(self, args: Sequence[Any], state: Any, sown_before: Any, sown: Any) -> None:
    """Writes the final state into the graph nodes, with each micro-batch's sown values
    (stacked on a leading micro-batch axis) appended to those they held before."""
    nodes = tuple(args[i] for i in self.positions)
    nnx.update(nodes, state)
    if jax.tree.leaves(sown):
      nnx.update(nodes, _appended(sown_before, sown))

  def write(self, args: Sequence[Any], diff_argnums: Sequence[int],
            values: Sequence[Any]) -> None:
    """Writes ``values`` (the differentiated arguments, in ``diff_argnums`` order, as the
    loss left them) into the graph nodes among them."""
    for i, value in zip(diff_argnums, values, strict=True):
      if i in self.positions:
        nnx.update(args[i], value)


def check_decode_caches(args: Sequence[Any], micro_rows: int, micro_batches: int) -> None:
  """An ``nnx.MultiHeadAttention`` decode cache holds a fixed number of rows; each call of
  the loss decodes one micro-batch, so the cache must hold a micro-batch's rows."""
  for arg in args:
    if not is_graph_node(arg):
      continue
    for path, node in nnx.iter_graph(arg):
      cache = getattr(node, "cached_key", None) if isinstance(
          node, nnx.MultiHeadAttention) else None
      if cache is not None and cache.shape[0] != micro_rows:
        where = "/".join(map(str, path)) or "the argument itself"
        raise ValueError(
            f"nnx.MultiHeadAttention at {where} holds a decode cache for {cache.shape[0]} "
            f"rows, but with micro_batches={micro_batches} each call of the loss decodes "
            f"a micro-batch of {micro_rows} rows. Call its init_cache with the "
            f"micro-batch's shape ({micro_rows} rows), or use micro_batches=1.")


def _paths(state: Any) -> list[tuple[Any, ...]]:
  """The variables' paths in an ``nnx.State`` (however its sub-states nest)."""
  return [path for path, _ in nnx.to_flat_state(state)]


def _differentiated(wrt: tuple[Any, ...]) -> Callable[[Any, Any], bool]:
  """The filter, over the tuple of graph nodes, of the variables differentiated: those of
  each differentiated position's own filter (applied to paths inside that node)."""
  predicates = [None if f is None else nnx.filterlib.to_predicate(f) for f in wrt]

  def differentiated(path, value) -> bool:
    predicate = predicates[path[0]]
    return predicate is not None and predicate(path[1:], value)

  return differentiated


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
