"""The docs: the MkDocs site builds offline without warnings, every public object has a
runnable docstring example (run by --doctest-modules), and every code block of the README
and the docs runs as written."""

import doctest
import inspect
import json
import os
import re
import select
import subprocess
import sys
import textwrap
import tomllib

import pytest
from helpers import JAX_VERSION, ROOT, version_tuple

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
               "checkpoint", "multihost", "diagnostics", "performance", "api",
               "notes/analysis_coverage", "notes/jax_workarounds"):
    assert (out_dir / f"{page}.html").is_file(), f"{page}.html was not built:\n{output}"


def test_docs_site_needs_no_network(site):
  """No script or stylesheet is loaded from another host (e.g. highlight.js from a CDN)."""
  _, out_dir = site
  remote = re.compile(r"<(?:script|link)\b[^>]*\b(?:src|href)=\"(?:https?:)?//", re.IGNORECASE)
  for page in out_dir.rglob("*.html"):
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


# A fenced python block, optionally after a marker: <!-- snippet: skip REASON --> (not run)
# or <!-- snippet: raises ERROR --> (run; must fail with ERROR, e.g. a JAX reproducer), or
# <!-- snippet: raises ERROR until JAX X.Y --> (a limit that JAX X.Y lifts: from X.Y on,
# the block must run, so the page's claim is checked on both sides of it).
BLOCK = re.compile(r"(?:<!-- snippet: (skip|raises) ([^>]*?) -->\s*\n)?([ \t]*)```python\n"
                   r"(.*?)\n[ \t]*```", flags=re.DOTALL)
PAGES = ["README.md", *sorted(p.relative_to(ROOT).as_posix()
                              for p in (ROOT / "docs").rglob("*.md"))]


def snippets():
  found = {}
  for page in PAGES:
    for index, (marker, arg, _, code) in enumerate(BLOCK.findall((ROOT / page).read_text())):
      found[f"{page}[{index}]"] = (marker, arg.strip(), textwrap.dedent(code) + "\n")
  return found


SNIPPETS = snippets()


def check_quickstart_instep(out):
  error = float(re.search(r"max relative error: (\S+)", out).group(1))
  assert error < 1e-5, out
  assert re.search(r"all-reduce\s+top\s+data\s", out), out
  assert "loop" not in out, out


def check_written_kernel(out):
  error, written = re.fullmatch(r"gradient error (\S+); kernel written: (\w+)\n", out).groups()
  assert float(error) < 1e-6 and written == "True", out


def check_calls(out):
  assert re.findall(r"call (\d): optimizer step (\d)", out) == [("3", "1"), ("7", "2")], out


def check_nnx_instep(out):
  assert len(re.findall(r"step \d: loss [\d.]+", out)) == 5, out
  assert "BatchNorm running mean moved: True" in out, out
  assert "RNG count after 5 steps of 4 micro-batches: 20" in out, out


def check_metrics(out):
  """Every marked aux leaf equals the whole batch's metric."""
  accuracy = re.search(r"accuracy\s+(\S+) whole batch: (\S+)", out).groups()
  assert abs(float(accuracy[0]) - float(accuracy[1])) < 1e-6, out
  correct = re.search(r"correct tokens\s+(\d+) whole batch: (\d+)", out).groups()
  assert correct[0] == correct[1], out
  largest = re.search(r"max \|logit\|\s+(\S+) whole batch: (\S+)", out).groups()
  assert largest[0] == largest[1], out
  assert "equal to the whole batch's: True" in out, out


def check_noise_scale(out):
  """The smoothed B_simple within 10 % of the closed form (the page's claim)."""
  found = re.search(r"B_simple (\S+), closed form (\S+)", out)
  estimate, truth = (float(v) for v in found.groups())
  assert abs(estimate / truth - 1) < 0.1, out


def check_equal_pair(out):
  a, b = (float(v) for v in out.split()[-2:])
  assert abs(a - b) <= 1e-5 * abs(b), out


