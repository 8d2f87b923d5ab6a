"""Rules of equations that hold sub-jaxprs: calls (``jit``, remat, custom derivative
rules, hijax primitives), ``shard_map``, ``scan``, ``while`` and ``cond``.

Their bodies are analyzed by the interpreter, called back through ``ctx.inner``; loops
iterate their carries' kinds to a fixpoint (:func:`fixpoint`), conditionals join their
branches'. A scan with one iteration per example (``lax.map`` over the batch) is analyzed
as ``jax.vmap`` of its body. May import ``fxaccum.jaxprs``,
:mod:`fxaccum.analysis.registry`, :mod:`fxaccum.analysis.kinds` and
:mod:`fxaccum.analysis.eqns`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
from jax.extend import core as jcore

from fxaccum.analysis.eqns import with_place
from fxaccum.analysis.kinds import (
    Blocked,
    Const,
    Exp,
    Kind,
    Rows,
    Stat,
    Top,
    Unpaired,
    add_exps,
    common_exp,
    join,
    mixing,
    plain,
)
from fxaccum.analysis.registry import (
    Context,
    Operands,
    Out,
    Result,
    Rule,
    register_call,
    register_facts,
)
from fxaccum.jaxprs import expansion, scan_counts

__all__ = ["call_hi_primitive", "cond", "custom_linear_solve", "fixpoint", "scan", "shard_map",
           "while_loop"]


def fixpoint(body: Callable[[list[Kind]], list[Kind]], carry: list[Kind]) -> list[Kind]:
  """Fixpoint of ``carry -> join(carry, body(carry))``: the kinds of a loop's carries."""
  for _ in range(8):
    new = [join(a, b) for a, b in zip(carry, body(carry), strict=True)]
    if new == carry:
      return carry
    carry = new
  return [c if isinstance(c, Const) else Top("a loop carry that does not settle")
          for c in carry]


def _call(param: str) -> Rule:
  """The rule of a call: its results are its body's."""
  def rule(ctx: Context, kinds: Operands) -> Out:
    return ctx.inner(ctx.eqn.params[param], list(kinds), ctx.sources)
  return rule


register_call("jit", "pjit", "remat2", "checkpoint")(_call("jaxpr"))
# In the jaxpr of a micro-step's value and gradients, a custom_jvp / custom_vjp call that
# remains is not differentiated (its rules were traced in where they are used): only its
# primal runs.
register_call("closed_call", "core_call", "custom_jvp_call", "custom_vjp_call")(
    _call("call_jaxpr"))


@register_call("call_hi_primitive")
def call_hi_primitive(ctx: Context, kinds: Operands) -> Out:
  """A JAX "hijax" primitive (JAX 0.12's ``jnp.searchsorted``): its results are those of
  its expansion into ordinary primitives."""
  return ctx.inner(expansion(ctx.eqn.params["_prim"]), list(kinds), ctx.sources)


@register_call("custom_linear_solve")
def custom_linear_solve(ctx: Context, kinds: Operands) -> Out:
  """``lax.custom_linear_solve`` (``jnp.linalg.solve``): it runs its ``solve`` jaxpr on
  that jaxpr's operands and ``b`` (its derivatives are other equations of the step)."""
  lengths = list(ctx.eqn.params["const_lengths"])
  start = sum(lengths[:2])  # the operands: matvec's, vecmat's, solve's, transpose_solve's, b
  stop = start + lengths[2]
  used = [*range(start, stop), *range(sum(lengths), len(kinds))]
  sources = {i: ctx.sources[pos] for i, pos in enumerate(used) if pos in ctx.sources}
  outs = ctx.inner(ctx.eqn.params["jaxprs"].solve, [kinds[pos] for pos in used], sources)
  unused = frozenset(q for pos, q in ctx.sources.items() if pos not in used)
  return Result(outs, not_reducible=unused)


@register_call("shard_map")
def shard_map(ctx: Context, kinds: Operands) -> Out:
  """A ``shard_map`` inside the loss: JAX 0.10 cannot lower it inside a region manual
  over the data axes, and its body's collectives read other devices' values."""
  eqn = ctx.eqn
  if all(isinstance(k, Const) for k in kinds):
    outs: list[Kind] = [Const(exp=common_exp(kinds))] * len(eqn.outvars)
  else:
    outs = [Top(with_place(eqn, "a shard_map inside the loss"))] * len(eqn.outvars)
  return Result(outs, not_reducible=frozenset(ctx.sources.values()),
                blockers=(with_place(eqn, "the loss calls jax.shard_map"),))


