"""How often fxaccum traces the loss per ``jax.jit(...).lower``, pinned per path. Compile
time grows with each trace of a large model.

Once where the per-device view runs the analysis's trace (:mod:`fxaccum.instep.replay`:
its jaxpr, traced with a symbolic number of rows, evaluated at the loop's), and for
k = 1 (the loop runs the decision's trace). Twice (the analysis's trace and the loop's)
where the loop traces the loss again: FSDP params gathered before the loss, forced
views (no symbolic trace), the global view, control flow the evaluation does not cover,
one row per device (JAX spells a size-1 broadcast otherwise). Four paths take a third:
a loss that names the data axes in collectives (the analysis's global trace stops at the
collective; its aux and FSDP layers are then read in the per-device region), the loss's
own sharding constraint over the data axes (tests/test_views.py: the decision traces the
forward pass per device; flax's logical constraints are traced once), the first call
with a shared key (the shared-key warning's own trace, once
per loss function), and a global view on an Explicit mesh whose loss fails with params
typed ``reduced`` (traced again without). A loss whose Python code computes with its
number of rows takes four: its symbolic trace fails, so the analysis traces it at the
two sizes that run, then the loop.
"""

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from helpers import (
    AXIS_TYPES,
    DATA,
    assert_tree_close,
    make_data,
    make_params,
    mesh_of,
    put,
    token_loss,
)
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import fxaccum
from fxaccum.instep import replay
from fxaccum.instep.analysed import INDEX

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


def with_scan(params, batch):
  """Runs its layer twice in a ``lax.scan``: control flow the evaluation does not cover."""
  def layer(h, _):
    return jnp.tanh(h @ params["w1"][:, :8] + params["b1"][:8]), None
  h, _ = jax.lax.scan(layer, batch["x"], None, length=2)
  pred = h @ params["w2"][:8]
  return weighted(params, batch, lambda p, b: (pred[..., 0] - b["y"]) ** 2)


# name: (loss, options, param specs, traces)
CASES = {
    "plain": (weighted, {}, {}, 1),
    "aux": (with_aux, {"has_aux": True}, {}, 1),
    "statistics": (with_statistics, {"has_aux": True}, {}, 1),
    "control flow": (with_scan, {}, {}, 2),
    "fsdp": (weighted, {"fsdp": "zero3"}, FSDP_SPECS, 2),
    "k=1": (weighted, {"micro_batches": 1}, {}, 1),
    "one row per device": (weighted, {"micro_batches": 8}, {}, 2),
    "collectives": (with_collective, {"view": "device", "has_aux": True}, FSDP_SPECS, 3),
    "view=device": (weighted, {"view": "device"}, {}, 2),
    "view=global": (weighted, {"view": "global"}, {}, 2),
    "folded key": (with_dropout, {"rng_argnums": 2}, {}, 2),
    "shared key": (with_dropout, {}, {}, 3),
    "no reduced types": (spec_indexing, {"view": "global"}, {}, 3),
    "rows in Python": (sized, {}, {}, 4),
}


@pytest.mark.parametrize("name", list(CASES))
def test_how_often_the_loss_is_traced_per_lower(name):
  loss, options, specs, expected = CASES[name]
  fun, traces = counted(loss)
  step = jax.jit(fxaccum.value_and_grad(fun, **{"micro_batches": 4, **options}))
  mesh = mesh_of((8,), ("data",), AxisType.Explicit)
  with jax.set_mesh(mesh):
    args = [put(make_params(), mesh, specs), put(make_data(k=4), mesh, DATA)]
    if "key" in name:
      args.append(jax.random.key(0))
    with pytest.warns(UserWarning) if name == "shared key" else _nothing():
      step.lower(*args)
  assert len(traces) == expected, (name, len(traces))


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


@jax.custom_vjp
def damped(x):
  """The identity, its gradient halved (a custom_vjp rule)."""
  return x


damped.defvjp(lambda x: (x, None), lambda _, g: (0.5 * g,))


def every_kind_of_equation(params, batch, key):
  """A mean loss with what the evaluation specializes: a nested jit, custom_jvp and
  custom_vjp calls (on the params' path and, left in the jaxpr, on the data's alone), a
  key folded per micro-batch (one random scale per micro-batch: the same on every
  device), a reshape of the rows and a mean over them (a symbolic size used as a
  number)."""
  rows = batch["x"].shape[0]
  h = jax.jit(lambda x: jax.nn.relu(x @ params["w1"] + params["b1"]))(batch["x"])
  h = damped(h * (1 + 0.5 * jax.random.normal(key, ())))
  target = damped(jax.nn.relu(batch["y"]))
  per_row = jnp.mean(((h @ params["w2"])[..., 0] - target) ** 2, axis=1)
  return jnp.mean(per_row.reshape(rows, 1))