def check_migrating(out):
  """docs/migrating.md's table (its script is in docs/notes/migrating.md): fxaccum exact,
  the notebooks' jax.jit step untrained and microbatch's summed gradient 3 times the
  gradient (relative error 2)."""
  errors = {line[:28].strip(): line[28:].split(",")[0] for line in out.splitlines()}
  assert float(errors["MultiSteps"]) < 1e-5 and float(errors["accumulate"]) < 1e-5, out
  assert float(errors["fxaccum.grad"]) < 1e-5, out
  assert abs(float(errors["microbatch(jax.grad) (SUM)"]) - 2) < 1e-3, out
  assert abs(float(errors["hand-written accumulator"]) - 2) < 1e-3, out
  assert out.splitlines()[2].endswith("trained nothing: True"), out


# What a snippet prints that its page claims, checked beyond "it runs".
CHECKS = {
    "docs/notes/migrating.md[0]": check_migrating,
    "docs/quickstart.md[0]": check_quickstart_instep,
    "docs/quickstart.md[1]": check_calls,
    "docs/nnx.md[0]": check_nnx_instep,
    "docs/nnx.md[1]": check_written_kernel,
    "docs/nnx.md[2]": check_calls,
    "docs/instep.md[0]": check_equal_pair,
    "docs/instep.md[1]": lambda out: "view='global'" in out or pytest.fail(out),
    "docs/instep.md[2]": lambda out: "('fsdp', None)" in out or pytest.fail(out),
    "docs/instep.md[4]": lambda out: out.split() == ["True"] or pytest.fail(out),
    "docs/instep.md[5]": lambda out: out.split() == ["True", "65536.0", "1.0"] or pytest.fail(
        out),
    "docs/instep.md[6]": lambda out: out.split() == ["0.0", "1"] or pytest.fail(out),
    "docs/instep.md[7]": check_metrics,
    "docs/normalization.md[0]": check_equal_pair,
    "docs/diagnostics.md[2]": check_noise_scale,
    "docs/pipeline.md[1]": lambda out: float(out) < 1e-6 or pytest.fail(out),
    "docs/notes/jax_workarounds.md[2]": lambda out: (
        "all-gathers" in out and (JAX_VERSION >= (0, 11) or "4 all-gathers" in out)
        or pytest.fail(out)),
    "README.md[1]": lambda out: "2 optimizer steps" in out or pytest.fail(out),
    "docs/crossstep.md[1]": lambda out: "2 optimizer steps" in out or pytest.fail(out),
}


# Runs snippets one after another in one interpreter (one per test worker), each as
# `python -c` runs it: in a fresh __main__ module, with sys.argv ["-c"], in its own working
# directory, its stdout and stderr (file descriptors 1 and 2) in files of its own, and an
# uncaught exception's traceback on its stderr and exit status 1. (A fresh interpreter for
# each snippet spent most of this file's time importing JAX, Flax and Optax again.) Each
# snippet imports what it uses: a name it does not import is a NameError, as for a reader.
# After a snippet that fails (but for one marked `raises`, as its page says), or that
# changes global state (os.environ, jax.config, a mesh left set), the runner exits and the
# next snippet gets a new interpreter. It reads one job per line on stdin and answers each
# with its exit status on a line of stdout.
RUNNER = r"""
import builtins, json, os, sys, traceback, types
import jax  # every snippet imports it; here to read its global state (it sets os.environ)

def global_state():
  return {"environ": dict(os.environ),
          "config": {k: repr(v) for k, v in jax.config.values.items()},
          "mesh": (repr(jax.sharding.get_abstract_mesh()), repr(jax.sharding.get_mesh()))}

answers = os.dup(1)
for line in sys.stdin:
  job = json.loads(line)
  before = global_state()
  os.chdir(job["cwd"])
  sys.argv = ["-c"]
  main = types.ModuleType("__main__")
  main.__builtins__ = builtins
  sys.stdout.flush(); sys.stderr.flush()
  saved = os.dup(1), os.dup(2), sys.modules["__main__"]
  with open(job["stdout"], "w") as out, open(job["stderr"], "w") as err:
    os.dup2(out.fileno(), 1); os.dup2(err.fileno(), 2)
    sys.modules["__main__"] = main
    try:
      exec(compile(job["code"], "<string>", "exec"), main.__dict__)
      status = 0
    except SystemExit as e:
      status = e.code if isinstance(e.code, int) else int(e.code is not None)
      if not isinstance(e.code, int | None):
        print(e.code, file=sys.stderr)
    except BaseException:
      traceback.print_exc()
      status = 1
    sys.stdout.flush(); sys.stderr.flush()
    sys.modules["__main__"] = saved[2]
    os.dup2(saved[0], 1); os.dup2(saved[1], 2)
    os.close(saved[0]); os.close(saved[1])
  after = global_state()
  changed = [k for k in after if after[k] != before[k]]
  os.write(answers, (json.dumps({"status": status, "changed": changed}) + "\n").encode())
  if (status != 0 and not job["raises"]) or changed:
    break
"""


