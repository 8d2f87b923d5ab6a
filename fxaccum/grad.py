"""In-step gradient accumulation: ``value_and_grad`` / ``grad`` with ``micro_batches=k``.

The loss function is the *compute-grad* part: it runs once per micro-batch inside one
``lax.scan`` of the compiled step, under ``jax.named_scope("fxaccum_compute")``.
Everything the caller does with the result (the optimizer) is the *apply-grad* part and
runs once. Gradients are summed per device in ``accum_dtype`` and reduced over the
data-parallel devices once, after the loop (see :mod:`fxaccum.sync`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from fxaccum import split, sync
from fxaccum.weighted import Weighted, safe_divide, weight_dtype

__all__ = ["value_and_grad", "grad"]

FsdpReduce = Literal["per_micro_batch", "per_step"]


def value_and_grad(
    fun: Callable[..., Any],
    argnums: int | Sequence[int] = 0,
    has_aux: bool = False,
    *,
    micro_batches: int,
    batch_argnums: int | Sequence[int] = 1,
    data_axes: str | Sequence[str] | None = None,
    accum_dtype: Any = jnp.float32,
    rng_argnums: int | Sequence[int] = (),
    fsdp_reduce: FsdpReduce = "per_micro_batch",
    reduce: bool = True,
) -> Callable[..., Any]:
  """Like ``jax.value_and_grad``, over ``micro_batches`` micro-batches of the batch.

  The leaves of the arguments at ``batch_argnums`` are split along axis 0 into
  ``micro_batches`` equal parts (micro-batch ``i`` holds rows ``i::micro_batches`` of each
  device's rows, so a data-sharded batch is never resharded). Every other argument
  (params, constants, keys) is shared by all micro-batches. ``fun`` runs on one
  micro-batch at a time inside a single ``lax.scan``; the result equals
  ``jax.value_and_grad(fun)`` on the whole batch, up to float rounding:

  * if ``fun`` returns a scalar, it must be the **mean over its micro-batch's examples**;
    the value is the mean over all examples;
  * if ``fun`` returns :class:`fxaccum.Weighted` ``(total, weight)``, the value is
    ``sum(total) / sum(weight)`` over all micro-batches and data-parallel devices (0 when
    the summed weight is 0), and the gradient is that of this global ratio;
  * with ``has_aux=True``, ``fun`` returns ``(loss, aux)`` and every ``aux`` leaf is
    averaged over the micro-batches with the loss's weights (equal weights for a scalar
    loss), summed in float32; an ``aux`` leaf that is itself a ``Weighted`` is normalized by
    its own weight. Aux leaves come back as float32. A micro-batch of weight 0 adds
    nothing to the aux average (even a NaN metric).

  Gradients come back in the dtype of the params (like ``jax.grad``), summed in
  ``accum_dtype``; the value has the dtype of the loss ``fun`` returned. With data axes,
  each device keeps its partial sums and one reduction over the data axes runs after the
  loop. Params sharded over a data axis (FSDP) are gathered per micro-batch and their
  gradients reduce-scattered per micro-batch into a sharded accumulator
  (``fsdp_reduce="per_micro_batch"``, memory-optimal), or gathered once with one
  reduce-scatter per step (``fsdp_reduce="per_step"``, one full-size local accumulator,
  communication-optimal).

  Randomness: keys at ``rng_argnums`` are replaced, for micro-batch ``i`` on data-parallel
  device ``d``, by ``jax.random.fold_in(key, d * micro_batches + i)``, so dropout differs
  between micro-batches. Alternatively put per-example keys in the batch
  (``jax.random.split(key, batch_size)``) and they are split like the data.

  Args:
    fun: loss function; see above for what it returns.
    argnums: which positional argument(s) to differentiate, as in ``jax.grad``.
    has_aux: whether ``fun`` returns ``(loss, aux)``.
    micro_batches: number ``k`` of micro-batches per call (a positive Python int).
    batch_argnums: positional argument(s) holding the batch, split along axis 0.
    data_axes: mesh axis name(s) the batch's axis 0 is sharded over; ``None`` infers them
      (see :mod:`fxaccum.sync`).
    accum_dtype: dtype of the gradient accumulators (float32 by default, also for bf16
      params). Loss totals are always summed in at least float32, weights in int32 or
      float32.
    rng_argnums: positional argument(s) holding PRNG keys to fold per micro-batch.
    fsdp_reduce: for params sharded over a data axis: ``"per_micro_batch"`` (default) or
      ``"per_step"``.
    reduce: ``False`` defers the data-axis reduction to a cross-step gate: the gradients
      come back as :class:`fxaccum.Unreduced` per-device sums (the value is still the
      reduced loss). Feed them to a chain with ``fxaccum.accumulate(k, data_axes=...)``.
      Params must be replicated over the data axes.

  Returns:
    A function with the signature of ``fun`` returning ``(value, grads)``, or
    ``((value, aux), grads)`` with ``has_aux=True``.

  Raises:
    ValueError / TypeError: for a bad ``micro_batches``, overlapping or out-of-range
      argnums, a batch that does not split evenly (per device), unknown ``data_axes``,
      non-float differentiated leaves, or a ``has_aux`` mismatch; all at trace time.

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
  micro_batches = split.check_micro_batches(micro_batches)
  diff_argnums = split.as_argnums(argnums, "argnums")
  batch_argnums_t = split.as_argnums(batch_argnums, "batch_argnums")
  rng_argnums_t = split.as_argnums(rng_argnums, "rng_argnums")
  for name, other in (("batch_argnums", batch_argnums_t), ("rng_argnums", rng_argnums_t)):
    overlap = set(diff_argnums) & set(other)
    if overlap:
      raise ValueError(
          f"argnums and {name} overlap at {sorted(overlap)}: fxaccum differentiates with "
          "respect to shared arguments only. Move the differentiated values out of the batch."
      )
  if set(batch_argnums_t) & set(rng_argnums_t):
    raise ValueError(
        f"batch_argnums and rng_argnums overlap at "
        f"{sorted(set(batch_argnums_t) & set(rng_argnums_t))}; keys in the batch are already "
        "split per micro-batch, so leave them out of rng_argnums."
    )
  if fsdp_reduce not in ("per_micro_batch", "per_step"):
    raise ValueError(
        f"fsdp_reduce must be 'per_micro_batch' or 'per_step', got {fsdp_reduce!r}."
    )
  axes_override = None if data_axes is None else _as_axes(data_axes)
  accum_dtype = jnp.dtype(accum_dtype)
  if not jnp.issubdtype(accum_dtype, jnp.floating):
    raise TypeError(f"accum_dtype must be a float dtype, got {accum_dtype}.")
  config = _Config(
      fun=fun,
      has_aux=has_aux,
      micro_batches=micro_batches,
      diff_argnums=diff_argnums,
      single_argnum=isinstance(argnums, int),
      batch_argnums=batch_argnums_t,
      rng_argnums=rng_argnums_t,
      accum_dtype=accum_dtype,
      fsdp_reduce=fsdp_reduce,
      reduce=bool(reduce),
  )
  compiled_for_layout: dict[sync.Layout, Callable[..., Any]] = {}

  @functools.wraps(fun)
  def value_and_grad_fn(*args, **kwargs):
    highest = max((*diff_argnums, *batch_argnums_t, *rng_argnums_t))
    if highest >= len(args):
      raise TypeError(
          f"{getattr(fun, '__name__', 'fun')} was called with {len(args)} positional "
          f"arguments, but argnums/batch_argnums/rng_argnums refer to argument {highest}. "
          "Pass the params and the batch positionally."
      )
    diff = [args[i] for i in diff_argnums]
    batch = [args[i] for i in batch_argnums_t]
    other = [a for i, a in enumerate(args) if i not in diff_argnums + batch_argnums_t]
    _check_differentiable(diff, diff_argnums)
    diff_leaves = jax.tree.leaves(diff)
    layout = sync.plan(diff_leaves, jax.tree.leaves(batch), jax.tree.leaves(other),
                       axes_override)
    split.leading_size(batch, micro_batches, layout.data_devices)
    if not reduce and any(layout.param_dims):
      raise ValueError(
          "reduce=False keeps one full gradient per device, so it needs params replicated "
          "over the data axes, but some params are sharded over them (FSDP). Use reduce=True "
          "(the default) with a cross-step accumulate() without data_axes."
      )

    # Keyword arguments reach `fun` as given (like jax.value_and_grad): not split, not
    # differentiated, not traced by fxaccum.
    run = functools.partial(_run, config, layout, kwargs)
    if _is_traced(args, kwargs):
      return run(args)
    # Eager call: compile the whole accumulation, once per layout when there are no kwargs.
    if kwargs:
      return jax.jit(run)(args)
    if layout not in compiled_for_layout:
      compiled_for_layout[layout] = jax.jit(run)
    return compiled_for_layout[layout](args)

  return value_and_grad_fn


