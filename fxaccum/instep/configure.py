"""The entry points' options, checked once, when an entry point is called, into a
:class:`~fxaccum.instep.call.Config` (all static: nothing here sees an argument)."""

from __future__ import annotations

import jax.numpy as jnp

from fxaccum import meshes, split
from fxaccum.instep import fsdp as fsdp_lib
from fxaccum.instep.call import Config
from fxaccum.instep.invoke import nnx_loaded
from fxaccum.split import MicroBatchSize

__all__ = ["make_config"]


def make_config(fun, argnums, has_aux, *, micro_batches=None, batch_argnums=1,
                 rng_argnums=(), state_argnums=(), data_axes=None, param_shardings=None,
                 accumulator_dtype=jnp.float32, view="auto", fsdp="auto", skip_nonfinite=False,
                 reduce) -> Config:
  """Validates the entry points' arguments (all static) into a :class:`Config`."""
  if micro_batches is None:
    raise TypeError(
        "fxaccum needs micro_batches=k (the number of micro-batches) or "
        "micro_batches=fxaccum.MicroBatchSize(m) (the rows of one micro-batch across all "
        "data devices).")
  micro_batch_size = None
  if isinstance(micro_batches, MicroBatchSize):
    micro_batch_size, micro_batches = micro_batches.rows, 1  # k set per call from the rows
  micro_batches = split.check_micro_batches(micro_batches)
  nnx_lib = nnx_loaded()
  argnums, filters = nnx_lib.argnums_and_filters(argnums) if nnx_lib else (argnums, {})
  diff_argnums = split.as_argnums(argnums, "argnums")
  batch_argnums_t = split.as_argnums(batch_argnums, "batch_argnums")
  rng_argnums_t = split.as_argnums(rng_argnums, "rng_argnums")
  state_argnums_t = split.as_argnums(state_argnums, "state_argnums")
  _check_roles(diff_argnums, batch_argnums_t, rng_argnums_t, state_argnums_t)
  if state_argnums_t and not has_aux:
    raise ValueError(
        "state_argnums needs has_aux=True: the loss returns each threaded argument's new "
        "value in its aux, as fxaccum.State(new_value).")
  for name, value, allowed in (("view", view, ("auto", "global", "device")),
                               ("fsdp", fsdp, fsdp_lib.STRATEGIES)):
    if value not in allowed:
      raise ValueError(f"{name} must be one of {allowed}, got {value!r}.")
  accumulator_dtype = jnp.dtype(accumulator_dtype)
  if not jnp.issubdtype(accumulator_dtype, jnp.floating):
    raise TypeError(f"accumulator_dtype must be a float dtype, got {accumulator_dtype}.")
  single_argnum = isinstance(argnums, int)
  if param_shardings is not None:
    param_shardings = (param_shardings,) if single_argnum else tuple(param_shardings)
  return Config(
      fun=fun, has_aux=has_aux, micro_batches=micro_batches,
      micro_batch_size=micro_batch_size, diff_argnums=diff_argnums,
      single_argnum=single_argnum, filters=filters, batch_argnums=batch_argnums_t,
      rng_argnums=rng_argnums_t, state_argnums=state_argnums_t,
      data_axes=meshes.as_data_axes(data_axes),
      param_shardings=param_shardings, accumulator_dtype=accumulator_dtype, fsdp=fsdp,
      reduce=reduce, view=view, skip_nonfinite=bool(skip_nonfinite))


def _check_roles(diff: tuple[int, ...], batch: tuple[int, ...], rng: tuple[int, ...],
                 state: tuple[int, ...]) -> None:
  """Each positional argument has one role: differentiated, split, folded or threaded."""
  for name, other in (("batch_argnums", batch), ("rng_argnums", rng),
                      ("state_argnums", state)):
    overlap = set(diff) & set(other)
    if overlap:
      raise ValueError(
          f"argnums and {name} overlap at {sorted(overlap)}: fxaccum differentiates with "
          "respect to shared arguments only. Move the differentiated values out of the batch."
      )
  if set(batch) & set(rng):
    raise ValueError(
        f"batch_argnums and rng_argnums overlap at {sorted(set(batch) & set(rng))}; keys "
        "in the batch are already split per micro-batch, so leave them out of rng_argnums."
    )
  if set(state) & (set(batch) | set(rng)):
    raise ValueError(
        f"state_argnums {state} overlaps batch_argnums or rng_argnums: a threaded "
        "argument is neither split nor folded. Name each argument in one of them.")
