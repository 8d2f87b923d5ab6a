"""The one-time warning on a PRNG key that every micro-batch shares but draws per example.

Arguments outside ``batch_argnums`` and ``rng_argnums`` reach every micro-batch whole, so
a key among them gives each micro-batch the same random values. That is right for a draw
every example shares (a random projection), and wrong for per-example noise (dropout
masks), which then repeats from one micro-batch to the next. :func:`warn_shared_keys`
traces the loss once per function, with a symbolic number of rows, and warns where a draw
along the batch axis comes from such a key (:mod:`fxaccum.analysis.randomness`).
"""

from __future__ import annotations

import functools
import warnings
import weakref
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from fxaccum.analysis import randomness
from fxaccum.instep.attempts import attempt

__all__ = ["looked_at", "warn_shared_keys"]

# Functions already looked at: the warning, and the trace, come once per function.
_SEEN: weakref.WeakSet[Any] = weakref.WeakSet()
_SEEN_IDS: set[int] = set()  # functions that take no weak reference


def _first_time(fun: Any) -> bool:
  try:
    seen = fun in _SEEN
    _SEEN.add(fun)
  except TypeError:
    seen = id(fun) in _SEEN_IDS
    _SEEN_IDS.add(id(fun))
  return not seen


def looked_at(fun: Any) -> None:
  """Marks ``fun`` as looked at: no warning for it (``micro_batched``'s backward loss,
  whose keys ``micro_batched`` itself looked at)."""
  _first_time(fun)


def warn_shared_keys(fun: Any, args: Sequence[Any], kwargs: dict, *, micro_batches: int,
                     batch_argnums: Sequence[int], named: set[int],
                     name: str | None = None) -> None:
  """Warns once per function where a shared key draws values along the batch axis, and
  ``micro_batches`` share it (one micro-batch shares it with none).

  ``named``: the positions that are not shared as given (differentiated, split, folded,
  threaded: an ``nnx.Rngs`` advances per micro-batch); ``name``: the function as the
  warning names it."""
  if micro_batches == 1 or not _first_time(fun):
    return
  offsets, inputs = 0, {}
  for i, arg in enumerate(args):
    leaves = jax.tree.leaves(arg)
    if i not in named:
      inputs.update({offsets + j: i for j, leaf in enumerate(leaves)
                     if randomness.is_key(leaf)})
    offsets += len(leaves)
  if not inputs:
    return
  # None: no symbolic trace (a hint, not a check)
  draws = attempt(_draws, fun, batch_argnums, args, kwargs, sorted(inputs)).value
  if draws:
    positions = sorted({inputs[i] for i in draws})
    what = ", ".join(sorted({d for found in draws.values() for d in found}))
    warnings.warn(
        f"fxaccum: argument(s) {positions} of {name or getattr(fun, '__name__', 'the loss')} "
        f"hold a PRNG key that every micro-batch shares, and it draws random values "
        f"along the batch axis from it ({what}), e.g. dropout masks: every micro-batch "
        f"gets the same pattern. Name it in rng_argnums={positions[0]} to fold it per "
        "micro-batch (jax.random.fold_in(key, i)), unless the micro-batches should share "
        "it.", UserWarning, stacklevel=4)


def _draws(fun: Any, batch_argnums: Sequence[int], args: Sequence[Any], kwargs: dict,
           inputs: list[int]) -> dict[int, list[str]]:
  """Per key input (flat index), the draws along the batch axis the loss makes from it."""
  (rows,) = jax.export.symbolic_shape("rows")
  args = list(args)
  for i in batch_argnums:
    args[i] = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct((rows, *jnp.shape(x)[1:]), jnp.result_type(x)), args[i])
  closed = jax.make_jaxpr(functools.partial(fun, **kwargs))(*args)
  found = {i: randomness.shared_key_draws(closed, [i]) for i in inputs}
  return {i: draws for i, draws in found.items() if draws}