def grad(
    fun: Callable[..., Any],
    argnums: int | Sequence[int] = 0,
    has_aux: bool = False,
    **kwargs: Any,
) -> Callable[..., Any]:
  """Like ``jax.grad``, over micro-batches; see :func:`value_and_grad` for the arguments.

  Returns ``grads``, or ``(grads, aux)`` with ``has_aux=True``.

  Example:
    >>> import jax.numpy as jnp, fxaccum
    >>> def loss(w, x):
    ...   return fxaccum.Weighted(total=jnp.sum(x * w), weight=jnp.sum(x != 0))
    >>> x = jnp.array([[1.0], [0.0], [3.0], [0.0]])   # two padding rows
    >>> fxaccum.grad(loss, micro_batches=2)(jnp.ones(1), x)   # (1 + 3) / 2 tokens
    Array([2.], dtype=float32)
  """
  value_and_grad_fn = value_and_grad(fun, argnums, has_aux, **kwargs)

  @functools.wraps(fun)
  def grad_fn(*args, **call_kwargs):
    value, grads = value_and_grad_fn(*args, **call_kwargs)
    return (grads, value[1]) if has_aux else grads

  return grad_fn


@dataclasses.dataclass(frozen=True)
class _Config:
  """Static configuration of one ``value_and_grad`` (closed over, never traced)."""

  fun: Callable[..., Any]
  has_aux: bool
  micro_batches: int
  diff_argnums: tuple[int, ...]
  single_argnum: bool
  batch_argnums: tuple[int, ...]
  rng_argnums: tuple[int, ...]
  accum_dtype: Any
  fsdp_reduce: FsdpReduce
  reduce: bool


