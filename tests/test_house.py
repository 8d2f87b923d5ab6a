"""The package stays readable: module and function sizes, and exception handlers that say
what they stand for (issue 43's figures, measured here rather than by hand)."""

import ast
import pathlib
import re
import sys

import fxaccum

ROOT = pathlib.Path(fxaccum.__file__).parent
BROAD = re.compile(r"except (Exception|BaseException)\b|except\s*:")

# Broad handlers today (issue 43's targets: at most 2 in fxaccum/instep, 8 in all). The
# in-step path has one, fxaccum.instep.attempts.attempt, where a trace of the user's loss
# may raise anything. Lower these as handlers go; a new one fails here until it is
# counted (and commented) on purpose.
MOST_BROAD = {"instep": 1, "all": 8}


def sources():
  return {path: path.read_text() for path in sorted(ROOT.rglob("*.py"))}


def test_modules_and_functions_stay_short():
  """No module of fxaccum over 800 lines (of fxaccum/instep over 400), no function body
  over 60 (docstrings aside)."""
  for path, source in sources().items():
    assert len(source.splitlines()) <= (400 if path.parent.name == "instep" else 800), path
    for node in ast.walk(ast.parse(source)):
      if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        body = node.body[1:] if ast.get_docstring(node) is not None else node.body
        if body:
          assert body[-1].end_lineno - body[0].lineno < 60, (path, node.name)


def test_broad_exception_handlers_are_counted_and_commented():
  """Every ``except Exception`` says, in a comment on its line, what it stands for; their
  number does not grow."""
  found = {"instep": 0, "all": 0}
  for path, source in sources().items():
    for number, line in enumerate(source.splitlines(), 1):
      if BROAD.search(line):
        assert "#" in line, f"{path}:{number}: a broad handler without a comment"
        found["all"] += 1
        found["instep"] += path.parent.name == "instep"
  for where, most in MOST_BROAD.items():
    assert found[where] <= most, (where, found[where])


def test_the_checks_can_fail(tmp_path, monkeypatch):
  """The two checks read real files: an uncommented handler and a long function fail."""
  bad = tmp_path / "bad.py"
  bad.write_text("def f():\n" + "  x = 1\n" * 61 + "  try:\n    pass\n  except Exception:\n"
                 "    pass\n")
  monkeypatch.setattr(sys.modules[__name__], "sources", lambda: {bad: bad.read_text()})
  for check in (test_modules_and_functions_stay_short,
                test_broad_exception_handlers_are_counted_and_commented):
    try:
      check()
    except AssertionError:
      continue
    raise AssertionError(f"{check.__name__} passed on a bad file")