register_facts("scan", shape_params={"length"})  # the rule checks it runs over the examples


@register_call("scan")
def scan(ctx: Context, kinds: Operands) -> Out:
  """A scan over another axis than the batch's (scanned layers) keeps each example's
  rows apart; one with an iteration per example is :func:`_scan_over_rows`."""
  n_consts, n_carry = scan_counts(ctx.eqn.params)
  # a param as loop state or sliced per iteration
  looped = frozenset(param for pos, param in ctx.sources.items() if pos >= n_consts)
  body_sources = {pos: q for pos, q in ctx.sources.items() if pos < n_consts}
  xs = kinds[n_consts + n_carry:]
  if any(isinstance(k, Blocked) for k in xs):
    outs = _scan_over_blocks(ctx, kinds, body_sources)
  elif "length" in ctx.changed or any(isinstance(k, Rows) and k.dim == 0 for k in xs):
    outs = _scan_over_rows(ctx, kinds, body_sources)
  else:
    outs = _scan_over_layers(ctx, kinds, body_sources)
  return Result(outs, not_reducible=looped)


def _scan_over_layers(ctx: Context, kinds: Operands,
                      body_sources: dict[int, int]) -> list[Kind]:
  """A scan whose iterations are not the examples: xs sliced along axis 0 (the batch axis
  of a row value moves down one), carries iterated to a fixpoint, ys stacked."""
  p = ctx.eqn.params
  n_consts, n_carry = scan_counts(p)
  consts, carry, xs = kinds[:n_consts], kinds[n_consts:n_consts + n_carry], kinds[
      n_consts + n_carry:]
  sliced: list[Kind] = []
  for k in xs:
    if isinstance(k, Rows):
      sliced.append(dataclasses.replace(k, dim=k.dim - 1))
    elif isinstance(k, Const):
      sliced.append(_sliced_const(k))
    else:
      sliced.append(plain(k))
  body = p["jaxpr"]

  def step(carry_kinds: list[Kind]) -> list[Kind]:
    return ctx.inner(body, [*consts, *carry_kinds, *sliced], body_sources)[:n_carry]

  carry = fixpoint(step, list(carry))
  ys = ctx.inner(body, [*consts, *carry, *sliced], body_sources)[n_carry:]
  stacked: list[Kind] = []
  for k in ys:
    if isinstance(k, Rows):
      stacked.append(dataclasses.replace(k, dim=k.dim + 1))
    elif isinstance(k, Const):
      stacked.append(_stacked_const(k))
    else:
      stacked.append(plain(k))
  return [*carry, *stacked]


def _sliced_const(k: Const) -> Const:
  """One iteration's slice (along axis 0) of a batch-independent ``xs``."""
  return Const(frozenset(d - 1 for d in k.uniform if d > 0), k.value, k.exp)


def _stacked_const(k: Const) -> Const:
  """Batch-independent ``ys``, stacked along a new axis 0."""
  return Const(frozenset(d + 1 for d in k.uniform), exp=k.exp)


