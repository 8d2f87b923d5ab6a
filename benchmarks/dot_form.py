"""The weight-gradient dot inside a per-device region (``jax.shard_map``), on XLA:CPU.

Run from the repository root::

  python benchmarks/dot_form.py        # under a minute on 2 cores

One ``nn.Dense(512)`` on a (64, 256, 128) batch sharded over 8 devices, ``jax.grad`` of a
mean-square loss, three ways: the SPMD program of ``jax.jit`` (the large batch), the same
inside ``jax.shard_map`` (fxaccum's per-device view), and inside ``shard_map`` with an
``optimization_barrier`` on every ``dot_general`` result that AD then transposes. Prints,
for each, the compiled dots (result, lhs / rhs contracting dimensions), how many of them
XLA:CPU's YNNPACK fusions the program has, and ms per call (median of 10).
"""

from __future__ import annotations

import re
import statistics
import time

import common  # noqa: F401 - first: sets XLA_FLAGS before JAX starts
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from common import md_header, md_row
from jax import lax
from jax.extend import core as jcore
from jax.extend.core import primitives
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

MODEL = nn.Dense(512)


def loss(params, x):
  return jnp.mean(nn.gelu(MODEL.apply(params, x)) ** 2)


def barriered(fn):
  """``fn`` re-run from its jaxpr, with a barrier on each dot that feeds a transpose."""
  def run(*args):
    closed = jax.make_jaxpr(fn)(*args)
    jaxpr = closed.jaxpr
    transposed = {v for e in jaxpr.eqns if e.primitive is primitives.transpose_p
                  for v in e.invars if not isinstance(v, jcore.Literal)}
    env = dict(zip(jaxpr.constvars, closed.consts, strict=True))
    env.update(zip(jaxpr.invars, jax.tree.leaves(args), strict=True))

    def read(v):
      return v.val if isinstance(v, jcore.Literal) else env[v]

    for e in jaxpr.eqns:
      out = e.primitive.bind(*map(read, e.invars), **e.primitive.get_bind_params(e.params))
      outs = list(out) if e.primitive.multiple_results else [out]
      if e.primitive is primitives.dot_general_p and e.outvars[0] in transposed:
        outs = [lax.optimization_barrier(outs[0])]
      env.update(zip(e.outvars, outs, strict=True))
    tree = jax.tree.structure(jax.eval_shape(fn, *args))
    return jax.tree.unflatten(tree, [read(v) for v in jaxpr.outvars])
  return run


def main() -> None:
  mesh = jax.make_mesh((8,), ("data",))
  x = np.random.default_rng(0).normal(size=(64, 256, 128)).astype(np.float32)
  params = MODEL.init(jax.random.key(0), x[:1])
  region = dict(mesh=mesh, in_specs=(P(), P("data")), out_specs=P())
  ways = {
      "jax.jit (SPMD, the large batch)": jax.grad(loss),
      "shard_map (per-device view)": jax.shard_map(jax.grad(loss), **region),
      "shard_map + barrier": jax.shard_map(barriered(jax.grad(loss)), **region),
  }
  lines = md_header(["program", "dots: result (lhs, rhs contracting)", "YNN fusions",
                     "ms"], 2)
  with jax.set_mesh(mesh):
    args = (jax.device_put(params, NamedSharding(mesh, P())),
            jax.device_put(x, NamedSharding(mesh, P("data"))))
    for name, fn in ways.items():
      compiled = jax.jit(fn).lower(*args).compile()
      text = compiled.as_text()
      dots = re.findall(r"= (f32\[[\d,]*\])\S* dot\(.*?lhs_contracting_dims=\{([\d,]*)\}, "
                        r"rhs_contracting_dims=\{([\d,]*)\}", text)
      in_ynn = text.count('"kind":"__ynn_fusion"')
      jax.block_until_ready(compiled(*args))
      times = []
      for _ in range(10):
        start = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        times.append((time.perf_counter() - start) * 1e3)
      lines.append(md_row([name, "; ".join(f"{r} ({a}, {b})" for r, a, b in dots),
                           in_ynn, f"{statistics.median(times):.1f}"]))
  print("\n".join(lines))


if __name__ == "__main__":
  main()
