"""Pipeline parallelism: micro-batches streamed through stages over a mesh axis (GPipe,
circular stages, 1F1B).

The stages live on the devices of one mesh axis (``stage``): stage ``s`` holds
``stage_params[s]``. The batch is split into ``k`` micro-batches, and one ``lax.scan`` of
``k + S - 1`` iterations runs inside a ``shard_map`` that is manual over the stage axis
and the data axes. In iteration ``t`` stage ``s`` works on micro-batch ``t - s``; one
collective-permute per iteration hands every stage's output to the next stage.

Why manual over the data axes too: inside the region the stage params are cast to
"varying" over the data axes once, before the loop, so ``jax.grad`` accumulates each
device's stage gradient locally over the micro-batches (the scan's transpose) and the
one data-axis reduction is the cast's transpose, after the loop. Under the compiler's
control instead (data axes left automatic), XLA places that reduction inside the
backward loop, once per iteration.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any, Literal

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from fxaccum import meshes, reductions, split

__all__ = ["SCHEDULES", "Schedule", "bubble_fraction", "pipeline"]

Schedule = Literal["gpipe", "circular", "1f1b"]
SCHEDULES = ("gpipe", "circular", "1f1b")


def pipeline(
    stage_fn: Callable[[Any, Any], Any],
    stage_params: Any,
    x: Any,
    *,
    micro_batches: int,
    stage_axis: str = "stage",
    data_axes: str | tuple[str, ...] | None = None,
    remat: bool = True,
    schedule: Schedule = "gpipe",
    repeats: int = 1,
) -> Any:
  """Runs ``stage_fn`` stage after stage over the ``stage_axis`` devices.

  Equal, up to float rounding, to the plain loop
  ``for s in range(S): x = stage_fn(stage_params[s], x)`` (``"gpipe"``, ``"1f1b"``), or
  ``for v in range(R * S): x = stage_fn(stage_params[v // S, v % S], x)``
  (``schedule="circular"``, ``repeats=R``), and differentiable: call it
  inside a loss (e.g. between the embedding and the head) and take ``jax.grad`` or
  ``fxaccum.value_and_grad`` of that loss. The gradient of ``stage_params`` is
  accumulated per stage over the micro-batches inside the loop and reduced over the data
  axes once, after it; it comes back sharded over ``stage_axis`` like the params.

  Args:
    stage_fn: ``(params of one stage, activations) -> activations`` of the same shapes
      and dtypes. For several layers per stage, loop over a further leading dimension of
      the params inside it (e.g. ``lax.scan``).
    stage_params: a pytree whose leaves have a leading dimension ``S``, the mesh size of
      ``stage_axis``; leaf ``[s]`` belongs to stage ``s``. Shard them over
      ``stage_axis`` on that dimension (other dimensions may be sharded over other axes,
      e.g. tensor-parallel ``model``). With ``schedule="circular"`` the leaves have two
      leading dimensions ``(R, S)``, the ``S`` one sharded over ``stage_axis``: virtual
      stage ``v = r * S + s`` uses ``leaf[r, s]`` and runs on device ``s``.
    x: the activations (an array or pytree), batch on axis 0 of every leaf, sharded over
      the data axes (or not at all). The result has ``x``'s shapes and sharding.
    micro_batches: ``k``, the number of micro-batches streamed through the stages. Each
      device's rows are split as in ``fxaccum.value_and_grad``: micro-batch ``i`` holds
      its rows ``i::k``, so nothing is resharded.
    stage_axis: the mesh axis the stages live on.
    data_axes: the data-parallel mesh axes ``x``'s batch is split over; ``None`` infers
      them as ``fxaccum.value_and_grad`` does (the batch's sharding, else the
      conventional names ``data``, ``fsdp``, ...), ``()`` for none.
    remat: recompute each stage in the backward pass, storing only the stage inputs
      (``jax.checkpoint``), instead of every intermediate of every iteration. (The 1F1B
      backward pass always recomputes.)
    schedule: ``"gpipe"`` (default): each micro-batch passes the ``S`` stages once, in
      ``k + S - 1`` iterations. ``"circular"`` (interleaved stages, MaxText's
      ``num_pipeline_repeats``): each device holds ``R`` stages, every micro-batch goes
      round the ring of devices ``R`` times, in ``k * R + S - 1`` iterations, so the
      bubble is ``(S - 1) / (k * R + S - 1)``; needs ``k >= S`` when ``R > 1``.
      ``"1f1b"``: GPipe's result and gradients with activation memory independent of
      ``k``: the forward pass keeps nothing but ``x``, and the backward pass is one
      wavefront scan of ``k + 2S - 2`` iterations in which each device runs one forward
      and one backward (recomputed from a ring of ``2S - 1`` stage inputs) per
      iteration. It costs one more forward pass than GPipe with ``remat``.
    repeats: ``R``, the stages per device of the circular schedule (1 for GPipe).

  Reverse-mode differentiation (``jax.grad``, ``jax.vjp``, and of those again) works
  for every schedule. 1F1B, streamed GPipe with ``remat`` and every schedule with
  tensor-parallel stages on an Explicit mesh differentiate by a ``jax.custom_vjp`` rule,
  so not in forward mode (``jax.jvp``): docs/pipeline.md, "What is not built yet".

  Returns:
    ``y``, the output of the last stage, with ``x``'s shape, dtype and sharding.

  Raises:
    ValueError: no mesh or no ``stage_axis`` in it, leaves whose leading dimensions are not
      ``S`` (``(R, S)`` for the circular schedule), ``micro_batches < 1``, a batch that
      does not split into ``k`` micro-batches per data device, a ``stage_fn`` that changes
      the activations' shapes or dtypes, an unknown ``schedule``, ``repeats`` with GPipe,
      a circular schedule with fewer micro-batches than stages, or a ``stage_fn`` that
      closes over a value being differentiated (pass it in ``stage_params``).

  Example:
    >>> import jax, jax.numpy as jnp
    >>> import fxaccum
    >>> mesh = jax.make_mesh((2, 4), ("data", "stage"))
    >>> w = jnp.stack([jnp.eye(4) * (s + 1) for s in range(4)])  # 4 stages
    >>> x = jnp.ones((8, 4))
    >>> with jax.set_mesh(mesh):
    ...   y = jax.jit(lambda w, x: fxaccum.pipeline(
    ...       lambda w_s, h: h @ w_s, w, x, micro_batches=2))(w, x)
    >>> float(jax.device_get(y)[0, 0])   # 1 * 2 * 3 * 4
    24.0
  """
  k = split.check_micro_batches(micro_batches)
  repeats = _check_schedule(schedule, repeats, k)
  mesh, stages, axes = _layout(stage_params, x, stage_axis, data_axes)
  leading = _checked_inputs(stage_fn, stage_params, x, k, schedule, repeats, stages,
                            stage_axis, math.prod(mesh.shape[a] for a in axes))
  # GPipe streams x in and the outputs out over the stages (each holds 1/S of them) where
  # every stage can hold whole micro-batches: k a multiple of S. 1F1B, whose backward
  # reads x in place, streams only an x known to be sharded over the stages: x replicated
  # over them would be copied, each stage's share, k-sized.
  streamed = stages > 1 and k % stages == 0 and (
      schedule == "gpipe" or (schedule == "1f1b" and _over_stages(x, stage_axis)))
  if streamed:
    body = _streamed(stage_fn, remat, k, stages, stage_axis, axes)
  else:
    body = _scheduled(stage_fn, remat, k, stages, repeats, len(leading) == 2, stage_axis,
                      axes)
  manual = (stage_axis, *axes)
  param_spec = P(*(None,) * (len(leading) - 1), stage_axis)
  x_spec = P((*axes, stage_axis)) if streamed else P(axes or None)
  # On Explicit mesh axes shard_map wants the arguments typed like its in_specs.
  stage_params = jax.tree.map(lambda p: meshes.conform(p, param_spec, manual), stage_params)
  given = x
  x = jax.tree.map(lambda a: meshes.conform(a, x_spec, manual), x)
  x_specs = jax.tree.map(lambda _: x_spec, x)
  param_specs = jax.tree.map(lambda _: param_spec, stage_params)
  # Stage params sharded over a free Explicit axis (tensor-parallel stages) keep that
  # sharding across the region's boundary (no gather of the params or their gradients).
  region = functools.partial(meshes.shard_map_keeping_axes, mesh=mesh, axis_names=set(manual),
                             in_specs=(param_specs, x_specs))
  forward = region(body, out_specs=x_specs)
  kept_specs, keeping = x_specs, None  # what the backward pass gets besides the params
  if schedule == "gpipe" and streamed and remat:
    # The stash (each iteration's stage input, as remat keeps) is the only residual.
    kept_specs = jax.tree.map(lambda _: P(None, (*axes, stage_axis)), x)
    keeping = region(_streamed(stage_fn, remat, k, stages, stage_axis, axes, keep_inputs=True),
                     out_specs=(x_specs, kept_specs))
    backward = _gpipe_backward(stage_fn, k, stages, stage_axis, axes)
  elif schedule == "1f1b":
    backward = _one_f_one_b(stage_fn, k, stages, stage_axis, axes, streamed)
  elif meshes.kept_axes(mesh, set(manual)):
    # JAX 0.10.2 cannot differentiate through such a region (its scalar residuals are
    # "closed over" Explicit-typed values): the vjp runs inside a region of its own,
    # recomputing the forward scan (docs/notes/jax_workarounds.md).
    backward = _vjp_of(body)
  else:
    backward = None
  if backward is not None:
    forward = _differentiated_by(forward, region(
        backward, in_specs=(param_specs, kept_specs, x_specs),
        out_specs=(param_specs, x_specs)), keeping)
  # Typed like x as given (Explicit meshes): x sharded over the stages too gets its output
  # back sharded so, without a collective; x replicated over them, by one all-gather.
  return jax.tree.map(_typed_like, forward(stage_params, x), given)


def _over_stages(x: Any, stage_axis: str) -> bool:
  """Whether every leaf of ``x`` is known (typed, or concrete) to have its batch sharded
  over ``stage_axis``."""
  return all(stage_axis in meshes.spec_axes(meshes.known_spec(leaf)[0])
             for leaf in jax.tree.leaves(x))


def _typed_like(a: jax.Array, like: jax.Array) -> jax.Array:
  """``a`` resharded to ``like``'s sharding where they differ on an Explicit mesh."""
  want = jax.typeof(like).sharding
  if jax.typeof(a).sharding == want or not any(
      t == AxisType.Explicit for t in want.mesh.axis_types):
    return a
  return jax.sharding.reshard(a, want.spec)


def _differentiated_by(forward: Callable, backward: Callable,
                       keeping: Callable | None = None) -> Callable:
  """``forward(params, x)`` whose vjp is ``backward(params, kept, dy)``: ``keeping(params,
  x)`` returns the output and what the backward needs (``kept``); without it the forward
  pass keeps ``x`` alone and the backward recomputes what it needs."""
  run = jax.custom_vjp(forward)

  def forward_keeping(params, x):
    y, kept = keeping(params, x) if keeping is not None else (forward(params, x), x)
    return y, (params, kept)

  def rule(saved, dy):
    _check_float_leaves(saved[0], dy)
    return backward(*saved, dy)

  run.defvjp(forward_keeping, rule)
  return run


def _check_float_leaves(params: Any, dy: Any) -> None:
  """The schedules with a backward pass of their own (1F1B, streamed GPipe, tensor-parallel
  stages) carry cotangents for floating-point leaves only; JAX gives an integer leaf of
  ``x`` (so of the output) a ``float0`` cotangent and an integer param none."""
  found = [f"stage_params{jax.tree_util.keystr(path)} ({jnp.result_type(leaf)})"
           for path, leaf in jax.tree_util.tree_leaves_with_path(params)
           if not jnp.issubdtype(jnp.result_type(leaf), jnp.inexact)]
  found += [f"x{jax.tree_util.keystr(path)} (an integer activation)"
            for path, leaf in jax.tree_util.tree_leaves_with_path(dy)
            if jnp.result_type(leaf) == jax.dtypes.float0]
  if found:
    raise ValueError(
        "fxaccum.pipeline differentiates this schedule by a backward pass of its own, "
        f"which takes floating-point leaves only; found {', '.join(found[:3])}. Keep "
        "integer values (masks, ids, indices) out of stage_params and x: close over "
        "them in stage_fn, or pass them as floats; or use schedule='gpipe' with "
        "remat=False, which JAX differentiates itself.")


def _vjp_of(body: Callable) -> Callable:
  """``body``'s vjp as a function of ``(params, x, dy)``, the forward recomputed."""
  def backward(params, x, dy):
    return jax.vjp(body, params, x)[1](dy)
  return backward


def bubble_fraction(stages: int, micro_batches: int, *, schedule: Schedule = "gpipe",
                    repeats: int = 1) -> float:
  """The idle fraction of a pipeline schedule: ``(S - 1) / (k * R + S - 1)``.

  Each of the ``S`` devices is busy in ``k * R`` of the ``k * R + S - 1`` iterations
  (``R = repeats`` stages per device with ``schedule="circular"``, 1 with GPipe).

  Example:
    >>> import fxaccum
    >>> fxaccum.diagnostics.bubble_fraction(4, 8)
    0.2727272727272727
    >>> round(fxaccum.diagnostics.bubble_fraction(4, 8, schedule="circular", repeats=2), 3)
    0.158
  """
  stages = split.check_micro_batches(stages, "stages")
  k = split.check_micro_batches(micro_batches)
  repeats = _check_schedule(schedule, repeats, k)
  return (stages - 1) / (k * repeats + stages - 1)


def _check_schedule(schedule: Any, repeats: Any, k: int) -> int:
  if schedule not in SCHEDULES:
    raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}.")
  if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
    raise ValueError(f"repeats must be a positive int (stages per device), got {repeats!r}.")
  if schedule != "circular" and repeats != 1:
    raise ValueError(
        f"repeats={repeats} needs schedule='circular' ({schedule!r} runs one stage per "
        "device).")
  return repeats


def _scheduled(stage_fn: Callable, remat: bool, k: int, stages: int, repeats: int,
               nested: bool, stage_axis: str, axes: tuple[str, ...]) -> Callable:
  """The per-device body: one scan of ``k * R + S - 1`` iterations.

  In iteration ``t`` device ``s`` works on item ``j = t - s`` (idle unless
  ``0 <= j < k * R``): micro-batch ``j % k`` in round ``r = j // k``, with the params of
  virtual stage ``r * S + s``. Each iteration hands every output to the next device (one
  collective-permute). GPipe (``R = 1``) sends ``s -> s + 1`` only. The circular schedule
  also sends the last device's output back to device 0, which keeps it in a buffer of one
  slot per micro-batch until its next round (``k >= S`` iterations later). ``nested``:
  the params have the circular schedule's leading ``(R, S)`` dimensions.
  """
  last = stages - 1
  circular = repeats > 1
  ring = [(s, (s + 1) % stages) for s in range(stages if circular else last)]

  def apply(params, r, h):
    # The round's params are picked inside the checkpoint: the backward pass then keeps
    # r per iteration, not a copy of the stage's params.
    return stage_fn(jax.tree.map(lambda leaf: _index(leaf, r), params), h)

  run = jax.checkpoint(apply) if remat else apply

  def body(params, x):
    # Both casts sit before the loop, so their transposes (the data-axis sum of the param
    # gradients, the stage-axis sum of x's gradient) run once, after it.
    # This device's stages, (R, ...) per leaf: leaf[r] is virtual stage r * S + s.
    params = meshes.vary(jax.tree.map(lambda leaf: leaf[:, 0] if nested else leaf[None, 0],
                                    params), axes)
    x = meshes.vary(x, (stage_axis,))
    stage = lax.axis_index(stage_axis)
    inputs = jax.tree.map(lambda leaf: split.stacked(leaf, k), x)
    outputs = jax.tree.map(jnp.zeros_like, inputs)
    # Idle iterations run the stages on real activations (micro-batch 0 and what the
    # stages make of it), never zeros: their results are dropped, but a stage whose
    # derivative is not finite at 0 (sqrt, log) would put 0 * inf = NaN into the gradient.
    first = jax.tree.map(lambda leaf: leaf[0], inputs)

    def iteration(carry, t):
      received, waiting, outputs = carry
      item = t - stage
      m = jnp.clip(item, 0, k * repeats - 1) % k
      fresh = jax.tree.map(lambda a: _index(a, m), inputs)
      if circular:
        # Device 0 keeps what the last device finished in iteration t - 1 (item
        # t - S) for its next round, then starts item t: micro-batch t % k, fresh in
        # round 0, else the one kept k - S + 1 or more iterations ago.
        back = t - stages
        slot = jnp.clip(back, 0, k * repeats - 1) % k
        keep = (stage == 0) & (back >= 0) & (back < k * (repeats - 1))
        waiting = jax.tree.map(lambda w, v: _put(w, slot, v, keep), waiting, received)
        again = jax.tree.map(lambda w: _index(w, m), waiting)
        fresh = jax.tree.map(lambda a, b: jnp.where(item >= k, b, a), fresh, again)
      r = jnp.clip(item // k, 0, repeats - 1)
      h = jax.tree.map(lambda a, b: jnp.where(stage == 0, a, b), fresh, received)
      y = _like(run(params, r, h), h)
      # The last device finishes micro-batch j % k of the last round in iteration t.
      done = item - k * (repeats - 1)
      slot = jnp.clip(done, 0, k - 1)
      keep = (stage == last) & (done >= 0) & (done < k)
      outputs = jax.tree.map(lambda o, v: _put(o, slot, v, keep), outputs, y)
      return (lax.ppermute(y, stage_axis, ring), waiting, outputs), None

    waiting = inputs if circular else ()  # real activations in the slots, as `first`
    (_, _, outputs), _ = lax.scan(iteration, (first, waiting, outputs),
                                  jnp.arange(k * repeats + last))
    # Only the last stage holds the outputs: the sum over stages hands them to every stage.
    outputs = lax.psum(outputs, stage_axis)
    return jax.tree.map(split.unstacked, outputs)

  return body


def _streamed(stage_fn: Callable, remat: bool, k: int, stages: int, stage_axis: str,
              axes: tuple[str, ...], keep_inputs: bool = False) -> Callable:
  """GPipe's per-device body with ``x`` and the outputs sharded over the stages.

  Stage ``s`` holds micro-batches ``m = i * S + s`` of its data device's rows (its own
  rows ``i::k/S``). Inputs travel left one stage per iteration (micro-batch ``m`` is at
  stage ``m - t`` in iteration ``t``, and stage 0 starts it in iteration ``m``);
  activations travel right; outputs travel left from the last stage to the stage holding
  their rows. One scan of ``k + S - 1`` iterations, then ``S - 1`` that only move the
  last outputs home. Nothing activation-sized is summed over the stages, forward or
  backward, and no stage holds more than its share of ``x`` and of the outputs.

  ``keep_inputs``: the body returns ``(outputs, stash)``, the stash each iteration's stage
  input (``k + S - 1`` of them) for :func:`_gpipe_backward`.
  """
  last = stages - 1
  shares = _Shares(k, stages)
  right = [(s, s + 1) for s in range(last)]
  left = [(s + 1, s) for s in range(last)]
  run = jax.checkpoint(stage_fn) if remat else stage_fn

  def body(params, x):
    params = meshes.vary(jax.tree.map(lambda leaf: leaf[0], params), axes)
    stage = lax.axis_index(stage_axis)
    # Real activations in every slot, never zeros (see _scheduled).
    first = shares.first(x)

    def iteration(carry, t, compute=True):
      received, arriving, leaving, outputs = carry
      if compute:
        # The input this stage holds in transit in iteration t is micro-batch t + s. (The
        # last stage receives nothing from its right: it keeps real activations.)
        arriving = shares.take(x, arriving, t + stage, stage, edge=stage == last)
        h = jax.tree.map(lambda a, r: jnp.where(stage == 0, a, r), arriving, received)
        y = _like(run(params, h), h)
        leaving = jax.tree.map(lambda new, r: jnp.where(stage == last, new, r), y, leaving)
        received = lax.ppermute(y, stage_axis, right)
        arriving = lax.ppermute(arriving, stage_axis, left)
      # The output this stage holds in transit in iteration t: micro-batch t - 2(S-1) + s.
      outputs = shares.home(outputs, leaving, t - 2 * last + stage, stage)
      carry = (received, arriving, lax.ppermute(leaving, stage_axis, left), outputs)
      return carry, (h if compute and keep_inputs else None)

    carry = (first, first, first, jax.tree.map(jnp.zeros_like, x))
    carry, stash = lax.scan(iteration, carry, jnp.arange(k + last))
    drain = functools.partial(iteration, compute=False)
    (_, _, _, outputs), _ = lax.scan(drain, carry, jnp.arange(k + last, k + 2 * last))
    return (outputs, stash) if keep_inputs else outputs

  return body


def _gpipe_backward(stage_fn: Callable, k: int, stages: int, stage_axis: str,
                    axes: tuple[str, ...]) -> Callable:
  """Streamed GPipe's backward pass from the forward's stash: one reverse scan over its
  ``k + S - 1`` iterations.

  Step ``u`` undoes forward iteration ``t = k + S - 2 - u``: device ``s`` runs the vjp of
  the stage on its input then (micro-batch ``t - s``, recomputed from the stash) with the
  cotangent its right neighbour returned in step ``u - 1`` (the last device: the output
  cotangent's share of that micro-batch). As in 1F1B's streamed backward, output
  cotangents travel right to the last stage and ``x``'s gradients right from stage 0 to
  the stage holding their rows; both are read and written in place, so the backward keeps
  no copy of them (JAX's transpose of the forward scan kept two).
  """
  last = stages - 1
  steps = k + last
  shares = _Shares(k, stages)
  right = [(s, s + 1) for s in range(last)]
  left = [(s + 1, s) for s in range(last)]

  def body(params, stash, dy):
    params = meshes.vary(jax.tree.map(lambda leaf: leaf[0], params), axes)
    stage = lax.axis_index(stage_axis)

    def iteration(carry, u):
      returned, owed, leaving, grads, dx = carry
      t = steps - 1 - u
      done = (t - stage >= 0) & (t - stage < k)
      owed = shares.take(dy, owed, k - stages - u + stage, stage, edge=stage == 0)
      cotangent = jax.tree.map(lambda g, r: jnp.where(stage == last, g, r), owed, returned)
      saved = jax.tree.map(lambda w: _index(w, t), stash)
      _, vjp = jax.vjp(stage_fn, params, saved)
      d_params, d_h = vjp(_like(cotangent, saved))
      grads = jax.tree.map(lambda g, d: g + jnp.where(done, d, jnp.zeros_like(d)), grads,
                           d_params)
      leaving = jax.tree.map(lambda d, r: jnp.where(stage == 0, d, r), d_h, leaving)
      dx = shares.home(dx, leaving, t + stage, stage)  # x's gradient of t + s, going home
      return (lax.ppermute(d_h, stage_axis, left), lax.ppermute(owed, stage_axis, right),
              lax.ppermute(leaving, stage_axis, right), grads, dx), None

    first = shares.first(dy)
    carry = (first, first, first, jax.tree.map(jnp.zeros_like, params),
             jax.tree.map(jnp.zeros_like, dy))
    (_, _, _, grads, dx), _ = lax.scan(iteration, carry, jnp.arange(steps))
    return _reduced_over(grads, axes), dx

  return body


def _reduced_over(grads: Any, axes: tuple[str, ...]) -> Any:
  """Local stage gradients reduced over the data axes, as in-step mode's per-device view
  reduces (one collective per bucket), with the stage dimension back."""
  leaves, tree = jax.tree.flatten(grads)
  leaves = reductions.reduce_leaves(leaves, [((), axes)] * len(leaves), reductions.BUCKET_BYTES)
  return jax.tree.unflatten(tree, [leaf[None] for leaf in leaves])


def _one_f_one_b(stage_fn: Callable, k: int, stages: int, stage_axis: str,
                 axes: tuple[str, ...], streamed: bool) -> Callable:
  """The per-device backward pass of the 1F1B schedule: one wavefront scan of
  ``k + 2S - 2`` iterations.

  In iteration ``t`` device ``s`` runs the forward of micro-batch ``t - s`` (its input
  kept in a ring of ``2S - 1`` slots) and the backward (``jax.vjp``, recomputed from that
  slot) of micro-batch ``t - (2S - 2 - s)``, ``2S - 2 - 2s`` iterations later; the last
  device runs both on the same micro-batch, with its output cotangent. Activations go right
  and cotangents left, one permute each per iteration. Returns the stage gradients, summed
  over the data axes once, after the scan, and ``x``'s gradient.

  ``streamed``: ``x``, the output cotangent and ``x``'s gradient are sharded over the
  stages as in :func:`_streamed` (stage ``s`` holds micro-batches ``i * S + s``): inputs
  travel left to stage 0, cotangents right to the last stage, ``x``'s gradients right from
  stage 0 to the stage holding their rows (``S - 1`` more iterations for the last ones).
  """
  return _OneFOneB(stage_fn, k, stages, stage_axis, axes, streamed)


@dataclasses.dataclass(frozen=True)
class _OneFOneB:
  """The 1F1B backward pass (see :func:`_one_f_one_b`), called as the per-device body."""

  stage_fn: Callable
  k: int
  stages: int
  stage_axis: str
  axes: tuple[str, ...]
  streamed: bool

  @property
  def slots(self) -> int:  # the ring of stage inputs
    return 2 * self.stages - 1

  @property
  def shares(self) -> _Shares:  # streamed: each stage's share of x, dy and dx
    return _Shares(self.k, self.stages)

  def __call__(self, params: Any, x: Any, dy: Any) -> tuple[Any, Any]:
    k, stages = self.k, self.stages
    # Varying over the data axes: each vjp returns this device's partial gradient.
    params = meshes.vary(jax.tree.map(lambda leaf: leaf[0], params), self.axes)
    x, dy = meshes.vary((x, dy), (self.stage_axis,))
    stage = lax.axis_index(self.stage_axis)
    first = (self.shares.first(x) if self.streamed
             else jax.tree.map(lambda a: split.take(a, 0, k), x))
    stash = jax.tree.map(lambda a: jnp.broadcast_to(a, (self.slots, *a.shape)), first)
    grads = jax.tree.map(jnp.zeros_like, params)
    dx = jax.tree.map(jnp.zeros_like, x)
    iteration = functools.partial(self._iteration, params, x, dy, stage)
    transit = (first, self.shares.first(dy), first) if self.streamed else ((), (), ())
    carry = (first, first, *transit, stash, grads, dx)
    carry, _ = lax.scan(iteration, carry, jnp.arange(k + 2 * stages - 2))
    if self.streamed:
      drain = functools.partial(iteration, compute=False)
      carry, _ = lax.scan(drain, carry, jnp.arange(k + 2 * stages - 2, k + 3 * stages - 3))
    grads, dx = carry[-2:]
    grads = _reduced_over(grads, self.axes)
    # Streamed, each stage holds its share of x's gradient; else only stage 0 holds it.
    return grads, dx if self.streamed else lax.psum(dx, self.stage_axis)

  def _iteration(self, params, x, dy, stage, carry, t, compute=True):
    received, returned, arriving, owed, leaving, stash, grads, dx = carry
    last, axis = self.stages - 1, self.stage_axis
    if compute:
      y, arriving, stash = self._forward(params, x, stage, t, received, arriving, stash)
      d_h, done, mb, owed, grads = self._backward(params, dy, stage, t, returned, owed,
                                                  stash, grads)
      received = lax.ppermute(y, axis, [(s, s + 1) for s in range(last)])
      returned = lax.ppermute(d_h, axis, [(s + 1, s) for s in range(last)])
      if self.streamed:
        arriving = lax.ppermute(arriving, axis, [(s + 1, s) for s in range(last)])
        owed = lax.ppermute(owed, axis, [(s, s + 1) for s in range(last)])
        leaving = jax.tree.map(lambda d, r: jnp.where(stage == 0, d, r), d_h, leaving)
      else:
        dx = jax.tree.map(lambda o, d: split.put(o, mb, self.k, d, done & (stage == 0)), dx,
                          d_h)
    if self.streamed:  # x's gradient of micro-batch t - 2(S-1) - s, on its way home
      dx = self.shares.home(dx, leaving, t - (2 * self.stages - 2) - stage, stage)
      leaving = lax.ppermute(leaving, axis, [(s, s + 1) for s in range(last)])
    return (received, returned, arriving, owed, leaving, stash, grads, dx), None

  def _forward(self, params, x, stage, t, received, arriving, stash):
    """Iteration ``t``'s forward: micro-batch ``t - s``, its input kept in the ring."""
    k = self.k
    f = t - stage
    mf = jnp.clip(f, 0, k - 1)
    if self.streamed:
      arriving = self.shares.take(x, arriving, t + stage, stage, edge=stage == self.stages - 1)
      fresh = arriving
    else:
      fresh = jax.tree.map(lambda a: split.take(a, mf, k), x)
    h = jax.tree.map(lambda a, r: jnp.where(stage == 0, a, r), fresh, received)
    stash = jax.tree.map(lambda w, v: _put(w, mf % self.slots, v, (f >= 0) & (f < k)),
                         stash, h)
    return _like(self.stage_fn(params, h), h), arriving, stash

  def _backward(self, params, dy, stage, t, returned, owed, stash, grads):
    """Iteration ``t``'s backward: micro-batch ``t - (2S - 2 - s)``, recomputed from its
    slot of the ring; its param gradient added where it is a real micro-batch."""
    k, last = self.k, self.stages - 1
    b = t - (2 * self.stages - 2 - stage)
    mb = jnp.clip(b, 0, k - 1)
    done = (b >= 0) & (b < k)
    saved = jax.tree.map(lambda w: _index(w, mb % self.slots), stash)
    if self.streamed:
      owed = self.shares.take(dy, owed, t - stage, stage, edge=stage == 0)
      given = owed
    else:
      given = jax.tree.map(lambda g: split.take(g, mb, k), dy)
    cotangent = jax.tree.map(lambda g, r: jnp.where(stage == last, g, r), given, returned)
    _, vjp = jax.vjp(self.stage_fn, params, saved)
    d_params, d_h = vjp(_like(cotangent, saved))
    grads = jax.tree.map(lambda g, d: g + jnp.where(done, d, jnp.zeros_like(d)), grads,
                         d_params)
    return d_h, done, mb, owed, grads


class _Shares:
  """A batch streamed over the stages: stage ``s`` holds micro-batches ``m = i * S + s``,
  rows ``i::k/S`` of its own rows."""

  def __init__(self, k: int, stages: int):
    self.k, self.stages = k, stages
    self.per_stage = max(k // stages, 1)  # rows i::k/S of a stage's own rows

  def first(self, tree: Any) -> Any:
    """This stage's first micro-batch (real values for idle iterations)."""
    return jax.tree.map(lambda a: split.take(a, 0, self.per_stage), tree)

  def take(self, tree: Any, transit: Any, m: Any, stage: Any, edge: Any = False) -> Any:
    """Micro-batch ``m`` of ``tree`` where this stage holds it (or at ``edge``, a stage
    that receives nothing), else ``transit``."""
    mine, slot = self._held(m, stage)
    held = functools.partial(split.take, m=slot, k=self.per_stage)
    return jax.tree.map(lambda a, r: jnp.where(mine | edge, held(a), r), tree, transit)

  def home(self, tree: Any, value: Any, m: Any, stage: Any) -> Any:
    """``tree`` with micro-batch ``m`` set to ``value`` where this stage holds it."""
    mine, slot = self._held(m, stage)
    return jax.tree.map(lambda o, v: split.put(o, slot, self.per_stage, v, mine), tree, value)

  def _held(self, m: Any, stage: Any) -> tuple[Any, Any]:
    mine = (m % self.stages == stage) & (m >= 0) & (m < self.k)
    return mine, jnp.clip(m // self.stages, 0, self.per_stage - 1)


def _put(buffer: jax.Array, slot: Any, value: jax.Array, keep: Any) -> jax.Array:
  """``buffer`` with ``buffer[slot]`` replaced by ``value`` where ``keep``."""
  return lax.dynamic_update_index_in_dim(buffer, jnp.where(keep, value, _index(buffer, slot)),
                                         slot, 0)


def _index(leaf: jax.Array, i: jax.Array) -> jax.Array:
  return lax.dynamic_index_in_dim(leaf, i, keepdims=False)


def _checked_inputs(stage_fn: Callable, stage_params: Any, x: Any, k: int, schedule: str,
                    repeats: int, stages: int, stage_axis: str, devices: int
                    ) -> tuple[int, ...]:
  """The stage params' leading dimensions, ``(R, S)`` or ``(S,)``, once the params, the
  batch and ``stage_fn`` are found usable; errors name the fix."""
  if schedule == "circular" and repeats > 1 and k < stages:
    raise ValueError(
        f"schedule='circular' needs micro_batches >= the {stages} stages (got "
        f"{k}): a micro-batch leaving the last stage waits at stage 0 until its next round; "
        f"use micro_batches={stages} or more, or repeats=1.")
  leading = (repeats, stages) if schedule == "circular" else (stages,)
  _check_params(stage_params, leading, stage_axis)
  _check_closure(stage_fn, stage_params, x, len(leading), k)
  split.leading_size(x, k, devices)
  return leading


def _layout(stage_params: Any, x: Any, stage_axis: str,
            data_axes: str | tuple[str, ...] | None) -> tuple[Any, int, tuple[str, ...]]:
  """The mesh, the number of stages and the data axes; errors name the fix."""
  leaves = jax.tree.leaves(x)
  if not leaves:
    raise ValueError("fxaccum.pipeline got no activations: x holds no arrays.")
  mesh = meshes.find_mesh([*leaves, *jax.tree.leaves(stage_params)])
  if mesh is None or stage_axis not in mesh.axis_names:
    found = "no mesh" if mesh is None else f"a mesh with axes {tuple(mesh.axis_names)}"
    raise ValueError(
        f"fxaccum.pipeline found {found}; it needs one with the stage axis "
        f"{stage_axis!r}: call it under `with jax.set_mesh(mesh):` for a mesh such as "
        f"jax.make_mesh((2, 4), ('data', {stage_axis!r})), or pass stage_axis=.")
  manual = meshes.manual_axes()
  if stage_axis in manual:
    raise ValueError(
        f"fxaccum.pipeline is called inside a shard_map that is already manual over "
        f"{stage_axis!r}; call it outside, where the stage axis is not manual.")
  axes = meshes.as_data_axes(data_axes, "pipeline's data_axes")
  if axes is None:
    axes = tuple(a for a in meshes.infer_data_axes(mesh, leaves, manual) if a != stage_axis)
  else:
    bad = meshes.missing_axes(mesh, axes) + [a for a in axes if a == stage_axis or a in manual]
    if bad:
      raise ValueError(
          f"data_axes={data_axes!r} names {bad}: data axes must be mesh axes "
          f"{tuple(mesh.axis_names)} other than the stage axis {stage_axis!r} that are not "
          "already manual here.")
  return mesh, mesh.shape[stage_axis], axes


# The tracers of JAX's differentiation (jax.grad / jax.vjp / jax.jvp), by name: a stage_fn
# closing over one is differentiated with respect to it.
_DIFFERENTIATED = frozenset({"JVPTracer", "LinearizeTracer"})


def _check_closure(stage_fn: Callable, stage_params: Any, x: Any, leading: int, k: int) -> None:
  """A ``stage_fn`` that closes over a value being differentiated fails deep inside JAX
  (a leaked tracer, or a mesh mismatch) in every schedule: say so, and what to do."""
  def sliced(leaf, shape):
    return jax.ShapeDtypeStruct(shape, leaf.dtype)

  try:
    closed = jax.make_jaxpr(stage_fn)(
        jax.tree.map(lambda a: sliced(a, a.shape[leading:]), stage_params),
        jax.tree.map(lambda a: sliced(a, (max(a.shape[0] // k, 1), *a.shape[1:])), x))
  except Exception:  # noqa: BLE001 - code that runs only inside the region: no check
    return
  if any(type(c).__name__ in _DIFFERENTIATED for c in closed.consts):
    raise ValueError(
        "stage_fn closes over a value that is being differentiated (e.g. a scale or a "
        "param outside stage_params, with jax.grad taken with respect to it). The pipeline "
        "differentiates only what it is given: pass that value in stage_params, with the "
        "leading stage dimension(s) (e.g. jnp.broadcast_to(scale, (S,))), or in x. "
        "Closing over values that are not differentiated is fine.")


def _check_params(stage_params: Any, leading: tuple[int, ...], stage_axis: str) -> None:
  flat = jax.tree_util.tree_flatten_with_path(stage_params)[0]
  if not flat:
    raise ValueError("fxaccum.pipeline got no stage params: stage_params holds no arrays.")
  stages = leading[-1]
  for path, leaf in flat:
    shape = jnp.shape(leaf)
    if len(leading) == 2 and tuple(shape[:2]) != leading:
      raise ValueError(
          f"stage_params leaf {jax.tree_util.keystr(path) or '<root>'} has shape {shape}; "
          f"schedule='circular' with repeats={leading[0]} needs leading dimensions "
          f"(repeats, stages) = {leading}, found {tuple(shape[:2])}: leaf[r, s] is virtual "
          f"stage r * {stages} + s, held by device s of {stage_axis!r}.")
    if len(leading) == 1 and (not shape or shape[0] != stages):
      raise ValueError(
          f"stage_params leaf {jax.tree_util.keystr(path) or '<root>'} has shape {shape}; "
          f"every leaf needs a leading dimension of {stages}, the size of the mesh axis "
          f"{stage_axis!r} (leaf [s] belongs to stage s). Stack the stages' params, e.g. "
          "jax.tree.map(lambda *p: jnp.stack(p), *per_stage), or use a mesh whose stage "
          "axis has as many devices as there are stages.")


def _like(y: Any, h: Any) -> Any:
  """stage_fn's output, checked to be shaped like its input (they flow in a ring); on an
  Explicit mesh resharded like it where the types differ only in sharding."""
  def describe(tree):
    return jax.tree.map(lambda a: f"{jnp.dtype(a.dtype).name}{list(a.shape)}", tree)
  if jax.tree.structure(y) != jax.tree.structure(h) or any(  # type: ignore[operator]
      (jnp.shape(a), jnp.result_type(a)) != (jnp.shape(b), jnp.result_type(b))
      for a, b in zip(jax.tree.leaves(y), jax.tree.leaves(h), strict=True)):
    raise ValueError(
        f"stage_fn must return activations like its input: it maps {describe(h)} to "
        f"{describe(y)} (one micro-batch on one device). Every stage's output is the next "
        "stage's input; keep the shapes and dtypes fixed inside the pipeline and change "
        "them outside (embedding, head).")
  return jax.tree.map(_typed_like, y, h)