@pytest.mark.parametrize("axis_type", AXIS_TYPES, ids=str)
def test_the_replayed_step_is_exact(axis_type):
  """The per-device loop runs the analysis's symbolic trace (one trace of the loss) and
  gives jax.value_and_grad's mean over the global micro-batches, each with its folded
  key; the same key for every micro-batch (an index the replay dropped) differs."""
  k = 4
  fun, traces = counted(every_kind_of_equation)
  step = jax.jit(fxaccum.value_and_grad(fun, micro_batches=k, rng_argnums=2))
  mesh = mesh_of((8,), ("data",), axis_type)
  params, batch, key = make_params(), make_data(k=k), jax.random.key(3)
  with jax.set_mesh(mesh):
    placed = put(params, mesh, {}), put(batch, mesh, DATA)
    value, grads = step(*placed, key)
    (path,) = fxaccum.diagnostics.paths(step, *placed, key)
  assert len(traces) == 1 and path.view == "device", (len(traces), path)
  reference = jax.jit(jax.value_and_grad(every_kind_of_equation))

  def mean_over_micro_batches(keys):
    results = [reference(params, jax.tree.map(lambda a, i=i: a[i::k], batch), keys[i])
               for i in range(k)]
    return jax.tree.map(lambda *xs: sum(xs) / k, *results)

  expected = mean_over_micro_batches([jax.random.fold_in(key, i) for i in range(k)])
  assert_tree_close((value, grads), expected)
  shared = mean_over_micro_batches([jax.random.fold_in(key, 0)] * k)  # negative control
  with pytest.raises(AssertionError):
    assert_tree_close(grads, shared[1])


@pytest.mark.parametrize(("fun", "reason"), [
    (lambda x: jax.lax.scan(lambda c, r: (c + r, None), 0.0, x)[0], "it holds a scan"),
    (lambda x: jax.lax.cond(x[0] > 0, jnp.sin, jnp.cos, x), "it holds a cond"),
    (lambda x: jax.lax.psum(x, "data"), "it names mesh axes in psum"),
    (lambda x: jax.debug.callback(print, x) or x, "its debug_callback has effects"),
    (lambda x: jax.jit(jnp.sin, donate_argnums=0)(x), "a nested jit names shardings or donates"),
    (lambda x: jax.jit(jnp.sin)(jnp.cumsum(x).at[0].add(1.0)), None),
])
def test_what_the_evaluation_covers(fun, reason):
  """The decision replays a micro-step only where every equation is covered; the first
  one that is not is the reason."""
  closed = jax.make_jaxpr(fun, axis_env=[("data", 8)])(jnp.ones(4))
  assert replay.blocker(closed, ("data",)) == reason


def test_the_output_types_read_from_the_jaxpr():
  """The loop shapes its accumulators with :func:`replay.out_types` (read from the
  symbolic jaxpr) before its body runs :func:`replay.evaluate`: per output the shape at
  the loop's number of rows and the dtype the evaluation gives, and the manual axes it
  varies over (a nested call's outputs each its own). Inputs as the region has them: a
  varying batch, an invariant param and index."""
  def step(w, x, index):
    rows = x.shape[0]
    both = jax.jit(lambda w, x: (x @ w, w * 2))(w, x)  # a nested call
    return [jnp.tanh(x @ w), w.sum() * 2, index + 1, jnp.zeros((rows, 2)), 3.0, *both,
            jnp.mean(x, axis=0).astype(jnp.bfloat16)]

  (rows,) = jax.export.symbolic_shape(replay.ROWS)
  closed = jax.make_jaxpr(step)(jax.ShapeDtypeStruct((4, 3), jnp.float32),
                                jax.ShapeDtypeStruct((rows, 4), jnp.float32), INDEX)
  mesh = mesh_of((8,), ("data",), AxisType.Explicit)
  found = []

  def region(w, x):
    sizes, inputs = {replay.ROWS: x.shape[0]}, (w, x, jnp.int32(0))
    actual = jax.make_jaxpr(lambda *a: replay.evaluate(closed, sizes, *a))(*inputs).out_avals
    found.append((replay.out_types(closed, sizes, inputs), actual))
    return ()

  with jax.set_mesh(mesh):
    jax.eval_shape(jax.shard_map(region, in_specs=(P(), P("data")), out_specs=()),
                   jnp.ones((4, 3)), jax.reshard(jnp.ones((16, 4)), P("data")))
  ((predicted, actual),) = found
  assert [(a.shape, a.dtype) for a in predicted] == [(a.shape, a.dtype) for a in actual]
  assert predicted[3].shape == (2, 2)  # the region's 2 rows
  axes = [(set(p.manual_axis_type.varying), set(a.manual_axis_type.varying))
          for p, a in zip(predicted, actual, strict=True)]
  assert axes[:5] == [({"data"},) * 2, (set(), set()), (set(), set()), (set(), set()),
                      (set(), set())], axes
  assert axes[5:] == [({"data"},) * 2, (set(), set()), ({"data"},) * 2], axes
