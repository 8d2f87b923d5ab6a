"""What `import fxaccum` loads: neither flax nor Orbax (the integrations load on first
use), and every public name still resolves."""

import subprocess
import sys

from helpers import ROOT, subprocess_env


def run(code: str) -> str:
  done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                        text=True, timeout=120, env=subprocess_env())
  assert done.returncode == 0, done.stderr[-3000:]
  return done.stdout.strip()


def test_import_loads_neither_flax_nor_orbax():
  loaded = run("import sys, fxaccum; print(sorted(m for m in sys.modules if m == 'flax' or "
               "m.startswith(('flax.', 'orbax', 'fxaccum.checkpoint', 'fxaccum.diagnostics'))))")
  assert loaded == "[]", loaded


def test_every_public_name_loads_on_first_use():
  """Each lazy name is the object its module defines, and loads its integration."""
  out = run("import sys, fxaccum\n"
            "from fxaccum import checkpoint, diagnostics, pipelining, planner\n"
            "from fxaccum.integrations import dynamic_scale, train_states\n"
            "assert all(getattr(fxaccum, n) is not None for n in fxaccum.__all__)\n"
            "assert fxaccum.TrainState is train_states.TrainState and fxaccum.Optimizer is "
            "train_states.Optimizer\n"
            "assert fxaccum.DynamicScale is dynamic_scale.DynamicScale\n"
            "assert fxaccum.pipeline is pipelining.pipeline and fxaccum.Plan is planner.Plan\n"
            "assert fxaccum.checkpoint is checkpoint and fxaccum.diagnostics is diagnostics\n"
            "print('flax' in sys.modules, 'orbax.checkpoint' in sys.modules, "
            "sorted(set(fxaccum.__all__) - set(dir(fxaccum))))")
  assert out == "True True []", out


def _fxaccum_imports() -> dict[str, set[str]]:
  """Per fxaccum module, the fxaccum modules it imports when it runs (at module level or
  in a function; not under ``if TYPE_CHECKING:``), from the source. ``from P import x``
  with ``x`` a module of P imports ``P.x``; the package's names loaded on first use
  (``fxaccum._LAZY``) count as imports of ``fxaccum``."""
  import ast

  import fxaccum
  modules = {}
  for path in (ROOT / "fxaccum").rglob("*.py"):
    parts = path.relative_to(ROOT).with_suffix("").parts
    modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path

  def skipped(node: ast.AST) -> bool:
    return (isinstance(node, ast.If) and isinstance(node.test, ast.Name)
            and node.test.id == "TYPE_CHECKING")

  graph: dict[str, set[str]] = {}
  for name, path in modules.items():
    found: set[str] = set()
    stack = list(ast.parse(path.read_text()).body)
    while stack:
      node = stack.pop()
      if skipped(node):
        continue
      stack.extend(ast.iter_child_nodes(node))
      if isinstance(node, ast.Import):
        found |= {a.name for a in node.names if a.name in modules}
      elif isinstance(node, ast.ImportFrom) and node.module in modules:
        submodules = {f"{node.module}.{a.name}" for a in node.names} & set(modules)
        found |= submodules or {node.module}
    graph[name] = found - {name}
  graph["fxaccum"] |= {module for module, _ in fxaccum._LAZY.values()}
  return graph


def test_no_import_cycle():
  graph = _fxaccum_imports()
  assert len(graph) > 20 and "fxaccum.instep.views" in graph["fxaccum.instep.invoke"]
  done: set[str] = set()

  def visit(name: str, path: list[str]) -> None:
    if name in path:
      raise AssertionError(f"import cycle: {' -> '.join(path[path.index(name):] + [name])}")
    if name in done:
      return
    for imported in sorted(graph[name]):
      visit(imported, [*path, name])
    done.add(name)

  for name in sorted(graph):
    visit(name, [])
