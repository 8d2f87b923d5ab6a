"""Cross-step accumulation: ``accumulate()``, its state, and the gate that applies it.

``optax.chain(fxaccum.accumulate(k), optax.adam(...))`` takes one micro-batch per call.
A plain ``optax.chain`` runs every element on every call, so it cannot keep Adam from
updating its moments on the k-1 calls that only accumulate. The *gate* —
:func:`apply_gradients`, :class:`fxaccum.TrainState` and :class:`fxaccum.Optimizer` —
does it: it adds the call's gradient to the :class:`AccumulateState` and, with one
``lax.cond``, either stops there (params and the rest of the chain untouched) or, on the
window's last call, runs the **whole chain once** on the window's mean gradient and
applies the update. ``accumulate``'s own ``update`` is a pass-through that raises when
traced outside a gate, so it can never silently act like ``optax.apply_every``.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from fxaccum import meshes, options, reductions, split
from fxaccum.markers import all_finite

__all__ = ["AccumulateState", "accumulate", "apply_gradients", "is_boundary"]

EveryK = int | Callable[[jax.Array], Any]

UNGATED_MESSAGE = (
    "fxaccum.accumulate's update ran outside a gate: a plain optax update would run the "
    "rest of the chain (e.g. Adam's moments) on every micro-step. Apply the chain with "
    "fxaccum.TrainState.apply_gradients (flax linen), fxaccum.Optimizer.update (flax NNX) "
    "or fxaccum.apply_gradients(tx, grads, opt_state, params), not with "
    "flax.training.train_state.TrainState, nnx.Optimizer or tx.update."
)


class AccumulateState(NamedTuple):
  """State of :func:`accumulate`.

  Attributes:
    micro_step: int32, calls accumulated in the current window; 0 right after an
      optimizer step.
    optimizer_step: int32, optimizer steps taken (completed windows).
    accumulator: the window's weighted gradient sum ``sum_i weight_i * grad_i``, with the
      params' tree structure, dtype ``accumulator_dtype`` and the params' sharding. With
      ``data_axes``, every leaf has a leading axis of one partial sum per data-parallel
      device (sharded over those axes, so one gradient copy per device). Right after an
      optimizer step (``micro_step`` 0) it still holds the finished window's sum, which
      the next call replaces: the step writes no params-sized tree of zeros.
    weight: float32, the window's summed weight (per device with ``data_axes``); after a
      step, the finished window's, like ``accumulator``.
    skipped: int32, calls dropped for non-finite gradients (``skip_nonfinite``), in total.
    calls: int32, gate calls so far, every one (skipped ones too): a micro-step counter
      that never repeats, e.g. for a per-call PRNG key ``jax.random.fold_in(key, calls)``
      (``optimizer_step`` repeats within a window).

  Example:
    >>> import jax.numpy as jnp, optax, fxaccum
    >>> tx = optax.chain(fxaccum.accumulate(4), optax.sgd(0.1))
    >>> params = {"w": jnp.zeros(2)}
    >>> params, opt_state = fxaccum.apply_gradients(tx, {"w": jnp.ones(2)}, tx.init(params),
    ...                                             params)
    >>> acc = opt_state[0]   # the AccumulateState: the chain's first element's state
    >>> int(acc.micro_step), int(acc.optimizer_step), acc.accumulator["w"], float(acc.weight)
    (1, 0, Array([1., 1.], dtype=float32), 1.0)
    >>> int(acc.calls)   # every call, for per-call randomness
    1
  """

  micro_step: jax.Array
  optimizer_step: jax.Array
  accumulator: Any
  weight: jax.Array
  skipped: jax.Array
  calls: jax.Array


@dataclasses.dataclass(frozen=True)
class _Config:
  every_k: EveryK
  accumulator_dtype: Any
  skip_nonfinite: bool
  data_axes: tuple[str, ...]

  def window(self, optimizer_step: jax.Array) -> jax.Array:
    """Number of calls in the window that starts at ``optimizer_step`` (at least 1)."""
    if not callable(self.every_k):
      return jnp.int32(self.every_k)
    k = self.every_k(optimizer_step)
    if k is None or isinstance(k, bool) or not jnp.issubdtype(jnp.result_type(k), jnp.integer):
      raise TypeError(
          f"The every_k schedule returned {k!r} (dtype "
          f"{None if k is None else jnp.result_type(k)}) at an optimizer step; it must return "
          "an integer number of calls per window, e.g. "
          "lambda step: jnp.where(step < 100, 1, 4), or round a float schedule: "
          "lambda step: jnp.int32(jnp.round(schedule(step))).")
    if not isinstance(k, jax.core.Tracer) and int(k) < 1:
      raise ValueError(f"The every_k schedule returned {int(k)}; a window needs at least 1 "
                       "call.")
    # A traced value below 1 cannot raise here: such a window has 1 call (documented).
    return jnp.maximum(jnp.asarray(k, jnp.int32), 1)


# The gate session: set while a gate traces the chain; collects accumulate's config.
_GATE: contextvars.ContextVar[list[_Config] | None] = contextvars.ContextVar(
    "fxaccum_gate", default=None)


@contextlib.contextmanager
def _gate_session():
  found: list[_Config] = []
  token = _GATE.set(found)
  try:
    yield found
  finally:
    _GATE.reset(token)


@options.public
def accumulate(
    every_k: EveryK,
    *,
    accumulator_dtype: Any = jnp.float32,
    skip_nonfinite: bool = False,
    data_axes: str | tuple[str, ...] | None = None,
    **removed: Any,
) -> optax.GradientTransformationExtraArgs:
  """Accumulates ``every_k`` calls' gradients; the chain steps once per window.

  Put it in an ``optax.chain`` (normally first) and apply the chain with a gate:
  :class:`fxaccum.TrainState`, :class:`fxaccum.Optimizer` or
  :func:`fxaccum.apply_gradients`. On the first ``every_k - 1`` calls of a window only
  this state changes; on the last call the whole chain runs once on the window's mean
  gradient ``sum_i weight_i * grad_i / sum_i weight_i`` (0 if the summed weight is 0),
  the params are updated and the next call starts a new window from zero (the state keeps
  the finished window's sums until then). Wherever it sits in the chain, the
  gate accumulates the raw gradients, so every element of the chain sees only the mean.

  Args:
    every_k: calls per optimizer step: an int, or a schedule
      ``optimizer_step -> k`` (like ``optax.MultiSteps``' ``every_k_schedule``).
    accumulator_dtype: dtype of the accumulator (float32 by default, also for bf16 params).
    skip_nonfinite: drop a call whose gradient (or weight) holds NaN/Inf, or whose weight
      is negative, as ``optax.MultiSteps`` does: it adds nothing and does not count as a
      call of the window (a window never ends on skipped calls alone); ``skipped`` counts
      it. Without it, such a call makes the window's gradient NaN (never silently wrong).
      A call of weight 0 adds exactly nothing either way, even with NaN gradients.
    data_axes: data-parallel mesh axes for *deferred* sync: the accumulator keeps one
      partial sum per device and the gradient is all-reduced once, inside the window's
      last call. Feed it with ``fxaccum.value_and_unreduced_grad``. ``None``
      (default): gradients arrive already reduced, one reduction per call.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is an
    :class:`AccumulateState`.

  Example:
    >>> import jax.numpy as jnp, optax, fxaccum
    >>> tx = optax.chain(fxaccum.accumulate(2), optax.sgd(1.0))
    >>> params = jnp.zeros(2)
    >>> opt_state = tx.init(params)
    >>> for g in (jnp.array([1.0, 2.0]), jnp.array([3.0, 4.0])):
    ...   params, opt_state = fxaccum.apply_gradients(tx, g, opt_state, params)
    ...   print(params, bool(fxaccum.is_boundary(opt_state)))
    [0. 0.] False
    [-2. -3.] True
  """
  options.check_removed("accumulate", removed)
  if removed:
    raise TypeError(f"fxaccum.accumulate() got an unexpected keyword argument "
                    f"{next(iter(removed))!r}.")
  if not callable(every_k):
    every_k = split.check_micro_batches(every_k, "every_k")
  accumulator_dtype = jnp.dtype(accumulator_dtype)
  if not jnp.issubdtype(accumulator_dtype, jnp.floating):
    raise TypeError(f"accumulator_dtype must be a float dtype, got {accumulator_dtype}.")
  axes = meshes.as_data_axes(data_axes, "accumulate's data_axes") or ()
  config = _Config(every_k, accumulator_dtype, bool(skip_nonfinite), axes)

  def init_fn(params):
    masked = jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, optax.MaskedNode))
    if any(isinstance(x, optax.MaskedNode) for x in masked):
      raise ValueError(
          "fxaccum.accumulate got a masked params tree (it is inside optax.masked or "
          "optax.multi_transform): it must accumulate every gradient leaf, since the whole "
          "chain steps once per window. Put it first in a top-level chain instead: "
          "optax.chain(fxaccum.accumulate(k), optax.masked(...), ...).")
    if axes:
      mesh = _data_mesh(params, axes)
      accumulator = _per_device_zeros(params, mesh, axes, accumulator_dtype)
      weight = _per_device_zeros(jnp.zeros((), jnp.float32), mesh, axes, jnp.float32)
    else:
      accumulator = jax.tree.map(lambda p: jnp.zeros_like(p, accumulator_dtype), params)
      weight = jnp.zeros((), jnp.float32)
    return AccumulateState(
        micro_step=jnp.zeros((), jnp.int32),
        optimizer_step=jnp.zeros((), jnp.int32),
        accumulator=accumulator,
        weight=weight,
        skipped=jnp.zeros((), jnp.int32),
        calls=jnp.zeros((), jnp.int32),
    )

  def update_fn(updates, state, params=None, **extra_args):
    del params, extra_args
    session = _GATE.get()
    if session is None:
      raise RuntimeError(UNGATED_MESSAGE)
    session.append(config)
    return updates, state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _data_mesh(params: Any, axes: tuple[str, ...]) -> Any:
  """The mesh per-device accumulators live on."""
  mesh = meshes.find_mesh(jax.tree.leaves(params))
  # Under jit without a mesh context only an abstract mesh is known, and JAX cannot place
  # new arrays on it.
  if mesh is None or not (isinstance(mesh, jax.sharding.Mesh)
                          or jax.sharding.get_abstract_mesh().axis_names):
    raise ValueError(
        f"accumulate(data_axes={axes}) needs a mesh to lay out per-device accumulators: "
        "call tx.init inside `with jax.set_mesh(mesh):` (required under jax.jit), or "
        "eagerly on params placed with a NamedSharding."
    )
  missing = meshes.missing_axes(mesh, axes)
  if missing:
    raise ValueError(
        f"accumulate(data_axes={axes}): the mesh has no axes {missing}; its axes are "
        f"{tuple(mesh.axis_names)}."
    )
  return mesh


def _per_device_zeros(tree: Any, mesh: Any, axes: tuple[str, ...], dtype: Any) -> Any:
  """Zeros with a leading axis of one slot per device of ``axes``, sharded over them; each
  slot is sharded like its leaf on the other axes (e.g. tensor-parallel ``model``), so the
  state a gated step returns is laid out like the state it took."""
  devices = math.prod(mesh.shape[a] for a in axes)
  explicit = meshes.explicit(mesh, axes)

  def zeros(leaf):
    spec = meshes.known_spec(leaf)
    if set(axes) & meshes.named_axes(spec):
      raise ValueError(
          f"accumulate(data_axes={axes}) keeps one full gradient sum per device, so it needs "
          f"params replicated over {axes}, but a param of shape {jnp.shape(leaf)} is sharded "
          f"P{tuple(spec)} (FSDP). Use accumulate(every_k) without data_axes: FSDP gradients "
          "are then reduce-scattered on every call.")
    out = jnp.zeros((devices, *jnp.shape(leaf)), dtype)
    sharding = NamedSharding(mesh, P(axes, *spec))
    if explicit:  # sharding in types
      return jax.sharding.reshard(out, sharding)
    if isinstance(mesh, jax.sharding.Mesh) and not isinstance(leaf, jax.core.Tracer):
      return jax.device_put(out, sharding)
    return lax.with_sharding_constraint(out, sharding)

  return jax.tree.map(zeros, tree)


def _states(opt_state: Any) -> list[AccumulateState]:
  leaves = jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, AccumulateState))
  return [x for x in leaves if isinstance(x, AccumulateState)]


def find_state(opt_state: Any) -> AccumulateState:
  """The one AccumulateState inside an optimizer state (raises if there is not one)."""
  found = _states(opt_state)
  if len(found) != 1:
    raise ValueError(
        f"The optimizer state holds {len(found)} fxaccum.AccumulateState; the gate needs "
        "exactly one. Build the optimizer as optax.chain(fxaccum.accumulate(k), ...) and "
        "initialise it with tx.init(params)."
    )
  return found[0]


def _replace_state(opt_state: Any, new: AccumulateState) -> Any:
  return jax.tree.map(lambda x: new if isinstance(x, AccumulateState) else x, opt_state,
                      is_leaf=lambda x: isinstance(x, AccumulateState))


def is_boundary(opt_state: Any) -> jax.Array:
  """Whether the last gated call ended a window (updated the params).

  Use it to log only real optimizer steps. Takes the optimizer state of a
  ``fxaccum.TrainState`` (``state.opt_state``), of a ``fxaccum.Optimizer``
  (``opt.opt_state``) or of the functional gate.

  Example:
    >>> import jax.numpy as jnp, optax, fxaccum
    >>> tx = optax.chain(fxaccum.accumulate(3), optax.sgd(0.1))
    >>> params = jnp.zeros(2)
    >>> opt_state = tx.init(params)
    >>> for call in range(4):
    ...   params, opt_state = fxaccum.apply_gradients(tx, jnp.ones(2), opt_state, params)
    ...   print(call, bool(fxaccum.is_boundary(opt_state)))
    0 False
    1 False
    2 True
    3 False
  """
  state = find_state(opt_state)
  # [...] reads plain arrays and flax NNX Variables (an fxaccum.Optimizer's opt_state) alike.
  return (state.micro_step[...] == 0) & (state.optimizer_step[...] > 0)


def apply_gradients(
    tx: optax.GradientTransformation,
    grads: Any,
    opt_state: Any,
    params: Any,
    *,
    weight: Any = None,
    **extra_args: Any,
) -> tuple[Any, Any]:
  """The functional gate: accumulate ``grads``; on a window's last call, step ``tx``.

  Args:
    tx: an optax chain containing exactly one :func:`accumulate`.
    grads: this call's gradient (the params' structure), or ``fxaccum.Unreduced`` from
      ``fxaccum.value_and_unreduced_grad`` with ``accumulate(data_axes=...)``.
    opt_state: ``tx``'s state.
    params: the params.
    weight: this call's weight, e.g. its number of valid tokens (default 1: calls weigh
      equally). Not with ``Unreduced`` grads, which carry their weight.
    **extra_args: passed to ``tx.update`` on the window's last call.

  Returns:
    ``(params, opt_state)``; the params change only on a window's last call.

  Example:
    >>> import jax.numpy as jnp, optax, fxaccum
    >>> tx = optax.chain(fxaccum.accumulate(2), optax.sgd(1.0))
    >>> params = jnp.zeros(1)
    >>> opt_state = tx.init(params)
    >>> params, opt_state = fxaccum.apply_gradients(tx, jnp.array([1.0]), opt_state, params,
    ...                                             weight=3)   # 3 tokens
    >>> params   # mid-window: unchanged
    Array([0.], dtype=float32)
    >>> params, opt_state = fxaccum.apply_gradients(tx, jnp.array([5.0]), opt_state, params,
    ...                                             weight=1)   # 1 token
    >>> params   # one SGD step on the token mean (3 * 1 + 1 * 5) / 4 = 2
    Array([-2.], dtype=float32)
  """
  params, opt_state, _, _ = gate(tx, grads, opt_state, params, weight=weight, **extra_args)
  return params, opt_state


def gate(
    tx: optax.GradientTransformation,
    grads: Any,
    opt_state: Any,
    params: Any,
    *,
    weight: Any = None,
    check_finite: bool = False,
    **extra_args: Any,
) -> tuple[Any, Any, jax.Array, jax.Array]:
  """:func:`apply_gradients` that also returns whether this call ended a window and
  whether the window's gradient was finite (``check_finite``: a window whose mean
  gradient is not finite ends without an optimizer step, its params and chain state
  untouched, as a dynamic loss scale skips a step).
  """
  config = probe_config(tx, opt_state, params, extra_args)
  before = find_state(opt_state)
  state = _add(config, before, grads, weight, params)
  boundary = state.micro_step >= config.window(before.optimizer_step)
  # Only the params and the rest of the chain go through the cond; the accumulator and
  # the weight go in as operands and never come out (a cond's results get buffers of their
  # own, which XLA does not share with the step's temporaries, and a held copy of a
  # params-sized tree would be one more). They stay readable after the step: the next
  # call starts a new window from zero (_add), so nothing params-sized is zeroed here.
  chain = _replace_state(opt_state, _hollow(state))
  step = functools.partial(_step, tx, config, check_finite, extra_args,
                           jax.tree.map(jnp.result_type, params))

  def hold(operands):
    params, chain, _, _ = operands
    return params, chain, jnp.array(True)

  operands = (params, chain, state.accumulator, state.weight)
  # lax.cond needs identical branch types: cast the held state like the stepped one
  # (e.g. bf16 params with float32 optimizer moments).
  stepped = jax.eval_shape(step, operands)

  def hold_like_step(operands):
    return jax.tree.map(lambda x, s: lax.convert_element_type(x, s.dtype), hold(operands),
                        stepped)

  params, chain, finite = lax.cond(boundary, step, hold_like_step, operands)
  state = state._replace(
      micro_step=jnp.where(boundary, jnp.zeros_like(state.micro_step), state.micro_step),
      optimizer_step=state.optimizer_step + boundary.astype(state.optimizer_step.dtype))
  return params, _replace_state(chain, state), boundary, finite


def _hollow(state: AccumulateState) -> AccumulateState:
  """``state`` without its params-sized accumulator, for the chain inside the gate's cond
  (``accumulate``'s own update passes its state through)."""
  return state._replace(accumulator=())


def _step(tx, config: _Config, check_finite: bool, extra_args: dict[str, Any], grad_dtypes: Any,
          operands: Any) -> tuple[Any, Any, jax.Array]:
  """The gate's boundary branch: the chain once on the window's mean gradient."""
  params, chain, total, weight = operands
  if config.data_axes:  # the one all-reduce of deferred sync, inside this branch
    total, weight = reductions.sum_deferred((total, weight), config.data_axes)
  mean = jax.tree.map(lambda t, d: _times_reciprocal(t, weight).astype(d), total, grad_dtypes)
  with _gate_session():
    updates, new_chain = tx.update(mean, chain, params, **extra_args)
  new_params = optax.apply_updates(params, updates)
  if not check_finite:
    return new_params, new_chain, jnp.array(True)
  finite = all_finite(mean)
  keep = functools.partial(jax.tree.map, lambda new, old: jnp.where(finite, new, old))
  return keep(new_params, params), keep(new_chain, chain), finite


def _times_reciprocal(total: jax.Array, weight: jax.Array) -> jax.Array:
  """``total / weight`` in at least float32, 0 where ``weight`` is 0, as a product with the
  reciprocal: XLA fuses a product into each of the chain's uses of the mean gradient, but
  writes a quotient (an expensive op to repeat) to a params-sized temporary."""
  dtype = jnp.promote_types(total.dtype, jnp.float32)
  weight = weight.astype(dtype)
  nonzero = weight != 0
  scale = jnp.where(nonzero, 1 / jnp.where(nonzero, weight, 1), 0)
  return total.astype(dtype) * scale


def probe_config(tx, opt_state, params, extra_args) -> _Config:
  """Finds the accumulate config by tracing ``tx.update`` abstractly in a gate session."""
  zeros = jax.tree.map(lambda p: jax.ShapeDtypeStruct(jnp.shape(p), jnp.result_type(p)), params)
  with _gate_session() as found:  # arguments, not closures: they may be ShapeDtypeStructs
    jax.eval_shape(lambda g, s, p: tx.update(g, s, p, **extra_args), zeros, opt_state, params)
  distinct = list({id(c): c for c in found}.values())
  if len(distinct) == 1 and len(found) > 1:
    raise ValueError(
        f"fxaccum.accumulate's update ran {len(found)} times in one gate call: it is wrapped "
        "in a transformation that runs its inner optimizer more than once, such as "
        "optax.MultiSteps (which accumulates by itself: use one or the other). Put "
        "accumulate first in a top-level chain: "
        "optax.chain(fxaccum.accumulate(k), optax.adam(1e-3)).")
  if len(found) != 1:
    raise ValueError(
        f"tx runs {len(distinct)} fxaccum.accumulate transformations; the gate needs exactly "
        "one, e.g. optax.chain(fxaccum.accumulate(k), optax.adam(1e-3)).")
  return found[0]


def _fresh_window(state: AccumulateState) -> AccumulateState:
  """``state`` with zero sums where a window starts (``micro_step`` 0): the previous
  window's sums stay in the state after its step (the gate writes no params-sized tree of
  zeros), and the window's first call starts from zero."""
  fresh = state.micro_step == 0
  return state._replace(
      accumulator=jax.tree.map(lambda a: jnp.where(fresh, jnp.zeros_like(a), a),
                               state.accumulator),
      weight=jnp.where(fresh, jnp.zeros_like(state.weight), state.weight))


def _add(config: _Config, state: AccumulateState, grads: Any, weight: Any,
         params: Any) -> AccumulateState:
  """The state after adding one call's gradient (no collective for deferred sync)."""
  unreduced = isinstance(grads, reductions.Unreduced)
  if bool(config.data_axes) != unreduced:
    if unreduced:
      raise TypeError(
          "Got fxaccum.Unreduced gradients (per-device partial sums), but accumulate was "
          "built without data_axes. Use fxaccum.accumulate(k, data_axes=...) or compute "
          "reduced gradients (fxaccum.value_and_grad, jax.grad)."
      )
    raise TypeError(
        f"accumulate(data_axes={config.data_axes}) keeps per-device partial sums and needs "
        "fxaccum.Unreduced gradients: compute them with "
        "fxaccum.value_and_unreduced_grad."
    )
  if unreduced:
    if weight is not None:
      raise ValueError(
          "fxaccum.Unreduced gradients carry their own weight; do not pass weight=.")
    total, weight = grads.total, grads.weight.astype(jnp.float32)
  else:
    weight = jnp.float32(1) if weight is None else _check_weight(weight)
    total = grads
  _check_grads(total, params, unreduced)
  state = _fresh_window(state)

  def contribution(g):
    g = g.astype(config.accumulator_dtype)
    g = g if unreduced else g * weight.astype(config.accumulator_dtype)
    # Weight 0 adds nothing, even a NaN gradient (Unreduced: per device slot).
    w = weight.reshape(weight.shape + (1,) * (g.ndim - weight.ndim))
    zero = jnp.broadcast_to(w == 0, g.shape)
    spec = jax.typeof(g).sharding.spec
    if jax.typeof(zero).sharding.spec != spec:  # Explicit axes: select wants equal types
      zero = jax.sharding.reshard(zero, spec)
    return jnp.where(zero, jnp.zeros_like(g), g)

  added = jax.tree.map(contribution, total)
  valid_weight = jnp.isfinite(weight) & (weight >= 0)
  skipped = state.skipped
  counted = jnp.ones((), state.micro_step.dtype)
  if config.skip_nonfinite:
    # One flag for the whole call (a reduction over devices under deferred sync, as in
    # MultiSteps): the call is dropped as if it never happened.
    good = jnp.all(valid_weight) & all_finite(added)
    added = jax.tree.map(lambda a: jnp.where(good, a, 0), added)
    weight = jnp.where(good, weight, 0)
    skipped = skipped + (~good).astype(skipped.dtype)
    counted = good.astype(counted.dtype)
  else:
    # Loud and elementwise (no collective): a NaN/Inf gradient propagates by itself, and
    # an invalid weight becomes NaN, so the window's mean total / weight is NaN.
    weight = jnp.where(valid_weight, weight, jnp.nan)
  return state._replace(
      micro_step=state.micro_step + counted,
      accumulator=jax.tree.map(jnp.add, state.accumulator, added),
      weight=state.weight + weight,
      skipped=skipped,
      calls=state.calls + 1,
  )


def _check_weight(weight: Any) -> jax.Array:
  """A call's weight: a scalar; a Python or NumPy number must be finite and >= 0."""
  array = jnp.asarray(weight)
  if array.shape:
    raise ValueError(f"weight must be a scalar (this call's count), got shape {array.shape}.")
  if not isinstance(weight, jax.core.Tracer):
    value = float(array)
    if not (0 <= value < float("inf")):
      raise ValueError(
          f"weight={value} is not a valid count: a call's weight must be finite and >= 0 "
          "(e.g. its number of valid tokens). A negative weight would flip the sign of its "
          "gradient.")
  return array.astype(jnp.float32)


def _check_grads(total: Any, params: Any, unreduced: bool) -> None:
  """Same tree and, leaf by leaf, the params' shape (Unreduced: a leading device axis)."""
  params_def, grads_def = jax.tree.structure(params), jax.tree.structure(total)
  if params_def != grads_def:  # type: ignore[operator]
    raise ValueError(
        f"The gradient's tree structure does not match the params': {grads_def} vs "
        f"{params_def}. Pass grads for exactly the params the optimizer was built for."
    )
  flat = jax.tree_util.tree_flatten_with_path(total)[0]
  for (path, g), p in zip(flat, jax.tree.leaves(params), strict=True):
    want = tuple(jnp.shape(p))
    got = tuple(jnp.shape(g))[1:] if unreduced else tuple(jnp.shape(g))
    if got != want:
      device_axis = " after the leading device axis of Unreduced" if unreduced else ""
      raise ValueError(
          f"The gradient at {jax.tree_util.keystr(path) or '<root>'} has shape "
          f"{tuple(jnp.shape(g))}{device_axis}, its param {want}. Gradients must have their "
          "params' shapes (nothing is broadcast).")
