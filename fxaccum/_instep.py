"""In-step gradient accumulation: ``value_and_grad`` / ``grad`` with ``micro_batches=k``.

The contract, for every loss on every mesh: with ``micro_batches=1`` the result equals
``jax.value_and_grad(fun)``; with ``k > 1`` it equals the weighted mean of
``jax.value_and_grad(fun)`` over the k *global* micro-batches (micro-batch ``i`` holds rows
``i::k`` of every device's rows, on all devices together).

The loss function is the *compute-grad* part: it runs once per micro-batch inside one
``lax.scan`` of the compiled step, under ``jax.named_scope("fxaccum_compute")``. Which
*view* runs it is decided per traced call (:mod:`fxaccum._view`): per device, with the
gradients summed locally and reduced over the data axes once after the loop, where the
loss provably keeps its examples apart; otherwise on the global micro-batch, as
``jax.value_and_grad`` runs it. Params sharded over a data axis (FSDP) are gathered and
reduced by the strategy :mod:`fxaccum._fsdp` picks.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import sys
import warnings
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Literal, NamedTuple, ParamSpec, TypedDict, Unpack, overload

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend import core as jcore
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from fxaccum import _accumulators as acc
from fxaccum import _analysis, _symbolic, _view
from fxaccum import _fsdp as fsdp_lib
from fxaccum import _gather as gather_lib
from fxaccum import _reduce as reduce_lib
from fxaccum import _split as split
from fxaccum import _sync as sync
from fxaccum._noise import NoiseScale
from fxaccum._split import MicroBatchSize
from fxaccum._statistics import Statistics, unavailable_noise_scale
from fxaccum._weighted import (
    Concat,
    Max,
    Min,
    State,
    Sum,
    Weighted,
    all_finite,
    highest,
    lowest,
    safe_divide,
    weight_dtype,
)

if TYPE_CHECKING:
  from fxaccum import _nnx

__all__ = ["Options", "grad", "value_and_grad", "value_and_unreduced_grad"]

MicroBatches = int | MicroBatchSize
Argnums = int | Sequence[int]
# The returned function takes fun's own parameters.
_P = ParamSpec("_P")


class Options(TypedDict, total=False):
  """The keyword options of every in-step entry point besides ``micro_batches`` (and
  ``fsdp``, which :func:`value_and_unreduced_grad` does not take). Each is independent of
  the others; see :func:`value_and_grad`."""

  batch_argnums: Argnums
  rng_argnums: Argnums
  state_argnums: Argnums
  data_axes: str | Sequence[str] | None
  param_shardings: Any
  accum_dtype: Any
  view: _view.View
  skip_nonfinite: bool


class _ReducedOptions(Options, total=False):
  fsdp: fsdp_lib.Fsdp


# Options that are gone, and what says the same now.
_REMOVED = {
    "micro_batch_size": "micro_batches=fxaccum.MicroBatchSize(m)",
    "fsdp_reduce": "fsdp='zero1' (fsdp_reduce='per_step'), or leave fsdp='auto' to choose",
    "fsdp_gather": "fsdp='zero3' (fsdp_gather='per_micro_batch'), or leave fsdp='auto' to "
                   "choose",
    "bucket_bytes": "nothing: gradient reductions are bucketed at 2 MiB, the size measured "
                    "best (docs/performance.md)",
    "reduce": "fxaccum.value_and_unreduced_grad(...) for reduce=False (its gradients are "
              "fxaccum.Unreduced)",
    "noise_scale": "has_aux=True with fxaccum.Statistics() in the loss's aux: the step's "
                   "statistics replace it, the noise scale in .noise_scale",
    "loss_reduction": "a loss returned as fxaccum.Sum(loss) for loss_reduction='sum' (the "
                      "value and gradients are then its sums over the micro-batches)",
}


def _public(fn: Callable[..., Any]) -> Callable[..., Any]:
  """``fn`` whose signature (``inspect.signature``, ``help``) leaves out ``**removed``, the
  catch-all that names a removed option's new spelling."""
  signature = inspect.signature(fn)
  fn.__signature__ = signature.replace(  # type: ignore[attr-defined]
      parameters=[p for p in signature.parameters.values() if p.name != "removed"])
  return fn


@overload
def value_and_grad(fun: Callable[_P, Any], argnums: Argnums = ...,
                   has_aux: Literal[False] = ..., *, micro_batches: MicroBatches,
                   **options: Unpack[_ReducedOptions]) -> Callable[_P, tuple[jax.Array, Any]]:
  ...
@overload
def value_and_grad(fun: Callable[_P, Any], argnums: Argnums = ..., *, has_aux: Literal[True],
                   micro_batches: MicroBatches, **options: Unpack[_ReducedOptions]
                   ) -> Callable[_P, tuple[tuple[jax.Array, Any], Any]]: ...
@overload
def value_and_grad(fun: Callable[_P, Any], argnums: Argnums, has_aux: Literal[True], *,
                   micro_batches: MicroBatches, **options: Unpack[_ReducedOptions]
                   ) -> Callable[_P, tuple[tuple[jax.Array, Any], Any]]: ...
@overload
def value_and_grad(fun: Callable[_P, Any], argnums: Argnums = ..., has_aux: bool = ..., *,
                   micro_batches: MicroBatches, **options: Unpack[_ReducedOptions]
                   ) -> Callable[_P, tuple[Any, Any]]: ...
