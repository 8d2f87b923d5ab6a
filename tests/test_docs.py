"""The docs: the MkDocs site builds offline without warnings, every public object has a
runnable docstring example (run by --doctest-modules), and the quick start's scripts run."""

import doctest
import inspect
import os
import re
import subprocess
import sys
import tomllib

import pytest
from helpers import ROOT

import fxaccum

# The README's command (see test_readme_has_the_docs_command); the test adds --site-dir.
README_COMMAND = 'python -m pip install -e ".[docs]" && mkdocs build --strict'
BUILD = [sys.executable, "-m", "mkdocs", "build", "--strict"]


def public_objects():
  """Every name in fxaccum.__all__ but __version__, and the functions and classes in the
  __all__ of its public submodules (checkpoint, diagnostics)."""
  found = {}
  for name in fxaccum.__all__:
    if name == "__version__":
      continue
    obj = getattr(fxaccum, name)
    found[f"fxaccum.{name}"] = obj
    if inspect.ismodule(obj):
      for member_name in obj.__all__:
        member = getattr(obj, member_name)
        if inspect.isclass(member) or inspect.isfunction(member):
          found[f"fxaccum.{name}.{member_name}"] = member
  return found


PUBLIC = public_objects()


def canonical_name(obj):
  if inspect.ismodule(obj):
    return obj.__name__
  return f"{obj.__module__}.{obj.__qualname__}"


@pytest.fixture(scope="module")
def site(tmp_path_factory):
  """Builds the site once; returns (build output, site directory)."""
  out_dir = tmp_path_factory.mktemp("docs") / "site"
  env = {**os.environ, "NO_COLOR": "1"}
  try:
    result = subprocess.run([*BUILD, "--site-dir", str(out_dir)], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=300)
  except FileNotFoundError:  # pragma: no cover
    pytest.fail("mkdocs is missing: python -m pip install -e '.[dev]'")
  output = result.stdout + result.stderr
  if "No module named mkdocs" in output:
    pytest.fail(f"mkdocs is missing: python -m pip install -e '.[dev]'\n{output}")
  assert result.returncode == 0, f"mkdocs build --strict failed:\n{output}"
  return output, out_dir


def test_docs_build_strict_without_warnings(site):
  output, out_dir = site
  assert "WARNING" not in output, output
  for page in ("index", "quickstart", "instep", "crossstep", "normalization", "sharding",
               "checkpoint", "multihost", "diagnostics", "performance", "api"):
    assert (out_dir / f"{page}.html").is_file(), f"{page}.html was not built:\n{output}"


def test_docs_site_needs_no_network(site):
  """No script or stylesheet is loaded from another host (e.g. highlight.js from a CDN)."""
  _, out_dir = site
  remote = re.compile(r"<(?:script|link)\b[^>]*\b(?:src|href)=\"(?:https?:)?//", re.IGNORECASE)
  for page in out_dir.glob("*.html"):
    hits = remote.findall(page.read_text())
    assert not hits, f"{page.name} loads remote resources: {hits}"


@pytest.mark.parametrize("name", sorted(PUBLIC))
def test_public_object_is_in_the_api_reference(site, name):
  _, out_dir = site
  html = (out_dir / "api.html").read_text()
  ids = {name, canonical_name(PUBLIC[name])}
  assert any(f'id="{i}"' in html for i in ids), (
      f"{name} is public but not in docs/api.md; add a `::: {name}` entry")


@pytest.mark.parametrize("name", sorted(PUBLIC))
def test_public_object_has_a_docstring_example(name):
  """A `>>>` example that doctest collects (pyproject's --doctest-modules runs it)."""
  obj = PUBLIC[name]
  tests = doctest.DocTestFinder(recurse=False).find(obj, name)
  assert any(t.examples for t in tests), (
      f"{name} has no `>>>` example in its docstring; add a short runnable one under "
      "`Example:` (Google style)")


def test_pytest_runs_the_docstring_examples():
  options = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"][
      "ini_options"]
  assert "--doctest-modules" in options["addopts"]
  assert "fxaccum" in options["testpaths"]


def test_readme_has_the_docs_command():
  readme = (ROOT / "README.md").read_text()
  assert README_COMMAND in readme
  extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
      "optional-dependencies"]
  docs = {re.split(r"[<>=\[]", r)[0] for r in extras["docs"]}
  assert docs <= {re.split(r"[<>=\[]", r)[0] for r in extras["dev"]}, (
      "the dev extra must carry the docs toolchain: CI installs only .[dev]")


def test_index_signatures_match_the_code():
  """docs/index.md's "API at a glance" table spells out signatures: keep them in sync."""
  text = (ROOT / "docs" / "index.md").read_text()
  rows = re.findall(r"`(fxaccum\.[\w.]+)\(([^`]*)\)`", text)
  assert len(rows) >= 8, rows
  for path, params in rows:
    obj = fxaccum
    for part in path.split(".")[1:]:
      obj = getattr(obj, part)
    documented = [p.strip().split("=")[0].lstrip("*") for p in params.split(",")]
    documented = [p for p in documented if p not in ("", "/")]
    actual = list(inspect.signature(obj).parameters)
    assert documented == actual, f"docs/index.md: {path}({params}) vs the code's {actual}"


def python_blocks(page):
  text = (ROOT / "docs" / page).read_text()
  return re.findall(r"```python\n(.*?)```", text, flags=re.DOTALL)


def test_quickstart_scripts_run():
  """The quick start's two scripts are complete programs: run them as written."""
  blocks = python_blocks("quickstart.md")
  assert len(blocks) == 2, blocks
  outputs = []
  for code in blocks:
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, f"{code}\n{result.stdout}\n{result.stderr}"
    outputs.append(result.stdout)
  error = float(re.search(r"max relative error: (\S+)", outputs[0]).group(1))
  assert error < 1e-5, outputs[0]
  assert re.search(r"all-reduce\s+top\s+data\s", outputs[0]), outputs[0]
  assert "loop" not in outputs[0], outputs[0]
  assert re.findall(r"call (\d): optimizer step (\d)", outputs[1]) == [("3", "1"), ("7", "2")]


def run_python(code: str) -> str:
  result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
  assert result.returncode == 0, f"{code}\n{result.stdout}\n{result.stderr}"
  return result.stdout


def test_nnx_page_scripts_run():
  """docs/nnx.md's in-step (BatchNorm + Dropout + nnx.Optimizer) and cross-step
  (fxaccum.Optimizer) scripts run as written and print what the page says."""
  instep, crossstep = python_blocks("nnx.md")
  out = run_python(instep)
  assert len(re.findall(r"step \d: loss [\d.]+", out)) == 5, out
  assert "BatchNorm running mean moved: True" in out, out
  assert "RNG count after 5 steps of 4 micro-batches: 20" in out, out
  out = run_python(crossstep)
  assert re.findall(r"call (\d): optimizer step (\d)", out) == [("3", "1"), ("7", "2")], out


def test_metrics_script_runs():
  """docs/instep.md#metrics: every marked aux leaf equals the whole batch's metric."""
  (code,) = python_blocks("instep.md")[-1:]
  out = run_python(code)
  accuracy = re.search(r"accuracy\s+(\S+) whole batch: (\S+)", out).groups()
  assert abs(float(accuracy[0]) - float(accuracy[1])) < 1e-6, out
  correct = re.search(r"correct tokens\s+(\d+) whole batch: (\d+)", out).groups()
  assert correct[0] == correct[1], out
  assert "equal to the whole batch's: True" in out, out
