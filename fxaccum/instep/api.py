"""The in-step entry points: ``value_and_grad`` / ``grad`` / ``value_and_unreduced_grad``.

Their signatures, options and documentation, and the function each returns: its options
checked into a :class:`~fxaccum.instep.call.Config` (:mod:`fxaccum.instep.configure`),
and each call of it run by :func:`fxaccum.instep.invoke.call`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Literal, ParamSpec, TypedDict, Unpack, overload

import jax
import jax.numpy as jnp

from fxaccum import options as options_lib
from fxaccum import reductions
from fxaccum.instep import fsdp as fsdp_lib
from fxaccum.instep import invoke, paths
from fxaccum.instep.configure import make_config
from fxaccum.split import MicroBatchSize

if TYPE_CHECKING:
  pass

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
  accumulator_dtype: Any
  view: paths.View
  skip_nonfinite: bool


class _ReducedOptions(Options, total=False):
  fsdp: fsdp_lib.Fsdp


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
@options_lib.public
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
    accumulator_dtype: Any = jnp.float32,
    view: paths.View = "auto",
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
  ``accumulator_dtype``; the value has the dtype of the loss ``fun`` returned. Params sharded
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
      (see :mod:`fxaccum.meshes`).
    param_shardings: the params' shardings where JAX does not show them (inside
      ``jax.jit`` on an ``Auto`` mesh): a tree of ``PartitionSpec`` / ``NamedSharding``
      (or None) with the structure of the differentiated argument (a tuple of trees for
      a tuple ``argnums``), e.g. from ``nn.get_partition_spec`` or
      ``nnx.get_partition_spec``. FSDP gradients then come back sharded like the params.
      flax NNX ``Variable`` sharding metadata is read without it.
    accumulator_dtype: dtype of the gradient accumulators (float32 by default, also for bf16
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
      accumulator_dtype=accumulator_dtype, view=view, fsdp=fsdp, skip_nonfinite=skip_nonfinite)


@overload
def value_and_unreduced_grad(
    fun: Callable[_P, Any], argnums: Argnums = ..., has_aux: Literal[False] = ..., *,
    micro_batches: MicroBatches, **options: Unpack[Options]
) -> Callable[_P, tuple[jax.Array, reductions.Unreduced]]: ...
@overload
def value_and_unreduced_grad(
    fun: Callable[_P, Any], argnums: Argnums = ..., *, has_aux: Literal[True],
    micro_batches: MicroBatches, **options: Unpack[Options]
) -> Callable[_P, tuple[tuple[jax.Array, Any], reductions.Unreduced]]: ...
@overload
def value_and_unreduced_grad(
    fun: Callable[_P, Any], argnums: Argnums, has_aux: Literal[True], *,
    micro_batches: MicroBatches, **options: Unpack[Options]
) -> Callable[_P, tuple[tuple[jax.Array, Any], reductions.Unreduced]]: ...
@overload
def value_and_unreduced_grad(
    fun: Callable[_P, Any], argnums: Argnums = ..., has_aux: bool = ..., *,
    micro_batches: MicroBatches, **options: Unpack[Options]
) -> Callable[_P, tuple[Any, reductions.Unreduced]]: ...
def value_and_unreduced_grad(fun: Callable[_P, Any], argnums: Argnums = 0,
                             has_aux: bool = False, *,
                             micro_batches: MicroBatches | None = None,
                             **options: Any) -> Callable[_P, tuple[Any, reductions.Unreduced]]:
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
  options_lib.check_removed(entry, given)
  options = {**options, **given}
  known = set(_ReducedOptions.__annotations__) | {"micro_batches"}
  for name in given:
    if name not in known or (name == "fsdp" and not reduce):
      raise TypeError(f"fxaccum.{entry}() got an unexpected keyword argument {name!r}.")
  config = make_config(fun, argnums, has_aux, reduce=reduce, **options)
  compiled: dict[Any, Callable[..., Any]] = {}  # one jitted program per layout (eager calls)

  @functools.wraps(fun)
  def value_and_grad_fn(*args, **kwargs):
    return invoke.call(config, compiled, args, kwargs)

  return value_and_grad_fn