@_public
def value_and_grad(
    fun: Callable[_P, Any],
    argnums: Argnums = 0,
    has_aux: bool = False,
    *,
    micro_batches: MicroBatches | None = None,
    batch_argnums: Argnums = 1,
    rng_argnums: Argnums = (),
    state_argnums: Argnums = (),
    data_axes: str | Sequence[str] | None = None,
    param_shardings: Any = None,
    accum_dtype: Any = jnp.float32,
    view: _view.View = "auto",
    fsdp: fsdp_lib.Fsdp = "auto",
    skip_nonfinite: bool = False,
    **removed: Any,
) -> Callable[_P, tuple[Any, Any]]:  # see the overloads
  """Like ``jax.value_and_grad``, over ``micro_batches`` micro-batches of the batch.

  The leaves of the arguments at ``batch_argnums`` are split along axis 0 into
  ``micro_batches`` equal parts (micro-batch ``i`` holds rows ``i::micro_batches`` of each
  device's rows, so a data-sharded batch is never resharded). Every other argument
  (params, constants, keys) is shared by all micro-batches. ``fun`` runs on one
  micro-batch at a time inside a single ``lax.scan``. The result has the structure
  ``jax.value_and_grad(fun, argnums, has_aux)`` gives, and is the weighted mean of its
  results over the global micro-batches, for every loss:

  * if ``fun`` returns a scalar, each micro-batch weighs 1: for a **mean over the
    micro-batch's examples** the value is the mean over all examples, exactly what
    ``jax.value_and_grad`` gives on the whole batch;
  * if ``fun`` returns :class:`fxaccum.Weighted` ``(total, weight)``, the value is
    ``sum(total) / sum(weight)`` over all micro-batches (0 when the summed weight is 0),
    and the gradient is that of this global ratio;
  * if ``fun`` returns :class:`fxaccum.Sum` ``(loss)`` (a loss already normalized
    globally, e.g. divided by the whole batch's token count, or a plain sum), the value
    and the gradients are its sums over the micro-batches (and devices);
  * with ``has_aux=True``, ``fun`` returns ``(loss, aux)``. Plain ``aux`` leaves are
    averaged over the micro-batches with the loss's weights, in float32 (a micro-batch of
    weight 0 adds nothing); a ``Weighted`` leaf is normalized by its own weight; a
    :class:`fxaccum.Sum` leaf is summed; a :class:`fxaccum.Max` / :class:`fxaccum.Min`
    leaf is combined by its maximum / minimum; a :class:`fxaccum.Concat` leaf
    (per-example outputs) comes back for the whole batch, in its row order; a
    :class:`fxaccum.Statistics` () comes back as the step's statistics (micro-batches
    skipped, the gradient noise scale).

  A flax NNX module among the arguments is taken the ``nnx.value_and_grad`` way: at a
  differentiated position its ``nnx.Param``s are differentiated (another filter:
  ``argnums=nnx.DiffState(i, filter)``) and the gradients come back as an ``nnx.State``;
  all its other state (BatchNorm statistics, RNG counts, sown values) is threaded through
  the micro-batches in order and written back into the module.

  Losses that mix examples (batch statistics, BatchNorm in train mode, in-batch
  negatives) get exactly this contract too. ``view`` picks how the loss runs on a mesh:
  ``"auto"`` runs it per device, with one data-axis reduction after the loop, when an
  analysis of its jaxpr proves that gives the same result (sums or means of per-example
  terms), and otherwise on the global micro-batch like ``jax.value_and_grad``;
  ``"device"`` forces the per-device view (each device's rows are a micro-batch of their
  own, like DDP without SyncBatchNorm); ``"global"`` forces the global view.
  ``fxaccum.diagnostics.report(step, ...).paths`` says which view a step took and why.

  Gradients come back in the dtype of the params (like ``jax.grad``), summed in
  ``accum_dtype``; the value has the dtype of the loss ``fun`` returned. Params sharded
  over a data axis (FSDP) keep their sharding. In the per-device view ``fsdp`` picks how
  they are gathered and their gradients reduced: ``"auto"`` (default) gathers each param
  where the loss uses it (one layer at a time in a scan over stacked layers, ZeRO-3)
  where that lowers the peak memory, else once per step with one reduce-scatter per
  micro-batch (ZeRO-2); the report's paths say which and why.

  Randomness: keys at ``rng_argnums`` are replaced, for micro-batch ``i``, by
  ``jax.random.fold_in(key, i)``, so dropout differs between micro-batches.

  Args:
    fun: loss function; see above for what it returns.
    argnums: which positional argument(s) to differentiate, as in ``jax.grad``; for an
      NNX module, also ``nnx.DiffState(argnum, filter)``.
    has_aux: whether ``fun`` returns ``(loss, aux)``.
    micro_batches: the number ``k`` of micro-batches per call (a positive Python int), or
      :class:`fxaccum.MicroBatchSize` ``(m)``: micro-batches of ``m`` rows, ``k`` following
      the batch size at trace time.
    batch_argnums: positional argument(s) holding the batch, split along axis 0.
    rng_argnums: positional argument(s) holding PRNG keys to fold per micro-batch.
    state_argnums: positional argument(s) threaded through the micro-batches, e.g. flax
      linen's ``batch_stats``: the loss returns each one's new value as an
      :class:`fxaccum.State` in its aux (``has_aux=True``), micro-batch ``i + 1`` receives
      the value micro-batch ``i`` returned, and the aux holds the last one. (Without it, a
      plain aux leaf is averaged over the micro-batches.)
    data_axes: mesh axis name(s) the batch's axis 0 is sharded over; ``None`` infers them
      (see :mod:`fxaccum._sync`).
    param_shardings: the params' shardings where JAX does not show them (inside
      ``jax.jit`` on an ``Auto`` mesh): a tree of ``PartitionSpec`` / ``NamedSharding``
      (or None) with the structure of the differentiated argument (a tuple of trees for
      a tuple ``argnums``), e.g. from ``nn.get_partition_spec`` or
      ``nnx.get_partition_spec``. FSDP gradients then come back sharded like the params.
      flax NNX ``Variable`` sharding metadata is read without it.
    accum_dtype: dtype of the gradient accumulators (float32 by default, also for bf16
      params). Loss totals are always summed in at least float32, weights in int32 or
      float32.
    view: ``"auto"`` (default), ``"device"`` or ``"global"``; see above.
    fsdp: for params sharded over a data axis, in the per-device view: ``"auto"``
      (default), or one strategy, named after the ZeRO stage whose memory it has during
      the step: ``"zero1"`` (gathered once, the gradient reduce-scattered once per step:
      the least communication, whole float32 gradients live), ``"zero2"`` (gathered
      once, reduce-scattered per micro-batch) or ``"zero3"`` (gathered where used and
      again in the backward pass, reduce-scattered per micro-batch: the least memory).
      See docs/sharding.md, "FSDP strategies".
    skip_nonfinite: drop a micro-batch whose loss or gradient is not finite: it
      contributes nothing (weight 0), and its module state update is not kept. The result
      is that of the batch without those examples; a :class:`fxaccum.Statistics` in the
      aux counts the micro-batches skipped.

  Returns:
    A function with the signature of ``fun`` returning ``(value, grads)``, or
    ``((value, aux), grads)`` with ``has_aux=True``, as ``jax.value_and_grad``'s.

  Raises:
    ValueError / TypeError: for a bad ``micro_batches``, overlapping or out-of-range
      argnums, a batch that does not split evenly (per device), unknown ``data_axes``,
      non-float differentiated leaves, a ``has_aux`` mismatch, ``view="device"`` with a
      loss that cannot run per device, or an option this version no longer takes (the
      message names its new spelling); all at trace time.

  Example:
    >>> import jax, jax.numpy as jnp, fxaccum
    >>> def loss(w, batch):
    ...   x, y = batch
    ...   return jnp.mean((x @ w - y) ** 2)
    >>> w = jnp.ones(3)
    >>> batch = (jnp.arange(24.0).reshape(8, 3), jnp.ones(8))
    >>> value, g = fxaccum.value_and_grad(loss, micro_batches=4)(w, batch)
    >>> ref_value, ref_g = jax.value_and_grad(loss)(w, batch)
    >>> bool(jnp.allclose(value, ref_value)), bool(jnp.allclose(g, ref_g))
    (True, True)
  """
  return _entry_point(
      "value_and_grad", fun, argnums, has_aux, removed, reduce=True,
      micro_batches=micro_batches, batch_argnums=batch_argnums, rng_argnums=rng_argnums,
      state_argnums=state_argnums, data_axes=data_axes, param_shardings=param_shardings,
      accum_dtype=accum_dtype, view=view, fsdp=fsdp, skip_nonfinite=skip_nonfinite)


@overload
def value_and_unreduced_grad(
    fun: Callable[_P, Any], argnums: Argnums = ..., has_aux: Literal[False] = ..., *,
    micro_batches: MicroBatches, **options: Unpack[Options]
) -> Callable[_P, tuple[jax.Array, sync.Unreduced]]: ...
@overload
def value_and_unreduced_grad(
    fun: Callable[_P, Any], argnums: Argnums = ..., *, has_aux: Literal[True],
    micro_batches: MicroBatches, **options: Unpack[Options]
) -> Callable[_P, tuple[tuple[jax.Array, Any], sync.Unreduced]]: ...
@overload
def value_and_unreduced_grad(
    fun: Callable[_P, Any], argnums: Argnums, has_aux: Literal[True], *,
    micro_batches: MicroBatches, **options: Unpack[Options]
) -> Callable[_P, tuple[tuple[jax.Array, Any], sync.Unreduced]]: ...
@overload
def value_and_unreduced_grad(
    fun: Callable[_P, Any], argnums: Argnums = ..., has_aux: bool = ..., *,
    micro_batches: MicroBatches, **options: Unpack[Options]
) -> Callable[_P, tuple[Any, sync.Unreduced]]: ...
def value_and_unreduced_grad(fun: Callable[_P, Any], argnums: Argnums = 0,
                             has_aux: bool = False, *,
                             micro_batches: MicroBatches | None = None,
                             **options: Any) -> Callable[_P, tuple[Any, sync.Unreduced]]:
  """:func:`value_and_grad` whose gradients stay per device: deferred sync across steps.

  The value (and aux) is :func:`value_and_grad`'s; the gradients come back as
  :class:`fxaccum.Unreduced`, each data-parallel device's sum over its micro-batches and
  its summed weight, without the data-axis reduction. Feed them to a chain with
  ``fxaccum.accumulate(k, data_axes=...)`` applied by a gate (:class:`fxaccum.TrainState`,
  :class:`fxaccum.Optimizer`, :func:`fxaccum.apply_gradients`), which adds them up per
  device and reduces once per optimizer step. The params must be replicated over the
  data axes; the loss returns a mean or :class:`fxaccum.Weighted` (the gate averages its
  calls by their weights). ``options``: :func:`value_and_grad`'s, but ``fsdp``.

  Example:
    >>> import jax, jax.numpy as jnp, optax, fxaccum
    >>> loss = lambda w, x: jnp.mean((x @ w) ** 2)
    >>> tx = optax.chain(fxaccum.accumulate(2, data_axes="data"), optax.sgd(0.1))
    >>> grad_fn = fxaccum.value_and_unreduced_grad(loss, micro_batches=2)
    >>> n = jax.device_count()
    >>> with jax.set_mesh(jax.make_mesh((n,), ("data",))):
    ...   w = jnp.ones(3)
    ...   opt_state = tx.init(w)
    ...   for call in range(2):   # the gate reduces the gradients once, in the 2nd call
    ...     _, g = grad_fn(w, jax.device_put(jnp.ones((4 * n, 3)), jax.P("data")))
    ...     w, opt_state = fxaccum.apply_gradients(tx, g, opt_state, w)
    >>> type(g).__name__, [round(float(v), 4) for v in w]   # one SGD step on the mean, 6
    ('Unreduced', [0.4, 0.4, 0.4])
  """
  return _entry_point("value_and_unreduced_grad", fun, argnums, has_aux, options,
                      reduce=False, micro_batches=micro_batches)


@overload
def grad(fun: Callable[_P, Any], argnums: Argnums = ..., has_aux: Literal[False] = ..., *,
         micro_batches: MicroBatches, **options: Unpack[_ReducedOptions]) -> Callable[_P, Any]:
  ...
@overload
def grad(fun: Callable[_P, Any], argnums: Argnums = ..., *, has_aux: Literal[True],
         micro_batches: MicroBatches, **options: Unpack[_ReducedOptions]
         ) -> Callable[_P, tuple[Any, Any]]: ...
@overload
def grad(fun: Callable[_P, Any], argnums: Argnums, has_aux: Literal[True], *,
         micro_batches: MicroBatches, **options: Unpack[_ReducedOptions]
         ) -> Callable[_P, tuple[Any, Any]]: ...
@overload
def grad(fun: Callable[_P, Any], argnums: Argnums = ..., has_aux: bool = ..., *,
         micro_batches: MicroBatches, **options: Unpack[_ReducedOptions]) -> Callable[_P, Any]:
  ...
def grad(fun: Callable[_P, Any], argnums: Argnums = 0, has_aux: bool = False, *,
         micro_batches: MicroBatches | None = None, **options: Any) -> Callable[_P, Any]:
  """Like ``jax.grad``, over micro-batches; see :func:`value_and_grad` for the options.

  Returns ``grads``, or ``(grads, aux)`` with ``has_aux=True``, as ``jax.grad``'s.

  Example:
    >>> import jax.numpy as jnp, fxaccum
    >>> def loss(w, x):
    ...   return fxaccum.Weighted(total=jnp.sum(x * w), weight=jnp.sum(x != 0))
    >>> x = jnp.array([[1.0], [0.0], [3.0], [0.0]])   # two padding rows
    >>> fxaccum.grad(loss, micro_batches=2)(jnp.ones(1), x)   # (1 + 3) / 2 tokens
    Array([2.], dtype=float32)
  """
  value_and_grad_fn = _entry_point("grad", fun, argnums, has_aux, options, reduce=True,
                                   micro_batches=micro_batches)

  @functools.wraps(fun)
  def grad_fn(*args, **call_kwargs):
    value, grads = value_and_grad_fn(*args, **call_kwargs)
    return (grads, value[1]) if has_aux else grads

  return grad_fn


