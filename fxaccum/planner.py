"""Choosing k: the fewest micro-batches whose compiled train step fits a memory budget.

:func:`plan_micro_batches` compiles the user's train step for candidate numbers of
micro-batches, in ascending order, and reads each compiled program's memory figures
(``compiled.memory_analysis()``: per device of the SPMD program). Nothing runs on the
devices. It stops at the first candidate whose peak fits the budget: fewer micro-batches
run faster (fewer, larger matmuls per step), so the smallest ``k`` that fits is the one to
train with. The compiler's figures are not monotone in ``k`` (buffer assignment, fusion and
the optimizer's temporaries change with the loop's shapes), so the planner never bisects
and never extrapolates: it compiles every candidate up to the one it chooses.
"""

from __future__ import annotations

import contextlib
import dataclasses
import operator
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, NamedTuple

import jax

from fxaccum import split
from fxaccum.diagnostics import _memory_of

__all__ = ["BUDGET_MARGIN", "Plan", "PlanRow", "plan_micro_batches"]

#: With ``budget_bytes=None`` the budget is the device's ``memory_stats()["bytes_limit"]``
#: less this fraction. The compiled figures are XLA's buffer assignment for the step; they
#: leave out what the allocator and the runtime add around it (fragmentation, cuBLAS /
#: cuDNN workspaces, collective staging buffers) and every array that lives outside the
#: step (the next batch being prefetched, metrics, an evaluation copy of the params). 10 %
#: of the device's memory is a margin for those, not a measured figure: pass
#: ``budget_bytes=`` for another.
BUDGET_MARGIN = 0.10

_MIB = float(1 << 20)


class PlanRow(NamedTuple):
  """One compiled candidate of :func:`plan_micro_batches`.

  Attributes:
    micro_batches: the candidate ``k``.
    peak_bytes: the compiled step's peak per device: temp + arguments + outputs - aliased
      (donated arguments whose buffers the outputs reuse count once).
    temp_bytes: its temporaries per device (activations, gradient accumulators, the
      optimizer's intermediates).
    compile_seconds: wall time of ``make_step(k)``, tracing, lowering and compiling.
    fits: ``peak_bytes <= budget_bytes``.

  Example:
    >>> from fxaccum import PlanRow
    >>> row = PlanRow(micro_batches=4, peak_bytes=3 << 20, temp_bytes=1 << 20,
    ...               compile_seconds=0.4, fits=True)
    >>> row.peak_bytes / 2**20, row.fits
    (3.0, True)
  """

  micro_batches: int
  peak_bytes: int
  temp_bytes: int
  compile_seconds: float
  fits: bool


@dataclasses.dataclass(frozen=True)
class Plan:
  """What :func:`plan_micro_batches` chose, the table it chose from, and the compiled step.

  ``str(plan)`` (or :meth:`format`) is the table, in MiB per device.

  Attributes:
    micro_batches: the smallest candidate ``k`` whose compiled step fits the budget.
    step: that step compiled (a ``jax.stages.Compiled``), ready to call with arrays of the
      example arguments' shapes, dtypes and shardings; its donations hold.
    table: one :class:`PlanRow` per compiled candidate, ascending in ``k``; the last row
      is the chosen ``k``, every row before it did not fit.
    budget_bytes: the budget per device the candidates were held to.

  Example:
    >>> from fxaccum import Plan, PlanRow
    >>> rows = (PlanRow(1, 5 << 20, 4 << 20, 0.41, False),
    ...         PlanRow(2, 3 << 20, 2 << 20, 0.45, True))
    >>> plan = Plan(micro_batches=2, step=None, table=rows, budget_bytes=4 << 20)
    >>> print(plan)
     k  peak MiB  temp MiB  compile s  fits
     1      5.00      4.00       0.41  no
     2      3.00      2.00       0.45  yes
    budget 4.00 MiB per device: micro_batches=2
  """

  micro_batches: int
  step: Any
  table: tuple[PlanRow, ...]
  budget_bytes: int

  @property
  def peak_bytes(self) -> int:
    """The chosen step's compiled peak per device (its row's ``peak_bytes``)."""
    return self.table[-1].peak_bytes

  def format(self) -> str:
    """The table, aligned, in MiB per device, and the choice."""
    return (f"{format_table(self.table)}\nbudget {self.budget_bytes / _MIB:.2f} MiB per device: "
            f"micro_batches={self.micro_batches}")

  def __str__(self) -> str:
    return self.format()


