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
            "from fxaccum import _flax, _dynamic_scale, _plan, _pipeline, checkpoint, "
            "diagnostics\n"
            "assert all(getattr(fxaccum, n) is not None for n in fxaccum.__all__)\n"
            "assert fxaccum.TrainState is _flax.TrainState and fxaccum.Optimizer is "
            "_flax.Optimizer\n"
            "assert fxaccum.DynamicScale is _dynamic_scale.DynamicScale\n"
            "assert fxaccum.pipeline is _pipeline.pipeline and fxaccum.Plan is _plan.Plan\n"
            "assert fxaccum.checkpoint is checkpoint and fxaccum.diagnostics is diagnostics\n"
            "print('flax' in sys.modules, 'orbax.checkpoint' in sys.modules, "
            "sorted(set(fxaccum.__all__) - set(dir(fxaccum))))")
  assert out == "True True []", out
