"""The per-primitive facts of the view analysis (``FACTS`` in
:mod:`fxaccum.analysis.registry`): each registered once, by the rule module that holds the
primitive's rule, and none lost from the sets the interpreter and the pairing kept before
the table (written out literally here, so a fact dropped from a rule module fails)."""

from __future__ import annotations

import ast
import pathlib

import pytest

import fxaccum.analysis
from fxaccum.analysis.registry import CALL_RULES, FACTS, RULES, register_facts

RULES_DIR = pathlib.Path(fxaccum.analysis.__file__).parent / "rules"

# The interpreter's ``_KEEPS_BOUND`` and ``TRANSPARENT``, the pairing's
# ``NOOP_REDUCTIONS``, ``_NOOP_RESHAPES``, ``_SHAPE_PARAMS`` and ``_SLICE_PARAMS``.
KEEPS_BOUND = {"reduce_sum", "convert_element_type", "copy", "copy_p", "stop_gradient",
               "reshape", "squeeze", "expand_dims", "broadcast_in_dim", "transpose",
               "optimization_barrier", "sharding_constraint", "reduce_max", "reduce_min"}
TRANSPARENT = {"convert_element_type", "transpose", "copy", "copy_p", "reduce_precision",
               "sharding_constraint", "optimization_barrier"}
NOOP_REDUCTIONS = {"reduce_sum", "reduce_max", "reduce_min", "reduce_and", "reduce_or",
                   "reduce_prod"}
NOOP_RESHAPES = {"reshape", "broadcast_in_dim", "squeeze", "expand_dims"}
SHAPE_PARAMS = {
    "broadcast_in_dim": {"shape", "sharding"},
    "reshape": {"new_sizes", "sharding"},
    "iota": {"shape", "sharding"},
    "random_bits": {"shape"},
    "random_split": {"shape"},
    "rng_bit_generator": {"shape"},
    "scan": {"length"},
    "dim_as_value": {"dim"},
}
SLICE_PARAMS = {"slice": {"start_indices", "limit_indices", "strides"},
                "dynamic_slice": {"slice_sizes"}, "gather": {"slice_sizes"}}


def _facts_registered_in(path: pathlib.Path) -> list[str]:
  """The primitives whose facts the module at ``path`` registers (string arguments of its
  ``register_facts`` calls)."""
  names = []
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "register_facts":
      assert all(isinstance(a, ast.Constant) for a in node.args), (path, ast.dump(node))
      names += [a.value for a in node.args]
  return names


def test_the_table_holds_the_facts_of_before():
  assert {n for n, f in FACTS.items() if f.bound is not None} == KEEPS_BOUND
  assert {n for n, f in FACTS.items() if f.bound == "sums"} == {"reduce_sum"}
  assert {n for n, f in FACTS.items() if f.transparent} == TRANSPARENT
  assert {n for n, f in FACTS.items() if f.noop_reduction} == NOOP_REDUCTIONS
  assert {n for n, f in FACTS.items() if f.noop_reshape} == NOOP_RESHAPES
  assert {n: set(f.shape_params) for n, f in FACTS.items() if f.shape_params} == SHAPE_PARAMS
  assert {n: set(f.slice_params) for n, f in FACTS.items() if f.slice_params} == SLICE_PARAMS
  expected = (KEEPS_BOUND | TRANSPARENT | NOOP_REDUCTIONS | NOOP_RESHAPES | set(SHAPE_PARAMS)
              | set(SLICE_PARAMS))
  assert set(FACTS) == expected  # and no record without a fact


def test_each_primitive_s_facts_are_registered_in_one_rule_module_beside_its_rule():
  where: dict[str, list[str]] = {}
  for path in sorted(RULES_DIR.glob("*.py")):
    for name in _facts_registered_in(path):
      where.setdefault(name, []).append(path.stem)
  assert {n: m for n, m in where.items() if len(m) != 1} == {}
  assert set(where) == set(FACTS)
  for name, (module,) in where.items():
    rule = RULES.get(name) or CALL_RULES.get(name)
    if rule is not None:  # expand_dims has none (older JAX's broadcast)
      assert rule.__module__ == f"fxaccum.analysis.rules.{module}", name
  # nowhere else in the package
  root = RULES_DIR.parents[1]
  others = [p for p in root.rglob("*.py") if RULES_DIR not in p.parents]
  assert [p for p in others if _facts_registered_in(p)] == []


def test_facts_are_registered_once():
  with pytest.raises(ValueError, match="reduce_sum"):
    register_facts("reduce_sum", noop_reduction=True)
  assert FACTS["reduce_sum"].bound == "sums"
