"""k micro-batches == one large batch, on every mesh layout."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    AXIS_TYPES,
    DATA,
    assert_tree_close,
    example_mean_loss,
    make_data,
    make_params,
    mesh_of,
    naive_mean_of_means,
    put,
    reference_token_mean,
    token_loss,
    weighted_loss,
)
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import fxaccum
from fxaccum import diagnostics

SEQ = {"x": P("data", "seq"), "y": P("data", "seq"), "mask": P("data", "seq")}
# name: (mesh shape, axis names, param specs, batch specs). Data parallel over one of the
# 8 devices (dp1, the degenerate data axis) and over all of them (dp8). dp2 and dp4 took
# dp8's path on a mesh of some of the devices, as the (4,) mesh of
# test_python_numbers_in_the_aux_are_averaged_like_arrays does.
LAYOUTS = {
    "dp1": ((1,), ("data",), {}, DATA),
    "dp8": ((8,), ("data",), {}, DATA),
    "data_x_model": ((4, 2), ("data", "model"),
                     {"w1": P(None, "model"), "b1": P("model"), "w2": P("model", None)}, DATA),
    "data_x_seq": ((4, 2), ("data", "seq"), {}, SEQ),
    "fsdp": ((8,), ("data",), {"w1": P("data", None), "b1": P("data"), "w2": P("data", None)},
             DATA),
}


# k = 1 (the whole batch) and k = 4 (the micro-batch scan, which k = 2 and k = 8 took too)
# on every layout; k = 8 where it leaves one row per device and micro-batch (8 data devices).
MATCHES = [pytest.param(layout, axis_type, k, id=f"{layout}-{axis_type.name.lower()}-{k}")
           for layout in LAYOUTS for axis_type in AXIS_TYPES
           for k in (1, 4, *((8,) if layout in ("dp8", "fsdp") else ()))]


@pytest.mark.parametrize("layout, axis_type, k", MATCHES)
def test_matches_large_batch(layout, axis_type, k):
  shape, names, param_specs, batch_specs = LAYOUTS[layout]
  data, params = make_data(k=k), make_params()
  ref_weighted = jax.value_and_grad(reference_token_mean)(params, data)
  ref_mean = jax.value_and_grad(example_mean_loss)(params, data)

  mesh = mesh_of(shape, names, axis_type)
  accumulated = (fxaccum.value_and_grad(weighted_loss, micro_batches=k),
                 fxaccum.value_and_grad(example_mean_loss, micro_batches=k))
  step = jax.jit(lambda p, b: tuple(f(p, b) for f in accumulated))
  with jax.set_mesh(mesh):
    sharded_params = put(params, mesh, param_specs)
    got_weighted, got_mean = step(sharded_params, put(data, mesh, batch_specs))

  assert_tree_close(got_weighted, ref_weighted)
  assert_tree_close(got_mean, ref_mean)
  if axis_type == AxisType.Explicit:  # sharding in types: grads are typed like params
    for name, g in got_weighted[1].items():
      assert g.sharding.is_equivalent_to(sharded_params[name].sharding, g.ndim), name


def test_naive_mean_of_means_is_wrong_on_the_same_data():
  """Negative control: the skewed masks make the naive method visibly wrong."""
  k = 4
  data, params = make_data(k=k), make_params()
  ref_value, ref_grads = jax.value_and_grad(reference_token_mean)(params, data)
  naive_value, naive_grads = jax.jit(jax.value_and_grad(naive_mean_of_means),
                                    static_argnums=2)(params, data, k)
  assert abs(naive_value - ref_value) / abs(ref_value) > 1e-2
  rel = np.max(np.abs(naive_grads["w1"] - ref_grads["w1"])) / np.max(np.abs(ref_grads["w1"]))
  assert rel > 1e-2

  value, grads = fxaccum.value_and_grad(weighted_loss, micro_batches=k)(params, data)
  assert_tree_close((value, grads), (ref_value, ref_grads))


def test_bit_exact_analytic_case():
  """Token counts (8, 2, 0, 6), coefficients (1, 2, 3, 4): the token mean is 36/16 = 2.25
  exactly; the mean of the micro-batch means (a plain loss) is (1 + 2 + 0 + 4) / 4 = 1.75."""
  counts, coefs = np.array([8, 2, 0, 6]), np.array([1.0, 2.0, 3.0, 4.0], np.float32)
  # Row i is micro-batch i (the split takes rows i::4).
  mask = (np.arange(8)[None, :] < counts[:, None]).astype(np.float32)
  batch = {"mask": mask, "coef": np.repeat(coefs[:, None], 8, axis=1)}

  def loss(w, b):
    return fxaccum.Weighted(jnp.sum(b["mask"] * b["coef"] * w), jnp.sum(b["mask"]))

  value, g = fxaccum.value_and_grad(loss, micro_batches=4)(jnp.float32(1.0), batch)
  np.testing.assert_array_equal(g, np.float32(2.25))
  np.testing.assert_array_equal(value, np.float32(2.25))
  # Negative control: the same sums returned as a per-micro-batch mean (a plain loss).
  def mean_loss(w, b):
    return loss(w, b).value()

  value, g = fxaccum.value_and_grad(mean_loss, micro_batches=4)(jnp.float32(1.0), batch)
  np.testing.assert_array_equal((value, g), (np.float32(1.75), np.float32(1.75)))


@pytest.mark.parametrize("mesh_shape", [(1,), (8,)])
def test_all_padding_gives_zeros_not_nan(mesh_shape):
  data, params = make_data(k=2), make_params()
  data["mask"] = np.zeros_like(data["mask"])
  mesh = mesh_of(mesh_shape, ("data",), AxisType.Explicit)
  with jax.set_mesh(mesh):
    (value, aux), grads = jax.jit(fxaccum.value_and_grad(
        lambda p, b: (weighted_loss(p, b), {"loss": weighted_loss(p, b)}),
        has_aux=True, micro_batches=2))(params, put(data, mesh, DATA))
  assert float(value) == 0.0 and float(aux["loss"]) == 0.0
  for g in jax.tree.leaves(grads):
    np.testing.assert_array_equal(g, np.zeros_like(g))


def test_eager_call_and_auto_fsdp_detected_from_concrete_arrays():
  """Called outside jit, fxaccum reads the arrays' shardings (also on Auto meshes) and
  returns FSDP gradients sharded like the params."""
  data, params = make_data(k=4), make_params()
  mesh = mesh_of((8,), ("data",), AxisType.Auto)
  specs = LAYOUTS["fsdp"][2]
  sharded = put(params, mesh, specs)
  value, grads = fxaccum.value_and_grad(weighted_loss, micro_batches=4)(
      sharded, put(data, mesh, DATA))
  assert_tree_close((value, grads), jax.value_and_grad(reference_token_mean)(params, data))
  for name, g in grads.items():
    assert g.sharding.is_equivalent_to(sharded[name].sharding, g.ndim), name


@pytest.mark.parametrize("fsdp", ["auto", "zero1", "zero2", "zero3"])
def test_fsdp_strategies_are_exact(fsdp):
  data, params = make_data(k=4), make_params()
  mesh = mesh_of((8,), ("data",), AxisType.Explicit)
  with jax.set_mesh(mesh):
    got = jax.jit(fxaccum.value_and_grad(weighted_loss, micro_batches=4, fsdp=fsdp))(
        put(params, mesh, LAYOUTS["fsdp"][2]), put(data, mesh, DATA))
  assert_tree_close(got, jax.value_and_grad(reference_token_mean)(params, data))


def test_argnums_tuple_and_has_aux_match_jax():
  data, params = make_data(k=2), make_params()
  scale = jnp.float32(1.5)

  def loss(p, s, b):
    value = s * example_mean_loss(p, b)
    return value, {"value": value, "count": jnp.sum(b["mask"])}

  (value, aux), (gp, gs) = fxaccum.value_and_grad(
      loss, argnums=(0, 1), has_aux=True, micro_batches=2, batch_argnums=2)(params, scale, data)
  (ref_value, ref_aux), (rp, rs) = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(
      params, scale, data)
  assert_tree_close((value, gp, gs), (ref_value, rp, rs))
  np.testing.assert_allclose(aux["value"], ref_aux["value"], rtol=1e-6)
  # A count aux is averaged over micro-batches: the mean count per micro-batch.
  np.testing.assert_allclose(aux["count"], ref_aux["count"] / 2, rtol=1e-6)

  grads_only, aux_only = fxaccum.grad(loss, has_aux=True, micro_batches=2, batch_argnums=2)(
      params, scale, data)
  assert_tree_close(grads_only, rp)
  np.testing.assert_allclose(aux_only["value"], ref_aux["value"], rtol=1e-6)
  np.testing.assert_allclose(aux_only["count"], ref_aux["count"] / 2, rtol=1e-6)


def test_auto_mesh_without_set_mesh_context():
  """The mesh is found from the arguments' shardings; 'data' is taken by its name."""
  data, params = make_data(k=2), make_params()
  mesh = mesh_of((8,), ("data",), AxisType.Auto)
  f = jax.jit(fxaccum.value_and_grad(weighted_loss, micro_batches=2))
  args = (put(params, mesh, {}), put(data, mesh, DATA))
  assert_tree_close(f(*args), jax.value_and_grad(reference_token_mean)(params, data))
  rep = fxaccum.diagnostics.report(f, *args)
  assert rep.reductions(place="loop") == [] and rep.reductions(place="top", axes="data")


