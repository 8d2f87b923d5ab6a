"""FSDP params gathered where they are used (``fsdp="zero3"``).

The micro-step's loss is traced once on whole params; its jaxpr then runs on the param
*shards*. Each equation that reads an FSDP param gathers it just before, and a ``scan``
over stacked layers (``nn.scan``, ``lax.scan``) takes the stacked shard as its ``xs`` and
gathers one layer inside its body. The step is differentiated under a ``jax.checkpoint``
that saves every value except the gathered params and what is computed from them alone
(a cast, a reshard), so the backward pass gathers each param again where it needs it
(the transpose of every gather is its reduce-scatter) instead of keeping the whole params
live from the forward pass to the backward one.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.extend import core as jcore
from jax.extend.core import primitives

from fxaccum import meshes, reductions
from fxaccum.jaxprs import scan_counts

__all__ = ["Traced", "per_layer", "trace", "value_and_grad"]

# The name of every value the backward pass may keep (see :func:`_eval`).
SAVED = "fxaccum_saved"


class _Shard(NamedTuple):
  """A param not gathered yet: this device's shard and the dims it is sharded along."""

  shard: Any
  dims: meshes.DataDims


# The checkpoint policy: values named SAVED are kept for the backward pass, the rest (the
# gathered params, and values computed from them alone) computed again there.
_saveable = jax.checkpoint_policies.save_only_these_names(SAVED)


def _gathered(value: Any) -> Any:
  if not isinstance(value, _Shard):
    return value
  return reductions.gather(value.shard, value.dims)


class Traced(NamedTuple):
  """The loss traced once on whole params (its forward pass), to run on their shards."""

  closed: jcore.ClosedJaxpr
  out_shape: Any
  dims: tuple[meshes.DataDims, ...]  # per param leaf: its sharded dims (``()``: whole)


def trace(fun: Callable[..., Any], shards: Sequence[Any], dims: Sequence[meshes.DataDims],
          *args: Any) -> Traced:
  """``fun(whole params, *args)`` traced on the whole params whose shards are ``shards``."""
  # The whole params' types, with the manual axes they vary over. (Not eval_shape: JAX
  # 0.10.2 rejects its ShapeDtypeStructs as arguments inside a partly manual region.)
  full = jax.make_jaxpr(lambda s: [reductions.gather(x, d) for x, d in zip(s, dims, strict=True)])(
      list(shards)).out_avals
  closed, out_shape = jax.make_jaxpr(fun, return_shape=True)(list(full), *args)
  return Traced(closed, out_shape, tuple(dims))


def value_and_grad(traced: Traced, shards: Sequence[Any], *args: Any) -> Any:
  """``jax.value_and_grad(fun, has_aux=True)`` of the :func:`trace` d ``fun`` with respect
  to the whole params whose shards are ``shards``, gathering each where it is used.
  Returns ``((value, aux), grads)``, the grads of sharded leaves reduce-scattered (summed
  over their axes), the others local partial sums.
  """
  arg_leaves = jax.tree.leaves(args)

  def run(shards):
    marked = [_Shard(x, d) if d else x for x, d in zip(shards, traced.dims, strict=True)]
    outs = _eval(traced.closed.jaxpr, traced.closed.consts, [*marked, *arg_leaves])
    value, aux = jax.tree.unflatten(jax.tree.structure(traced.out_shape), outs)
    return value, aux

  checkpointed = jax.checkpoint(run, policy=_saveable)
  return jax.value_and_grad(checkpointed, has_aux=True)(list(shards))


def per_layer(jaxpr: jcore.Jaxpr, dims: Sequence[meshes.DataDims]) -> bool:
  """Whether :func:`value_and_grad` would gather some param one slice at a time: a ``scan``
  over layers takes it (stacked, sharded along another dimension than the layers') as
  ``xs``, as ``nn.scan`` and ``lax.scan`` over stacked params do (see :func:`_scan`).
  ``jaxpr``'s first inputs are the params, sharded along ``dims``: the loss's forward
  pass, or the micro-step it is differentiated in (its forward scan takes them as they
  are)."""
  params = jaxpr.invars[:len(dims)]
  sharded = {var: d for var, d in zip(params, dims, strict=True) if d}
  for eqn in jaxpr.eqns:
    if eqn.primitive is primitives.scan_p:
      n_consts, n_carry = scan_counts(eqn.params)
      for var in eqn.invars[n_consts + n_carry:]:
        var_dims = None if isinstance(var, jcore.Literal) else sharded.get(var)
        if var_dims and all(dim > 0 for dim, _ in var_dims):
          return True
  return False


