"""Unit tests of the pieces: the HLO parser on fixed text, the split, the layout planning."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from fxaccum import diagnostics, meshes, reductions, split

# A hand-written module on a (data 4, model 2) mesh: device d sits at (d // 2, d % 2).
HLO = """\
HloModule fixed, entry_computation_layout={(f32[8]{0})->f32[8]{0}}

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %sum = f32[] add(%a, %b)
}

%body (p: (s32[], f32[8])) -> (s32[], f32[8]) {
  %p = (s32[], f32[8]{0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x = f32[8]{0} get-tuple-element(%p), index=1
  %over_model = f32[8]{0} all-reduce(%x), channel_id=1, replica_groups=[4,2]<=[8], to_apply=%add
  %ring = f32[8]{0} collective-permute(%over_model), channel_id=2, source_target_pairs={{0,2},{2,4},{4,6},{6,0},{1,3},{3,5},{5,7},{7,1}}
  ROOT %t = (s32[], f32[8]{0}) tuple(%i, %ring)
}

%cond (p: (s32[], f32[8])) -> pred[] {
  %p = (s32[], f32[8]{0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %n = s32[] constant(5)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

%taken (x: f32[8]) -> f32[16] {
  %x = f32[8]{0} parameter(0)
  ROOT %gathered = f32[16]{0} all-gather(%x), channel_id=3, replica_groups=[4,2]<=[8], dimensions={0}
}

%skipped (x: f32[8]) -> f32[16] {
  %x = f32[8]{0} parameter(0)
  ROOT %zeros = f32[16]{0} broadcast(f32[] constant(0)), dimensions={}
}

ENTRY %main (x: f32[8]) -> f32[8] {
  %x = f32[8]{0} parameter(0)
  %init = (s32[], f32[8]{0}) tuple(s32[] constant(0), %x)
  %loop = (s32[], f32[8]{0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"5"}}
  %y = f32[8]{0} get-tuple-element(%loop), index=1
  %over_data = f32[8]{0} all-reduce(%y), channel_id=4, replica_groups=[2,4]<=[4,2]T(1,0), to_apply=%add
  %flag = pred[] constant(true)
  %branch = f32[16]{0} conditional(%flag, %over_data, %over_data), true_computation=%taken, false_computation=%skipped
  %scattered = f32[4]{0} reduce-scatter(%over_data), channel_id=5, replica_groups=[1,8]<=[8], dimensions={0}, to_apply=%add
  ROOT %out = f32[8]{0} slice(%branch), slice={[0:8]}
}
"""


def test_parse_hlo_places_counts_and_names_every_collective():
  mesh = jax.sharding.AbstractMesh((4, 2), ("data", "model"))
  found = {c.name: c for c in diagnostics.parse_hlo(HLO, mesh)}
  assert set(found) == {"over_model", "ring", "over_data", "gathered", "scattered"}
  expected = {  # kind, place, executions, axes, bytes
      "over_model": ("all-reduce", "loop", 5, ("model",), 32),
      "ring": ("collective-permute", "loop", 5, ("data",), 32),
      "over_data": ("all-reduce", "top", 1, ("data",), 32),
      "gathered": ("all-gather", "conditional", 1, ("model",), 64),
      "scattered": ("reduce-scatter", "top", 1, ("data", "model"), 32),
  }
  for name, (kind, place, runs, axes, nbytes) in expected.items():
    c = found[name]
    assert (c.kind, c.place, c.executions, c.axes, c.bytes) == (kind, place, runs, axes,
                                                                 nbytes), c


def test_parse_hlo_without_a_mesh_leaves_axes_unknown():
  assert {c.axes for c in diagnostics.parse_hlo(HLO)} == {None}


def test_micro_batch_i_is_rows_i_mod_k():
  batch = {"x": np.arange(24).reshape(12, 2), "y": np.arange(12)}
  for i in range(3):
    part = split.micro_batch(batch, jnp.int32(i), 3)
    np.testing.assert_array_equal(part["x"], batch["x"][i::3])
    np.testing.assert_array_equal(part["y"], batch["y"][i::3])


def test_split_both_ways_is_rows_i_mod_k():
  leaf = jnp.arange(24.0).reshape(12, 2)
  stacked = split.stacked(leaf, 3)
  for i in range(3):  # the pipeline's stacked form and the in-step take agree with i::k
    np.testing.assert_array_equal(stacked[i], np.asarray(leaf)[i::3])
    np.testing.assert_array_equal(split.take(leaf, jnp.int32(i), 3), np.asarray(leaf)[i::3])
  np.testing.assert_array_equal(split.unstacked(stacked), leaf)
  value = -jnp.ones((4, 2))
  written = np.asarray(leaf).copy()
  written[1::3] = -1
  np.testing.assert_array_equal(split.put(leaf, jnp.int32(1), 3, value, True), written)
  np.testing.assert_array_equal(split.put(leaf, jnp.int32(1), 3, value, False), leaf)


def test_as_argnums_counts_negative_entries_from_the_end_only_given_a_count():
  assert split.as_argnums((0, -1), "batch_argnums", count=3) == (0, 2)
  with pytest.raises(TypeError, match="non-negative int"):
    split.as_argnums(-1, "batch_argnums")
  with pytest.raises(ValueError, match="names argument 3, but 3 argument"):
    split.as_argnums(3, "batch_argnums", count=3)
  with pytest.raises(ValueError, match="repeated entries"):
    split.as_argnums((2, -1), "batch_argnums", count=3)


def test_rows_per_device_reads_the_shard_shape():
  mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
  batch = {"x": _placed(mesh, P("data")), "y": jax.ShapeDtypeStruct(
      (16,), jnp.int32, sharding=NamedSharding(mesh, P("data")))}
  assert split.rows_per_device([batch], (1,)) == 4
  with pytest.raises(ValueError, match=r"different numbers of rows per device: argument "
                     r"1\['x'\]: 4, argument 1\['z'\]: 16"):
    split.rows_per_device([{"x": batch["x"], "z": np.ones(16)}], (1,))


@pytest.mark.parametrize("data_axes, expected", [
    (None, None), ("data", ("data",)), (["data", "model"], ("data", "model")), ((), ()),
    (5, TypeError), (("data", 1), TypeError), (("data", "data"), ValueError),
])
def test_as_data_axes_is_every_entry_points_spelling(data_axes, expected):
  if isinstance(expected, type):
    with pytest.raises(expected, match="data_axes"):
      meshes.as_data_axes(data_axes)
  else:
    assert meshes.as_data_axes(data_axes) == expected


@pytest.mark.parametrize("entry", ["accumulate", "pipeline"])
def test_cross_step_and_pipeline_refuse_data_axes_as_value_and_grad_does(entry):
  import fxaccum
  call = {"accumulate": lambda: fxaccum.accumulate(2, data_axes=("data", "data")),
          "pipeline": lambda: fxaccum.pipeline(lambda w, h: h, jnp.ones((2, 1)),
                                               jnp.ones((4, 1)), micro_batches=2,
                                               data_axes=("data", "data"))}[entry]
  with jax.set_mesh(jax.make_mesh((4, 2), ("data", "stage"))):
    with pytest.raises(ValueError, match=r"data_axes names an axis twice"):
      call()


def test_deferred_slots_sum_to_the_whole():
  mesh = jax.make_mesh((8,), ("data",))
  value = {"w": jnp.arange(3.0)}
  slots = jax.jit(lambda t: reductions.in_first_slot(t, ("data",), mesh))(value)
  assert slots["w"].shape == (8, 3) and slots["w"].sharding.spec[0] == "data"
  local = np.asarray(slots["w"])
  np.testing.assert_array_equal(local[0], value["w"])
  np.testing.assert_array_equal(local[1:], 0)  # negative control: not a broadcast
  np.testing.assert_array_equal(reductions.sum_slots(slots)["w"], value["w"])


@pytest.mark.parametrize("batch,k,devices,match", [
    ({"x": np.ones((6, 2)), "y": np.ones(4)}, 2, 1, "different leading sizes"),
    ({"x": np.ones(6)}, 4, 1, "not divisible by micro_batches=4"),
    ({"x": np.ones(8)}, 2, 8, "per-device micro-batch of 0.5"),
    ({"x": np.float32(1)}, 1, 1, "is a scalar"),
    ({}, 1, 1, "hold no arrays"),
])
def test_leading_size_errors(batch, k, devices, match):
  with pytest.raises(ValueError, match=match):
    split.leading_size(batch, k, devices)


@pytest.mark.parametrize("value,error", [(0, ValueError), (-2, ValueError), (True, TypeError),
                                         (2.0, TypeError), ("4", TypeError)])
def test_check_micro_batches(value, error):
  with pytest.raises(error, match="positive int"):
    split.check_micro_batches(value)


def test_fold_differs_per_index_and_refuses_non_keys():
  key = jax.random.key(0)
  keys = [jax.random.key_data(split.fold(key, jnp.int32(i))) for i in range(3)]
  assert len({tuple(np.asarray(k).ravel()) for k in keys}) == 3
  with pytest.raises(TypeError, match="rng_argnums leaves must be PRNG keys"):
    split.fold(jnp.ones(3), jnp.int32(0))


def _placed(mesh, spec, shape=(16, 4)):
  return jax.device_put(np.ones(shape, np.float32), NamedSharding(mesh, spec))


def test_plan_reads_data_axes_and_fsdp_dims_from_concrete_shardings():
  mesh = jax.make_mesh((2, 2, 2), ("replica", "fsdp", "model"),
                       axis_types=(AxisType.Explicit,) * 3)
  batch = _placed(mesh, P(("replica", "fsdp")))
  replicated, fsdp, tp = (_placed(mesh, s) for s in (P(), P("fsdp"), P(None, "model")))
  layout = meshes.layout_of([replicated, fsdp, tp], [batch], [], None)
  assert layout.data_axes == ("replica", "fsdp")
  assert layout.param_dims == ((), ((0, ("fsdp",)),), ())
  assert layout.data_devices == 4
  assert [layout.param_spec(i) for i in range(3)] == [P(), P("fsdp"), P()]


def test_plan_takes_conventional_names_where_auto_shardings_are_hidden():
  mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
  seen = {}

  def probe(w, x):
    seen["layout"] = meshes.layout_of([w], [x], [], None)
    return x

  with jax.set_mesh(mesh):
    jax.jit(probe)(_placed(mesh, P()), _placed(mesh, P("data")))
  assert seen["layout"].data_axes == ("data",)


def test_plan_refuses_unknown_axes_and_mixed_dimensions():
  mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
  batch = _placed(mesh, P("data"))
  with pytest.raises(ValueError, match="which the mesh does not have"):
    meshes.layout_of([], [batch], [], ("dp",))
  mixed = _placed(mesh, P(("data", "model")))
  layout = meshes.layout_of([mixed], [batch], [], None)
  assert "mixing data axes" in layout.device_blocker


@pytest.mark.parametrize("bucket_bytes", [None, 0, 700])
def test_bucketed_reduction_equals_the_per_leaf_one(bucket_bytes):
  """fxaccum.reductions packs leaves sharded on different dimensions (and replicated ones)
  into buckets; element for element it is reductions.reduce leaf by leaf."""

  mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
  rng = np.random.default_rng(0)
  shapes = [(16, 3), (5, 24), (8,), (4, 2)]
  plans = [(((0, ("data",)),), ()), (((1, ("data",)),), ()), (((0, ("data",)),), ()),
           ((), ("data",))]
  local = [rng.normal(size=(8, *s)).astype(np.float32) for s in shapes]  # one per device

  def run(fn):
    def body(*leaves):
      leaves = [x[0] for x in leaves]
      return [x[None] for x in fn(leaves)]
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=P("data")))(
        *local)

  with jax.set_mesh(mesh):
    local = [jax.device_put(x, NamedSharding(mesh, P("data"))) for x in local]
    want = run(lambda leaves: [reductions.reduce(x, ("data",), dims)
                               for x, (dims, _) in zip(leaves, plans, strict=True)])
    got = run(lambda leaves: reductions.reduce_leaves(leaves, plans, bucket_bytes))
  for a, b in zip(got, want, strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