def format_table(rows: Iterable[PlanRow]) -> str:
  """Rows of a plan as an aligned text table in MiB per device."""
  lines = [f"{'k':>2}  {'peak MiB':>8}  {'temp MiB':>8}  {'compile s':>9}  fits"]
  for row in rows:
    lines.append(f"{row.micro_batches:>2}  {row.peak_bytes / _MIB:>8.2f}  "
                 f"{row.temp_bytes / _MIB:>8.2f}  {row.compile_seconds:>9.2f}  "
                 f"{'yes' if row.fits else 'no'}")
  return "\n".join(lines)


def plan_micro_batches(
    make_step: Callable[[int], Any],
    *example_args: Any,
    budget_bytes: int | None = None,
    candidates: Iterable[int] | None = None,
    batch_argnums: int | Sequence[int] = 1,
    progress: bool = True,
) -> Plan:
  """Compiles ``make_step(k)`` for ascending ``k`` until its compiled peak fits the budget.

  Nothing runs on the devices: each candidate is traced, lowered and compiled for the
  example arguments (``make_step(k).lower(*example_args).compile()``), and its memory is
  read from ``compiled.memory_analysis()``: peak = temp + arguments + outputs - aliased
  bytes, per device of the SPMD program. The first (smallest) ``k`` that fits is chosen:
  fewer micro-batches is faster. The compiler's figures are not monotone in ``k``, so the
  candidates are compiled in order, never bisected or extrapolated. The chosen step comes
  back compiled (no second compile).

  The figures are the compiler's: on GPU/TPU, leave room for what it does not see (see
  ``budget_bytes``). ``micro_batches=fxaccum.MicroBatchSize(m)`` in
  :func:`fxaccum.value_and_grad` is the other way to bound activation memory: it fixes the
  rows of one micro-batch as the batch grows, where this picks ``k`` for one batch size
  from measured figures (docs/choosing_k.md).

  Args:
    make_step: ``k -> `` the jitted train step (typically with donated params and
      optimizer state) that uses ``micro_batches=k``; called once per compiled candidate.
    *example_args: the step's positional arguments: arrays, or ``jax.ShapeDtypeStruct``
      with their shardings (e.g. from ``jax.eval_shape``), so nothing need be allocated.
    budget_bytes: bytes per device the compiled peak must not exceed. ``None``: the
      device's ``memory_stats()["bytes_limit"]`` (the smallest over the devices of the
      example arguments) less 10 %, a margin for what the compiled figures leave out
      (allocator fragmentation, runtime workspaces, arrays that live outside the step);
      backends that report no limit (CPU) need it given.
    candidates: the ``k`` to try (positive ints, each dividing the batch's rows per
      device); default: every divisor of the rows per device. Sorted ascending,
      duplicates dropped.
    batch_argnums: the positional argument(s) of the step (of ``example_args``) holding
      the batch, e.g. ``2`` for a step ``(params, opt_state, batch)``. Rows per device:
      the leading dimension of their leaves divided by the devices it is sharded over
      (read from each array's or ``ShapeDtypeStruct``'s sharding; none: one device).
    progress: a progress bar over the compiles, where ``tqdm`` is installed.

  Returns:
    A :class:`Plan`: ``micro_batches``, ``table`` (every compiled candidate), ``step``
    (compiled for the chosen ``k``) and ``budget_bytes``.

  Raises:
    TypeError: ``make_step(k)`` returned a function that is not jitted (no ``.lower``);
      a candidate that is not an int.
    ValueError: no budget given and the backend reports no memory limit; a candidate that
      is not positive or does not divide the rows per device; batch leaves with different
      rows per device; no candidate fits (the message lists every ``k`` with its peak).
    Exception: whatever ``make_step(k)`` or the compiler raised, with a note naming ``k``.

  Example:
    >>> import jax, jax.numpy as jnp, fxaccum
    >>> def loss(w, x):
    ...   return jnp.mean(jnp.tanh(x @ w) ** 2)
    >>> def make_step(k):
    ...   grad = fxaccum.grad(loss, micro_batches=k)
    ...   return jax.jit(lambda w, x: w - 0.1 * grad(w, x), donate_argnums=0)
    >>> w = jax.ShapeDtypeStruct((16, 256), jnp.float32)
    >>> x = jax.ShapeDtypeStruct((512, 16), jnp.float32)
    >>> roomy = fxaccum.plan_micro_batches(make_step, w, x, budget_bytes=1 << 30,
    ...                                    progress=False)
    >>> roomy.micro_batches, len(roomy.table)   # k = 1 fits: one compile
    (1, 1)
    >>> tight = fxaccum.plan_micro_batches(make_step, w, x, progress=False,
    ...                                    budget_bytes=roomy.peak_bytes // 2)
    >>> tight.micro_batches > 1, tight.peak_bytes <= tight.budget_bytes
    (True, True)
    >>> [row.fits for row in tight.table][-2:]   # all before the last did not fit
    [False, True]
    >>> tight.step(jnp.ones((16, 256)), jnp.ones((512, 16))).shape
    (16, 256)
  """
  argnums = split.as_argnums(batch_argnums, "plan_micro_batches: batch_argnums",
                             count=len(example_args))
  if not argnums:
    raise ValueError("plan_micro_batches: batch_argnums is empty; name the batch argument(s).")
  rows = split.rows_per_device([example_args[i] for i in argnums], argnums)
  ks = _candidates(candidates, rows)
  if budget_bytes is None:
    budget = _default_budget(example_args)
  else:
    budget = _check_budget(budget_bytes)

  table: list[PlanRow] = []
  bar = _progress_bar(len(ks)) if progress else None
  try:
    for k in ks:
      if bar is not None:
        bar.set_postfix_str(f"k={k}", refresh=True)
      row, compiled = _compile(make_step, k, example_args, budget)
      table.append(row)
      if bar is not None:
        bar.update(1)
      if row.fits:
        return Plan(micro_batches=k, step=compiled, table=tuple(table), budget_bytes=budget)
  finally:
    if bar is not None:
      bar.close()
  larger = [d for d in range(ks[-1] + 1, rows + 1) if rows % d == 0][:3]
  more = (f"try larger k (candidates=, e.g. {larger}; divisors of the {rows} rows per "
          "device), " if larger else "")
  peaks = ", ".join(f"k={r.micro_batches}: {r.peak_bytes} bytes ({r.peak_bytes / _MIB:.2f} MiB)"
                    for r in table)
  raise ValueError(
      f"plan_micro_batches: no candidate fits the budget of {budget} bytes "
      f"({budget / _MIB:.2f} MiB) per device. Compiled peaks per device: {peaks}.\n"
      f"{format_table(table)}\n"
      f"Give a larger budget_bytes, {more}or shrink what k does not: params and optimizer "
      "state (shard them over the data axis, FSDP) and one micro-batch's activations "
      "(jax.checkpoint).")