class SnippetRunner:
  """The RUNNER interpreter, started on first use and again after it exits."""

  def __init__(self, tmp_dir):
    self.tmp_dir, self.process, self.count = tmp_dir, None, 0

  def run(self, code, raises=False, timeout=300):
    """Runs `code` as `python -c` would, with the suite's 8 CPU devices; returns a
    CompletedProcess (returncode, stdout, stderr). `raises`: the snippet is expected to
    fail; the interpreter goes on to the next one if it leaves global state as it was."""
    if self.process is None or self.process.poll() is not None:
      self.log = self.tmp_dir / f"runner{self.count}.log"
      with open(self.log, "w") as log:
        self.process = subprocess.Popen([sys.executable, "-c", RUNNER], cwd=self.tmp_dir,
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        stderr=log, text=True)
    self.count += 1
    cwd = self.tmp_dir / f"snippet{self.count}"
    cwd.mkdir()
    out, err = (self.tmp_dir / f"{self.count}.{name}" for name in ("stdout", "stderr"))
    job = {"code": code, "cwd": str(cwd), "stdout": str(out), "stderr": str(err),
           "raises": raises}
    self.process.stdin.write(json.dumps(job) + "\n")
    self.process.stdin.flush()
    answer = ""
    if select.select([self.process.stdout], [], [], timeout)[0]:
      answer = self.process.stdout.readline()
    if not answer:  # the interpreter died (or hung) in this snippet: its failure
      self.close()
      status = self.process.returncode or 1
    else:
      answer = json.loads(answer)
      status = answer["status"]
      if (status != 0 and not raises) or answer["changed"]:  # the runner exits: wait
        self.process.wait(timeout=60)
    read = lambda path: path.read_text() if path.exists() else ""  # noqa: E731
    stderr = read(err) + ("" if answer else f"\n[runner]\n{read(self.log)}")
    return subprocess.CompletedProcess([], status, read(out), stderr)

  def close(self):
    if self.process is not None and self.process.poll() is None:
      self.process.stdin.close()
      try:
        self.process.wait(timeout=10)
      except subprocess.TimeoutExpired:
        self.process.kill()
        self.process.wait()


@pytest.fixture(scope="module")
def snippet_runner(tmp_path_factory):
  runner = SnippetRunner(tmp_path_factory.mktemp("snippets"))
  yield runner
  runner.close()


@pytest.mark.parametrize("name", sorted(SNIPPETS))
def test_snippet_runs_as_written(name, snippet_runner):
  """Every python block of the README and the docs is a complete program: it runs on its
  own, as `python -c` runs it (see RUNNER), and prints what its page says, where CHECKS
  knows it."""
  marker, arg, code = SNIPPETS[name]
  if marker == "skip":
    pytest.skip(arg)
  result = snippet_runner.run(code, raises=marker == "raises")
  error, _, lifted_in = arg.partition(" until JAX ")
  if marker == "raises" and not (lifted_in and JAX_VERSION >= version_tuple(lifted_in)):
    assert result.returncode != 0 and error in result.stderr, (code, result.stderr[-3000:])
    return
  assert result.returncode == 0, f"{code}\n{result.stdout}\n{result.stderr[-3000:]}"
  CHECKS.get(name, lambda out: None)(result.stdout)


def test_every_page_is_scanned_for_snippets():
  assert {name.split("[")[0] for name in SNIPPETS} >= {"README.md", "docs/quickstart.md",
                                                        "docs/instep.md", "docs/pipeline.md"}