def _eval(jaxpr: jcore.Jaxpr, consts: Sequence[Any], args: Sequence[Any]) -> list[Any]:
  """Evaluates ``jaxpr`` where some inputs are :class:`_Shard` s: gathered just before the
  first equation of each reading them, or inside the body of a ``scan`` over them.

  Each value is named :data:`SAVED` (kept for the backward pass, as without a checkpoint)
  unless it is computed from gathered params alone: a gathered param, and its casts,
  reshards or transposes, are as large as the param, and the backward pass computes them
  again from the shard. (A policy that refuses only the gathers would keep a cast of one:
  JAX asks it about each operation, not about where its operands came from.) Values
  inside a call this does not walk (a ``jax.jit`` function, a ``custom_vjp`` rule's
  forward pass) are not named, so the backward pass computes them again too.
  """
  env: dict[Any, Any] = {}

  def read(var):
    return var.val if isinstance(var, jcore.Literal) else env[var]

  env.update(zip(jaxpr.constvars, consts, strict=True))
  env.update(zip(jaxpr.invars, args, strict=True))
  derived: set[Any] = set()  # values computed from gathered params alone
  for eqn in jaxpr.eqns:
    values = [read(v) for v in eqn.invars]
    if any(isinstance(v, _Shard) for v in values) and eqn.primitive is primitives.scan_p:
      outs = _scan(eqn, values)
    else:
      params = eqn.primitive.get_bind_params(eqn.params)
      with eqn.ctx.manager:
        outs = eqn.primitive.bind(*map(_gathered, values), **params)
      outs = outs if eqn.primitive.multiple_results else [outs]
    if _from_params_alone(eqn.invars, values, derived):
      derived.update(eqn.outvars)
    else:
      outs = [checkpoint_name(o, SAVED) for o in outs]
    env.update(zip(eqn.outvars, outs, strict=True))
  return [_gathered(read(v)) for v in jaxpr.outvars]


def _from_params_alone(invars: Sequence[Any], values: Sequence[Any], derived: set[Any]) -> bool:
  """Whether an equation reads gathered params, or values computed from them alone, and
  nothing else but literals."""
  found = False
  for var, value in zip(invars, values, strict=True):
    if isinstance(value, _Shard) or (not isinstance(var, jcore.Literal) and var in derived):
      found = True
    elif not isinstance(var, jcore.Literal):
      return False
  return found


def _scan(eqn: jcore.JaxprEqn, values: list[Any]) -> list[Any]:
  """A ``scan`` whose ``xs`` hold shards of stacked params (sharded along another
  dimension than the scanned one): each iteration gathers its own slice. (A param the
  body closes over is gathered once, before the scan; JAX keeps what the backward pass
  needs of it once, not per iteration.)"""
  params = eqn.params
  body, (n_consts, n_carry) = params["jaxpr"], scan_counts(params)
  consts = [_gathered(v) for v in values[:n_consts]]
  carry = [_gathered(v) for v in values[n_consts:n_consts + n_carry]]
  xs, sliced = [], []
  for v in values[n_consts + n_carry:]:
    per_slice = isinstance(v, _Shard) and all(dim > 0 for dim, _ in v.dims)
    xs.append(v.shard if per_slice else _gathered(v))
    sliced.append(tuple((dim - 1, axes) for dim, axes in v.dims) if per_slice else None)

  # Checkpointed per iteration: the backward pass then gathers each slice inside its own
  # iteration (a checkpoint around the whole scan would re-gather all slices first).
  @functools.partial(jax.checkpoint, policy=_saveable)
  def step(carry, x):
    x = [_Shard(s, d) if d is not None else s for s, d in zip(x, sliced, strict=True)]
    outs = _eval(body.jaxpr, body.consts, [*consts, *carry, *x])
    return outs[:n_carry], outs[n_carry:]

  carry, ys = lax.scan(step, carry, xs, length=params["length"], reverse=params["reverse"],
                       unroll=params["unroll"])
  return [*carry, *ys]
