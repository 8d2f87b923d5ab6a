"""What one traced call of the in-step function holds: its static configuration, its
arguments, and the loss run on one micro-batch (what it returned: a mean, ``Weighted`` or
``Sum``; its aux markers; the threaded state)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from fxaccum import jaxprs, markers, meshes, split
from fxaccum.instep import fsdp as fsdp_lib
from fxaccum.instep import paths
from fxaccum.markers import is_marker, weight_dtype

if TYPE_CHECKING:
  from fxaccum.integrations import nnx_modules

__all__ = ["Call", "Config", "Kind", "LossKind", "Threaded", "is_array", "micro_batch_avals",
           "micro_loss", "traced_aux", "traced_kind", "written_leaves"]


@dataclasses.dataclass(frozen=True)
class Config:
  """Static configuration of one ``value_and_grad`` (closed over, never traced)."""

  fun: Callable[..., Any]
  has_aux: bool
  micro_batches: int
  micro_batch_size: int | None  # micro_batches then follows the batch, per call
  diff_argnums: tuple[int, ...]
  single_argnum: bool
  filters: dict[int, Any]
  batch_argnums: tuple[int, ...]
  rng_argnums: tuple[int, ...]
  state_argnums: tuple[int, ...]
  data_axes: tuple[str, ...] | None  # None: inferred per call
  param_shardings: tuple[Any, ...] | None  # one tree per differentiated argument
  accumulator_dtype: Any
  fsdp: fsdp_lib.Fsdp
  reduce: bool  # False: value_and_unreduced_grad
  view: paths.View
  skip_nonfinite: bool


class Threaded(NamedTuple):
  """What the micro-batches thread through in order: micro-batch ``i`` starts from what
  micro-batch ``i - 1`` left.

  Attributes:
    modules: the NNX graph nodes' state other than the differentiated variables (``()``
      without graph nodes).
    arguments: the values of the arguments at ``state_argnums``.
    params: per differentiated leaf, the value the loss wrote into it (an NNX layer that
      writes its own ``nnx.Param``, e.g. ``nnx.WeightNorm``), None for a leaf it did not
      write; ``()`` where it wrote none. A trace of the loss reports every leaf set again
      (``nnx.remat`` sets its params back); the loop and the view analysis keep those
      whose value the micro-step's jaxpr does not forward
      (:func:`fxaccum.jaxprs.forwards`). The next micro-batch reads (and is
      differentiated at) the written value. A loss's input never holds written values:
      the loop passes them in as the differentiated leaves.
  """

  modules: Any = ()
  arguments: tuple[Any, ...] = ()
  params: tuple[Any, ...] = ()


@dataclasses.dataclass(frozen=True)
class Call:
  """One traced call: the differentiated leaves and everything else ``fun`` receives.

  ``state`` is what is threaded through the micro-batches (:class:`Threaded`, with no
  written params): each micro-batch's call takes the state the previous one left.
  """

  diff_leaves: list[Any]
  diff_def: Any
  rest: tuple[Any, ...]  # the positional args, None at the differentiated ones
  kwargs: dict[str, Any]
  state: Threaded = Threaded()
  modules: nnx_modules.Modules | None = None

  def argument_leaves(self) -> list[Any]:
    """The leaves of the arguments other than the differentiated ones, which the
    per-device region takes as its own arguments (a trace closes over them)."""
    return jax.tree.leaves((self.rest, self.kwargs))

  def batch(self, config: Config) -> dict[int, Any]:
    return {i: self.rest[i] for i in config.batch_argnums}

  def loss(self, config: Config, diff_leaves, micro, index, state) -> tuple[Any, ...]:
    """``fun`` on micro-batch ``micro`` (number ``index``) with the threaded ``state``, as
    ``(total, weight, aux, state, sown, kind)``; the state returned holds the values the
    loss wrote into differentiated leaves (:attr:`Threaded.params`), ``kind`` is
    :class:`Kind`."""
    call_args = list(self.rest)
    for i in config.batch_argnums:
      call_args[i] = micro[i]
    for i in config.rng_argnums:
      call_args[i] = split.fold(self.rest[i], index)
    values = jax.tree.unflatten(self.diff_def, diff_leaves)
    for i, value in zip(config.diff_argnums, values, strict=True):
      call_args[i] = value
    for i, value in zip(config.state_argnums, state.arguments, strict=True):
      call_args[i] = value
    after = None
    if self.modules is not None:
      call_args, after = self.modules.merged(call_args, state.modules, config.diff_argnums)
    with jax.named_scope("fxaccum_compute"), meshes.linen_rules_without_manual_axes():
      out = config.fun(*call_args, **self.kwargs)
    module_state, sown, read, written = after() if after is not None else (
        (), (), diff_leaves, diff_leaves)
    loss, aux = _split_output(out, config.has_aux)
    state = Threaded(module_state, _threaded(aux, state.arguments, config),
                     _written(read, written))
    total, weight, kind = _total_and_weight(loss)
    if kind == "sum" and not config.reduce:
      raise TypeError(
          "fxaccum.value_and_unreduced_grad feeds a gate that averages its calls by their "
          "weights, but the loss returned fxaccum.Sum (already normalized). Return "
          "fxaccum.Weighted(total, count) from the loss instead.")
    return total, weight, aux, state, sown, Kind(kind)


def _threaded(aux: Any, threaded: tuple[Any, ...], config: Config) -> tuple[Any, ...]:
  """The new values of the arguments at ``state_argnums``: the ``State`` markers of
  ``aux``, in order, each like the value it replaces (``threaded``)."""
  states = [m for m in jax.tree.leaves(aux, is_leaf=is_marker) if isinstance(m, markers.State)]
  if len(states) != len(config.state_argnums):
    raise TypeError(
        f"state_argnums={config.state_argnums} threads {len(config.state_argnums)} "
        f"argument(s), but the loss's aux holds {len(states)} fxaccum.State marker(s): "
        "return each threaded argument's new value as fxaccum.State(new_value) in the aux, "
        "in the order of state_argnums.")
  for i, old, new in zip(config.state_argnums, threaded, states, strict=True):
    want, got = jax.eval_shape(lambda t: t, old), jax.eval_shape(lambda t: t, new.value)
    same = str(jax.tree.structure(want)) == str(jax.tree.structure(got)) and all(
        (a.shape, a.dtype) == (b.shape, b.dtype)
        for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got), strict=True))
    if not same:
      raise TypeError(
          f"The fxaccum.State for argument {i} ({_summary(got)}) does not match the "
          f"argument ({_summary(want)}): the next micro-batch receives it in the "
          "argument's place, so it must have the argument's tree, shapes and dtypes.")
  return tuple(s.value for s in states)


def _written(read: list[Any], after: list[Any]) -> tuple[Any, ...]:
  """Per differentiated leaf, its value after the loss where the loss wrote it (another
  value than the one it read), else None; ``()`` where it wrote none."""
  written = tuple(None if new is old else new for old, new in zip(read, after, strict=True))
  return written if any(w is not None for w in written) else ()


def traced_aux(shapes: Any) -> Any:
  """The aux of a traced micro-step whose outputs are ``shapes`` (see
  :func:`written_leaves`): abstract, with its markers."""
  return shapes[0][1][1]


def traced_kind(shapes: Any) -> LossKind:
  """What the loss of a traced micro-step whose outputs are ``shapes`` returned."""
  return shapes[0][1][4].value


def written_leaves(closed: Any, shapes: Any) -> tuple[bool, ...]:
  """Per differentiated leaf, whether the micro-step traced as ``closed`` (its outputs
  ``shapes``: ``((total, (weight, aux, state, sown, kind)), grads)``, its first inputs the
  differentiated leaves) wrote another value into it: a :attr:`Threaded.params` leaf
  whose output the jaxpr does not forward from the leaf's input (a param set again to
  the value it read, as ``nnx.remat`` sets its params back, is no write)."""
  (total, (weight, aux, state, _, _)), _ = shapes
  first = len(jax.tree.leaves((total, weight, aux, state.modules, state.arguments)))
  outs = iter(closed.jaxpr.outvars[first:])
  return tuple(value is not None and not jaxprs.forwards(
      closed.jaxpr, next(outs), closed.jaxpr.invars[i]) for i, value in enumerate(state.params))


def _summary(tree: Any) -> str:
  leaves = jax.tree_util.tree_flatten_with_path(tree)[0][:3]
  return ", ".join(f"{jax.tree_util.keystr(p) or 'value'}: {x.dtype}{list(x.shape)}"
                   for p, x in leaves) or "no arrays"


def _split_output(out: Any, has_aux: bool) -> tuple[Any, Any]:
  """``fun``'s output as ``(loss, aux)``, raising on a ``has_aux`` mismatch."""
  if has_aux:
    if isinstance(out, markers.Weighted) or not (isinstance(out, (tuple, list)) and len(out) == 2):
      raise TypeError(
          "has_aux=True, so the loss function must return a pair (loss, aux), but it "
          f"returned {type(out).__name__}. Return (loss, aux) or set has_aux=False."
      )
    return out[0], out[1]
  if isinstance(out, (tuple, list)):
    raise TypeError(
        f"The loss function returned a {type(out).__name__} of length {len(out)}; without "
        "has_aux it must return a scalar or fxaccum.Weighted. If it returns (loss, aux), "
        "pass has_aux=True."
    )
  return out, None