@contextlib.contextmanager
def _noted(where: str) -> Iterator[None]:
  """Runs the user's code, adding to what it raises a note saying where the planner was."""
  try:
    yield
  except Exception as err:  # noqa: BLE001 - the user's code: a note added, re-raised
    err.add_note(f"fxaccum.plan_micro_batches: {where}")
    raise


def _compile(make_step: Callable[[int], Any], k: int, example_args: Sequence[Any],
             budget: int) -> tuple[PlanRow, Any]:
  """``make_step(k)`` compiled for the example arguments, and its row of the table."""
  start = time.perf_counter()
  with _noted(f"raised by make_step({k}) (micro_batches={k})."):
    step = make_step(k)
  if not callable(getattr(step, "lower", None)):
    raise TypeError(
        f"plan_micro_batches: make_step({k}) returned a {type(step).__name__!r}, which has "
        "no .lower(): the planner compiles the step ahead of time without running it, "
        "so make_step must return a jitted function. Wrap the step in jax.jit, e.g. "
        "`return jax.jit(train_step, donate_argnums=(0, 1))`.")
  with _noted(f"raised while compiling make_step({k}) (micro_batches={k}) for the "
              "example arguments."):
    compiled = step.lower(*example_args).compile()
  seconds = time.perf_counter() - start
  memory = _memory_of(compiled)
  if memory is None:
    raise ValueError(
        f"plan_micro_batches: the {jax.default_backend()} backend gives no "
        "memory_analysis() for the compiled step, so its memory cannot be read.")
  peak = memory.peak_bytes
  return PlanRow(micro_batches=k, peak_bytes=peak, temp_bytes=memory.temp_bytes,
                 compile_seconds=seconds, fits=peak <= budget), compiled