def test_explicit_data_axes_reshard_a_replicated_batch():
  """data_axes given for a batch typed replicated on an Explicit mesh: fxaccum reshards it
  (shard_map needs in_specs equal to the types) instead of failing."""
  data, params = make_data(k=2), make_params()
  mesh = mesh_of((8,), ("data",), AxisType.Explicit)
  with jax.set_mesh(mesh):
    got = jax.jit(fxaccum.value_and_grad(weighted_loss, micro_batches=2, data_axes="data"))(
        put(params, mesh, {}), put(data, mesh, {}))
  assert_tree_close(got, jax.value_and_grad(reference_token_mean)(params, data))


def test_keyword_arguments_reach_fun_as_given():
  data, params = make_data(k=2), make_params()

  def loss(p, b, *, double=False):  # a Python bool: must not be traced
    value = weighted_loss(p, b)
    return fxaccum.Weighted(2 * value.total, value.weight) if double else value

  ref = jax.value_and_grad(lambda p, b: 2 * reference_token_mean(p, b))(params, data)
  eager = fxaccum.value_and_grad(loss, micro_batches=2)(params, data, double=True)
  jitted = jax.jit(fxaccum.value_and_grad(loss, micro_batches=2), static_argnames="double")(
      params, data, double=True)
  assert_tree_close(eager, ref)
  assert_tree_close(jitted, ref)