def _as_axes(data_axes: str | Sequence[str]) -> tuple[str, ...]:
  axes = (data_axes,) if isinstance(data_axes, str) else tuple(data_axes)
  if not all(isinstance(a, str) for a in axes):
    raise TypeError(f"data_axes must be a mesh axis name or a tuple of them, got {data_axes!r}.")
  return axes


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
            "Differentiate only float params; pass integer state in another argument."
        )


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


def _total_and_weight(loss: Any) -> tuple[jax.Array, jax.Array]:
  """A micro-batch's ``(total, weight)``: a mean counts as total=mean, weight=1."""
  if isinstance(loss, Weighted):
    total, weight = jnp.asarray(loss.total), jnp.asarray(loss.weight)
    if total.shape or weight.shape:
      raise TypeError(
          f"Weighted(total, weight) must hold scalars, got shapes {total.shape} and "
          f"{weight.shape}. Sum over the items: Weighted(jnp.sum(mask * l), jnp.sum(mask))."
      )
    return total, lax.stop_gradient(weight).astype(weight_dtype(weight))
  loss = jnp.asarray(loss)
  if loss.shape or not jnp.issubdtype(loss.dtype, jnp.floating):
    raise TypeError(
        f"The loss function must return a float scalar (the mean over its micro-batch) or "
        f"fxaccum.Weighted(total, weight); got {loss.dtype}{list(loss.shape)}."
    )
  return loss, jnp.ones((), jnp.int32)


