"""Collectives and memory of a compiled step, read from its optimized HLO.

"Prove my step reduces once": :func:`report` compiles a function for example arguments
and lists every collective the compiled program runs — its kind, bytes, the mesh axes it
spans, and whether it sits at the top level, inside a loop body (``while``, e.g. the
micro-batch ``lax.scan``) or inside a conditional branch (``lax.cond``) — together with
the compiled memory figures.

Example:
  >>> import jax, jax.numpy as jnp, fxaccum
  >>> rep = fxaccum.diagnostics.report(jax.jit(lambda x: jnp.sin(x) * 2), jnp.ones(4))
  >>> rep.count()   # a one-device program runs no collective
  0
  >>> rep.memory.argument_bytes
  16
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import re
import warnings
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import jax
import numpy as np

from fxaccum import meshes
from fxaccum.instep import paths as paths_lib
from fxaccum.instep.paths import Path
from fxaccum.pipelining.schedules import bubble_fraction
from fxaccum.statistics import NoiseScaleEMA

__all__ = ["Collective", "Memory", "NoiseScaleEMA", "Path", "Report", "REDUCTIONS",
           "bubble_fraction", "from_compiled", "paths", "report"]

#: Collective kinds that reduce (sum) values across devices.
REDUCTIONS = ("all-reduce", "reduce-scatter")
_KINDS = (
    "all-reduce", "reduce-scatter", "all-gather", "all-to-all", "ragged-all-to-all",
    "collective-permute", "collective-broadcast",
)
_BYTES = {
    "pred": 1, "s4": 1, "u4": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
    "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
}
_ARRAY = re.compile(r"\b([a-z]\w*)\[([\d,]*)\]")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_HEADER = re.compile(r"^\s*(ENTRY\s+)?%?([\w.\-]+)\s*(?:\(.*\))?.*\{\s*$")


@dataclasses.dataclass(frozen=True)
class Collective:
  """One collective instruction of a compiled program.

  Attributes:
    kind: HLO kind without the async suffix, e.g. ``"all-reduce"``, ``"reduce-scatter"``.
    name: the instruction's name in the HLO.
    bytes: per-device payload: the larger of its operand and result sizes (the full,
      unscattered size for a reduce-scatter, the gathered size for an all-gather).
    in_loop: inside a ``while`` body (a ``lax.scan``/``fori_loop``), at any depth.
    in_conditional: inside a branch of a ``conditional`` (``lax.cond``/``switch``).
    executions: how often one call runs it: the product of the known trip counts of the
      loops around it (1 at top level; a conditional branch counts as if taken).
    axes: the mesh axes its device groups span, when a mesh was given and they match
      one; else None.

  Example:
    >>> from fxaccum.diagnostics import Collective
    >>> c = Collective(kind="all-reduce", name="all-reduce.1", bytes=64, in_loop=True,
    ...                in_conditional=False, executions=8, axes=("data",))
    >>> c.place, c.bytes * c.executions
    ('loop', 512)
  """

  kind: str
  name: str
  bytes: int
  in_loop: bool
  in_conditional: bool
  executions: int
  axes: tuple[str, ...] | None

  @property
  def place(self) -> str:
    """``"loop"``, ``"conditional"`` or ``"top"`` (innermost-first priority: loop)."""
    if self.in_loop:
      return "loop"
    return "conditional" if self.in_conditional else "top"


@dataclasses.dataclass(frozen=True)
class Memory:
  """``compiled.memory_analysis()`` figures, in bytes per device.

  Example:
    >>> from fxaccum.diagnostics import Memory
    >>> m = Memory(temp_bytes=100, argument_bytes=40, output_bytes=40, alias_bytes=40,
    ...            generated_code_bytes=0)
    >>> m.peak_bytes   # 100 + 40 + 40 - 40: a donated argument aliases the output
    140
  """

  temp_bytes: int
  argument_bytes: int
  output_bytes: int
  alias_bytes: int
  generated_code_bytes: int

  @property
  def peak_bytes(self) -> int:
    """Temp + arguments + outputs - aliased (XLA's own peak leaves temp out on CPU)."""
    return self.temp_bytes + self.argument_bytes + self.output_bytes - self.alias_bytes


@dataclasses.dataclass(frozen=True)
class Report:
  """What a compiled program communicates and how much memory it needs.

  Built by :func:`report` or :func:`from_compiled`; filter its collectives with
  :meth:`select`, :meth:`count`, :meth:`bytes_per_call` and :meth:`reductions`.
  ``paths`` lists, for each ``fxaccum.value_and_grad`` call compiled into the program,
  which view ran its loss and why (:class:`Path`).

  Example:
    >>> from fxaccum.diagnostics import Collective, Report
    >>> ar = Collective("all-reduce", "ar", 64, in_loop=True, in_conditional=False,
    ...                 executions=8, axes=("data",))
    >>> ag = Collective("all-gather", "ag", 32, in_loop=False, in_conditional=False,
    ...                 executions=1, axes=("model",))
    >>> rep = Report(collectives=(ar, ag), memory=None)
    >>> rep.count(), rep.count(place="loop"), rep.reductions(axes="model")
    (2, 1, [])
    >>> rep.bytes_per_call("all-reduce")   # 64 bytes x 8 loop iterations
    512
    >>> print(rep.summary())
    kind                place        axes                   bytes  runs
    all-reduce          loop         data                      64     8
    all-gather          top          model                     32     1
  """

  collectives: tuple[Collective, ...]
  memory: Memory | None
  paths: tuple[Path, ...] = ()

  def select(
      self,
      kind: str | Iterable[str] | None = None,
      place: str | None = None,
      axes: str | Iterable[str] | None = None,
  ) -> list[Collective]:
    """Collectives of the given kind(s), place (``top``/``loop``/``conditional``; a
    collective in a conditional inside a loop counts as ``loop``) and spanning any of the
    given mesh axes."""
    kinds = {kind} if isinstance(kind, str) else None if kind is None else set(kind)
    wanted = {axes} if isinstance(axes, str) else None if axes is None else set(axes)
    if place not in (None, "top", "loop", "conditional"):
      raise ValueError(f"place must be 'top', 'loop' or 'conditional', got {place!r}.")
    out = []
    for c in self.collectives:
      if kinds is not None and c.kind not in kinds:
        continue
      if place is not None and c.place != place:
        continue
      if wanted is not None and (c.axes is None or not wanted & set(c.axes)):
        continue
      out.append(c)
    return out

  def count(self, kind=None, place=None, axes=None) -> int:
    """Number of matching collective instructions (see :meth:`select`)."""
    return len(self.select(kind, place, axes))

  def bytes_per_call(self, kind=None, place=None, axes=None) -> int:
    """Bytes the matching collectives move in one call (bytes x executions)."""
    return sum(c.bytes * c.executions for c in self.select(kind, place, axes))

  def reductions(self, place=None, axes=None) -> list[Collective]:
    """The all-reduces and reduce-scatters (gradient reductions)."""
    return self.select(REDUCTIONS, place, axes)

  def summary(self) -> str:
    """A human-readable table."""
    lines = [f"{'kind':<20}{'place':<13}{'axes':<16}{'bytes':>12}{'runs':>6}"]
    for c in self.collectives:
      axes = ",".join(c.axes) if c.axes else "?"
      lines.append(f"{c.kind:<20}{c.place:<13}{axes:<16}{c.bytes:>12}{c.executions:>6}")
    if self.memory is not None:
      m = self.memory
      lines.append(
          f"memory: temp={m.temp_bytes} args={m.argument_bytes} out={m.output_bytes} "
          f"alias={m.alias_bytes} peak~{m.peak_bytes}"
      )
    lines.extend(f"fxaccum: {path}" for path in self.paths)
    return "\n".join(lines)


def report(fn: Callable[..., Any], *args: Any, mesh: Any = None, **kwargs: Any) -> Report:
  """Compiles ``fn`` for the example arguments and reports its collectives and memory.

  Args:
    fn: a ``jax.jit``-wrapped function (its ``donate_argnums`` etc. are kept) or a plain
      function, which is jitted.
    *args: example arguments (arrays or ``jax.ShapeDtypeStruct`` with shardings).
    mesh: the mesh, to name the axes of each collective; default: the ``jax.set_mesh``
      context mesh, else the mesh of the first argument with a ``NamedSharding``.
    **kwargs: example keyword arguments.

  Returns:
    A :class:`Report` of the compiled program. A program with no outputs (or with no
    arguments, outputs, temporaries or collectives) warns: it computes nothing, e.g. a
    step that updates flax NNX modules in place under ``jax.jit`` instead of ``nnx.jit``.

  Example:
    >>> import jax, jax.numpy as jnp, fxaccum
    >>> loss = lambda w, x: jnp.mean((x @ w) ** 2)
    >>> n = jax.device_count()
    >>> with jax.set_mesh(jax.make_mesh((n,), ("data",))):
    ...   x = jax.device_put(jnp.ones((4 * n, 3)), jax.P("data"))
    ...   rep = fxaccum.diagnostics.report(
    ...       jax.jit(fxaccum.value_and_grad(loss, micro_batches=4)), jnp.ones(3), x)
    >>> rep.reductions(place="loop")   # nothing is reduced inside the micro-batch loop
    []
    >>> grad_bytes, loss_and_weight_bytes = 3 * 4, 2 * 4   # reduced at most once per step
    >>> rep.bytes_per_call(fxaccum.diagnostics.REDUCTIONS) <= grad_bytes + loss_and_weight_bytes
    True
  """
  if not hasattr(fn, "lower"):
    fn = jax.jit(fn)
  compiled = fn.lower(*args, **kwargs).compile()
  if mesh is None:
    mesh = meshes.find_mesh(jax.tree.leaves((args, kwargs)))
  rep = _report_of(compiled, mesh)
  _warn_if_empty(compiled, rep)
  return rep


def paths(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Path]:
  """Which view each ``fxaccum.value_and_grad`` call in ``fn`` runs its loss in, and why.

  Traces and lowers ``fn`` for the example arguments (no compilation; cheaper than
  :func:`report`, whose ``paths`` say the same).

  Example:
    >>> import jax, jax.numpy as jnp, fxaccum
    >>> def centred(w, x):   # each example minus the batch mean: mixes examples
    ...   h = x * w
    ...   return jnp.mean((h - jnp.mean(h, axis=0)) ** 2)
    >>> n = jax.device_count()
    >>> with jax.set_mesh(jax.make_mesh((n,), ("data",))):
    ...   x = jax.device_put(jnp.ones((4 * n, 3)), jax.P("data"))
    ...   mean = lambda w, x: jnp.mean((x * w) ** 2)
    ...   views = [fxaccum.diagnostics.paths(
    ...       jax.jit(fxaccum.value_and_grad(f, micro_batches=2)), jnp.ones(3), x)[0].view
    ...       for f in (mean, centred)]
    >>> views
    ['device', 'global']
  """
  if not hasattr(fn, "lower"):
    fn = jax.jit(fn)
  return paths_lib.recorded(fn.lower(*args, **kwargs).as_text(debug_info=True))


def from_compiled(compiled: Any, mesh: Any = None) -> Report:
  """Builds a :class:`Report` from a ``jax.stages.Compiled``.

  Args:
    compiled: a compiled program, e.g. ``jax.jit(f).lower(*args).compile()``.
    mesh: the mesh, to name the axes of each collective (optional).

  Example:
    >>> import jax, jax.numpy as jnp, fxaccum
    >>> compiled = jax.jit(lambda x: x * 2).lower(jnp.ones(8)).compile()
    >>> rep = fxaccum.diagnostics.from_compiled(compiled)
    >>> rep.collectives, rep.memory.output_bytes
    ((), 32)
  """
  rep = _report_of(compiled, mesh)
  _warn_if_empty(compiled, rep)
  return rep


def _report_of(compiled: Any, mesh: Any) -> Report:
  text = compiled.as_text()
  return Report(tuple(parse_hlo(text, mesh)), _memory_of(compiled),
                tuple(paths_lib.recorded(text)))


EMPTY_MESSAGE = (
    "fxaccum.diagnostics: the compiled step {what}, so this report is empty: it computes "
    "nothing a caller can see. The likely cause: the step updates flax NNX modules or "
    "optimizers in place (optimizer.update(model, grads)) under jax.jit, which keeps "
    "none of those updates, so the compiler removed the whole step and nothing trains. "
    "Jit it with nnx.jit, or return the new state from the step (e.g. "
    "nnx.state((model, optimizer)), then nnx.update after the call).")


def _warn_if_empty(compiled: Any, rep: Report) -> None:
  """Warns where a compiled program has no outputs, or nothing to report at all."""
  out_tree = getattr(compiled, "out_tree", None)
  memory = rep.memory
  if out_tree is not None and out_tree.num_leaves == 0:
    what = "returns nothing (no outputs)"
  elif not rep.collectives and memory is not None and not (
      memory.temp_bytes or memory.argument_bytes or memory.output_bytes):
    what = "has no collectives and no memory (no arguments, outputs or temporaries)"
  else:
    return
  warnings.warn(EMPTY_MESSAGE.format(what=what), UserWarning, stacklevel=3)


def _memory_of(compiled: Any) -> Memory | None:
  """The compiled program's memory figures per device (None where the backend has none)."""
  analysis = compiled.memory_analysis()
  if analysis is None:
    return None
  return Memory(
      temp_bytes=int(analysis.temp_size_in_bytes),
      argument_bytes=int(analysis.argument_size_in_bytes),
      output_bytes=int(analysis.output_size_in_bytes),
      alias_bytes=int(analysis.alias_size_in_bytes),
      generated_code_bytes=int(analysis.generated_code_size_in_bytes),
  )


def parse_hlo(text: str, mesh: Any = None) -> list[Collective]:
  """Collectives of an HLO module's text, with their place in the call graph."""
  computations, entry = _computations(text)
  if entry is None:
    return []
  types = {name: _type_of(rest) for body in computations.values() for name, rest in body}
  groups_by_axes = _axis_groups(mesh) if mesh is not None else {}
  found: list[Collective] = []
  seen: set[_Place] = set()

  def visit(place: _Place) -> None:
    if place in seen or place.name not in computations:
      return
    seen.add(place)
    for inst_name, rest in computations[place.name]:
      opcode = _opcode(rest)
      if opcode.removesuffix("-start") in _KINDS and not opcode.endswith("-done"):
        operands = re.findall(r"%([\w.\-]+)", rest.split("(", 1)[1].split(")", 1)[0]) \
            if "(" in rest else []
        found.append(Collective(
            kind=opcode.removesuffix("-start"), name=inst_name,
            bytes=max(_nbytes(types[inst_name]),
                      sum(_nbytes(types.get(o, "")) for o in operands)),
            in_loop=place.in_loop, in_conditional=place.in_conditional,
            executions=place.runs, axes=_match_axes(rest, groups_by_axes)))
      for callee in _callees(place, opcode, rest):
        visit(callee)

  visit(_Place(entry, in_loop=False, in_conditional=False, runs=1))
  return found


class _Place(NamedTuple):
  """A computation as called from somewhere: inside a loop or a conditional, and how many
  times it runs per call of the program."""

  name: str
  in_loop: bool
  in_conditional: bool
  runs: int


def _computations(text: str) -> tuple[dict[str, list[tuple[str, str]]], str | None]:
  """An HLO module's computations (each a list of ``(instruction, right-hand side)``) and
  the name of its entry computation."""
  computations: dict[str, list[tuple[str, str]]] = {}
  entry = current = None
  for line in text.splitlines():
    # Computation headers are the unindented lines ending in "{"; instructions are indented.
    header = _HEADER.match(line) if not line[:1].isspace() and line.rstrip().endswith("{") \
        else None
    if header:
      current = header.group(2)
      computations[current] = []
      entry = current if header.group(1) else entry
    elif line.strip() == "}":
      current = None
    elif current is not None and (match := _INSTRUCTION.match(line)):
      computations[current].append((match.group(1), match.group(2)))
  return computations, entry


def _callees(place: _Place, opcode: str, rest: str) -> list[_Place]:
  """The computations an instruction calls: a while loop's body (its condition holds no
  collectives) runs its known trip count times; a conditional's branches run
  conditionally; ``calls``/``to_apply`` computations run where the caller runs."""
  if opcode == "while":
    trip = re.search(r'"known_trip_count":\{"n":"(\d+)"', rest)
    body = re.search(r"body=%?([\w.\-]+)", rest)
    runs = place.runs * (int(trip.group(1)) if trip else 1)
    return [place._replace(name=body.group(1), in_loop=True, runs=runs)] if body else []
  if opcode == "conditional":
    branches = re.findall(r"(?:true_computation|false_computation)=%?([\w.\-]+)", rest) + [
        b for group in re.findall(r"branch_computations=\{([^}]*)\}", rest)
        for b in re.findall(r"%?([\w.\-]+)", group)]
    return [place._replace(name=b, in_conditional=True) for b in branches]
  return [place._replace(name=c) for c in re.findall(r"(?:calls|to_apply)=%?([\w.\-]+)", rest)]


def _type_of(rest: str) -> str:
  """The result type at the start of an instruction's right-hand side."""
  if rest.startswith("("):
    depth = 0
    for i, ch in enumerate(rest):
      depth += ch == "("
      depth -= ch == ")"
      if depth == 0:
        return rest[: i + 1]
  return rest.split(" ", 1)[0]


def _opcode(rest: str) -> str:
  after_type = rest[len(_type_of(rest)):].lstrip()
  return after_type.split("(", 1)[0].strip()


def _nbytes(type_text: str) -> int:
  total = 0
  for dtype, dims in _ARRAY.findall(type_text):
    if dtype in _BYTES:
      total += _BYTES[dtype] * math.prod(int(d) for d in dims.split(",") if d)
  return total


def _axis_groups(mesh: Any) -> dict[tuple[str, ...], frozenset[frozenset[int]]]:
  """For every non-empty set of mesh axes, the device groups a collective over it has.

  Device ids are positions in the mesh's flattened device order (jit's device
  assignment for a mesh).
  """
  names = tuple(mesh.axis_names)
  shape = tuple(mesh.shape[a] for a in names)
  ids = np.arange(math.prod(shape)).reshape(shape)
  out = {}
  for r in range(1, len(names) + 1):
    for subset in itertools.combinations(range(len(names)), r):
      others = [i for i in range(len(names)) if i not in subset]
      moved = np.transpose(ids, others + list(subset)).reshape(
          -1, math.prod(shape[i] for i in subset))
      out[tuple(names[i] for i in subset)] = frozenset(frozenset(g.tolist()) for g in moved)
  return out


def _replica_groups(rest: str) -> frozenset[frozenset[int]] | None:
  explicit = re.search(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}", rest)
  if explicit:
    groups = re.findall(r"\{([\d,]*)\}", explicit.group(1))
    return frozenset(frozenset(int(i) for i in g.split(",") if i) for g in groups)
  iota = re.search(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", rest)
  if iota:
    out_shape = [int(d) for d in iota.group(1).split(",")]
    dims = [int(d) for d in iota.group(2).split(",")]
    ids = np.arange(math.prod(dims)).reshape(dims)
    if iota.group(3):
      ids = ids.transpose([int(p) for p in iota.group(3).split(",")])
    ids = ids.reshape(out_shape[0], -1)
    return frozenset(frozenset(g.tolist()) for g in ids)
  mesh_form = re.search(
      r"replica_groups=mesh\[([^\]]*)\](?:,\s*device_ids=\(\[([\d,]+)\](?:T\(([\d,]+)\))?\))?"
      r"\s*\{([^}]*)\}", rest)
  if mesh_form:
    sizes = re.findall(r"'([^']+)'=(\d+)", mesh_form.group(1))
    names = [n for n, _ in sizes]
    shape = [int(d) for _, d in sizes]
    ids = np.arange(math.prod(shape))
    if mesh_form.group(2):
      ids = ids.reshape([int(d) for d in mesh_form.group(2).split(",")])
      if mesh_form.group(3):
        ids = ids.transpose([int(p) for p in mesh_form.group(3).split(",")])
    ids = ids.reshape(shape)
    over = [names.index(a) for a in re.findall(r"'([^']+)'", mesh_form.group(4)) if a in names]
    rest_axes = [i for i in range(len(names)) if i not in over]
    ids = ids.transpose(rest_axes + over).reshape(-1, math.prod(shape[i] for i in over))
    return frozenset(frozenset(g.tolist()) for g in ids)
  return None  # a format this parser does not read


def _permute_axes(rest: str, groups_by_axes: dict) -> tuple[str, ...] | None:
  """The fewest mesh axes whose device groups hold every source-target pair."""
  pairs = re.search(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}", rest)
  if not pairs:
    return None
  moves = [tuple(int(i) for i in p.split(",")) for p in re.findall(r"\{(\d+,\d+)\}",
                                                                   pairs.group(1))]
  for axes, groups in groups_by_axes.items():
    if all(any(a in g and b in g for g in groups) for a, b in moves):
      return axes
  return None


def _match_axes(rest: str, groups_by_axes: dict) -> tuple[str, ...] | None:
  if not groups_by_axes:
    return None
  if "source_target_pairs=" in rest:
    return _permute_axes(rest, groups_by_axes)
  groups = _replica_groups(rest)
  if groups is None:
    return None
  singletons = all(len(g) == 1 for g in groups)
  if singletons:
    return ()
  for axes, axis_groups in groups_by_axes.items():
    if groups == axis_groups:
      return axes
  return None
