"""The rule table of the view analysis, and the context a rule reads.

A rule is a pure function ``rule(ctx, kinds)`` of a :class:`Context` (one equation, the
facts the pairing of two traces found about its sizes, and a way to analyze a jaxpr it
holds) and its operands' kinds. It returns the kinds of the equation's results (one kind
for all, or a list with one per result), or a :class:`Result` that adds findings: params
used other than as a matmul operand against rows, reasons the loss cannot run inside a
manual region, positions that follow the number of rows. The interpreter merges the
findings; a rule changes nothing. Rules register with :func:`register` (equations whose
operands the interpreter has read, ``RULES``) or :func:`register_call` (equations holding
sub-jaxprs, which see their operands' params and call the interpreter back through
``ctx.inner``, ``CALL_RULES``), as JAX registers its own per-primitive rules.

What the interpreter and the pairing know of a primitive besides its rule (a param stays
itself through it, it keeps a bound on its elements, JAX leaves it out where it changes
nothing, which of its parameters may follow the rows) is a :class:`Facts` record in a
third table, ``FACTS``, filled with :func:`register_facts` by the rule module that holds
the primitive's rule: adding a primitive touches that one module.

Owns the three tables, :class:`Context` and :class:`Result`. May import :mod:`.kinds` and
:mod:`.eqns` (:mod:`.pairing` for types only: it reads ``FACTS``); the rule modules
(:mod:`fxaccum.analysis.rules`), the pairing and the interpreter import it, and it imports
none of them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

from fxaccum.analysis.eqns import with_place
from fxaccum.analysis.kinds import Exp, Kind

if TYPE_CHECKING:  # the pairing reads FACTS: a run-time import would be circular
  from fxaccum.analysis.pairing import Pairing

__all__ = ["CALL_RULES", "FACTS", "READS_BLOCKS", "RULES", "Bound", "Context", "Facts",
           "Inner", "Operands", "Out", "Result", "Rule", "facts_of", "register",
           "register_call", "register_facts"]


@dataclasses.dataclass(frozen=True)
class Result:
  """A rule's answer with findings.

  Attributes:
    kinds: the kind of every result (one kind), or a list with one kind per result.
    not_reducible: indices of params this equation uses other than through a cast into
      a matmul against batch rows (see ``Analysis.reducible``).
    blockers: why the loss cannot run inside a region manual over the data axes.
    sized_positions: an index or position operand followed the number of rows.
  """

  kinds: Kind | list[Kind]
  not_reducible: frozenset[int] = frozenset()
  blockers: tuple[str, ...] = ()
  sized_positions: bool = False


Out = Kind | list[Kind] | Result  # what a rule returns
# A rule's operands' kinds. Typed loosely on purpose: the interpreter answers an equation
# with a Top operand itself (except a call rule's), and a rule reads the attributes of
# the kinds it has tested for (or that its primitive's typing rule guarantees).
Operands = Sequence[Any]
# ``inner(jaxpr, kinds, sources, partner=None)``: the kinds of the outputs of a jaxpr
# (closed or open) an equation holds, given its inputs' kinds and which inputs are params
# (position -> param index); with ``partner`` (the same jaxpr in the partner trace) the
# two are paired first, and :class:`~fxaccum.analysis.kinds.Unpaired` says they differ.
Inner = Callable[..., list[Kind]]


@dataclasses.dataclass(frozen=True)
class Context:
  """What a rule may read about its equation.

  Attributes:
    eqn: the equation.
    pairing: the facts of the two traces (read only).
    sources: operand position -> index of the param it is (through casts).
    inner: analyzes a jaxpr the equation holds (see :data:`Inner`).
  """

  eqn: Any
  pairing: Pairing
  sources: Mapping[int, int]
  inner: Inner

  @property
  def rows(self) -> Any:
    """The global number of rows (a symbolic dimension in symbolic mode)."""
    return self.pairing.rows

  @property
  def base(self) -> float | None:
    """``D``: the global rows over the partner trace's rows; None without a partner."""
    return self.pairing.base

  @property
  def symbol(self) -> Any:
    """The symbolic number of rows, or None when sizes are numbers."""
    return self.pairing.symbol

  @property
  def partner(self) -> Any:
    """The same equation in the partner trace, or None."""
    return self.pairing.partners.get(id(self.eqn))

  @property
  def changed(self) -> tuple[str, ...]:
    """The names of the parameters that differ in the partner trace."""
    return self.pairing.changed.get(id(self.eqn), ())

  def scaled_dims(self, position: int, out: bool = False) -> set[int]:
    """Dims of input (or output) ``position`` whose size follows the rows."""
    return self.pairing.scaled_dims(self.eqn, position, out)

  def size_exp(self, position: int, dims: set[int]) -> Exp:
    """How the number of elements along ``dims`` of input ``position`` scales."""
    return self.pairing.size_exp(self.eqn, position, dims)

  def partner_shape(self, position: int, out: bool = False) -> tuple[int, ...] | None:
    """The partner trace's shape of input (or output) ``position``."""
    return self.pairing.partner_shape(self.eqn, position, out)

  def place(self, what: str) -> str:
    """``what``, followed by the line of the user's code that made the equation."""
    return with_place(self.eqn, what)