# What a loss returned: a scalar mean over its micro-batch, fxaccum.Weighted or fxaccum.Sum.
LossKind = Literal["mean", "weighted", "sum"]


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class Kind:
  """What the loss returned (:data:`LossKind`), as a traced micro-step's outputs hold it: a
  pytree node without leaves, so it is read from the outputs' tree (``return_shape``)
  without changing the jaxpr."""

  value: LossKind


def _total_and_weight(loss: Any) -> tuple[jax.Array, jax.Array, LossKind]:
  """A micro-batch's ``(total, weight, kind)``: a mean or a ``Sum`` counts as its total with
  weight 1 (a ``Sum``'s totals are then added up, not divided by their weights)."""
  if isinstance(loss, markers.Weighted):
    total, weight = jnp.asarray(loss.total), jnp.asarray(loss.weight)
    if total.shape or weight.shape:
      raise TypeError(
          f"Weighted(total, weight) must hold scalars, got shapes {total.shape} and "
          f"{weight.shape}. Sum over the items: Weighted(jnp.sum(mask * l), jnp.sum(mask))."
      )
    return total, lax.stop_gradient(weight).astype(weight_dtype(weight)), "weighted"
  kind: LossKind = "sum" if isinstance(loss, markers.Sum) else "mean"
  value = jnp.asarray(loss.value if isinstance(loss, markers.Sum) else loss)
  if value.shape or not jnp.issubdtype(value.dtype, jnp.floating):
    raise TypeError(
        f"The loss function must return a float scalar (the mean over its micro-batch), "
        f"fxaccum.Weighted(total, weight) or fxaccum.Sum(scalar); got "
        f"{'fxaccum.Sum of ' if kind == 'sum' else ''}{value.dtype}{list(value.shape)}.")
  return value, jnp.ones((), jnp.int32), kind


def micro_batch_avals(config: Config, call: Call) -> Any:
  """The abstract micro-batch (``{batch argnum: tree}``) that ``fun`` receives."""
  return jax.eval_shape(lambda b: split.micro_batch(b, 0, config.micro_batches),
                        call.batch(config))


def is_array(x: Any) -> bool:
  return isinstance(x, (jax.Array, jax.core.Tracer)) or hasattr(x, "__array__")


def micro_loss(config: Config, call: Call) -> Callable[..., Any]:
  """``fun`` on a micro-batch as the loop differentiates it: ``(whole params, micro-batch,
  index, state) -> (total, (weight, aux, state, sown, kind))``."""
  def micro_loss(full, micro, index, state):
    total, *rest = call.loss(config, full, micro, index, state)
    return total, tuple(rest)
  return micro_loss
