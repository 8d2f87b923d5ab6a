"""Test set-up: 8 simulated CPU devices, set before JAX initializes its backend."""

import os
from importlib import metadata

# Most of the suite's time is XLA:CPU compiling. Its LLVM backend at -O0 compiles about
# twice as fast, and on jaxlib 0.10 its older loop emitters (no MLIR fusion emitters) about
# three times as fast again (0.5 s against 1.6 s for an 8-device accumulation step). The
# XLA of jaxlib 0.11 and later no longer knows that flag, and an unknown XLA flag aborts
# the process, so it is set on 0.10 alone. XLA's HLO passes (SPMD partitioning, collectives,
# buffer assignment) depend on neither, so the collectives the tests read are the same;
# results differ at rounding level only. Subprocesses inherit them
# (helpers.subprocess_env). docs/development.md says how to run with XLA's defaults.
FAST_COMPILE = {"xla_backend_optimization_level": "0"}
if metadata.version("jaxlib").startswith("0.10."):
  FAST_COMPILE["xla_cpu_use_fusion_emitters"] = "false"
flags = os.environ.get("XLA_FLAGS", "")
for name, value in FAST_COMPILE.items():
  if name not in flags:
    flags += f" --{name}={value}"
os.environ["XLA_FLAGS"] = (flags + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# A rule of the view analysis that raises is a bug the test that found it must fail on
# (users get the global view and a one-time warning instead). Subprocesses inherit it.
os.environ.setdefault("FXACCUM_RULE_ERRORS", "raise")

import jax  # noqa: E402
import pytest  # noqa: E402

# Subprocess scripts (they pick their own device counts) and a file for mypy: not test modules.
collect_ignore = ["checkpoint_worker.py", "multihost_worker.py", "typing_usage.py"]


@pytest.fixture(autouse=True, scope="session")
def _eight_devices():
  assert jax.device_count() == 8, "tests need XLA_FLAGS=--xla_force_host_platform_device_count=8"


def pytest_collection_modifyitems(items):
  """Tests marked slow run first, the rest in file order. With --dist worksteal (pyproject)
  an idle worker takes over half of the other's queue, from its end: the long tests are
  then not left for the end, where one worker would wait while the other runs them."""
  items.sort(key=lambda item: item.get_closest_marker("slow") is None)
