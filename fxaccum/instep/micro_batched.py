"""``micro_batched``: a function run over micro-batches, at micro-batch activation memory.

The forward runs ``fun`` on one micro-batch at a time in a ``lax.scan`` and keeps only its
outputs. The backward, given the cotangent ``ct`` of the outputs, is the in-step
``value_and_grad`` of ``Sum(sum(fun(micro-batch) * ct[micro-batch]))`` over the same
micro-batches with the same keys: each micro-batch's forward is recomputed and
differentiated in turn, its gradients accumulated (per device, and reduced once after the
loop, where the view analysis proves ``fun`` per-example). A large-batch loss on the
outputs (a contrastive loss with in-batch negatives) is then the large batch's, exactly
(GradCache).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any, ParamSpec, TypeVar

import jax
import jax.numpy as jnp
from jax import lax

from fxaccum import markers, meshes, split
from fxaccum.instep import api, paths
from fxaccum.instep.call import is_array
from fxaccum.instep.invoke import nnx_loaded
from fxaccum.instep.keys import looked_at, warn_shared_keys

__all__ = ["micro_batched"]

_P = ParamSpec("_P")
_R = TypeVar("_R")


def micro_batched(fun: Callable[_P, _R], *, micro_batches: int,
                  batch_argnums: int | Sequence[int] = 1,
                  rng_argnums: int | Sequence[int] = (),
                  param_shardings: Sequence[Any] | None = None) -> Callable[_P, _R]:
  """``fun`` run on ``micro_batches`` micro-batches of its batch, one at a time.

  The result is ``fun`` applied to each global micro-batch, put back in the batch's row
  order: micro-batch ``i`` holds rows ``i::micro_batches`` of the leaves at
  ``batch_argnums`` (the split of :func:`fxaccum.value_and_grad`, which never moves rows
  between devices) and receives ``jax.random.fold_in(key, i)`` for each key at
  ``rng_argnums``. For a per-example ``fun`` (a tower: an image or text encoder) that is
  ``fun(*args)`` itself, to float rounding; a ``fun`` that mixes the rows of its batch
  (batch normalization in train mode) gets statistics per micro-batch (ghost batch
  statistics).

  Forward and backward hold the activations of one micro-batch; only ``fun``'s outputs
  are kept for the whole batch. Gradients (under ``jax.grad``, ``jax.vjp``... of any loss
  of the outputs) are exactly those of the function above, for every float argument
  (params, and the batch too): the backward recomputes each micro-batch's forward with
  the same keys and differentiates it, through :func:`fxaccum.value_and_grad`'s loop. So a
  contrastive loss (CLIP, SigLIP, NT-Xent) on micro-batched towers is the large batch's
  loss, with its gradients, at micro-batch memory. On a data mesh a per-example ``fun``'s
  gradients are summed per device and reduced once; ``fxaccum.diagnostics.report(...)
  .paths`` says which view the backward took and why.

  ``fun`` returns a pytree of per-example leaves (axis 0 the micro-batch's rows), e.g.
  embeddings and any extra outputs. It is a ``jax.custom_vjp``: reverse mode only
  (``jax.jvp`` raises, as JAX's error says). Keyword arguments are passed to every
  micro-batch whole; flax NNX modules are taken with their ``nnx.Param`` state only (module state
  that changes, such as BatchNorm statistics or RNG counts, is refused, as is linen's
  ``mutable=``).

  Args:
    fun: the function, e.g. ``lambda params, images: model.apply(params, images)``.
    micro_batches: the number ``k`` of micro-batches, a positive int dividing the rows of
      each device.
    batch_argnums: positional argument(s) holding the batch, split along axis 0.
    rng_argnums: positional argument(s) holding PRNG keys, folded per micro-batch.
    param_shardings: the shardings of ``fun``'s arguments where JAX does not show them
      (params sharded over the data axes, FSDP, inside ``jax.jit`` on an ``Auto`` mesh),
      as :func:`fxaccum.value_and_grad` takes them: one tree prefix of ``PartitionSpec``
      / ``NamedSharding`` / None per positional argument (a shorter tuple ends in None;
      the batch's and the keys' entries are None). With them the backward keeps those
      params sharded and their gradients come back sharded like them. Not needed on an
      ``Explicit`` mesh, nor for NNX modules that carry sharding metadata.

  Returns:
    A function with the signature of ``fun``.

  Raises:
    ValueError / TypeError: for a bad ``micro_batches`` or argnums, a batch whose rows
      (per device) ``micro_batches`` does not divide, outputs without the micro-batch's
      rows on axis 0, or module state that changes; at trace time.

  Example:
    >>> import jax, jax.numpy as jnp, fxaccum
    >>> tower = lambda w, x: jnp.tanh(x @ w)
    >>> w, x = jnp.ones((3, 2)) / 3, jnp.arange(24.0).reshape(8, 3) / 24
    >>> def loss(tower, w):   # in-batch negatives: mixes all 8 rows
    ...   e = tower(w, x)
    ...   return jax.nn.logsumexp(e @ e.T, axis=1).mean()
    >>> g = jax.grad(loss, argnums=1)(fxaccum.micro_batched(tower, micro_batches=4), w)
    >>> bool(jnp.allclose(g, jax.grad(loss, argnums=1)(tower, w), atol=1e-6))
    True
  """
  k = split.check_micro_batches(micro_batches)
  batch_t = split.as_argnums(batch_argnums, "batch_argnums")
  rng_t = split.as_argnums(rng_argnums, "rng_argnums")
  if set(batch_t) & set(rng_t):
    raise ValueError(
        f"batch_argnums and rng_argnums overlap at {sorted(set(batch_t) & set(rng_t))}: "
        "keys in the batch are already split per micro-batch, so leave them out of "
        "rng_argnums.")
  if param_shardings is not None and not isinstance(param_shardings, (tuple, list)):
    raise TypeError(
        "micro_batched's param_shardings is a tuple with one tree prefix per positional "
        f"argument of fun (None for the batch and the keys), got {type(param_shardings)}: "
        "e.g. param_shardings=(params_specs, None) for fun(params, batch).")
  spec = _Spec(fun, k, batch_t, rng_t,
               None if param_shardings is None else tuple(param_shardings))

  @functools.wraps(fun)
  def wrapped(*args: Any, **kwargs: Any) -> Any:
    return _call(spec, args, kwargs)

  return wrapped


@dataclasses.dataclass(frozen=True)
class _Spec:
  fun: Callable[..., Any]
  k: int
  batch_argnums: tuple[int, ...]
  rng_argnums: tuple[int, ...]
  param_shardings: tuple[Any, ...] | None

  @property
  def name(self) -> str:
    return f"fxaccum.micro_batched({getattr(self.fun, '__name__', 'fun')})"


@dataclasses.dataclass(frozen=True)
class _Parts:
  """One call's arguments, as leaves: ``diff`` (float leaves of the shared arguments),
  ``batch``, ``keys`` and ``fixed`` (the shared arguments' other array leaves), and how
  to rebuild ``fun``'s arguments from them (``build``); ``hints``: per ``diff`` leaf, the
  PartitionSpec ``param_shardings`` or NNX metadata gives it, or None."""

  diff: list[Any]
  hints: tuple[Any, ...]
  batch: list[Any]
  keys: list[Any]
  fixed: list[Any]
  build: Callable[[list[Any], list[Any], list[Any], list[Any]], tuple[tuple, dict]]


def _call(spec: _Spec, args: tuple, kwargs: dict) -> Any:
  """One call of the function :func:`micro_batched` returned."""
  highest = max((*spec.batch_argnums, *spec.rng_argnums))
  if highest >= len(args):
    raise TypeError(
        f"{spec.name} was called with {len(args)} positional arguments, but batch_argnums/"
        f"rng_argnums refer to argument {highest}. Pass the batch and keys positionally.")
  if kwargs.get("mutable", False) is not False:
    raise TypeError(
        f"{spec.name}: mutable={kwargs['mutable']!r} asks for module state that changes "
        "(e.g. linen BatchNorm statistics), which micro_batched does not thread through "
        "the micro-batches. Use the module without mutable state (e.g. "
        "use_running_average=True, or LayerNorm), or fxaccum.value_and_grad with "
        "state_argnums.")
  parts = _parts(spec, args, kwargs)
  layout = meshes.layout_of(parts.diff, parts.batch, [*parts.keys, *parts.fixed], None,
                            parts.hints)
  rows = split.leading_size(parts.batch, spec.k, layout.data_devices)
  for path, leaf in jax.tree_util.tree_flatten_with_path(kwargs)[0]:
    if rows > 1 and is_array(leaf) and jnp.shape(leaf)[:1] == (rows,):
      raise ValueError(
          f"{spec.name}: keyword argument {jax.tree_util.keystr(path)} has the batch's "
          f"{rows} rows on axis 0, but keyword arguments reach every micro-batch whole, not "
          f"split. Pass batch data positionally and name it in batch_argnums (now "
          f"{spec.batch_argnums}).")
  warn_shared_keys(spec.fun, args, kwargs, micro_batches=spec.k,
                   batch_argnums=spec.batch_argnums,
                   named={*spec.batch_argnums, *spec.rng_argnums}, name=spec.name)
  return _custom(spec, parts, layout.data_axes)(parts.diff, parts.batch, parts.keys, parts.fixed)


def _parts(spec: _Spec, given: tuple, kwargs: dict) -> _Parts:
  """Splits the arguments into leaves by role; NNX modules into their ``nnx.Param``s."""
  args = list(given)
  nnx_lib = nnx_loaded()
  graphdefs = {i: _nnx_params(spec, i, a) for i, a in enumerate(args)
               if nnx_lib and nnx_lib.is_graph_node(a)}
  for i, (_, params) in graphdefs.items():
    if i in spec.batch_argnums or i in spec.rng_argnums:
      raise TypeError(f"{spec.name}: argument {i} is an NNX module; it cannot be the batch "
                      "or a key. Pass the batch as an argument of its own.")
    args[i] = params
  roles = set(spec.batch_argnums) | set(spec.rng_argnums)
  shared = ([a if i not in roles else None for i, a in enumerate(args)], kwargs)
  leaves, shared_def = jax.tree.flatten(shared)
  is_diff = [is_array(x) and jnp.issubdtype(jnp.result_type(x), jnp.inexact) for x in leaves]
  specs = spec.param_shardings
  hints = meshes.param_hints([shared], None if specs is None else [(
      [specs[i] if i < len(specs) and i not in roles else None for i in range(len(args))],
      None)])
  is_fixed = [is_array(x) and not d for x, d in zip(leaves, is_diff, strict=True)]
  batch = [jax.tree.flatten(args[i]) for i in spec.batch_argnums]
  keys = [jax.tree.flatten(args[i]) for i in spec.rng_argnums]

  def build(diff, batch_leaves, key_leaves, fixed):
    diff_it, fixed_it = iter(diff), iter(fixed)
    new = [next(diff_it) if d else next(fixed_it) if f else x
           for x, d, f in zip(leaves, is_diff, is_fixed, strict=True)]
    call_args, call_kwargs = jax.tree.unflatten(shared_def, new)
    for argnums, trees, values in ((spec.batch_argnums, batch, batch_leaves),
                                   (spec.rng_argnums, keys, key_leaves)):
      at = 0
      for i, (tree_leaves, treedef) in zip(argnums, trees, strict=True):
        call_args[i] = jax.tree.unflatten(treedef, values[at:at + len(tree_leaves)])
        at += len(tree_leaves)
    for i, (graphdef, _) in graphdefs.items():
      call_args[i] = _nnx_merge(graphdef, call_args[i])
    return tuple(call_args), call_kwargs

  return _Parts(diff=[x for x, d in zip(leaves, is_diff, strict=True) if d],
                hints=tuple(h for h, d in zip(hints, is_diff, strict=True) if d),
                batch=[x for tree, _ in batch for x in tree],
                keys=[x for tree, _ in keys for x in tree],
                fixed=[x for x, f in zip(leaves, is_fixed, strict=True) if f], build=build)


def _custom(spec: _Spec, parts: _Parts, data_axes: tuple[str, ...]) -> Callable[..., Any]:
  """The ``jax.custom_vjp`` function of one call, over ``(diff, batch, keys, fixed)``."""
  perturbed: dict[str, list[bool]] = {}

  def run(diff, batch, keys, fixed):
    call_args, call_kwargs = parts.build(diff, batch, keys, fixed)
    return spec.fun(*call_args, **call_kwargs)

  @jax.custom_vjp
  def apply(diff, batch, keys, fixed):
    return _forward(spec, run, data_axes, diff, batch, keys, fixed)

  def fwd(diff, batch, keys, fixed):
    perturbed["batch"] = [b.perturbed for b in batch]
    values = [[x.value for x in group] for group in (diff, batch, keys, fixed)]
    return apply(*values), values

  def bwd(res, ct):
    return _backward(spec, run, res, ct, perturbed["batch"], parts.hints)

  apply.defvjp(fwd, bwd, symbolic_zeros=True)
  return apply


def _forward(spec: _Spec, run: Callable[..., Any], data_axes: tuple[str, ...],
             diff: list[Any], batch: list[Any], keys: list[Any], fixed: list[Any]) -> Any:
  """``fun`` on each micro-batch in a ``lax.scan``; its outputs back in the rows' order."""
  k = spec.k
  rows = jnp.shape(batch[0])[0] // k

  def body(carry, i):
    micro = [split.take(leaf, i, k) for leaf in batch]
    out = run(diff, micro, split.fold(keys, i), fixed)
    for path, leaf in jax.tree_util.tree_flatten_with_path(out)[0]:
      if jnp.shape(leaf)[:1] != (rows,):
        raise ValueError(
            f"{spec.name}: output {jax.tree_util.keystr(path) or '<root>'} has shape "
            f"{jnp.shape(leaf)}, but micro_batched needs per-example outputs: the "
            f"micro-batch's {rows} rows on axis 0 (they are put back in the batch's order).")
    return carry, out

  placed = (f"; the compiler places any communication over {data_axes} (none for a "
            "per-example fun with replicated params)" if data_axes else "")
  path = paths.Path("global", f"{spec.name} forward: each global micro-batch in turn ({k}, "
                    f"in a scan), only the outputs kept{placed}", ())
  with jax.named_scope(paths.record(path)):
    _, outs = lax.scan(body, None, jnp.arange(k))
  return jax.tree.map(split.unstacked, outs)


def _backward(spec: _Spec, run: Callable[..., Any], res: list[list[Any]], ct: Any,
              batch_perturbed: list[bool], hints: tuple[Any, ...]) -> tuple[Any, ...]:
  """The cotangents of ``(diff, batch, keys, fixed)``: ``value_and_grad`` of
  ``Sum(sum(fun(micro-batch) * ct[micro-batch]))`` over the micro-batches; ``hints``, per
  ``diff`` leaf, its ``param_shardings``."""
  diff, batch, keys, fixed = res
  cts = [None if _zero(c) else c for c in jax.tree.leaves(
      ct, is_leaf=lambda c: c is None or _zero(c))]
  need = [j for j, (leaf, p) in enumerate(zip(batch, batch_perturbed, strict=True))
          if p and jnp.issubdtype(jnp.result_type(leaf), jnp.inexact)]
  none = (None,) * len(batch), [None] * len(keys), [None] * len(fixed)
  if all(c is None for c in cts):
    return ([jnp.zeros_like(d) for d in diff], *none)
  present = [j for j, c in enumerate(cts) if c is not None]

  def loss(diff, micro, keys, fixed):
    micro_batch, micro_cts = micro
    full_cts = dict(zip(present, micro_cts, strict=True))
    if not need:
      out = jax.tree.leaves(run(diff, micro_batch, keys, fixed))
      return markers.Sum(sum(_dot(out[j], c) for j, c in full_cts.items()))

    def of_inputs(diff, xs):
      given = list(micro_batch)
      for j, x in zip(need, xs, strict=True):
        given[j] = x
      return run(diff, given, keys, fixed)

    out, vjp = jax.vjp(of_inputs, diff, [micro_batch[j] for j in need])
    out_leaves, out_def = jax.tree.flatten(out)
    grads_diff, grads_x = vjp(jax.tree.unflatten(out_def, [
        full_cts[j].astype(o.dtype) if j in full_cts else _zero_cotangent(o)
        for j, o in enumerate(out_leaves)]))
    # Differentiated, this sum gives grads_diff: the gradients of one joint backward pass.
    total = sum(jnp.vdot(d, lax.stop_gradient(g)).real
                for d, g in zip(diff, grads_diff, strict=True))
    return markers.Sum(jnp.asarray(total, jnp.float32)), [markers.Concat(g) for g in grads_x]

  def of_micro_batch(d, micro, ks, f):
    return loss(diff and d, micro, ks, f)

  looked_at(of_micro_batch)  # micro_batched's call warned of spec.fun's shared keys
  differentiated = diff or [jnp.zeros((), jnp.float32)]
  fn = api.value_and_grad(of_micro_batch, has_aux=bool(need), micro_batches=spec.k,
                          batch_argnums=1, rng_argnums=2,
                          param_shardings=list(hints) if diff and any(hints) else None)
  with paths.entry(f"{spec.name} backward"):
    value, grads = fn(differentiated, (batch, [cts[j] for j in present]), keys, fixed)
  grads_batch: list[Any] = [None] * len(batch)
  for j, g in zip(need, value[1] if need else (), strict=True):
    grads_batch[j] = g
  return (grads if diff else [], grads_batch, *none[1:])


def _dot(out: jax.Array, ct: jax.Array) -> jax.Array:
  return jnp.sum(out.astype(jnp.float32) * ct.astype(jnp.float32))


def _zero(c: Any) -> bool:
  from jax.custom_derivatives import SymbolicZero
  return c is None or isinstance(c, SymbolicZero) or (
      is_array(c) and jnp.result_type(c) == jax.dtypes.float0)


def _zero_cotangent(x: jax.Array) -> jax.Array:
  if jnp.issubdtype(jnp.result_type(x), jnp.inexact):
    return jnp.zeros_like(x)
  return jnp.zeros(jnp.shape(x), jax.dtypes.float0)


def _nnx_params(spec: _Spec, i: int, node: Any) -> tuple[Any, Any]:
  """``(graphdef, params)`` of an NNX module; refuses state besides its ``nnx.Param``s."""
  from flax import nnx
  graphdef, params, *rest = nnx.split(node, nnx.Param, ...)
  if jax.tree.leaves(rest):
    kinds = sorted({type(v).__name__ for v in jax.tree.leaves(
        rest, is_leaf=lambda v: isinstance(v, nnx.Variable))})
    raise TypeError(
        f"{spec.name}: the NNX module at argument {i} holds state besides its nnx.Params "
        f"({', '.join(kinds)}), which micro_batched does not thread through the "
        "micro-batches (mutable state is out of scope). Pass a module whose only state is "
        "nnx.Param (keys as an argument at rng_argnums, no BatchNorm in train mode), or use "
        "fxaccum.value_and_grad, which threads module state.")
  return graphdef, params


def _nnx_merge(graphdef: Any, params: Any) -> Any:
  from flax import nnx
  return nnx.merge(graphdef, params)
