"""How often fxaccum traces the loss per ``jax.jit(...).lower``: at most twice (the view
analysis's trace and the loop's) in every path: aux, Statistics, FSDP, k = 1 (once: the
loop runs the decision's trace), forced views, a key, NNX modules. Compile time grows
with each trace of a large model. Three paths take a third, pinned so they do not take
more: a loss that names the data axes in collectives (the analysis's global trace stops
at the collective; its aux and FSDP layers are then read in the per-device region, once,
where before the region read each again: 5 traces), the first call with a shared key
(the shared-key warning's own trace, once per loss function), and a global view on an
Explicit mesh whose loss fails with params typed ``reduced`` (traced again without).
A loss whose Python code computes with its number of rows takes four: its symbolic
trace fails, so the analysis traces it at the two sizes that run, then the loop.
"""

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from helpers import DATA, make_data, make_params, mesh_of, put, token_loss
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import fxaccum

FSDP_SPECS = {"w1": P(None, "data"), "b1": P("data"), "w2": P("data", None)}


def counted(loss):
  """``loss`` and a list that grows by one per trace of it."""
  traces = []

  def wrapped(*args, **kwargs):
    traces.append(None)
    return loss(*args, **kwargs)

  return wrapped, traces


def mlp_loss(params, batch):
  """Per-token squared error of a tanh MLP (plain matmuls: fine with ``reduced`` types)."""
  h = jnp.tanh(batch["x"] @ params["w1"] + params["b1"])
  return ((h @ params["w2"])[..., 0] - batch["y"]) ** 2


def weighted(params, batch, token_loss=mlp_loss):
  return fxaccum.Weighted(jnp.sum(batch["mask"] * token_loss(params, batch)),
                          jnp.sum(batch["mask"]))


def spec_indexing(params, batch):
  """helpers.token_loss: its row-parallel matmul indexes the params' PartitionSpec, which
  JAX refuses for a spec with a ``reduced`` set."""
  return weighted(params, batch, token_loss)


def with_aux(params, batch):
  return weighted(params, batch), {"rows": fxaccum.Concat(jnp.sum(batch["mask"], axis=1))}


def with_statistics(params, batch):
  return weighted(params, batch), fxaccum.Statistics()


def with_collective(params, batch):
  """Names the data axis in a collective: it traces only in the per-device region."""
  return weighted(params, batch), {"devices": jax.lax.psum(1, "data")}


def sized(params, batch):
  """Computes with its number of rows in Python: no trace for every number of rows."""
  return jnp.sum(mlp_loss(params, batch)) / max(batch["x"].shape[0], 8)


def with_dropout(params, batch, key):
  keep = jax.random.bernoulli(key, 0.5, batch["x"].shape)
  return weighted(params, {**batch, "x": jnp.where(keep, batch["x"] * 2, 0.0)})


# name: (loss, options, param specs, most traces)
CASES = {
    "plain": (weighted, {}, {}, 2),
    "aux": (with_aux, {"has_aux": True}, {}, 2),
    "statistics": (with_statistics, {"has_aux": True}, {}, 2),
    "fsdp": (weighted, {"fsdp": "zero3"}, FSDP_SPECS, 2),
    "k=1": (weighted, {"micro_batches": 1}, {}, 1),
    "collectives": (with_collective, {"view": "device", "has_aux": True}, FSDP_SPECS, 3),
    "view=device": (weighted, {"view": "device"}, {}, 2),
    "view=global": (weighted, {"view": "global"}, {}, 2),
    "folded key": (with_dropout, {"rng_argnums": 2}, {}, 2),
    "shared key": (with_dropout, {}, {}, 3),
    "no reduced types": (spec_indexing, {"view": "global"}, {}, 3),
    "rows in Python": (sized, {}, {}, 4),
}


@pytest.mark.parametrize("name", list(CASES))
def test_the_loss_is_traced_at_most_twice_per_lower(name):
  loss, options, specs, most = CASES[name]
  fun, traces = counted(loss)
  step = jax.jit(fxaccum.value_and_grad(fun, **{"micro_batches": 4, **options}))
  mesh = mesh_of((8,), ("data",), AxisType.Explicit)
  with jax.set_mesh(mesh):
    args = [put(make_params(), mesh, specs), put(make_data(k=4), mesh, DATA)]
    if "key" in name:
      args.append(jax.random.key(0))
    with pytest.warns(UserWarning) if name == "shared key" else _nothing():
      step.lower(*args)
  assert 1 <= len(traces) <= most, (name, len(traces))


def test_an_nnx_module_is_traced_at_most_twice():
  model = nnx.Linear(4, 1, rngs=nnx.Rngs(0))

  def loss(model, batch):
    return jnp.mean((model(batch["x"])[..., 0] - batch["y"]) ** 2)

  fun, traces = counted(loss)
  step = nnx.jit(fxaccum.value_and_grad(fun, micro_batches=4))
  x = jnp.ones((32, 4))
  step(model, {"x": x, "y": x[:, 0]})
  assert 1 <= len(traces) <= 2, len(traces)


class _nothing:
  def __enter__(self):
    return self

  def __exit__(self, *exc):
    return False