def _candidates(candidates: Iterable[int] | None, rows: int) -> tuple[int, ...]:
  """The candidate ``k``, validated, ascending, without duplicates."""
  if candidates is None:
    return tuple(k for k in range(1, rows + 1) if rows % k == 0)
  if isinstance(candidates, int):
    raise TypeError(
        f"plan_micro_batches: candidates must be an iterable of ints, got the int "
        f"{candidates!r}; e.g. candidates=[{candidates}].")
  values = [split.check_micro_batches(k, "plan_micro_batches: each of candidates")
            for k in candidates]
  if not values:
    raise ValueError("plan_micro_batches: candidates is empty.")
  ks = tuple(sorted(set(values)))
  bad = [k for k in ks if rows % k]
  if bad:
    raise ValueError(
        f"plan_micro_batches: candidate(s) {', '.join(map(str, bad))} do not divide the "
        f"batch's {rows} rows per device (each micro-batch needs the same rows on every "
        f"device); divisors: {[k for k in range(1, rows + 1) if rows % k == 0]}.")
  return ks


def _check_budget(budget_bytes: Any) -> int:
  if isinstance(budget_bytes, bool):
    raise TypeError(f"plan_micro_batches: budget_bytes must be a positive int, got "
                    f"{budget_bytes!r}.")
  try:
    budget = operator.index(budget_bytes)
  except TypeError:
    if isinstance(budget_bytes, float) and budget_bytes.is_integer():
      budget = int(budget_bytes)
    else:
      raise TypeError(f"plan_micro_batches: budget_bytes must be a positive int (bytes per "
                      f"device), got {budget_bytes!r}.") from None
  if budget <= 0:
    raise ValueError(f"plan_micro_batches: budget_bytes must be positive, got {budget}.")
  return budget


def _default_budget(example_args: Sequence[Any]) -> int:
  """The smallest ``bytes_limit`` of the example arguments' devices, less the margin."""
  devices: set[Any] = set()
  for leaf in jax.tree.leaves(example_args):
    sharding = getattr(leaf, "sharding", None)
    if isinstance(sharding, jax.sharding.Sharding):
      try:
        devices |= set(sharding.device_set)
      except Exception:  # an abstract mesh (e.g. from jax.eval_shape) names no devices
        pass
  local = sorted((d for d in devices if d.process_index == jax.process_index()),
                 key=lambda d: d.id) or jax.local_devices()[:1]
  limits = []
  for device in local:
    try:
      stats = device.memory_stats()
    except Exception:  # backends without the call
      stats = None
    if not stats or "bytes_limit" not in stats:
      raise ValueError(
          f"plan_micro_batches: budget_bytes=None reads the device's "
          f"memory_stats()['bytes_limit'], which {device.platform} device {device.id} does "
          "not report. Pass budget_bytes= (bytes per device), e.g. budget_bytes=2 << 30 for "
          "2 GiB.")
    limits.append(int(stats["bytes_limit"]))
  return int(min(limits) * (1 - BUDGET_MARGIN))


def _progress_bar(total: int) -> Any:
  """A tqdm bar over the compiles, or None where tqdm is not installed."""
  try:
    from tqdm.auto import tqdm
  except ImportError:
    return None
  return tqdm(total=total, desc="plan_micro_batches", unit="compile", leave=False)