def _is_weighted(x: Any) -> bool:
  return isinstance(x, Weighted)


def _specs_like(tree: Any, spec: P) -> Any:
  return jax.tree.map(lambda _: spec, tree)


def _run(config: _Config, layout: sync.Layout, kwargs: dict, args: tuple) -> Any:
  """The whole accumulation for one layout; jit-traceable."""
  diff = tuple(args[i] for i in config.diff_argnums)
  diff_leaves, diff_def = jax.tree.flatten(diff)
  rest = tuple(a if i not in config.diff_argnums else None for i, a in enumerate(args))

  def local(diff_leaves, rest):
    return _accumulate(config, layout, diff_leaves, diff_def, rest, kwargs)

  if layout.data_axes:
    batch_spec = P(layout.data_axes)
    rest_specs = tuple(
        _specs_like(a, batch_spec if i in config.batch_argnums else P())
        for i, a in enumerate(rest)
    )
    param_specs = [layout.param_spec(i) for i in range(len(diff_leaves))]
    diff_leaves, rest = jax.tree.map(
        lambda x, spec: sync.conform(x, spec, layout.data_axes),
        (diff_leaves, rest), (param_specs, rest_specs))
    grad_specs = param_specs if config.reduce else (
        [batch_spec] * len(diff_leaves), batch_spec)  # per-device sums and weights
    local = jax.shard_map(
        local,
        mesh=layout.mesh,
        in_specs=(param_specs, rest_specs),
        out_specs=(P(), grad_specs),
        axis_names=set(layout.data_axes),
    )
  (value, aux), grad_leaves = local(diff_leaves, rest)
  if not config.reduce:
    grad_leaves, weight = grad_leaves
    total = jax.tree.unflatten(diff_def, grad_leaves)
    grads = sync.Unreduced(total[0] if config.single_argnum else total, weight)
    return ((value, aux), grads) if config.has_aux else (value, grads)
  grads = jax.tree.unflatten(diff_def, grad_leaves)
  if config.single_argnum:
    grads = grads[0]
  return ((value, aux), grads) if config.has_aux else (value, grads)