def _scan_over_rows(ctx: Context, kinds: Operands,
                    body_sources: dict[int, int]) -> list[Kind]:
  """A scan with one iteration per example (``lax.map`` over the batch, its transpose,
  a ``fori_loop`` of ``n`` steps): the iterations are the examples, so the body is
  analyzed as ``jax.vmap`` of it over them. Each carry must pass through unchanged or only
  add a value that does not depend on the carries (a sum over the iterations, such as
  the transposed scan's gradient accumulators); any other carry links the examples."""
  eqn = ctx.eqn
  p = eqn.params
  n_consts, n_carry = scan_counts(p)
  outs = len(eqn.outvars)
  what = with_place(eqn, "a loop over the examples that carries state from one to the next")
  body = p["jaxpr"]
  if not all(_accumulates(body.jaxpr, i, n_consts, n_carry) for i in range(n_carry)):
    return [Top(what)] * outs
  if any(_read_while_it_grows(body.jaxpr, i, n_consts) for i in range(n_carry)):
    return [Top(with_place(eqn, "a loop over the examples that reads a running total (e.g. "
                           "an example counter): each example sees another value"))] * outs
  if any(isinstance(k, Rows) and k.dim != 0 for k in kinds[n_consts + n_carry:]):
    return [Top(with_place(eqn, "a scan over the batch axis"))] * outs
  partner = ctx.partner
  count = _count(ctx)
  mapped = _vmapped(body, n_consts, n_carry, p["length"])
  theirs = _vmapped(partner.params["jaxpr"], n_consts, n_carry,
                    partner.params["length"]) if partner is not None else None
  if mapped is None or (partner is not None and theirs is None):
    return [Top(what)] * outs
  in_kinds = [*kinds[:n_consts], *_carried(body, kinds, n_consts, n_carry),
              *kinds[n_consts + n_carry:]]
  try:  # paired with the partner's vmapped body first, where there is one
    got = ctx.inner(mapped, in_kinds, body_sources, partner=theirs)
  except Unpaired:
    return [Top(what)] * outs
  carry = []
  for init, step in zip(kinds[n_consts:n_consts + n_carry], got[:n_carry], strict=True):
    carry.append(init if isinstance(step, Const) and step.value == 0 else _plus_sum(
        eqn, init, step, count))
  return [*carry, *got[n_carry:]]


def _count(ctx: Context) -> Exp:
  """How a scan's number of iterations scales with the rows."""
  length, partner = ctx.eqn.params["length"], ctx.partner
  if ctx.symbol is not None:
    return ctx.pairing.degree(length)
  return ctx.pairing.ratio_exp(length, partner.params["length"]) if partner is not None else 0.0


def _carried(body, kinds: Operands, n_consts: int, n_carry: int) -> list[Kind]:
  """A scan's carries seen from one step whose carries only accumulate: their value where
  the body passes them through, else zero (what the step adds is its result)."""
  return [init if body.jaxpr.outvars[i] is body.jaxpr.invars[n_consts + i] else
          Const(value=0.0) for i, init in enumerate(kinds[n_consts:n_consts + n_carry])]


def _scan_over_blocks(ctx: Context, kinds: Operands,
                      body_sources: dict[int, int]) -> list[Kind]:
  """A scan over blocks of consecutive examples (``lax.map(f, x, batch_size=b)``, and its
  transpose): each iteration's slice holds ``b`` examples, so the body is analyzed on
  them (in an order of their own). Every batch-dependent ``xs`` must be blocked alike,
  every constant batch-independent, every carry only accumulate; its ``ys`` are blocked
  again, its accumulators sum statistics of the blocks."""
  eqn = ctx.eqn
  p = eqn.params
  n_consts, n_carry = scan_counts(p)
  xs = kinds[n_consts + n_carry:]
  blocked = next(k for k in xs if isinstance(k, Blocked))
  refused: list[Kind] = [Top(blocked.mixed)] * len(eqn.outvars)
  if not all(isinstance(k, Const) or (isinstance(k, Blocked) and k.dim == 0 and (
      k.block, k.order) == (blocked.block, blocked.order)) for k in xs):
    return refused
  # A batch-dependent constant (all rows, a batch statistic) would be read by every block:
  # a statistic of it added up per block counts its examples once per block.
  if not all(isinstance(k, Const) for k in kinds[:n_consts]):
    return [Top(mixing(next(k for k in kinds[:n_consts] if not isinstance(k, Const))) or
                with_place(eqn, "a scan over blocks of examples whose body reads the whole "
                           "batch"))] * len(eqn.outvars)
  body = p["jaxpr"]
  if not all(_accumulates(body.jaxpr, i, n_consts, n_carry) for i in range(n_carry)) or any(
      _read_while_it_grows(body.jaxpr, i, n_consts) for i in range(n_carry)):
    return [Top(with_place(eqn, "a scan over blocks of examples that carries state from one "
                           "block to the next"))] * len(eqn.outvars)
  inner = ("block", blocked.order)
  sliced = [Rows(0, None, k.exp, inner) if isinstance(k, Blocked) else _sliced_const(k)
            for k in xs]
  got = ctx.inner(body, [*kinds[:n_consts], *_carried(body, kinds, n_consts, n_carry),
                         *sliced], body_sources)
  carry = [init if isinstance(step, Const) and step.value == 0 else _started(
      eqn, init, _block_sums(eqn, step)) for init, step in zip(
          kinds[n_consts:n_consts + n_carry], got[:n_carry], strict=True)]
  ys: list[Kind] = []
  for k in got[n_carry:]:
    if isinstance(k, Rows) and k.dim == 0 and k.order == inner and k.mixed is None:
      ys.append(Blocked(blocked.mixed, k.exp, 0, blocked.block, blocked.order))
    elif isinstance(k, Const):
      ys.append(_stacked_const(k))
    else:
      ys.append(Top(mixing(k) or with_place(eqn, "a scan over blocks of examples whose "
                                            "outputs mix the examples of a block")))
  return [*carry, *ys]