def _entry_point(entry: str, fun: Callable[..., Any], argnums: Any, has_aux: bool,
                 given: dict[str, Any], *, reduce: bool, **options: Any) -> Callable[..., Any]:
  """The function an entry point returns, from its options (``given``: the keyword
  arguments it did not name: removed options, or, for :func:`grad`, all of them)."""
  options = {**options, **{k: v for k, v in given.items() if k not in _REMOVED}}
  known = set(_ReducedOptions.__annotations__) | {"micro_batches"}
  for name in given:
    if name in _REMOVED:
      raise TypeError(f"fxaccum.{entry} no longer takes {name}=; use {_REMOVED[name]}.")
    if name not in known or (name == "fsdp" and not reduce):
      raise TypeError(f"fxaccum.{entry}() got an unexpected keyword argument {name!r}.")
  config = _make_config(fun, argnums, has_aux, reduce=reduce, **options)
  compiled: dict[Any, Callable[..., Any]] = {}  # one jitted program per layout (eager calls)

  @functools.wraps(fun)
  def value_and_grad_fn(*args, **kwargs):
    return _call(config, compiled, args, kwargs)

  return value_and_grad_fn


def _make_config(fun, argnums, has_aux, *, micro_batches=None, batch_argnums=1,
                 rng_argnums=(), state_argnums=(), data_axes=None, param_shardings=None,
                 accum_dtype=jnp.float32, view="auto", fsdp="auto", skip_nonfinite=False,
                 reduce) -> _Config:
  """Validates the entry points' arguments (all static) into a :class:`_Config`."""
  if micro_batches is None:
    raise TypeError(
        "fxaccum needs micro_batches=k (the number of micro-batches) or "
        "micro_batches=fxaccum.MicroBatchSize(m) (the rows of one micro-batch across all "
        "data devices).")
  micro_batch_size = None
  if isinstance(micro_batches, MicroBatchSize):
    micro_batch_size, micro_batches = micro_batches.rows, 1  # k set per call from the rows
  micro_batches = split.check_micro_batches(micro_batches)
  nnx_lib = _nnx_loaded()
  argnums, filters = nnx_lib.argnums_and_filters(argnums) if nnx_lib else (argnums, {})
  diff_argnums = split.as_argnums(argnums, "argnums")
  batch_argnums_t = split.as_argnums(batch_argnums, "batch_argnums")
  rng_argnums_t = split.as_argnums(rng_argnums, "rng_argnums")
  state_argnums_t = split.as_argnums(state_argnums, "state_argnums")
  _check_roles(diff_argnums, batch_argnums_t, rng_argnums_t, state_argnums_t)
  if state_argnums_t and not has_aux:
    raise ValueError(
        "state_argnums needs has_aux=True: the loss returns each threaded argument's new "
        "value in its aux, as fxaccum.State(new_value).")
  for name, value, allowed in (("view", view, ("auto", "global", "device")),
                               ("fsdp", fsdp, fsdp_lib.STRATEGIES)):
    if value not in allowed:
      raise ValueError(f"{name} must be one of {allowed}, got {value!r}.")
  accum_dtype = jnp.dtype(accum_dtype)
  if not jnp.issubdtype(accum_dtype, jnp.floating):
    raise TypeError(f"accum_dtype must be a float dtype, got {accum_dtype}.")
  single_argnum = isinstance(argnums, int)
  if param_shardings is not None:
    param_shardings = (param_shardings,) if single_argnum else tuple(param_shardings)
  return _Config(
      fun=fun, has_aux=has_aux, micro_batches=micro_batches,
      micro_batch_size=micro_batch_size, diff_argnums=diff_argnums,
      single_argnum=single_argnum, filters=filters, batch_argnums=batch_argnums_t,
      rng_argnums=rng_argnums_t, state_argnums=state_argnums_t,
      data_axes=None if data_axes is None else _as_axes(data_axes),
      param_shardings=param_shardings, accum_dtype=accum_dtype, fsdp=fsdp,
      reduce=reduce, view=view, skip_nonfinite=bool(skip_nonfinite))


def _check_roles(diff: tuple[int, ...], batch: tuple[int, ...], rng: tuple[int, ...],
                 state: tuple[int, ...]) -> None:
  """Each positional argument has one role: differentiated, split, folded or threaded."""
  for name, other in (("batch_argnums", batch), ("rng_argnums", rng),
                      ("state_argnums", state)):
    overlap = set(diff) & set(other)
    if overlap:
      raise ValueError(
          f"argnums and {name} overlap at {sorted(overlap)}: fxaccum differentiates with "
          "respect to shared arguments only. Move the differentiated values out of the batch."
      )
  if set(batch) & set(rng):
    raise ValueError(
        f"batch_argnums and rng_argnums overlap at {sorted(set(batch) & set(rng))}; keys "
        "in the batch are already split per micro-batch, so leave them out of rng_argnums."
    )
  if set(state) & (set(batch) | set(rng)):
    raise ValueError(
        f"state_argnums {state} overlaps batch_argnums or rng_argnums: a threaded "
        "argument is neither split nor folded. Name each argument in one of them.")


def _call(config: _Config, compiled: dict, args: Sequence[Any], kwargs: dict) -> Any:
  """One call of the function ``value_and_grad`` returned."""
  highest = max((*config.diff_argnums, *config.batch_argnums, *config.rng_argnums,
                 *config.state_argnums))
  if highest >= len(args):
    raise TypeError(
        f"{getattr(config.fun, '__name__', 'fun')} was called with {len(args)} positional "
        f"arguments, but argnums/batch_argnums/rng_argnums/state_argnums refer to argument "
        f"{highest}. Pass the params and the batch positionally."
    )
  module_args = args
  _check_graph_nodes(args, config)
  nnx_lib = _nnx_loaded()
  args, state, sown, modules = (
      nnx_lib.Modules.split(args, config.diff_argnums, config.filters) if nnx_lib
      else (list(args), (), (), None))
  # Threaded: the NNX graph nodes' state, and the arguments at state_argnums.
  state = (state, tuple(args[i] for i in config.state_argnums))
  diff = [args[i] for i in config.diff_argnums]
  batch = [args[i] for i in config.batch_argnums]
  other = [a for i, a in enumerate(args)
           if i not in config.diff_argnums + config.batch_argnums]
  _check_differentiable(diff, config.diff_argnums)
  layout = sync.plan(jax.tree.leaves(diff), jax.tree.leaves(batch),
                     jax.tree.leaves((other, state)), config.data_axes,
                     sync.param_hints(diff, config.param_shardings))
  if config.micro_batch_size is not None:
    config = _sized(config, split.leading_size(batch, 1, layout.data_devices),
                    layout.data_devices)
  rows = split.leading_size(batch, config.micro_batches, layout.data_devices)
  _check_kwargs(kwargs, rows, config)
  if not config.reduce and any(layout.param_dims):
    raise ValueError(
        "fxaccum.value_and_unreduced_grad keeps one full gradient per device, so it needs "
        "params replicated over the data axes, but some params are sharded over them "
        "(FSDP). Use fxaccum.value_and_grad with a cross-step accumulate() without "
        "data_axes."
    )
  # Keyword arguments reach `fun` as given (like jax.value_and_grad): not split, not
  # differentiated; an eager call compiles once per layout and static keyword values.
  kw_leaves, kw_def = jax.tree.flatten(kwargs)
  dynamic = [i for i, leaf in enumerate(kw_leaves) if _is_array(leaf)]

  def run(packed, kw_arrays):
    leaves = list(kw_leaves)
    for i, array in zip(dynamic, kw_arrays, strict=True):
      leaves[i] = array
    return _run(config, layout, jax.tree.unflatten(kw_def, leaves), modules, packed)

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
    modules.update(module_args, state[0], sown, new_sown)
  return out


def _nnx_loaded() -> Any:
  """:mod:`fxaccum._nnx` where flax NNX is loaded (an NNX graph node or ``DiffState`` can
  only exist then), else None: fxaccum loads no flax of its own."""
  if "flax.nnx" not in sys.modules:
    return None
  from fxaccum import _nnx  # imports flax, loaded already
  return _nnx


def _sized(config: _Config, rows: int, devices: int) -> _Config:
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


def _check_graph_nodes(args: Sequence[Any], config: _Config) -> None:
  """NNX graph nodes (modules, ``nnx.Rngs``, Variables) are threaded through the
  micro-batches like module state: one cannot be the batch, nor a key to fold."""
  for name, argnums in (("batch_argnums", config.batch_argnums),
                        ("rng_argnums", config.rng_argnums),
                        ("state_argnums", config.state_argnums)):
    for i in argnums:
      if (nnx_lib := _nnx_loaded()) and nnx_lib.is_graph_node(args[i]):
        raise TypeError(
            f"argument {i} is an {type(args[i]).__name__} (an NNX graph node), but "
            f"{name}={getattr(config, name)} names it. fxaccum threads NNX graph nodes "
            "through the micro-batches like module state (an nnx.Rngs advances once per "
            "micro-batch), and splits only the batch: pass the batch as an argument of "
            "its own and name it in batch_argnums, e.g. loss_fn(model, batch, rngs) with "
            "batch_argnums=1 (a batch the loss closes over is not split).")