Rule = Callable[[Context, Operands], Out]

RULES: dict[str, Rule] = {}
CALL_RULES: dict[str, Rule] = {}
# Primitives whose rules read :class:`~fxaccum.analysis.kinds.Blocked` operands; to every
# other rule (and before every other primitive) they are the plain Top they are.
READS_BLOCKS: set[str] = set()


def register(*names: str, reads_blocks: bool = False) -> Callable[[Rule], Rule]:
  """Registers a rule for the primitives ``names`` (see the module doc); with
  ``reads_blocks`` it is given :class:`~fxaccum.analysis.kinds.Blocked` operands."""
  if reads_blocks:
    READS_BLOCKS.update(names)
  return _adding_to(RULES, names)


def register_call(*names: str) -> Callable[[Rule], Rule]:
  """Registers the rule of primitives ``names`` that hold sub-jaxprs."""
  return _adding_to(CALL_RULES, names)


def _adding_to(table: dict[str, Rule], names: tuple[str, ...]) -> Callable[[Rule], Rule]:
  def add(rule: Rule) -> Rule:
    for name in names:
      table[name] = rule
    return rule
  return add


# How a primitive carries a bound on the magnitude of its elements: "keeps" it (moves or
# copies elements), or "sums" them (the bound times the number of elements summed).
Bound = Literal["keeps", "sums"]


@dataclasses.dataclass(frozen=True)
class Facts:
  """What the interpreter and the pairing know of a primitive besides its rule.

  Attributes:
    transparent: a param stays "the param" through it, for the reduced-type analysis
      (``Analysis.reducible``): casts, transposes, copies, placements.
    bound: how it carries a bound on the magnitude of integer elements (see
      :data:`Bound`), or None where a bound is lost.
    noop_reduction: a reduction over ``axes`` that JAX leaves out where those dims have
      size 1 (a gradient's sum over the batch when there is one row per device); its
      ``axes`` may differ from the partner's by such dims.
    noop_reshape: a reshape or broadcast that JAX leaves out where it changes nothing
      (to a dim of size 1 per device).
    shape_params: its parameters that are shapes: they may follow the rows (what reads
      along such a dim is checked by the rules).
    slice_params: its parameters that may follow the rows where it takes each dim that
      follows them whole.
  """

  transparent: bool = False
  bound: Bound | None = None
  noop_reduction: bool = False
  noop_reshape: bool = False
  shape_params: frozenset[str] = frozenset()
  slice_params: frozenset[str] = frozenset()


FACTS: dict[str, Facts] = {}
_NO_FACTS = Facts()


def register_facts(*names: str, transparent: bool = False, bound: Bound | None = None,
                   noop_reduction: bool = False, noop_reshape: bool = False,
                   shape_params: Iterable[str] = (),
                   slice_params: Iterable[str] = ()) -> None:
  """Records the :class:`Facts` of the primitives ``names`` (once per primitive, by the
  rule module that holds its rule).

  Raises:
    ValueError: a primitive's facts were registered already.
  """
  facts = Facts(transparent, bound, noop_reduction, noop_reshape, frozenset(shape_params),
                frozenset(slice_params))
  for name in names:
    if name in FACTS:
      raise ValueError(f"the facts of {name} are registered already")
    FACTS[name] = facts


def facts_of(name: str) -> Facts:
  """The facts of primitive ``name`` (none, for a primitive without a record)."""
  return FACTS.get(name, _NO_FACTS)