def _block_sums(eqn, step: Kind) -> Kind:
  """The sum over the blocks of what one step adds: a statistic of each block's examples
  sums to one of all examples; rows of a block would add up different examples."""
  if isinstance(step, Stat) and not step.ratio and step.extreme is None:
    return Stat(step.mixed, step.exp)
  if isinstance(step, Const):
    return Const(exp=None)  # one term per block, each its own: no known scaling
  return Top(mixing(step) or with_place(eqn, "a scan over blocks of examples that adds up "
                                        "rows of different blocks"))


def _accumulates(jaxpr, i: int, n_consts: int, n_carry: int) -> bool:
  """Whether carry ``i`` of a scan body passes through, or only has a carry-independent
  value added to it."""
  carry_in = jaxpr.invars[n_consts + i]
  out = jaxpr.outvars[i]
  if out is carry_in:
    return True
  carries = set(jaxpr.invars[n_consts:n_consts + n_carry])
  producer = next((e for e in jaxpr.eqns if out in e.outvars), None)
  if producer is None or producer.primitive.name not in ("add", "add_any"):
    return False
  others = [v for v in producer.invars if v is not carry_in]
  if len(others) != 1:
    return False
  reached = set(carries)
  for e in jaxpr.eqns:
    if e is producer:
      break
    if any(not isinstance(v, jcore.Literal) and v in reached for v in e.invars):
      reached.update(e.outvars)
  return isinstance(others[0], jcore.Literal) or others[0] not in reached


def _read_while_it_grows(jaxpr, i: int, n_consts: int) -> bool:
  """Whether carry ``i`` of a scan body changes from step to step and is read by anything
  but the addition that grows it (an output per iteration, say: ``v * 0.9 ** count``)."""
  carry_in = jaxpr.invars[n_consts + i]
  out = jaxpr.outvars[i]
  if out is carry_in:
    return False
  reads = [e for e in jaxpr.eqns if carry_in in e.invars and out not in e.outvars]
  return bool(reads) or any(v is carry_in for v in jaxpr.outvars)


def _vmapped(body, n_consts: int, n_carry: int, length: int):
  """``body`` vmapped over its sliced inputs (one per iteration), or None."""
  avals = [v.aval for v in body.jaxpr.invars]
  args = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in avals[:n_consts + n_carry]]
  args += [jax.ShapeDtypeStruct((length, *a.shape), a.dtype)
           for a in avals[n_consts + n_carry:]]
  in_axes = [None] * (n_consts + n_carry) + [0] * (len(avals) - n_consts - n_carry)
  try:
    return jax.make_jaxpr(jax.vmap(jcore.jaxpr_as_fun(body), in_axes=in_axes, out_axes=0,
                                   axis_size=length))(*args)
  except Exception:  # noqa: BLE001 - a body JAX cannot vmap: no proof
    return None


def _plus_sum(eqn, init: Kind, step: Kind, count: Exp) -> Kind:
  """``init`` plus the sum over the iterations (examples) of ``step`` (stacked on axis 0);
  ``count``: how the number of iterations scales."""
  if isinstance(step, Rows) and step.dim == 0:
    total: Kind = Stat(step.mixed, step.exp)
  elif isinstance(step, Const) and (0 in step.uniform or step.value is not None):
    total = Const(exp=add_exps([step, Const(exp=count)]))  # equal terms, count of them
  else:
    return Top(with_place(eqn, "a loop whose number of iterations follows the number of rows "
                      "adds up values that are no per-example terms"))
  return _started(eqn, init, total)