@pytest.mark.parametrize("with_rows", [False, True], ids=["device_view", "global_view"])
@pytest.mark.parametrize("axis_type", AXIS_TYPES, ids=lambda t: t.name)
def test_python_numbers_in_the_aux_are_averaged_like_arrays(axis_type, with_rows):
  """jax.value_and_grad passes a Python int / float / bool aux through; fxaccum averages it
  over the micro-batches like any plain aux leaf (it used to raise "'TypedInt' object has
  no attribute 'astype'" from inside its loop). The row count makes the aux depend on the
  batch, which takes the global view."""
  k = 2
  data, params = make_data(k=k), make_params()

  def loss(p, b):
    aux = {"scale": 1.5, "flag": True}
    return example_mean_loss(p, b), {**aux, "rows": b["x"].shape[0]} if with_rows else aux

  mesh = mesh_of((4,), ("data",), axis_type)
  with jax.set_mesh(mesh):
    step = jax.jit(fxaccum.value_and_grad(loss, has_aux=True, micro_batches=k))
    args = (put(params, mesh, {}), put(data, mesh, DATA))
    (value, aux), grads = step(*args)
    (path,) = diagnostics.paths(step, *args)
  assert path.view == ("global" if with_rows else "device")
  assert_tree_close((value, grads), jax.value_and_grad(example_mean_loss)(params, data))
  expected = {"scale": 1.5, "flag": 1.0, **({"rows": data["x"].shape[0] // k} if with_rows
                                            else {})}
  assert_tree_close(aux, expected)
  assert all(leaf.dtype == jnp.float32 for leaf in jax.tree.leaves(aux))


def test_bf16_weights_are_counted_exactly():
  """Three micro-batches of 255 tokens: a bf16 running count gives 764, not 765."""
  mask = np.zeros((3, 256), np.float32)
  mask[:, :255] = 1.0

  def loss(w, m):
    m = m.astype(jnp.bfloat16)
    return fxaccum.Weighted(jnp.sum(m.astype(jnp.float32) * w), jnp.sum(m))

  value, g = fxaccum.value_and_grad(loss, micro_batches=3)(jnp.float32(3.0), mask)
  np.testing.assert_array_equal(g, np.float32(1.0))  # 765 / 765, not 765 / 764
  np.testing.assert_array_equal(value, np.float32(3.0))


def aux_kinds_loss(params, batch):
  """A token-weighted loss with one aux output of each kind."""
  per_token = batch["mask"] * token_loss(params, batch)
  per_example = jnp.sum(per_token, axis=-1)
  aux = {"mean": jnp.mean(per_example),  # averaged with the loss's (token) weights
         "ratio": fxaccum.Weighted(jnp.sum(per_example > 0.5), jnp.sum(batch["mask"][:, 0])),
         "count": fxaccum.Sum(jnp.sum(batch["mask"])),
         "amax": fxaccum.Max(jnp.max(jnp.abs(per_token))),
         "lowest": fxaccum.Min(jnp.min(per_example - 10.0)),
         "rows": fxaccum.Concat(per_example)}
  return fxaccum.Weighted(jnp.sum(per_token), jnp.sum(batch["mask"])), aux


@pytest.mark.parametrize("view", ["auto", "global", "device"])
@pytest.mark.parametrize("axis_type", AXIS_TYPES, ids=lambda t: t.name)
def test_every_aux_kind_in_every_view(axis_type, view):
  k, devices = 4, 4
  params, data = make_params(), make_data(k=k)
  # Plain aux leaves are averaged over the micro-batches with their loss weights; in the
  # device view each device's share of a micro-batch is a micro-batch of its own.
  shards = ([jax.tree.map(lambda a, d=d: np.split(a, devices)[d], data)
             for d in range(devices)] if view == "device" else [data])
  micro = [jax.tree.map(lambda a, i=i: a[i::k], shard) for shard in shards for i in range(k)]
  weights = np.array([np.sum(m["mask"]) for m in micro])
  means = np.array([float(jnp.mean(jnp.sum(m["mask"] * token_loss(params, m), -1)))
                    for m in micro])
  per_example = np.asarray(jnp.sum(data["mask"] * token_loss(params, data), -1))
  expected = {"mean": np.sum(weights * means) / np.sum(weights),
              "ratio": np.sum(per_example > 0.5) / np.sum(data["mask"][:, 0]),
              "count": np.sum(data["mask"]), "rows": per_example,
              "amax": np.max(np.abs(data["mask"] * token_loss(params, data))),
              "lowest": np.min(per_example) - 10.0}
  assert not np.isclose(expected["mean"], np.mean(means))  # weights matter here
  mesh = mesh_of((4, 2), ("data", "model"), axis_type)
  with jax.set_mesh(mesh):
    step = jax.jit(fxaccum.value_and_grad(aux_kinds_loss, has_aux=True, micro_batches=k,
                                          view=view))
    (value, aux), grads = step(put(params, mesh, {}), put(data, mesh, DATA))
  ref_value, ref_grads = jax.value_and_grad(reference_token_mean)(params, data)
  assert_tree_close((value, grads), (ref_value, ref_grads))
  assert_tree_close(aux, expected)
  assert aux["count"].dtype == jnp.float32 and aux["rows"].sharding.spec == P("data")
