"""``run.py --study coverage``: how many of the primitives that per-example code emits have
a rule in fxaccum's view analysis.

Traces (``jax.make_jaxpr`` on abstract inputs: no devices, nothing runs) each public
function of ``jax.numpy`` (and its ``linalg`` and ``fft``), ``jax.nn``, ``jax.random`` and
``optax.losses`` it can call generically (one float array, then two, then a key and a
shape), plus call recipes for those that need specific arguments, and flax's linen and
NNX layers (Dense / Linear, Conv, Embed, LayerNorm, BatchNorm, GroupNorm, RMSNorm,
Dropout, attention, LSTM and GRU cells under ``RNN``, pooling). Each is traced with its
gradient where it has one (the analysis reads a micro-step's value and gradients). The
primitives are collected through every sub-jaxpr (``fxaccum.jaxprs.eqns_within``) and
compared with the analysis's registry (``RULES`` and ``CALL_RULES``; the interpreter
handles no primitive without a rule, it answers one with none as mixing examples). Each
primitive without a rule is listed with a reason from :data:`REASONS` ("no rule yet" for
one not there). ``--quick`` traces a handful of each family only.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax import nnx

from fxaccum.analysis.registry import CALL_RULES, RULES
from fxaccum.jaxprs import eqns_within

F32 = jnp.float32
X = jax.ShapeDtypeStruct((4, 6), F32)  # 4 examples of 6 features
SQUARE = jax.ShapeDtypeStruct((4, 4), F32)
LABELS = jax.ShapeDtypeStruct((4,), jnp.int32)
INTS = jax.ShapeDtypeStruct((4, 6), jnp.int32)
KEY = jax.ShapeDtypeStruct((2,), jnp.uint32)  # a raw PRNG key
IMAGES = jax.ShapeDtypeStruct((2, 8, 8, 3), F32)
SEQS = jax.ShapeDtypeStruct((2, 5, 3), F32)

# Why a primitive has no rule. One not here prints "no rule yet".
_LINALG = ("linear algebra per matrix: no rule yet (batched over the examples it would keep "
           "them apart)")
_NO_OPERANDS = "takes no operand: batch-independent, the interpreter needs no rule"
REASONS = {
    "cholesky": _LINALG, "eig": _LINALG, "eigh": _LINALG, "lu": _LINALG, "qr": _LINALG,
    "svd": _LINALG, "triangular_solve": _LINALG, "schur": _LINALG, "hessenberg": _LINALG,
    "tridiagonal": _LINALG, "tridiagonal_solve": _LINALG, "householder_product": _LINALG,
    "lu_pivots_to_permutation": _LINALG,
    "custom_linear_solve": "holds solver jaxprs (matrix inverses, eigvals): no rule yet",
    "fft": "no rule yet (per example along the transformed axes, not the batch's)",
    "empty2": _NO_OPERANDS,
    "platform_index": _NO_OPERANDS,
    "lt_to": "no rule yet (an elementwise comparison, in searchsorted / digitize)",
    "le_to": "no rule yet (an elementwise comparison, in searchsorted / digitize)",
    "random_gamma": "no rule yet (a sampler per key, like random_bits)",
    "stack": "no rule yet (a concatenation of new axes)",
    "unstack": "no rule yet (a split along an axis)",
    "tile": "no rule yet (a repetition, like a broadcast)",
    "pure_callback": "runs Python on host values: the analysis cannot see inside",
    "io_callback": "runs Python on host values: the analysis cannot see inside",
}
# Names in the modules that are no functions to trace, or that read files or Python.
SKIPPED = {"load", "save", "savez", "fromfile", "frombuffer", "fromstring", "fromiter",
           "fromfunction", "vectorize", "frompyfunc", "piecewise", "set_printoptions",
           "printoptions", "get_printoptions", "from_dlpack", "array_repr", "array_str",
           "show_config", "issubdtype", "isdtype", "result_type", "promote_types",
           "can_cast", "dtype", "iinfo", "finfo", "ndim", "shape", "size", "isscalar"}


Tries = list[tuple[Callable[..., Any], tuple[Any, ...]]]


def recipes(quick: bool) -> Iterator[tuple[str, Tries]]:
  """``(name, [(function, abstract arguments), ...])`` for every call the study traces:
  the first alternative that traces counts."""
  yield from _numpy_recipes(quick)
  yield from _generic("jax.nn", jax.nn, quick, ("relu", "softmax", "gelu", "standardize"))
  yield from _random_recipes(quick)
  yield from _optax_recipes(quick)
  yield from _linen_recipes(quick)
  yield from _nnx_recipes(quick)


def _numpy_recipes(quick: bool):
  quick_names = ("mean", "sum", "cumsum", "sort", "max", "argmax", "logaddexp")
  yield from _generic("jax.numpy", jnp, quick, quick_names)
  calls = {
      "einsum": (lambda a, b: jnp.einsum("ij,kj->ik", a, b), (X, X)),
      "take_along_axis": (lambda a, i: jnp.take_along_axis(a, i[:, None], 1), (X, LABELS)),
      "put_along_axis": (lambda a, i: jnp.put_along_axis(a, i[:, None], 0.0, 1,
                                                         inplace=False), (X, LABELS)),
      "take": (lambda a, i: jnp.take(a, i, axis=1), (X, LABELS)),
      "where": (lambda a: jnp.where(a > 0, a, 0.0), (X,)),
      "argsort": (jnp.argsort, (X,)),
      "unique": (lambda a: jnp.unique(a, size=3), (X,)),
      "histogram": (lambda a: jnp.histogram(a, bins=4, range=(0.0, 1.0))[0], (X,)),
      "cov": (jnp.cov, (X,)),
      "convolve": (lambda a: jnp.convolve(a[0], a[1]), (X,)),
      "searchsorted": (lambda a: jnp.searchsorted(jnp.arange(3.0), a), (X,)),
      "bincount": (lambda i: jnp.bincount(i, length=5), (LABELS,)),
      "repeat": (lambda a: jnp.repeat(a, 2, axis=1), (X,)),
      "tile": (lambda a: jnp.tile(a, (1, 2)), (X,)),
      "roll": (lambda a: jnp.roll(a, 1, axis=1), (X,)),
  }
  for name, call in calls.items():
    if not quick or name in ("einsum", "take_along_axis", "where"):
      yield f"jax.numpy.{name}", [call]
  if not quick:
    yield from _generic("jax.numpy.linalg", jnp.linalg, quick, (), args=(SQUARE,))
    yield "jax.numpy.linalg.cholesky", [
        (lambda a: jnp.linalg.cholesky(a @ a.T + jnp.eye(4)), (SQUARE,))]
    yield from _generic("jax.numpy.fft", jnp.fft, quick, ())
    yield "jax.nn.one_hot", [(lambda i: jax.nn.one_hot(i, 5), (LABELS,))]
    yield "jax.nn.dot_product_attention", [(jax.nn.dot_product_attention, (SEQS,) * 3)]


def _random_recipes(quick: bool):
  wrap = jax.random.wrap_key_data
  shape = (4, 6)
  calls = {
      "normal": lambda k: jax.random.normal(wrap(k), shape),
      "uniform": lambda k: jax.random.uniform(wrap(k), shape),
      "bernoulli": lambda k: jax.random.bernoulli(wrap(k), 0.5, shape),
      "categorical": lambda k, a: jax.random.categorical(wrap(k), a),
      "permutation": lambda k, a: jax.random.permutation(wrap(k), a),
      "choice": lambda k, a: jax.random.choice(wrap(k), a),
      "randint": lambda k: jax.random.randint(wrap(k), shape, 0, 5),
      "truncated_normal": lambda k: jax.random.truncated_normal(wrap(k), -1.0, 1.0, shape),
      "split": lambda k: jax.random.split(wrap(k)),
      "fold_in": lambda k: jax.random.fold_in(wrap(k), 3),
      "gamma": lambda k: jax.random.gamma(wrap(k), 2.0, shape),
      "beta": lambda k: jax.random.beta(wrap(k), 2.0, 3.0, shape),
      "poisson": lambda k: jax.random.poisson(wrap(k), 3.0, shape),
      "binomial": lambda k: jax.random.binomial(wrap(k), 5.0, 0.5, shape),
      "dirichlet": lambda k: jax.random.dirichlet(wrap(k), jnp.ones(3), (4,)),
      "multinomial": lambda k: jax.random.multinomial(wrap(k), 5.0, jnp.ones(3) / 3, shape=(4, 3)),
      "multivariate_normal": lambda k: jax.random.multivariate_normal(
          wrap(k), jnp.zeros(3), jnp.eye(3), (4,)),
      "orthogonal": lambda k: jax.random.orthogonal(wrap(k), 4),
  }
  for name, fun in calls.items():
    if quick and name not in ("normal", "split"):
      continue
    args = (KEY, X) if fun.__code__.co_argcount == 2 else (KEY,)
    yield f"jax.random.{name}", [(fun, args)]
  if not quick:  # every other sampler: (key, shape), else (key, parameter, shape)
    for name in _public(jax.random):
      if name not in calls and name not in ("key", "PRNGKey", "wrap_key_data", "key_data",
                                           "key_impl", "clone"):
        f = getattr(jax.random, name)
        yield f"jax.random.{name}", [
            (lambda k, f=f: f(wrap(k), shape), (KEY,)),
            (lambda k, f=f: f(wrap(k), 2.0, shape=shape), (KEY,)),
            (lambda k, f=f: f(wrap(k), 2.0, 3.0, shape=shape), (KEY,)),
            (lambda k, f=f: f(wrap(k), 0.0, 1.0, 2.0, shape=shape), (KEY,))]


def _optax_recipes(quick: bool):
  quick_names = ("softmax_cross_entropy", "l2_loss")
  yield from _generic("optax.losses", optax.losses, quick, quick_names, args=(X, X),
                      retry=((X, LABELS), (X,)))
  if not quick:
    lg = jax.ShapeDtypeStruct((2, 5, 4), F32)
    pads = jax.ShapeDtypeStruct((2, 5), F32)
    labels = jax.ShapeDtypeStruct((2, 3), jnp.int32)
    label_pads = jax.ShapeDtypeStruct((2, 3), F32)
    for name in ("ctc_loss", "ctc_loss_with_forward_probs"):
      yield f"optax.losses.{name}", [(getattr(optax.losses, name),
                                      (lg, pads, labels, label_pads))]
    yield "optax.losses.triplet_margin_loss", [(optax.losses.triplet_margin_loss, (X, X, X))]


def _linen_recipes(quick: bool):
  attention = nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=8)
  layers: dict[str, tuple[Any, Any, dict[str, Any]]] = {
      "Dense": (nn.Dense(5), X, {}),
      "LayerNorm": (nn.LayerNorm(), X, {}),
      "Conv": (nn.Conv(4, (3, 3)), IMAGES, {}),
      "Embed": (nn.Embed(10, 4), LABELS, {}),
      "BatchNorm": (nn.BatchNorm(use_running_average=False), X, {"mutable": ["batch_stats"]}),
      "GroupNorm": (nn.GroupNorm(num_groups=2), X, {}),
      "RMSNorm": (nn.RMSNorm(), X, {}),
      "Dropout": (nn.Dropout(0.5, deterministic=False), X, {"rngs": {
          "dropout": jax.random.key(1)}}),
      "MultiHeadDotProductAttention": (attention, SEQS, {}),
      "RNN(LSTMCell)": (nn.RNN(nn.LSTMCell(4)), SEQS, {}),
      "RNN(GRUCell)": (nn.RNN(nn.GRUCell(4)), SEQS, {}),
  }
  for name, (layer, arg, kw) in layers.items():
    if quick and name not in ("Dense", "LayerNorm"):
      continue
    variables = jax.eval_shape(layer.init, {"params": jax.random.key(0),
                                            "dropout": jax.random.key(1)}, arg)
    params = variables.get("params", {})
    rest = {c: v for c, v in variables.items() if c != "params"}

    def call(p, r, a, layer=layer, kw=kw):
      return layer.apply({"params": p, **r}, a, **kw)

    yield f"flax.linen.{name}", [(call, (params, rest, arg))]
  if not quick:
    yield "flax.linen.max_pool", [(lambda a: nn.max_pool(a, (2, 2), (2, 2)), (IMAGES,))]
    yield "flax.linen.avg_pool", [(lambda a: nn.avg_pool(a, (2, 2), (2, 2)), (IMAGES,))]


def _nnx_recipes(quick: bool):
  def made():
    rngs = nnx.Rngs(0, dropout=1)
    yield "Linear", nnx.Linear(6, 5, rngs=rngs), X
    yield "LayerNorm", nnx.LayerNorm(6, rngs=rngs), X
    if quick:
      return
    yield "Conv", nnx.Conv(3, 4, (3, 3), rngs=rngs), IMAGES
    yield "Embed", nnx.Embed(10, 4, rngs=rngs), LABELS
    yield "BatchNorm", nnx.BatchNorm(6, rngs=rngs), X
    yield "GroupNorm", nnx.GroupNorm(6, num_groups=2, rngs=rngs), X
    yield "RMSNorm", nnx.RMSNorm(6, rngs=rngs), X
    yield "Dropout", nnx.Dropout(0.5, rngs=rngs), X
    yield "MultiHeadAttention", nnx.MultiHeadAttention(2, 3, 8, decode=False, rngs=rngs), SEQS
    yield "RNN(LSTMCell)", nnx.RNN(nnx.LSTMCell(3, 4, rngs=rngs)), SEQS
    yield "RNN(GRUCell)", nnx.RNN(nnx.GRUCell(3, 4, rngs=rngs)), SEQS

  for name, module, arg in made():
    graphdef, params, rest = nnx.split(module, nnx.Param, ...)

    def call(p, r, a, graphdef=graphdef):
      return nnx.merge(graphdef, p, r)(a)

    yield f"flax.nnx.{name}", [(call, (_abstract(params), _abstract(rest), arg))]


def _abstract(tree: Any) -> Any:
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)


def _public(module: Any) -> list[str]:
  return sorted(n for n in dir(module) if not n.startswith("_") and n not in SKIPPED
                and callable(getattr(module, n)) and not isinstance(getattr(module, n), type))


def _generic(prefix: str, module: Any, quick: bool, quick_names: tuple[str, ...],
             args: tuple[Any, ...] = (X,), retry: tuple[tuple[Any, ...], ...] = ()):
  """Every public function of ``module`` (``--quick``: ``quick_names``) that no recipe
  names, called with ``args`` or, where that fails to trace, the next of
  :data:`ALTERNATIVES` (``retry`` first)."""
  for name in quick_names if quick else _public(module):
    if name in CURATED:
      continue
    fun = getattr(module, name)
    tries = [(fun, a) for a in (args, *retry)]
    tries += [(lambda *a, f=fun, call=call: call(f, *a), a) for call, a in ALTERNATIVES]
    yield f"{prefix}.{name}", tries


# Generic calls, in turn, for a function the first arguments do not fit.
ALTERNATIVES: list[tuple[Callable[..., Any], tuple[Any, ...]]] = [
    (lambda f, a, b: f(a, b), (X, X)),
    (lambda f, a, b: f(a, b), (SQUARE, SQUARE)),
    (lambda f, a: f(a), (INTS,)),
    (lambda f, a, b: f(a, b), (INTS, INTS)),
    (lambda f, a: f(a, 1), (X,)),
    (lambda f, a: f(a, 1), (INTS,)),
    (lambda f, a, i: f(a, i), (X, LABELS)),
    (lambda f, a: f(a, a > 0), (X,)),
    (lambda f: f((4, 6)), ()),
    (lambda f: f(4), ()),
    (lambda f, a: f(a[0]), (X,)),
    (lambda f, a: f(a, 0, 1), (X,)),
    (lambda f, a: f(a, (6, 4)), (X,)),
    (lambda f, a: f(a[0], (4, 6)), (X,)),
    (lambda f, a: f(a, (2, 1, 3)), (jax.ShapeDtypeStruct((4, 6, 2), F32),)),
]
# Functions with a recipe of their own (not called generically).
CURATED = {"einsum", "take_along_axis", "where", "argsort", "unique", "histogram", "cov",
           "convolve", "cholesky", "one_hot", "dot_product_attention", "ctc_loss",
           "ctc_loss_with_forward_probs", "triplet_margin_loss", "put_along_axis", "take",
           "searchsorted", "bincount", "choose", "repeat", "tile", "roll"}


def traced(tries: list[tuple[Callable[..., Any], tuple[Any, ...]]]) -> list[Any]:
  """The jaxprs of the first ``(function, abstract arguments)`` of ``tries`` that traces,
  and of its gradient with respect to its float arguments where it has one; [] where
  none traces."""
  for fun, args in tries:
    try:
      with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        found = [jax.make_jaxpr(fun)(*args)]
        found.extend(_gradient(fun, args))
        return found
    except Exception:  # noqa: BLE001 - a call this signature does not fit
      continue
  return []


def _gradient(fun: Callable[..., Any], args: tuple[Any, ...]) -> list[Any]:
  floats = [i for i, a in enumerate(args) if all(
      jnp.issubdtype(leaf.dtype, jnp.floating) for leaf in jax.tree.leaves(a))]
  if not floats:
    return []

  def total(*a):
    leaves = [jnp.real(leaf) for leaf in jax.tree.leaves(fun(*a))
              if jnp.issubdtype(leaf.dtype, jnp.inexact)]
    return sum((jnp.sum(leaf.astype(F32)) for leaf in leaves), jnp.zeros((), F32))

  try:
    return [jax.make_jaxpr(jax.grad(total, argnums=floats))(*args)]
  except Exception:  # noqa: BLE001 - not differentiable (integer outputs, a custom rule)
    return []


def primitives(closed: Any) -> set[str]:
  """The primitives of a jaxpr, through every sub-jaxpr."""
  return {e.primitive.name for eqn in closed.jaxpr.eqns for e in eqns_within(eqn)}


def coverage(quick: bool) -> dict[str, Any]:
  """The primitives seen (name -> the first call that emitted it), those with a rule and
  those without (name -> reason), and the calls that did not trace."""
  seen: dict[str, str] = {}
  failed: list[str] = []
  calls = 0
  for name, tries in recipes(quick):
    jaxprs = traced(tries)
    calls += 1
    if not jaxprs:
      failed.append(name)
    for closed in jaxprs:
      for prim in sorted(primitives(closed)):
        seen.setdefault(prim, name)
  ruled = {p for p in seen if p in RULES or p in CALL_RULES}
  without = {p: REASONS.get(p, "no rule yet") for p in sorted(set(seen) - ruled)}
  return {"calls": calls, "seen": seen, "ruled": sorted(ruled), "without": without,
          "failed": failed}


def study(args: argparse.Namespace) -> None:
  """``run.py --study coverage``: prints the counts and the table of primitives without a
  rule (``--quick``: a few calls of each family)."""
  found = coverage(args.quick)
  seen, without = found["seen"], found["without"]
  print(f"calls traced: {found['calls'] - len(found['failed'])} of {found['calls']}")
  print(f"primitives seen: {len(seen)}, with a rule: {len(found['ruled'])}, "
        f"without: {len(without)}")
  print(f"with a rule: {', '.join(found['ruled'])}")
  print(f"did not trace generically: {', '.join(found['failed']) or 'none'}")
  print("\n| primitive | first emitted by | why no rule |\n|---|---|---|")
  for prim, reason in without.items():
    print(f"| `{prim}` | `{seen[prim]}` | {reason} |")