def _started(eqn, init: Kind, total: Kind) -> Kind:
  """``init`` plus ``total``, a loop's sum over the examples."""
  if isinstance(total, Top):
    return total
  if isinstance(init, Const) and init.value == 0:
    return total
  if isinstance(total, Const) and isinstance(init, Const):
    return Const(exp=common_exp([init, total]))
  return Top(with_place(eqn, "a loop over the examples whose sum starts from a non-zero value"))


@register_call("while")
def while_loop(ctx: Context, kinds: Operands) -> Out:
  """A while loop keeps its carries' kinds if its trip count is batch-independent, or if
  its predicate is per example (:func:`_per_example_predicate`)."""
  eqn = ctx.eqn
  p = eqn.params
  nc, nb = p["cond_nconsts"], p["body_nconsts"]
  cond_consts, body_consts, carry = kinds[:nc], kinds[nc:nc + nb], kinds[nc + nb:]
  looped = frozenset(param for pos, param in ctx.sources.items() if pos >= nc + nb)
  body_sources = {pos - nc: q for pos, q in ctx.sources.items() if nc <= pos < nc + nb}
  cond_sources = {pos: q for pos, q in ctx.sources.items() if pos < nc}

  def step(carry_kinds: list[Kind]) -> list[Kind]:
    return ctx.inner(p["body_jaxpr"], [*body_consts, *carry_kinds], body_sources)

  carry = fixpoint(step, list(carry))
  (pred,) = ctx.inner(p["cond_jaxpr"], [*cond_consts, *carry], cond_sources)
  if isinstance(pred, Rows) and _per_example_predicate(p, pred):
    return Result(_masked(eqn, pred, carry, nb), not_reducible=looped)
  if not isinstance(pred, Const) or pred.exp != 0:
    return Result([Top(with_place(eqn, "a while loop whose trip count depends on the batch or "
                                  "on the number of rows"))] * len(carry), not_reducible=looped)
  return Result(carry, not_reducible=looped)


def _per_example_predicate(params, pred: Kind) -> bool:
  """Whether a while loop's predicate is one boolean per example (``jax.vmap`` of a
  ``while_loop``): JAX then runs the body while any example's holds and keeps each
  example's carries where its own does not, so each example runs its own trip count."""
  (aval,) = params["cond_jaxpr"].out_avals
  return (isinstance(pred, Rows) and pred.dim == 0 and pred.mixed is None
          and len(aval.shape) == 1)


def _masked(eqn, pred: Rows, carry: list[Kind], nb: int) -> list[Kind]:
  """The carries of a while loop with a per-example predicate (see
  :func:`_per_example_predicate`): each keeps its example's rows apart if it is rows in
  the predicate's order, or batch-independent and passed through; a batch-independent
  carry the body changes stops at each example's own trip count, so it becomes rows."""
  body = eqn.params["body_jaxpr"].jaxpr
  outs: list[Kind] = []
  for i, kind in enumerate(carry):
    passed = body.outvars[i] is body.invars[nb + i]
    if isinstance(kind, Rows) and kind.dim == 0 and kind.order == pred.order:
      outs.append(kind)
    elif isinstance(kind, Const) and passed:
      outs.append(kind)
    elif isinstance(kind, Const) and kind.exp == 0:
      outs.append(Rows(0, exp=0.0, order=pred.order))
    else:
      outs.append(Top(mixing(kind) or with_place(
          eqn, "a while loop with a per-example predicate whose carry is not batched along "
          "the examples")))
  return outs


@register_call("cond")
def cond(ctx: Context, kinds: Operands) -> Out:
  """A conditional joins its branches' kinds if its index is batch-independent."""
  eqn = ctx.eqn
  index, operands = kinds[0], kinds[1:]
  branch_sources = {pos - 1: q for pos, q in ctx.sources.items() if pos >= 1}
  picked = frozenset([ctx.sources[0]]) if 0 in ctx.sources else frozenset()
  outs: list[Kind] | None = None
  for branch in eqn.params["branches"]:
    got = ctx.inner(branch, list(operands), branch_sources)
    outs = got if outs is None else [join(a, b) for a, b in zip(outs, got, strict=True)]
  assert outs is not None  # a conditional has at least one branch
  if not isinstance(index, Const) or index.exp != 0:
    return Result([Top(with_place(eqn, "a conditional on batch values or on the number of "
                                  "rows"))] * len(outs), not_reducible=picked)
  return Result(outs, not_reducible=picked)