def _check_kwargs(kwargs: dict, rows: int, config: _Config) -> None:
  """Keyword arguments are shared by all micro-batches: one with the batch's rows on
  axis 0 is most likely batch data that would not be split."""
  for path, leaf in jax.tree_util.tree_flatten_with_path(kwargs)[0]:
    shape = jnp.shape(leaf) if _is_array(leaf) else ()
    if rows > 1 and shape[:1] == (rows,):
      raise ValueError(
          f"Keyword argument {jax.tree_util.keystr(path)} has the batch's {rows} rows on "
          "axis 0, but keyword arguments are passed to every micro-batch whole, not split. "
          "Pass batch data positionally and list its position in batch_argnums (now "
          f"{config.batch_argnums}).")


@dataclasses.dataclass(frozen=True)
class _Config:
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
  accum_dtype: Any
  fsdp: fsdp_lib.Fsdp
  reduce: bool  # False: value_and_unreduced_grad
  view: _view.View
  skip_nonfinite: bool


@dataclasses.dataclass(frozen=True)
class _Call:
  """One traced call: the differentiated leaves and everything else ``fun`` receives.

  ``state`` is what is threaded through the micro-batches: ``(the NNX graph nodes' state
  (() without them), the values of the arguments at state_argnums)``. Each micro-batch's
  call takes the state the previous one left.
  """

  diff_leaves: list[Any]
  diff_def: Any
  rest: tuple[Any, ...]  # the positional args, None at the differentiated ones
  kwargs: dict[str, Any]
  state: Any = ((), ())
  modules: _nnx.Modules | None = None
  # Appended by each trace of the loss: what it returned (see _LossKind).
  kinds: list[_LossKind] = dataclasses.field(default_factory=list, compare=False)

  def batch(self, config: _Config) -> dict[int, Any]:
    return {i: self.rest[i] for i in config.batch_argnums}

  def loss(self, config: _Config, diff_leaves, micro, index, state) -> tuple[Any, ...]:
    """``fun`` on micro-batch ``micro`` (number ``index``) with module state ``state``, as
    ``(total, weight, aux, state, sown)``."""
    call_args = list(self.rest)
    for i in config.batch_argnums:
      call_args[i] = micro[i]
    for i in config.rng_argnums:
      call_args[i] = split.fold(self.rest[i], index)
    values = jax.tree.unflatten(self.diff_def, diff_leaves)
    for i, value in zip(config.diff_argnums, values, strict=True):
      call_args[i] = value
    module_state, threaded = state
    for i, value in zip(config.state_argnums, threaded, strict=True):
      call_args[i] = value
    after = None
    if self.modules is not None:
      call_args, after = self.modules.merged(call_args, module_state)
    with jax.named_scope("fxaccum_compute"), sync.linen_rules_without_manual_axes():
      out = config.fun(*call_args, **self.kwargs)
    module_state, sown = after() if after is not None else ((), ())
    loss, aux = _split_output(out, config.has_aux)
    state = (module_state, _threaded(aux, threaded, config))
    total, weight, kind = _total_and_weight(loss)
    if kind == "sum" and not config.reduce:
      raise TypeError(
          "fxaccum.value_and_unreduced_grad feeds a gate that averages its calls by their "
          "weights, but the loss returned fxaccum.Sum (already normalized). Return "
          "fxaccum.Weighted(total, count) from the loss instead.")
    self.kinds.append(kind)
    return total, weight, aux, state, sown


def _as_axes(data_axes: str | Sequence[str]) -> tuple[str, ...]:
  if isinstance(data_axes, str):
    return (data_axes,)
  if not isinstance(data_axes, (tuple, list)) or not all(isinstance(a, str) for a in data_axes):
    raise TypeError(
        f"data_axes must be a mesh axis name or a tuple of them (or () for none), got "
        f"{data_axes!r}.")
  if len(set(data_axes)) != len(data_axes):
    raise ValueError(f"data_axes names an axis twice: {tuple(data_axes)}.")
  return tuple(data_axes)


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


def _threaded(aux: Any, threaded: tuple[Any, ...], config: _Config) -> tuple[Any, ...]:
  """The new values of the arguments at ``state_argnums``: the ``State`` markers of
  ``aux``, in order, each like the value it replaces (``threaded``)."""
  states = [m for m in jax.tree.leaves(aux, is_leaf=_is_marker) if isinstance(m, State)]
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


def _summary(tree: Any) -> str:
  leaves = jax.tree_util.tree_flatten_with_path(tree)[0][:3]
  return ", ".join(f"{jax.tree_util.keystr(p) or 'value'}: {x.dtype}{list(x.shape)}"
                   for p, x in leaves) or "no arrays"


def _split_output(out: Any, has_aux: bool) -> tuple[Any, Any]:
  """``fun``'s output as ``(loss, aux)``, raising on a ``has_aux`` mismatch."""
  if has_aux:
    if isinstance(out, Weighted) or not (isinstance(out, (tuple, list)) and len(out) == 2):
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
_LossKind = Literal["mean", "weighted", "sum"]


def _total_and_weight(loss: Any) -> tuple[jax.Array, jax.Array, _LossKind]:
  """A micro-batch's ``(total, weight, kind)``: a mean or a ``Sum`` counts as its total with
  weight 1 (a ``Sum``'s totals are then added up, not divided by their weights)."""
  if isinstance(loss, Weighted):
    total, weight = jnp.asarray(loss.total), jnp.asarray(loss.weight)
    if total.shape or weight.shape:
      raise TypeError(
          f"Weighted(total, weight) must hold scalars, got shapes {total.shape} and "
          f"{weight.shape}. Sum over the items: Weighted(jnp.sum(mask * l), jnp.sum(mask))."
      )
    return total, lax.stop_gradient(weight).astype(weight_dtype(weight)), "weighted"
  kind: _LossKind = "sum" if isinstance(loss, Sum) else "mean"
  value = jnp.asarray(loss.value if isinstance(loss, Sum) else loss)
  if value.shape or not jnp.issubdtype(value.dtype, jnp.floating):
    raise TypeError(
        f"The loss function must return a float scalar (the mean over its micro-batch), "
        f"fxaccum.Weighted(total, weight) or fxaccum.Sum(scalar); got "
        f"{'fxaccum.Sum of ' if kind == 'sum' else ''}{value.dtype}{list(value.shape)}.")
  return value, jnp.ones((), jnp.int32), kind


def _explicit(mesh: Any, axes: Sequence[str]) -> bool:
  types = dict(zip(mesh.axis_names, mesh.axis_types, strict=True))
  return bool(axes) and all(types[a] == AxisType.Explicit for a in axes)


# ---------------------------------------------------------------------------------------
# Which view


def _run(config: _Config, layout: sync.Layout, kwargs: dict, modules: _nnx.Modules | None,
         packed: tuple[tuple, Any]) -> Any:
  """The whole accumulation for one layout; jit-traceable. ``packed`` is ``(args, state)``
  (module arguments split into their state); returns ``(result, (state, sown))``."""
  args, state = packed
  diff = tuple(args[i] for i in config.diff_argnums)
  diff_leaves, diff_def = jax.tree.flatten(diff)
  rest = tuple(None if i in config.diff_argnums else a for i, a in enumerate(args))
  call = _Call(diff_leaves, diff_def, rest, kwargs, state, modules)
  if layout.manual:
    value_aux, grads, after = _per_rank(config, layout, call)
  elif (direct := _direct(config, layout, call)) is not None:
    value_aux, grads, after = direct
  elif not layout.data_axes:
    path = _view.Path("global", "the batch is not split over data-parallel devices", ())
    value_aux, grads, after = _global(config, layout, path, frozenset(), call)
  else:
    path, reducible, traced_aux, stacked = _decide(config, layout, call)
    value_aux = None
    if path.view == "device":
      try:
        value_aux, grads, after = _device(config, layout, path, call, traced_aux, stacked)
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
  if config.single_argnum and not isinstance(grads, sync.Unreduced):
    grads = grads[0]
  value, aux, stats = value_aux
  if stats is not None:
    aux = _with_statistics(aux, stats, grads)
  return ((value, aux) if config.has_aux else value, grads), after


def _with_statistics(aux: Any, stats: tuple[jax.Array, jax.Array | None], grads: Any) -> Any:
  """``aux`` with the step's :class:`fxaccum.Statistics` where the loss asked for them;
  ``stats`` is the loop's skipped count and summed :data:`_NOISE_TERMS` (None: no noise
  scale for this step)."""
  skipped, terms = stats
  noise = (_noise_scale(terms, grads) if terms is not None and
           not isinstance(grads, sync.Unreduced) else unavailable_noise_scale())
  filled = Statistics(skipped=skipped, noise_scale=noise)
  return jax.tree.map(lambda m: filled if isinstance(m, Statistics) else m, aux,
                      is_leaf=_is_marker)


def _noise_scale(terms: jax.Array, grads: Any) -> NoiseScale:
  """The step's :class:`fxaccum.NoiseScale` from its small batches' summed
  :data:`_NOISE_TERMS` and its gradient."""
  sq_sum, count, inverse_sum, size_sum = terms
  return NoiseScale(small_sq_norm=sq_sum / count, big_sq_norm=_sq_norm(grads),
                    small_batch=count / inverse_sum, big_batch=size_sum)