def _accumulate(config, layout, diff_leaves, diff_def, rest, kwargs):
  """Per-device loop: sums of gradients, loss totals, weights and aux over micro-batches."""
  k = config.micro_batches
  axes = layout.data_axes
  per_step = config.fsdp_reduce == "per_step"
  # Leaves gathered inside the loop body (FSDP per micro-batch) vs. held whole locally.
  gather_in_loop = [dims if not per_step else () for dims in layout.param_dims]
  whole = [
      sync.gather(leaf, dims) if per_step else leaf
      for leaf, dims in zip(diff_leaves, layout.param_dims, strict=True)
  ]
  # Varying (per-device) params: jax.grad then returns local partial sums, no psum.
  whole = sync.vary(whole, axes)
  batch = {i: rest[i] for i in config.batch_argnums}
  device = lax.axis_index(axes) if axes else 0

  def micro_step(index):
    """The loss of micro-batch ``index`` as a function of the (local) differentiated
    leaves, returning ``(total, (weight, aux))``."""
    micro = split.micro_batch(batch, index, k)
    call_args = list(rest)
    for i in config.batch_argnums:
      call_args[i] = micro[i]
    for i in config.rng_argnums:
      call_args[i] = split.fold(rest[i], device * k + index)

    def compute(leaves):
      full = [sync.gather(leaf, dims) for leaf, dims in zip(leaves, gather_in_loop, strict=True)]
      for i, value in zip(config.diff_argnums, jax.tree.unflatten(diff_def, full), strict=True):
        call_args[i] = value
      with jax.named_scope("fxaccum_compute"):
        out = config.fun(*call_args, **kwargs)
      loss, aux = _split_output(out, config.has_aux)
      total, weight = _total_and_weight(loss)
      return total, (weight, aux)

    return compute

  def body_outputs(index):
    compute = micro_step(index)
    (total, (weight, aux)), grads = jax.value_and_grad(compute, has_aux=True)(whole)
    return total, weight, aux, grads

  # Shapes of one micro-step's outputs, to build the loop carry.
  total_shape, (weight_shape, aux_template) = jax.eval_shape(micro_step(0), whole)
  total_dtype = total_shape.dtype

  def zeros(x, dtype=None):
    return sync.vary(jnp.zeros(x.shape, dtype or x.dtype), axes)

  init = (
      # zeros_like keeps the params' sharding (typed on Explicit meshes): the accumulator
      # is sharded like the params.
      [sync.vary(jnp.zeros_like(leaf, config.accum_dtype), axes) for leaf in whole],
      zeros(jax.ShapeDtypeStruct((), jnp.promote_types(total_dtype, jnp.float32))),
      zeros(weight_shape),
      jax.tree.map(lambda a: _aux_zeros(a, zeros), aux_template, is_leaf=_is_weighted),
  )

  def body(carry, index):
    grad_acc, total_acc, weight_acc, aux_acc = carry
    total, weight, aux, grads = body_outputs(index)
    grad_acc = [acc + g.astype(acc.dtype) for acc, g in zip(grad_acc, grads, strict=True)]
    aux_acc = jax.tree.map(
        lambda acc, a: _aux_add(acc, a, weight), aux_acc, aux, is_leaf=_is_weighted
    )
    carry = (
        grad_acc,
        total_acc + total.astype(total_acc.dtype),
        weight_acc + weight,
        aux_acc,
    )
    return sync.vary(carry, axes), None

  (grad_acc, total, weight, aux_acc), _ = lax.scan(body, init, jnp.arange(k))

  with jax.named_scope("fxaccum_reduce"):
    local_weight = weight
    total, weight = sync.reduce(total, axes), sync.reduce(weight, axes)
    value = safe_divide(total, weight).astype(total_dtype)
    aux = jax.tree.map(
        lambda acc: _aux_finish(acc, weight, axes), aux_acc, is_leaf=_is_weighted
    )
    if not config.reduce:  # deferred: each device's sums, one slot per device
      return (value, aux), ([acc[None] for acc in grad_acc],
                            local_weight.astype(jnp.float32)[None])
    grads = []
    for acc, leaf, dims, loop_dims in zip(grad_acc, diff_leaves, layout.param_dims,
                                          gather_in_loop, strict=True):
      # In-loop gathers already reduce-scattered over their axes each micro-batch.
      scattered = {a for _, dim_axes in loop_dims for a in dim_axes}
      remaining = tuple(a for a in axes if a not in scattered)
      reduced = sync.reduce(acc, remaining, () if loop_dims else dims)
      grads.append(safe_divide(reduced, weight).astype(jnp.result_type(leaf)))
  return (value, aux), grads


def _aux_zeros(template, zeros):
  if isinstance(template, Weighted):
    return Weighted(zeros(template.total, jnp.float32),
                    zeros(template.weight, weight_dtype(template.weight.dtype)))
  return zeros(template, jnp.float32)


def _aux_add(acc, value, weight):
  if isinstance(acc, Weighted):
    return Weighted(acc.total + value.total.astype(acc.total.dtype),
                    acc.weight + lax.stop_gradient(value.weight).astype(acc.weight.dtype))
  # A zero-weight micro-batch contributes nothing, even if its metric is NaN (0/0).
  weighted = jnp.where(weight != 0, value.astype(acc.dtype) * weight.astype(acc.dtype), 0)
  return acc + weighted


def _aux_finish(acc, weight, axes):
  if isinstance(acc, Weighted):
    return safe_divide(sync.reduce(acc.total, axes), sync.reduce(acc.weight, axes))
  return safe_divide(sync.reduce(acc, axes), weight)
