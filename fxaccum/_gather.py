"""FSDP params gathered where they are used (``fsdp_gather="per_micro_batch"``, ZeRO-3).

The micro-step's loss is traced once on whole params; its jaxpr then runs on the param
*shards*. Each equation that reads an FSDP param gathers it just before, and a ``scan``
over stacked layers (``nn.scan``, ``lax.scan``) takes the stacked shard as its ``xs`` and
gathers one layer inside its body. The step is differentiated under a ``jax.checkpoint``
whose policy saves everything except those gathers, so the backward pass gathers each
param again where it needs it (the transpose of every gather is its reduce-scatter)
instead of keeping the whole params live from the forward pass to the backward one.
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

from fxaccum import _sync as sync
from fxaccum._jax_compat import scan_counts

__all__ = ["value_and_grad"]

GATHERED = "fxaccum_gathered"


class _Shard(NamedTuple):
  """A param not gathered yet: this device's shard and the dims it is sharded along."""

  shard: Any
  dims: sync.DataDims


def _saveable(prim: Any, *_: Any, **params: Any) -> bool:
  """The checkpoint policy: every value is saved for the backward pass as without a
  checkpoint, except gathered params (the backward pass gathers them again)."""
  if prim is primitives.all_gather_p:
    return False
  return not (prim is primitives.name_p and params.get("name") == GATHERED)


def _gathered(value: Any) -> Any:
  if not isinstance(value, _Shard):
    return value
  return checkpoint_name(sync.gather(value.shard, value.dims), GATHERED)


def value_and_grad(fun: Callable[..., Any], shards: Sequence[Any],
                   dims: Sequence[sync.DataDims], *args: Any) -> Any:
  """``jax.value_and_grad(fun, has_aux=True)`` with respect to the whole params whose
  shards are ``shards`` (sharded along ``dims``; ``()``: whole already), gathering each
  where it is used. Returns ``((value, aux), grads)``, the grads of sharded leaves
  reduce-scattered (summed over their axes), the others local partial sums.
  """
  # The whole params' types, with the manual axes they vary over. (Not eval_shape: JAX
  # 0.10.2 rejects its ShapeDtypeStructs as arguments inside a partly manual region.)
  full = jax.make_jaxpr(lambda s: [sync.gather(x, d) for x, d in zip(s, dims, strict=True)])(
      list(shards)).out_avals
  closed, out_shape = jax.make_jaxpr(fun, return_shape=True)(list(full), *args)
  arg_leaves = jax.tree.leaves(args)

  def run(shards):
    marked = [_Shard(x, d) if d else x for x, d in zip(shards, dims, strict=True)]
    outs = _eval(closed.jaxpr, closed.consts, [*marked, *arg_leaves])
    value, aux = jax.tree.unflatten(jax.tree.structure(out_shape), outs)
    return value, aux

  checkpointed = jax.checkpoint(run, policy=_saveable)
  return jax.value_and_grad(checkpointed, has_aux=True)(list(shards))


def _eval(jaxpr: jcore.Jaxpr, consts: Sequence[Any], args: Sequence[Any]) -> list[Any]:
  """Evaluates ``jaxpr`` where some inputs are :class:`_Shard` s: gathered just before the
  first equation of each reading them, or inside the body of a ``scan`` over them."""
  env: dict[Any, Any] = {}

  def read(var):
    return var.val if isinstance(var, jcore.Literal) else env[var]

  env.update(zip(jaxpr.constvars, consts, strict=True))
  env.update(zip(jaxpr.invars, args, strict=True))
  for eqn in jaxpr.eqns:
    values = [read(v) for v in eqn.invars]
    if any(isinstance(v, _Shard) for v in values) and eqn.primitive is primitives.scan_p:
      outs = _scan(eqn, values)
    else:
      params = eqn.primitive.get_bind_params(eqn.params)
      with eqn.ctx.manager:
        outs = eqn.primitive.bind(*map(_gathered, values), **params)
      outs = outs if eqn.primitive.multiple_results else [outs]
    env.update(zip(eqn.outvars, outs, strict=True))
  return [_gathered(read(v)) for v in jaxpr.outvars]


def _scan(eqn: jcore.JaxprEqn, values: list[Any]) -> list[Any]:
  """A ``scan`` whose ``xs`` hold shards of stacked params (sharded along another
  dimension than the scanned one): each iteration gathers its own slice."""
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
