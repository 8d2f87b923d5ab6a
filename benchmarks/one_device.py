"""fxaccum's micro-batch loop against plain ``jit`` + ``lax.scan``'s on ONE device.

A study of ``benchmarks/run.py``; run from the repository root (made for a GPU; on CPU it
runs one simulated device)::

  python benchmarks/run.py --study one-device --profile   # about 2 minutes on one H200
  python benchmarks/run.py --study one-device --quick     # tiny sizes (the test's run)

With one device there is no communication to save: the two loops should be the same
program. For the suite's MLP (``common.mlp_setup``) at k micro-batches, per variant (f32
matmul precision x XLA:GPU's programmatic dependent launch, PDL, on or off; each in its own
process, since both are read when JAX starts): ms per call of the gradient function of the
large batch, fxaccum, plain scan, and plain scan written to slice each micro-batch inside
its loop as fxaccum does (median, min, max of ``--rounds`` interleaved rounds of ``--calls`` calls
each), temp memory, the instructions in each compiled loop body, the largest gradient
difference to the large batch's and, with ``--profile``, each loop's device time per kernel
from ``jax.profiler``. Writes ``benchmarks/results/one_device.json`` (``--out``).
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile

RUN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "run.py")
# name -> (JAX_DEFAULT_MATMUL_PRECISION, extra XLA_FLAGS): f32 matmuls at full precision
# or at the default (TF32 on XLA:GPU), with or without programmatic dependent launch.
VARIANTS = {
    "f32": ("highest", ""),
    "f32-no-pdl": ("highest", "--xla_gpu_enable_pdl=false"),
    "default": ("", ""),
    "default-no-pdl": ("", "--xla_gpu_enable_pdl=false"),
}


def loop_bodies(hlo: str) -> list[int]:
  """The instruction count of each ``while`` body computation in compiled HLO text."""
  from fxaccum.diagnostics import _computations  # the project's one HLO parser

  computations, _ = _computations(hlo)
  bodies = {m.group(1) for body in computations.values() for _, rest in body
            if (m := re.search(r"body=%?([\w.\-]+)", rest))}
  return [len(computations[b]) for b in sorted(bodies)]


def kernel_ms(compiled, args, calls: int, top: int) -> list[tuple[str, float, float]]:
  """``(kernel, ms per call, launches per call)`` of the ``top`` largest device kernels."""
  import jax
  with tempfile.TemporaryDirectory() as folder:
    with jax.profiler.trace(folder):
      for _ in range(calls):
        out = compiled(*args)
      jax.block_until_ready(out)
    (path,) = glob.glob(f"{folder}/**/*.xplane.pb", recursive=True)
    data = jax.profiler.ProfileData.from_file(path)
  ns, launches = collections.Counter(), collections.Counter()
  for plane in data.planes:
    if plane.name.startswith("/device:"):
      for line in plane.lines:
        if "Stream" in line.name:
          for event in line.events:
            ns[event.name] += event.duration_ns
            launches[event.name] += 1
  return [(k, round(v / 1e6 / calls, 4), launches[k] / calls) for k, v in ns.most_common(top)]


def sliced_in_loop(loss, k: int):
  """Plain scan, but slicing micro-batch ``i`` (rows ``i::k``) inside the loop as fxaccum
  does, rather than transposing the batch once before it."""
  import jax
  import jax.numpy as jnp
  from jax import lax

  def value_and_grad(params, batch):
    rows = jax.tree.map(lambda a: a.reshape(a.shape[0] // k, k, *a.shape[1:]), batch)

    def body(carry, index):
      micro = jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, index, 1, False), rows)
      loss_value, grads = jax.value_and_grad(loss)(params, micro)
      return jax.tree.map(jnp.add, carry, (loss_value, grads)), None

    init = (jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, params))
    total, _ = lax.scan(body, init, jnp.arange(k))
    return jax.tree.map(lambda t: t / k, total)

  return value_and_grad


def child(k: int, rounds: int, calls: int, profile: bool, quick: bool) -> dict:
  """One variant's figures (JAX starts here, with this process's flags)."""
  import common  # noqa: F401 - first: XLA_FLAGS before JAX starts
  import jax
  import jax.numpy as jnp
  from common import environment, interleaved, layout_mesh, mlp_setup
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P
  from methods import plain_scan_value_and_grad

  import fxaccum

  setup = mlp_setup(quick)
  mesh = layout_mesh("replicated")
  out: dict = {"environment": environment(), "k": k}
  with jax.set_mesh(mesh):
    args = (jax.device_put(setup["params"], NamedSharding(mesh, P())),
            jax.device_put(setup["batch"], NamedSharding(mesh, P("data"))))
    fns = {"large batch": jax.value_and_grad(setup["loss"]),
           "fxaccum": fxaccum.value_and_grad(setup["loss"], micro_batches=k),
           "plain scan": plain_scan_value_and_grad(setup["loss"], k),
           "plain scan, sliced in the loop": sliced_in_loop(setup["loss"], k)}
    compiled = {name: jax.jit(fn).lower(*args).compile() for name, fn in fns.items()}
    reference = jax.block_until_ready(compiled["large batch"](*args))[1]
    for name, fn in compiled.items():
      got = jax.block_until_ready(fn(*args))[1]
      out[name] = {
          "temp_MiB": round(fn.memory_analysis().temp_size_in_bytes / 2**20, 1),
          "loop_body_instructions": loop_bodies(fn.as_text()),
          "max_grad_abs_err": max(float(jnp.max(jnp.abs(a - b))) for a, b in
                                  zip(jax.tree.leaves(got), jax.tree.leaves(reference),
                                      strict=True))}
    # ``calls`` calls per timed run, waited for once: the loop's own time, not dispatch.
    timed = interleaved({name: lambda fn=fn: [fn(*args) for _ in range(calls)][-1]
                         for name, fn in compiled.items()}, rounds, warmups=3)
    for name, (_, times, _) in timed.items():
      per_call = [t / calls for t in times]
      out[name]["ms_per_call"] = {"median": round(statistics.median(per_call), 4),
                                  "min": round(min(per_call), 4),
                                  "max": round(max(per_call), 4)}
      if profile and name != "large batch":  # device time per kernel
        out[name]["kernels"] = kernel_ms(compiled[name], args, calls, top=8)
  return out


def run_variant(name: str, argv: list[str]) -> dict:
  precision, flags = VARIANTS[name]
  env = {key: value for key, value in os.environ.items()
         if key != "JAX_DEFAULT_MATMUL_PRECISION"}
  if precision:
    env["JAX_DEFAULT_MATMUL_PRECISION"] = precision
  inherited = re.sub(r"--xla_force_host_platform_device_count=\S*", "",  # run.py's 8
                     env.get("XLA_FLAGS", ""))
  env["XLA_FLAGS"] = " ".join(filter(None, [inherited.strip(), flags,
                                            "--xla_force_host_platform_device_count=1"]))
  with tempfile.NamedTemporaryFile(suffix=".json") as f:
    subprocess.run([sys.executable, RUN, "--study", "one-device", "--child", f.name, *argv],
                   env=env, check=True)
    return json.load(open(f.name))


def study(args: argparse.Namespace) -> None:
  """``run.py --study one-device``: ``--ks`` (one k, 8), ``--rounds`` (30), ``--calls``
  (20), ``--profile``, ``--variants`` (all), ``--quick``, ``--out``
  (benchmarks/results/one_device.json); ``--child`` is how it runs each variant."""
  k = int(args.ks or 8)
  rounds, calls = (2, 2) if args.quick else (args.rounds or 30, args.calls or 20)
  from common import write_json  # imports JAX: each variant's own JAX runs in --child

  shared = ["--ks", str(k), "--rounds", str(rounds), "--calls", str(calls),
            *(["--profile"] if args.profile else []), *(["--quick"] if args.quick else [])]
  if args.child:
    write_json(args.child, child(k, rounds, calls, args.profile, args.quick))
    return
  out = args.out or "benchmarks/results/one_device.json"
  names = (args.variants or ",".join(VARIANTS)).split(",")
  results = {name: run_variant(name, shared) for name in names if name}
  write_json(out, results)
  first = next(iter(results.values()))
  methods = [m for m, figures in first.items() if isinstance(figures, dict) and
             "ms_per_call" in figures]
  print("| variant | " + " | ".join(methods) + " | fxaccum ÷ plain scan |")
  print("|---|" + "---:|" * (len(methods) + 1))
  for name, r in results.items():
    ms = {m: r[m]["ms_per_call"]["median"] for m in methods}
    print(f"| {name} | " + " | ".join(f"{ms[m]:.3f}" for m in methods) +
          f" | {ms['fxaccum'] / ms['plain scan']:.2f} |")
  print(f"\nwrote {out} ({first['environment']['device_kind']})")
