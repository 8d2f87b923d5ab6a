"""The examples run and their printed proofs hold (fast paths)."""

import re

from helpers import run_script


def test_train_lm_fast_path_proves_its_claims():
  out = run_script("examples/train_lm.py", "--steps", "3")
  error = float(re.search(r"gradient error vs large batch: (\S+)", out).group(1))
  assert error < 1e-5, out
  assert re.search(r"fxaccum\s+reductions in loop body: 0, reduced bytes per step: 1\.00x", out)
  assert re.search(r"plain jit\+scan\s+reductions in loop body: [1-9]", out), out


def test_crossstep_example_steps_once_per_window():
  out = run_script("examples/crossstep_lm.py", "--steps", "2")
  assert "2 optimizer steps from 8 calls; Adam count = 2" in out, out
  assert "1.00x gradient bytes inside the boundary branch; 8 bytes" in out, out


def test_resume_example_is_bit_identical_after_a_kill():
  out = run_script("examples/resume_lm.py", "--calls", "8", "--kill-at", "6")
  assert "[killed] killed after call 6 (micro_step 2)" in out, out
  assert "killed-and-resumed vs uninterrupted: bit-identical" in out, out