def _warn_gathered_by_the_compiler(config: _Config, layout: sync.Layout,
                                   path: _view.Path) -> None:
  """An FSDP strategy named in ``fsdp=`` applies in the per-device view only."""
  if config.fsdp != "auto" and any(layout.param_dims):
    warnings.warn(
        f"fsdp='{config.fsdp}' has no effect on this step: it runs in the global view "
        f"({path.reason}), where the compiler places the FSDP gathers (above the "
        "micro-batch loop). view='device' runs the strategy, if the loss may run per "
        "device.", stacklevel=4)


def _direct(config: _Config, layout: sync.Layout, call: _Call) -> Any:
  """One micro-batch (``view="auto"``, reduced): nothing to accumulate, and the compiler's
  reduction of ``jax.value_and_grad``'s program is already one per step, so that program
  runs, without a per-device region or a loop. None where it does not trace (code valid
  only per device, e.g. FSDP params beside a data-sharded batch on an Explicit mesh)."""
  if config.micro_batches != 1 or config.view != "auto" or not config.reduce:
    return None
  path = _view.Path("global", "one micro-batch: the step runs as jax.value_and_grad runs it",
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
  micro-step scans over stacked FSDP params (:func:`fxaccum._gather.per_layer`; None where
  it traced none)."""

  path: _view.Path
  reducible: frozenset[int] = frozenset()
  aux: Any = None
  stacked: bool | None = None


def _decide(config: _Config, layout: sync.Layout, call: _Call) -> _Decision:
  """The view for this call (see :class:`_Decision`)."""
  axes = layout.data_axes
  explicit = _explicit(layout.mesh, axes)
  if config.view == "global" and not explicit:
    return _Decision(_view.Path("global", "view='global'", axes))
  problem: str | None = None
  reducible: frozenset[int] = frozenset()
  try:
    for analysis, roles, aux, jaxpr in _analyses(config, layout, call,
                                          paired=config.view == "auto"):
      reducible = analysis.reducible if explicit else frozenset()
      blockers = [*analysis.blockers,
                  *([layout.device_blocker] if layout.device_blocker else [])]
      if config.view == "device":
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
        return _Decision(_view.Path("device", "view='device'", axes), reducible, aux,
                         gather_lib.per_layer(jaxpr, layout.param_dims))
      if config.view == "global":
        return _Decision(_view.Path("global", "view='global'", axes), reducible)
      found, what = _view.classify(analysis.outputs, roles, summed=call.kinds[-1] == "sum")
      if not blockers and found is None:
        return _Decision(_view.Path(
            "device", f"the loss is a {what} of per-example terms", axes), reducible, aux,
            gather_lib.per_layer(jaxpr, layout.param_dims))
      problem = problem or (blockers[0] if blockers else found)
      if blockers:  # no other trace removes a blocker
        break
  except NameError as err:  # a collective over an axis that only the device view binds
    if config.view == "device":
      return _Decision(_view.Path("device", "view='device'", axes))
    raise ValueError(
        f"The loss does not run on the global micro-batch ({_first_line(err)}). A loss "
        "that names the data axes in collectives (e.g. flax BatchNorm(axis_name=...), "
        "jax.lax.pmean(x, 'data')) runs only per device: pass view='device'.") from err
  except _NoDeviceTrace as err:
    problem = problem or str(err)
  return _Decision(_view.Path(
      "global", problem or "no proof that per-device results add up", axes), reducible)


class _NoDeviceTrace(Exception):
  """The micro-step does not trace on one device's rows (the message says why)."""


def _analyses(config: _Config, layout: sync.Layout, call: _Call, paired: bool):
  """:func:`fxaccum._analysis.analyze` of one micro-step (the loss, its aux and state, and
  its gradients), with each output's role, the traced aux and the micro-step's jaxpr:
  ``(analysis, roles, aux, jaxpr)``, generated lazily.

  With ``paired``, the step is first traced with a *symbolic* number of rows: a proof on
  that jaxpr holds for every number of rows, so for the global micro-batch and for each
  device's share alike. Where that trace fails (the loss's Python code computes with the
  number of rows, e.g. ``max(n, 8)`` or a numpy array of ``n`` weights) or proves
  nothing (JAX spells a few operations differently for a symbolic size, e.g. a reversal
  as a gather), the step is traced on the global micro-batch and on one device's rows,
  and the two programs are compared (see :mod:`fxaccum._analysis`): the proof then holds
  for the two programs that run. Without ``paired`` only the global micro-batch is
  traced (to find mixing operations and reducible params, not how values scale).

  The global step is traced with the types the global view gives it; if that fails (code
  valid only per device, e.g. a gather of data-sharded indices on an Explicit mesh), with
  the data axes dropped from the types, as the per-device view sees them. Values, and so
  the analysis, do not depend on shardings.
  """
  axes = layout.data_axes
  micro = _micro_batch_avals(config, call)
  leaves = [_gathered(leaf, axes) for leaf in call.diff_leaves]
  rows, devices = jax.tree.leaves(micro)[0].shape[0], layout.data_devices
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
    return _analysis.analyze(
        closed, rows=rows, batch_inputs=range(n_diff, n_diff + n_micro),
        param_inputs=range(n_diff), partner=partner,
        partner_rows=rows // devices if partner is not None else None), _roles(
            closed, aux, state, sown, n_diff, n_micro), aux, closed.jaxpr

  if paired:
    (symbol,) = jax.export.symbolic_shape("rows")
    traced: Any
    try:
      with _symbolic.undecided_uses() as undecided:
        traced = jax.make_jaxpr(step, return_shape=True)(
            per_device(leaves), per_device(micro, symbol), per_device(call.state))
      if undecided:  # e.g. `if x.shape[0] == 2`, `if n % 2`: not the program on 2 rows
        traced = None
    except Exception:  # noqa: BLE001 - not traceable for any number of rows: pair two
      traced = None
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


def _micro_batch_avals(config: _Config, call: _Call) -> Any:
  """The abstract micro-batch (``{batch argnum: tree}``) that ``fun`` receives."""
  return jax.eval_shape(lambda b: split.micro_batch(b, 0, config.micro_batches),
                        call.batch(config))


def _roles(closed: Any, aux: Any, state: Any, sown: Any, n_diff: int,
           n_micro: int) -> list[_view.Role]:
  """The role of each output of a traced micro-step (see :func:`_analyses`)."""
  roles: list[_view.Role] = ["total", "weight"]
  for marker in jax.tree.leaves(aux, is_leaf=_is_marker):
    if isinstance(marker, Weighted):
      roles.extend(["aux_total", "aux_weight"])
      continue
    by_marker: dict[type, _view.Role] = {Sum: "aux_sum", Concat: "aux_concat",
                                         Max: "aux_max", Min: "aux_min", State: "state"}
    role = by_marker.get(type(marker), "aux")
    roles.extend([role] * len(jax.tree.leaves(marker)))
  # Threaded module state must pass through unchanged for the per-device view.
  state_in = closed.jaxpr.invars[n_diff + n_micro:]
  state_out = closed.jaxpr.outvars[len(roles):len(roles) + len(jax.tree.leaves(state))]
  roles.extend("state" if v_out is v_in else "state_update"
               for v_in, v_out in zip(state_in, state_out, strict=True))
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
  spec = P(*(tuple(a for a in sync.spec_axes(e) if a not in data_axes) or None
             for e in sharding.spec))
  return jax.ShapeDtypeStruct(aval.shape, aval.dtype,
                              sharding=NamedSharding(sharding.mesh, spec))


# ---------------------------------------------------------------------------------------
# The two views


def _device(config: _Config, layout: sync.Layout, path: _view.Path, call: _Call,
            traced_aux: Any = None, stacked: bool | None = None):
  """Per-device view: a shard_map manual over the data axes, one reduction after the loop.
  ``traced_aux`` and ``stacked``: the aux as the view analysis traced it (its markers),
  and whether its micro-step scans over stacked FSDP params, if it traced one."""
  axes = layout.data_axes
  batch_spec = P(axes)
  rest_specs = tuple(_specs_like(a, batch_spec if i in config.batch_argnums else P())
                     for i, a in enumerate(call.rest))
  param_specs = [layout.param_spec(i) for i in range(len(call.diff_leaves))]
  kw_leaves, kw_def = jax.tree.flatten(call.kwargs)
  kw_arrays = [i for i, leaf in enumerate(kw_leaves) if _is_array(leaf)]
  conform = functools.partial(sync.conform, data_axes=axes)
  diff_leaves = [conform(x, spec) for x, spec in zip(call.diff_leaves, param_specs, strict=True)]
  rest = jax.tree.map(conform, call.rest, rest_specs)
  arrays = [conform(kw_leaves[i], P()) for i in kw_arrays]

  state = jax.tree.map(lambda x: conform(x, P()), call.state)

  def local_call(diff_leaves, rest, arrays, state) -> _Call:
    leaves = list(kw_leaves)
    for i, array in zip(kw_arrays, arrays, strict=True):
      leaves[i] = array
    return _Call(diff_leaves, call.diff_def, rest, jax.tree.unflatten(kw_def, leaves), state,
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
      full = [sync.gather(x, dims) for x, dims in zip(local.diff_leaves, layout.param_dims,
                                                        strict=True)]
      found["specs"] = _aux_specs(local.loss(config, full, micro, 0, local.state)[2],
                                  batch_spec)
      return ()

    jax.eval_shape(sync.shard_map_keeping_axes(
        probe, mesh=layout.mesh, in_specs=in_specs, out_specs=(), axis_names=set(axes)),
        diff_leaves, rest, arrays, state)
    aux_specs = found["specs"]
  region = sync.shard_map_keeping_axes(
      local, mesh=layout.mesh, in_specs=in_specs,
      out_specs=((P(), aux_specs, P()), grad_specs, P()), axis_names=set(axes))
  scope = _view.record(path)
  with jax.named_scope(scope):
    value_aux, grad_leaves, after = region(diff_leaves, rest, arrays, state)
  if chosen:
    _view.amend(scope, fsdp=f"{chosen[0].strategy}: {chosen[0].reason}")
  return value_aux, _package(config, call, grad_leaves), after


def _aux_specs(aux: Any, batch_spec: P) -> Any:
  """The region's out_specs of the aux: Concat rows stay with their device, like the batch;
  everything else is reduced (invariant)."""
  return jax.tree.map(lambda m: batch_spec if isinstance(m, Concat) else P(), aux,
                      is_leaf=_is_marker)


def _per_rank(config: _Config, layout: sync.Layout, call: _Call):
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
    if isinstance(total, _analysis.Stat) and total.ratio:
      raise ValueError(
          f"Inside a shard_map over {layout.data_axes} each device's loss is its shard of "
          "the global loss, but this loss divides by a statistic of its own shard (e.g. its "
          f"token count: {total.mixed}). Per-shard means do not combine into the global "
          "mean (DeepSpeed #5248). Return fxaccum.Weighted(jnp.sum(mask * loss), "
          "jnp.sum(mask)) instead.")
  path = _view.Path("device", "per-rank code inside a shard_map over the data axes: "
                    "local sums, one reduction after the loop", layout.data_axes)
  with jax.named_scope(_view.record(path)):
    value_aux, grad_leaves, after = _device_loop(config, layout, call, presummed=True)
  return value_aux, _package(config, call, grad_leaves), after


def _package(config: _Config, call: _Call, grad_leaves) -> Any:
  """The gradient leaves of the device loop as the differentiated arguments' trees, or
  ``fxaccum.Unreduced`` per-device sums (:func:`value_and_unreduced_grad`)."""
  if not config.reduce:
    grad_leaves, weight = grad_leaves
    return sync.Unreduced(_unflatten_grads(config, call, grad_leaves), weight)
  return jax.tree.unflatten(call.diff_def, grad_leaves)


def _specs_like(tree: Any, spec: P) -> Any:
  return jax.tree.map(lambda _: spec, tree)


def _unflatten_grads(config: _Config, call: _Call, leaves: list[Any]) -> Any:
  grads = jax.tree.unflatten(call.diff_def, leaves)
  return grads[0] if config.single_argnum else grads


def _is_array(x: Any) -> bool:
  return isinstance(x, (jax.Array, jax.core.Tracer)) or hasattr(x, "__array__")


def _device_loop(config: _Config, layout: sync.Layout, call: _Call, presummed: bool = False,
                 chosen: list[fsdp_lib.Choice] | None = None, stacked: bool | None = None):
  """Inside the data-manual region: local sums over the micro-batches, then reductions
  (``presummed``: see :func:`_loop`). The FSDP strategy taken is appended to ``chosen``;
  ``stacked``: see :func:`_fsdp_choice`."""
  axes = layout.data_axes
  # Varying (per-device) params: jax.grad then returns local partial sums, no psum.
  shards = sync.vary(list(call.diff_leaves), axes)
  strategy, traced = "zero2", None
  if any(layout.param_dims):
    choice, traced = _fsdp_choice(config, layout, call, shards, stacked)
    strategy = choice.strategy
    if chosen is not None:
      chosen.append(choice)
  per_step = strategy == "zero1"
  # Leaves gathered inside the loop body (FSDP per micro-batch) vs. held whole locally.
  gather_in_loop = [dims if not per_step else () for dims in layout.param_dims]
  whole = sync.vary([sync.gather(leaf, dims) for leaf, dims in zip(
      call.diff_leaves, layout.param_dims, strict=True)], axes) if per_step else shards

  def finalize(sums, weight):
    if not config.reduce:  # deferred: packaged below, with this device's weight
      return sums
    plans = []
    for dims, loop_dims in zip(layout.param_dims, gather_in_loop, strict=True):
      # In-loop gathers already reduce-scattered over their axes each micro-batch.
      scattered = {a for _, dim_axes in (loop_dims or dims) for a in dim_axes}
      plans.append(((() if loop_dims else dims), tuple(a for a in axes if a not in scattered)))
    means = safe_divide(reduce_lib.reduce_leaves(sums, plans, reduce_lib.BUCKET_BYTES), weight)
    return [mean.astype(jnp.result_type(leaf))
            for mean, leaf in zip(means, call.diff_leaves, strict=True)]

  sums = acc.Accumulator(
      lambda: [sync.vary(jnp.zeros_like(leaf, config.accum_dtype), axes) for leaf in whole],
      lambda sums, grads, index, weight: [
          total + g.astype(total.dtype) for total, g in zip(sums, grads, strict=True)],
      finalize)
  value_aux, grads, local_weight, after = _loop(
      config, call, axes, whole, gather_in_loop, sums, presummed, traced=traced)
  if not config.reduce:  # each device's sums, one slot per device
    grads = ([total[None] for total in grads], sync.vary(local_weight, axes)[None])
  return value_aux, grads, after


def _fsdp_choice(config: _Config, layout: sync.Layout, call: _Call, shards: list[Any],
                 stacked: bool | None) -> tuple[fsdp_lib.Choice, gather_lib.Traced | None]:
  """The FSDP strategy of this step (:mod:`fxaccum._fsdp`) and, for zero3, the loss traced
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
    return gather_lib.trace(_micro_loss(config, call), shards, layout.param_dims, micro,
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


def _zero3_blocker(leaves: Sequence[Any], layout: sync.Layout) -> str | None:
  """Why zero3 cannot gather a param in the loop: JAX 0.10.2 cannot differentiate an
  all_gather over a manual data axis of a value also sharded over an ``Explicit`` non-data
  axis (an AssertionError in its sharding rule, without fxaccum too; docs/sharding.md)."""
  for i, (leaf, dims) in enumerate(zip(leaves, layout.param_dims, strict=True)):
    other = {a for entry in jax.typeof(leaf).sharding.spec for a in sync.spec_axes(entry)}
    other -= set(layout.data_axes)
    if dims and _explicit(layout.mesh, sorted(other)):
      return (f"param leaf {i} is sharded over the Explicit axes {sorted(other)} too, and "
              f"JAX {jax.__version__} fails to differentiate its gather inside the loop")
  return None


def _micro_loss(config: _Config, call: _Call) -> Callable[..., Any]:
  """``fun`` on a micro-batch as the loop differentiates it: ``(whole params, micro-batch,
  index, state) -> (total, (weight, aux, state, sown))``."""
  def micro_loss(full, micro, index, state):
    total, weight, aux, state, sown = call.loss(config, full, micro, index, state)
    return total, (weight, aux, state, sown)
  return micro_loss


def _global(config: _Config, layout: sync.Layout, path: _view.Path,
            reducible: frozenset[int], call: _Call, direct: bool = False):
  """Global view: the loss on the global micro-batch; leaves in ``reducible`` are typed
  ``reduced`` over the data axes (Explicit meshes) so their gradients stay unreduced
  through the loop and are reduced once after it. ``direct``: see :func:`_loop`."""
  if reducible:
    try:
      return _global_loop(config, layout, path, reducible, call)
    except Exception as err:  # noqa: BLE001 - an op without reduced/unreduced rules
      path = dataclasses.replace(
          path, reason=f"{path.reason}; params not kept reduced ({_first_line(err)})")
  return _global_loop(config, layout, path, frozenset(), call, direct)


def _global_loop(config: _Config, layout: sync.Layout, path: _view.Path,
                 reducible: frozenset[int], call: _Call, direct: bool = False):
  axes = layout.data_axes
  specs = [_spec_of(leaf, hint) for leaf, hint in zip(
      call.diff_leaves, layout.param_specs or [None] * len(call.diff_leaves), strict=True)]
  reduced = [frozenset(a for a in axes if a not in _named(spec)) if i in reducible
             else frozenset() for i, spec in enumerate(specs)]
  whole = [jax.sharding.reshard(leaf, P(*spec, reduced=r)) if r else leaf
           for leaf, spec, r in zip(call.diff_leaves, specs, reduced, strict=True)]
  hints = layout.param_specs or (None,) * len(whole)

  def constrain(i: int, x: jax.Array) -> jax.Array:
    # Auto meshes: keep accumulators and gradients sharded like the params (FSDP).
    hint = hints[i]
    if reduced[i] or hint is None or layout.mesh is None or _explicit(layout.mesh, axes):
      return x
    return lax.with_sharding_constraint(x, NamedSharding(layout.mesh, hint))

  def init():
    return [jnp.zeros(jnp.shape(leaf), config.accum_dtype, out_sharding=P(*spec, unreduced=r))
            if r else constrain(i, jnp.zeros_like(leaf, config.accum_dtype))
            for i, (leaf, spec, r) in enumerate(zip(call.diff_leaves, specs, reduced,
                                                    strict=True))]

  def update(sums, grads, index, weight):
    return [constrain(i, total + g.astype(total.dtype))
            for i, (total, g) in enumerate(zip(sums, grads, strict=True))]

  def finalize(sums, weight):
    sums = [jax.sharding.reshard(total, P(*spec)) if r else total
            for total, spec, r in zip(sums, specs, reduced, strict=True)]
    if not config.reduce:
      return _as_unreduced(config, layout, call, sums, weight)
    grads = [constrain(i, mean.astype(jnp.result_type(leaf))) for i, (mean, leaf) in
             enumerate(zip(safe_divide(sums, weight), call.diff_leaves, strict=True))]
    return jax.tree.unflatten(call.diff_def, grads)

  path = dataclasses.replace(path, reduced_leaves=sum(map(bool, reduced)), leaves=len(whole))
  with jax.named_scope(_view.record(path)):
    value_aux, grads, _, after = _loop(config, call, (), whole, [()] * len(whole),
                                       acc.Accumulator(init, update, finalize), direct=direct)
  return value_aux, grads, after


def _spec_of(leaf: Any, hint: P | None) -> tuple[Any, ...]:
  """The leaf's PartitionSpec entries, one per dimension (typed, else the hint)."""
  ndim = len(jnp.shape(leaf))
  spec = sync.known_spec(leaf)
  if all(e is None for e in spec) and hint is not None:
    spec = tuple(hint) + (None,) * (ndim - len(hint))
  return tuple(spec)


def _named(spec: Any) -> set[str]:
  return {a for entry in spec for a in sync.spec_axes(entry)}


def _as_unreduced(config: _Config, layout: sync.Layout, call: _Call, sums, weight):
  """Global-view sums in the per-device form ``Unreduced`` gives them: the whole sum in
  the first device's slot, zeros in the others (exact; the reduction already ran)."""
  axes = layout.data_axes
  if not axes:
    return sync.Unreduced(_unflatten_grads(config, call, [s[None] for s in sums]),
                          weight.astype(jnp.float32)[None])

  def first_device_slot(x):  # x is replicated over the data axes: no communication
    return jnp.where(lax.axis_index(axes) == 0, x, jnp.zeros_like(x))[None]

  slots = sync.shard_map_keeping_axes(
      lambda tree: jax.tree.map(first_device_slot, tree), mesh=layout.mesh,
      in_specs=P(), out_specs=P(axes), axis_names=set(axes))
  sums, weight = slots((sums, weight.astype(jnp.float32)))
  return sync.Unreduced(_unflatten_grads(config, call, sums), weight)


# ---------------------------------------------------------------------------------------
# The micro-batch loop, shared by both views


class _StatisticsPerDevice(Exception):
  """A one-micro-batch step asked for Statistics: its noise scale's small batches are the
  devices' rows, so it runs per device, not as jax.value_and_grad's program."""


def _loop(config: _Config, call: _Call, axes: tuple[str, ...], whole: list[Any],
          gather_dims: Sequence[sync.DataDims], grads: acc.Accumulator,
          presummed: bool = False, traced: gather_lib.Traced | None = None,
          direct: bool = False):
  """The micro-batch loop: ``grads`` sums the gradients, and one accumulator each the loss
  totals, weights and aux outputs, while the module state is threaded through in order;
  ``axes`` are the manual axes the sums are reduced over afterwards.

  With ``presummed`` (per-rank code in the caller's shard_map), a loss total, weight or aux
  leaf that depends on the batch but does not vary over some of those axes was summed over
  them by the loss itself (its ``psum``) and is not summed again; the gradients always are.
  With ``traced`` (``fsdp="zero3"``), the loss traced on whole params runs on the shards
  ``whole``, gathering each where it is used. ``direct`` (one micro-batch, run as
  ``jax.value_and_grad`` runs it) raises :class:`_StatisticsPerDevice` for a loss that asks
  for :class:`fxaccum.Statistics`.

  Returns ``((value, aux, statistics), grads, local_weight, (state, sown))``: ``grads`` as
  ``grads.finalize`` gives them, ``statistics`` None or the skipped count and the summed
  :data:`_NOISE_TERMS` (None where the step has no noise scale), ``local_weight`` this
  device's share of the summed loss weight (the shares add up to it over ``axes``),
  ``sown`` the values sown per micro-batch, stacked.
  """
  step = _micro_step(config, call, axes, gather_dims, traced)
  # The micro-step is traced once: its outputs (abstract, with the manual axes each varies
  # over) shape the accumulators, and the loop body runs its jaxpr.
  closed, shapes = jax.make_jaxpr(step, return_shape=True)(whole, jnp.int32(0), call.state)
  sums = _Sums.of(config, call, closed, shapes, axes, presummed, grads,
                  micro_gradients=traced is None)
  if direct and sums.statistics:
    raise _StatisticsPerDevice()
  _warn_batch_shaped(config, call, whole, gather_dims, sums.markers)
  init = (sums.accumulator.init(), call.state)
  body = _loop_body(config, jcore.jaxpr_as_fun(closed), jax.tree.structure(shapes), sums,
                    init, whole, gather_dims, axes, zero3=traced is not None)
  if config.micro_batches == 1:  # one micro-batch: no loop, the step as jax.value_and_grad
    (carry, state), sown = body(init, jnp.int32(0))  # runs it
    sown = jax.tree.map(lambda x: x[None], sown)
  else:
    (carry, state), sown = lax.scan(body, init, jnp.arange(config.micro_batches))
  with jax.named_scope("fxaccum_reduce"):
    value_aux, grad_values, local_weight = sums.finalize(carry, axes)
  return value_aux, grad_values, local_weight, (state, sown)


def _micro_step(config: _Config, call: _Call, axes: tuple[str, ...],
                gather_dims: Sequence[sync.DataDims], traced: gather_lib.Traced | None
                ) -> Callable[..., Any]:
  """One micro-step, ``(params, index, state) -> ((total, (weight, aux, state, sown)),
  local gradients)``: FSDP leaves gathered (``gather_dims``) as the compiler places it,
  or (``traced``) where the loss uses them."""
  batch = call.batch(config)
  micro_loss = _micro_loss(config, call)

  def step(leaves, index, state):
    micro = split.micro_batch(batch, index, config.micro_batches)
    if traced is not None:  # the shards tied to the loop index: no gather is hoisted above
      leaves, _ = lax.optimization_barrier((leaves, index))  # the loop
      return gather_lib.value_and_grad(traced, leaves, micro, index, state)
    full = sync.vary([sync.gather(leaf, dims) for leaf, dims in zip(
        leaves, gather_dims, strict=True)], axes)  # still varying: local gradients
    return jax.value_and_grad(micro_loss, has_aux=True)(full, micro, index, state)

  return step


@dataclasses.dataclass(frozen=True)
class _Sums:
  """The loop's accumulators: the gradients', the loss total and weight, each aux marker's,
  the skipped count and (where the step has one) the noise scale's terms, and all of them
  together (``accumulator``, over lists of the values in that order)."""

  grads: acc.Accumulator
  total: acc.Accumulator
  weight: acc.Accumulator
  aux: acc.Accumulator
  skipped: acc.Accumulator
  noise: acc.Accumulator | None
  total_aval: Any
  aux_def: Any  # the aux's tree structure, its markers as leaves
  markers: list[Any]
  weight_axes: frozenset[str]
  kind: _LossKind
  statistics: bool  # whether the aux asks for Statistics
  rows_per_weight: int  # the examples a unit of loss weight stands for (noise scale)

  @property
  def accumulator(self) -> acc.Accumulator:
    return acc.combined([self.grads, self.total, self.weight, self.aux, self.skipped,
                         *([self.noise] if self.noise else [])])

  @staticmethod
  def of(config: _Config, call: _Call, closed: Any, shapes: Any, axes: tuple[str, ...],
         presummed: bool, grads: acc.Accumulator, micro_gradients: bool) -> _Sums:
    """The accumulators of a micro-step traced as ``closed``; ``micro_gradients``: whether
    it returns each micro-batch's gradient before any reduction (not zero3's)."""
    out_def = jax.tree.structure(shapes)
    (total_aval, (weight_aval, aux_avals, _, _)), _ = jax.tree.unflatten(
        out_def, closed.out_avals)
    summed = _summed_over(closed, axes, call.batch(config), presummed)
    (total_axes, (weight_axes, aux_axes, _, _)), _ = jax.tree.unflatten(
        out_def, [frozenset(axes) if s is None else s for s in summed])
    (_, (constant_weight, _, _, _)), _ = jax.tree.unflatten(out_def, [s is None for s in summed])
    if constant_weight:  # the same on every device (a scalar loss's 1): summed like the total
      weight_axes = total_axes
    markers = jax.tree.leaves(aux_avals, is_leaf=_is_marker)
    kind = call.kinds[-1]
    statistics = any(isinstance(m, Statistics) for m in markers)
    # The noise scale's small batches are each device's share of a micro-batch (or the
    # global micro-batch): a device's gradient must be that share's, not yet reduced, of a
    # mean loss, and the step's gradient must be reduced.
    noise = (statistics and micro_gradients and config.reduce and kind != "sum"
             and set(weight_axes) == set(axes))
    batch_rows = jax.tree.leaves(call.batch(config))[0].shape[0]
    return _Sums(
        grads=grads,
        total=acc.summed(total_aval, _ordered(axes, total_axes),
                         jnp.promote_types(total_aval.dtype, jnp.float32)),
        weight=acc.summed(weight_aval, _ordered(axes, weight_axes)),
        aux=acc.combined([
            acc.for_aux(m, jax.tree.map(functools.partial(_ordered, axes), m_axes),
                        config.micro_batches)
            for m, m_axes in zip(markers, jax.tree.leaves(aux_axes, is_leaf=_is_marker),
                                 strict=True)]),
        skipped=acc.summed(jax.ShapeDtypeStruct((), jnp.int32), axes),
        noise=acc.summed(jax.ShapeDtypeStruct((len(_NOISE_TERMS),), jnp.float32), axes)
        if noise else None,
        total_aval=total_aval, aux_def=jax.tree.structure(aux_avals, is_leaf=_is_marker),
        markers=markers, weight_axes=weight_axes, kind=kind, statistics=statistics,
        # A mean loss weighs 1 and stands for the micro-batch's rows; a Weighted one
        # counts its own items.
        rows_per_weight=1 if kind == "weighted" else batch_rows // config.micro_batches)

  def finalize(self, carry: list[Any], axes: tuple[str, ...]):
    """``((value, aux, statistics), grads, local_weight)`` of the summed ``carry``."""
    grad_sums, total_sum, weight_sum, aux_sums, skipped_sum, *noise_sums = carry
    shared = [a for a in axes if a not in self.weight_axes]
    local_weight = weight_sum.astype(jnp.float32) / math.prod(
        lax.axis_size(a) for a in shared)
    summed_weight = self.weight.finalize(weight_sum, None)
    # The aux is averaged with the loss weights; the value and gradients are normalized
    # by them, or (a Sum loss) left as sums over the micro-batches.
    norm = jnp.ones_like(summed_weight) if self.kind == "sum" else summed_weight
    aux = jax.tree.unflatten(self.aux_def, self.aux.finalize(aux_sums, summed_weight))
    value = safe_divide(self.total.finalize(total_sum, norm), norm).astype(
        self.total_aval.dtype)
    statistics = None
    if self.statistics:
      statistics = (self.skipped.finalize(skipped_sum, summed_weight),
                    self.noise.finalize(noise_sums[0], None) if self.noise else None)
    return (value, aux, statistics), self.grads.finalize(grad_sums, norm), local_weight


def _loop_body(config: _Config, traced_step: Callable[..., Any], out_def: Any, sums: _Sums,
               init: Any, whole: list[Any], gather_dims: Sequence[sync.DataDims],
               axes: tuple[str, ...], zero3: bool) -> Callable[..., Any]:
  """The scan body over micro-batch indices: ``((sums, state), index) -> ((sums, state),
  sown)``, its carry typed like ``init``."""
  accumulator = sums.accumulator

  def body(carry, index):
    sums_carry, old_state = carry
    # A jaxpr output that is a literal (a Python number in the aux) comes back as one.
    outs = [x if isinstance(x, jax.Array) else jnp.asarray(x)
            for x in traced_step(*jax.tree.leaves((whole, index, old_state)))]
    (loss_total, (loss_weight, aux_values, state, sown)), grad_values = jax.tree.unflatten(
        out_def, outs)
    # This device's (or, global view, the micro-batch's) gradient, before any reduction.
    sq_norm = _sq_norm(grad_values) if sums.noise else 0.0
    if any(gather_dims) and not zero3:  # local gradients, reduce-scattered in buckets
      grad_values = reduce_lib.reduce_leaves(
          grad_values, [(dims, ()) for dims in gather_dims], reduce_lib.BUCKET_BYTES)
    values = [grad_values, loss_total, loss_weight,
              jax.tree.leaves(aux_values, is_leaf=_is_marker), jnp.zeros((), jnp.int32)]
    if config.skip_nonfinite:  # a non-finite micro-batch contributes nothing
      good = all_finite((loss_total, grad_values))
      if zero3 and axes:  # reduce-scattered gradients mix the devices' shares: all skip
        good = lax.pmin(good.astype(jnp.int32), axes).astype(bool)
      values, state = _drop_unless(good, values, state, old_state)
      loss_weight = values[2]
    if sums.noise:  # after the skip: a skipped micro-batch weighs 0
      values.append(_noise_terms(sq_norm, loss_weight, sums.rows_per_weight))
    threaded = iter(state[1])  # a State aux is the threaded value the loop carries on
    values[3] = [State(next(threaded)) if isinstance(m, State) else m for m in values[3]]
    carry = (accumulator.update(sums_carry, values, index, loss_weight), state)
    return _retyped(carry, like=init, axes=axes), sown

  return body


# Per small batch i (a micro-batch, per device in the per-device view) of loss weight w_i,
# size b_i and gradient sum g_i (so g_i / w_i is its mean loss's gradient), summed over
# the small batches of nonzero weight.
_NOISE_TERMS = ("|g_i / w_i|^2", "count", "1 / b_i", "b_i")


def _noise_terms(sq_norm: jax.Array, weight: jax.Array, rows_per_weight: int) -> jax.Array:
  """One small batch's :data:`_NOISE_TERMS`, its size its weight times ``rows_per_weight``."""
  w = weight.astype(jnp.float32)
  taken = w != 0  # skipped and all-padding micro-batches are left out
  safe = jnp.where(taken, w, 1)
  size = safe * rows_per_weight
  return jnp.where(taken, jnp.stack([sq_norm / safe**2, 1.0, 1 / size, size]), 0.0)


def _sq_norm(tree: Any) -> jax.Array:
  """The squared norm of every leaf of ``tree`` together, in float32."""
  return sum((jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(tree)),
             jnp.float32(0))


def _summed_over(closed: jax.extend.core.ClosedJaxpr, axes: tuple[str, ...], batch: Any,
                 presummed: bool) -> list[frozenset[str] | None]:
  """Per output of one micro-step, the manual axes to sum it over after the loop: all,
  but (``presummed``) those a value fed by the batch or by a collective (``psum(n)``) does
  not vary over: the loss summed it over them. None (``presummed``): a value fed by
  neither, the same on every device (a weight of 1), for the caller to place."""
  if not (presummed and sync.tracks_varying(axes)):
    return [frozenset(axes)] * len(closed.out_avals)
  depends = _analysis.depends_on(closed, jax.tree.leaves(batch), _REDUCING_COLLECTIVES)
  return [frozenset(a for a in axes if a in sync.varying_axes(aval)) if dep
          else None for aval, dep in zip(closed.out_avals, depends, strict=True)]


# Collectives whose result no longer varies over their axes: a value computed from one
# was reduced over them by the loss.
_REDUCING_COLLECTIVES = frozenset({"psum", "psum_invariant", "pmax", "pmin", "all_gather"})


def _retyped(carry: Any, *, like: Any, axes: tuple[str, ...]) -> Any:
  """``carry`` cast to vary over the manual axes each leaf of ``like`` (the loop's initial
  carry) varies over, as ``lax.scan`` requires of its body."""
  leaves = [sync.vary(x, _ordered(axes, sync.varying_axes(init)))
            for x, init in zip(jax.tree.leaves(carry), jax.tree.leaves(like), strict=True)]
  return jax.tree.unflatten(jax.tree.structure(carry), leaves)


def _drop_unless(good: jax.Array, values: list[Any], state: Any,
                 old_state: Any) -> tuple[list[Any], Any]:
  """A micro-batch's ``[grads, total, weight, aux, skipped]`` and module state, or nothing
  from it unless ``good``: zeros (Concat rows are kept, in place), a skip counted, and the
  state it started from."""
  grads, total, weight, aux, _ = values

  def zero(x):
    return jnp.where(good, x, jnp.zeros_like(x))

  def keep_old(new, old):
    if jnp.issubdtype(jnp.result_type(new), jax.dtypes.prng_key):
      return new  # keys are not advanced by a call; their counts are
    return jnp.where(good, new, old)

  def dropped(a):  # what the skipped micro-batch adds: nothing to each accumulator
    if isinstance(a, Concat):
      return a
    if isinstance(a, (Max, Min)):
      identity = lowest if isinstance(a, Max) else highest
      return type(a)(jnp.where(good, a.value, identity(jnp.result_type(a.value))))
    return jax.tree.map(zero, a)

  aux = [dropped(a) for a in aux]
  values = [[zero(g) for g in grads], zero(total), zero(weight), aux,
            (~good).astype(jnp.int32)]
  return values, jax.tree.map(keep_old, state, old_state)


def _is_marker(x: Any) -> bool:
  return isinstance(x, (Weighted, Sum, Max, Min, Concat, State, Statistics))


def _ordered(axes: tuple[str, ...], subset: frozenset[str]) -> tuple[str, ...]:
  return tuple(a for a in axes if a in subset)


def _warn_batch_shaped(config: _Config, call: _Call, whole: list[Any],
                       gather_dims: Sequence[sync.DataDims], markers: list[Any]) -> None:
  """Warns about plain aux leaves that hold one value per example: averaged over the
  micro-batches, they would come back as one averaged micro-batch. A leaf only shaped
  like that (e.g. 8 BatchNorm channels, 8 rows) is checked against the loss's jaxpr."""
  micro = _micro_batch_avals(config, call)
  rows = jax.tree.leaves(micro)[0].shape[0]
  if rows < 2 or not any(not _is_marker(m) and m.shape[:1] == (rows,) for m in markers):
    return

  def aux_leaves(leaves, micro, state):
    full = [sync.gather(leaf, dims) for leaf, dims in zip(leaves, gather_dims, strict=True)]
    return jax.tree.leaves(call.loss(config, full, micro, 0, state)[2])

  try:
    closed = jax.make_jaxpr(aux_leaves)(whole, micro, call.state)
    kinds = _analysis.analyze(closed, rows=rows, batch_inputs=range(
        len(whole), len(whole) + len(jax.tree.leaves(micro))), param_inputs=()).outputs
  except Exception:  # noqa: BLE001 - no jaxpr to read: go by the shape
    kinds = None
  position = 0
  for marker in markers:
    kind = kinds[position] if kinds is not None else None
    position += len(jax.tree.leaves(marker))
    per_example = kind is None or (isinstance(kind, _analysis.Rows) and kind.dim == 0)
    if not _is_marker(marker) and marker.shape[:1] == (rows,) and per_example:
      warnings.warn(
          f"An aux output of shape {tuple(marker.shape)} holds one value per example of "
          "the micro-batch: plain aux leaves are averaged over the micro-batches, so "
          "per-example values would come back as one averaged micro-batch. Wrap "
          "per-example outputs in fxaccum.Concat(...) to get them for the whole batch, "
          "in order.", stacklevel=4)
