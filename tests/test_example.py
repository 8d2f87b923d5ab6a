"""The README's main example runs and its proof holds (fast path)."""

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_train_lm_fast_path_proves_its_claims():
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  out = subprocess.run(
      [sys.executable, str(ROOT / "examples" / "train_lm.py"), "--steps", "3"],
      capture_output=True, text=True, timeout=300, env=env, check=True,
  ).stdout
  error = float(re.search(r"gradient error vs large batch: (\S+)", out).group(1))
  assert error < 1e-5, out
  assert re.search(r"fxaccum\s+reductions in loop body: 0, reduced bytes per step: 1\.00x", out)
  assert re.search(r"plain jit\+scan\s+reductions in loop body: [1-9]", out), out


def test_crossstep_example_steps_once_per_window():
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  out = subprocess.run(
      [sys.executable, str(ROOT / "examples" / "crossstep_lm.py"), "--steps", "2"],
      capture_output=True, text=True, timeout=300, env=env, check=True,
  ).stdout
  assert "2 optimizer steps from 8 calls; Adam count = 2" in out, out
  assert "1.00x gradient bytes inside the boundary branch; 8 bytes" in out, out
