"""fxaccum.pipeline: GPipe stages over a mesh axis, against the sequential model on one
device (plain jax.value_and_grad of the same layers in a Python loop)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_tree_close, row_parallel_matmul
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import fxaccum

BATCH, TOKENS, DIM, HIDDEN, VOCAB = 32, 8, 8, 16, 16
# mesh shape and axis names per number of stages; S = 2 has tensor-parallel stages
MESHES = {8: ((8,), ("stage",)), 4: ((2, 4), ("data", "stage")),
          2: ((2, 2, 2), ("data", "stage", "model"))}


def make_params(stages: int, seed: int = 0) -> dict:
  rng = np.random.default_rng(seed)
  def normal(*shape, scale=1.0):
    return (scale * rng.normal(size=shape)).astype(np.float32)
  return {"embed": normal(VOCAB, DIM),
          "stages": {"w1": normal(stages, DIM, HIDDEN, scale=DIM ** -0.5),
                     "w2": normal(stages, HIDDEN, DIM, scale=HIDDEN ** -0.5)},
          "head": normal(DIM, VOCAB, scale=DIM ** -0.5)}


def make_batch(k: int, seed: int = 1) -> dict:
  """Skewed padding: empty rows, long rows, and (k > 1) an all-padding pipeline
  micro-batch (rows i::k of each data device's rows, i = k - 1)."""
  rng = np.random.default_rng(seed)
  lengths = rng.integers(1, 4, size=BATCH)
  lengths[::7] = TOKENS
  lengths[2::5] = 0
  if k > 1:
    lengths[np.arange(BATCH) % k == k - 1] = 0  # row r is in micro-batch r % k
  mask = (np.arange(TOKENS)[None, :] < lengths[:, None]).astype(np.float32)
  tokens = rng.integers(0, VOCAB, size=(BATCH, TOKENS + 1)).astype(np.int32)
  return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "mask": mask}


def block(p, h):
  """One stage: a residual MLP (column- then row-parallel on a model axis)."""
  return h + row_parallel_matmul(jnp.tanh(h @ p["w1"]), p["w2"])


def embed(table, ids):
  """``table[ids]``; on an Explicit mesh JAX needs the gather's output sharding spelled
  out (a plain-JAX rule, not fxaccum's)."""
  sharding = jax.typeof(ids).sharding
  if any(t == AxisType.Explicit for t in sharding.mesh.axis_types):
    return table.at[ids].get(out_sharding=P(*sharding.spec, None))
  return table[ids]


def token_sums(params, batch, body):
  h = embed(params["embed"], batch["inputs"])
  logits = body(params["stages"], h) @ params["head"]
  logp = jax.nn.log_softmax(logits)
  nll = -jnp.take_along_axis(logp, batch["targets"][..., None], axis=-1)[..., 0]
  return fxaccum.Weighted(jnp.sum(nll * batch["mask"]), jnp.sum(batch["mask"]))


def sequential(stages, h):
  for s in range(jax.tree.leaves(stages)[0].shape[0]):
    h = block(jax.tree.map(lambda a, s=s: a[s], stages), h)
  return h


def value_and_grad(body):
  """jax.value_and_grad of the token mean with the stages run by ``body``, jitted: one
  compilation per configuration instead of one per op (and stage index) run eagerly."""
  return jax.jit(jax.value_and_grad(lambda p, batch: token_sums(p, batch, body).value()))


def reference(params, batch):
  """The sequential model on one device: the token mean over all valid tokens."""
  with jax.default_matmul_precision("highest"):
    return SEQUENTIAL(params, batch)


def pipelined_loss(k: int, remat: bool = True, **schedule):
  def loss(params, batch):
    return token_sums(params, batch, lambda stages, h: fxaccum.pipeline(
        block, stages, h, micro_batches=k, remat=remat, **schedule))
  return loss


def place(params, batch, mesh):
  """The stage leaves over `stage` (after the circular schedule's leading R dimension),
  tensor-parallel over `model` where the mesh has it; the batch over `data`."""
  model = "model" in mesh.axis_names
  data = P("data") if "data" in mesh.axis_names else P()
  lead = (None,) * (params["stages"]["w1"].ndim - 3) + ("stage",)
  specs = {"embed": P(), "head": P(),
           "stages": {"w1": P(*lead, None, "model" if model else None),
                      "w2": P(*lead, "model" if model else None, None)}}
  params = jax.tree.map(lambda a, s: jax.device_put(a, NamedSharding(mesh, s)), params, specs)
  return params, jax.tree.map(lambda a: jax.device_put(a, NamedSharding(mesh, data)), batch)


def run(stages, k, axis_type=AxisType.Auto, outer=1, remat=True, differentiate="fxaccum",
        schedule="gpipe", repeats=1):
  """The pipelined token loss's value and gradients under fxaccum.value_and_grad (over
  `outer` micro-batches) or jax.value_and_grad, and (step, args, mesh). Cached: tests that
  check other properties of the same program (its collectives, its memory) share one
  compilation and run; every result is an immutable array."""
  return _run(stages, k, axis_type, outer, remat, differentiate, schedule, repeats)


@functools.cache
def _run(stages, k, axis_type, outer, remat, differentiate, schedule, repeats):
  shape, names = MESHES[stages]
  mesh = jax.make_mesh(shape, names, axis_types=(axis_type,) * len(names))
  loss = pipelined_loss(k, remat, schedule=schedule, repeats=repeats)
  if differentiate == "fxaccum":
    step = jax.jit(fxaccum.value_and_grad(loss, micro_batches=outer))
  else:
    step = jax.jit(jax.value_and_grad(lambda p, b: loss(p, b).value()))
  params = (circular_params(stages, repeats) if schedule == "circular"
            else make_params(stages))
  with jax.set_mesh(mesh), jax.default_matmul_precision("highest"):
    args = place(params, make_batch(k), mesh)
    return step(*args), (step, args, mesh)


def compiled_step(step, args, mesh):
  """``run``'s step compiled in the context it ran in (mesh, matmul precision): the program
  that ran, from JAX's caches, not a second compilation."""
  with jax.set_mesh(mesh), jax.default_matmul_precision("highest"):
    return step.lower(*args).compile()


def report_of(step, args, mesh):
  """fxaccum.diagnostics' report of ``run``'s step (see ``compiled_step``)."""
  return fxaccum.diagnostics.from_compiled(compiled_step(step, args, mesh), mesh=mesh)


# Each path of GPipe once: k = 1 and k below S, not a multiple of it (x gathered over the
# stages, outputs summed over them); k = S and k = 2S (x and the outputs streamed over the
# stages); on tensor-parallel stages (S = 2, with a model axis), with data and stage axes
# (S = 4), and with a stage axis only (S = 8, no data axis).
@pytest.mark.parametrize("stages,k", [(2, 1), (2, 4), (4, 2), (4, 4), (4, 8), (8, 8)])
def test_pipeline_matches_the_sequential_model(stages, k):
  (loss, grads), _ = run(stages, k)
  ref_loss, ref_grads = expected(stages, k)
  assert_tree_close(loss, ref_loss, rtol=1e-5)
  assert_tree_close(grads, ref_grads, rtol=1e-5)


@pytest.mark.parametrize("stages,k", [(4, 4), (2, 4)])
def test_explicit_meshes(stages, k):
  (loss, grads), _ = run(stages, k, AxisType.Explicit)
  ref_loss, ref_grads = expected(stages, k)
  assert_tree_close(loss, ref_loss, rtol=1e-5)
  assert_tree_close(grads, ref_grads, rtol=1e-5)
  spec = jax.typeof(grads["stages"]["w1"]).sharding.spec
  assert spec[0] == "stage"  # stage gradients stay on their stages


def test_inside_in_step_accumulation():
  """fxaccum.value_and_grad over 2 micro-batches, each pipelined in 2: the token mean of
  the whole batch (the all-padding micro-batch included)."""
  (loss, grads), _ = run(4, 2, outer=2)
  ref_loss, ref_grads = expected(4, 2)
  assert_tree_close(loss, ref_loss, rtol=1e-5)
  assert_tree_close(grads, ref_grads, rtol=1e-5)


def circular_params(stages: int, repeats: int) -> dict:
  """make_params with the circular schedule's (R, S) leading dimensions on the stages."""
  params = make_params(stages * repeats)
  params["stages"] = jax.tree.map(lambda a: a.reshape(repeats, stages, *a.shape[1:]),
                                  params["stages"])
  return params


def virtual_stages(stages, h):
  """The circular schedule's contract: virtual stage v = r * S + s uses leaf[r, s]."""
  repeats, count = jax.tree.leaves(stages)[0].shape[:2]
  for v in range(repeats * count):
    h = block(jax.tree.map(lambda a, v=v: a[v // count, v % count], stages), h)
  return h


SEQUENTIAL, VIRTUAL_STAGES = value_and_grad(sequential), value_and_grad(virtual_stages)


def circular_reference(params, batch):
  with jax.default_matmul_precision("highest"):
    return VIRTUAL_STAGES(params, batch)


@functools.cache
def expected(stages, k, repeats=0):
  """The reference for ``run(stages, k, ...)``: the sequential model (``repeats=0``: GPipe,
  1F1B) or the circular schedule's virtual stages, computed once per configuration (it
  does not depend on the mesh's axis types or on how the pipeline is differentiated)."""
  if repeats:
    return circular_reference(circular_params(stages, repeats), make_batch(k))
  return reference(make_params(stages), make_batch(k))


AUTO, EXPLICIT = ("auto", AxisType.Auto), ("explicit", AxisType.Explicit)


def schedule_cases(*cases):
  """pytest params with readable ids: (stages, k[, repeats], (name, axis type), how)."""
  return [pytest.param(*case[:-2], case[-2][1], case[-1],
                       id="-".join(map(str, (*case[:-2], case[-2][0], case[-1]))))
          for case in cases]


# Not the full product of (S, k, R), axis types and differentiators: fxaccum.value_and_grad
# over one micro-batch runs the step as jax.value_and_grad does (view 'global'), and k
# only moves the iteration at which a round's outputs come back to device 0 (k = S: the
# next one). R = 1 (tensor-parallel, S = 2) and R = 2 with k = S and k > S; each S on Auto
# and Explicit meshes (tensor-parallel stages on an Explicit mesh differentiate by their
# own vjp rule) and under both differentiators. test_tensor_parallel_...[circular] adds
# (2, 4, 2) on an Explicit mesh under fxaccum.value_and_grad.
@pytest.mark.parametrize("stages,k,repeats,axis_type,differentiate", schedule_cases(
    (2, 2, 2, AUTO, "jax"), (2, 4, 1, EXPLICIT, "jax"), (4, 4, 2, EXPLICIT, "fxaccum"),
    (4, 8, 2, AUTO, "jax")))
def test_circular_schedule_matches_the_virtual_stages(stages, k, repeats, axis_type,
                                                      differentiate):
  """Exact against R * S stages in a Python loop on one device: S in {2, 4} (S = 2 with
  tensor-parallel stages), k in {S, 2S}, R in {1, 2}, Auto and Explicit meshes, under
  fxaccum.value_and_grad and jax.value_and_grad, on the skewed token batch."""
  (loss, grads), _ = run(stages, k, axis_type, differentiate=differentiate,
                         schedule="circular", repeats=repeats)
  ref_loss, ref_grads = expected(stages, k, repeats)
  assert_tree_close(loss, ref_loss, rtol=1e-5)
  assert_tree_close(grads, ref_grads, rtol=1e-5)


def test_circular_schedule_runs_k_times_r_plus_s_minus_1_iterations():
  """R = 2 stages per device, S = 4, k = 8: 8 * 2 + 3 = 19 iterations, one ring permute
  each (the last device hands its outputs back to the first), the stage gradients reduced
  over the data axes once; the bubble is (S - 1) / (k R + S - 1)."""
  _, (step, args, mesh) = run(4, 8, differentiate="jax", schedule="circular", repeats=2)
  report = report_of(step, args, mesh)
  permutes = report.select("collective-permute")
  assert {c.executions for c in permutes} == {8 * 2 + 3}, report.summary()
  assert report.reductions("loop", axes="data") == [], report.summary()
  assert fxaccum.diagnostics.bubble_fraction(4, 8, schedule="circular", repeats=2) == (
      pytest.approx(3 / 19))


def test_1f1b_inside_in_step_accumulation():
  """fxaccum.value_and_grad over 2 micro-batches, each through the 1F1B pipeline in 2."""
  (loss, grads), _ = run(4, 2, outer=2, schedule="1f1b")
  ref_loss, ref_grads = expected(4, 2)
  assert_tree_close(loss, ref_loss, rtol=1e-5)
  assert_tree_close(grads, ref_grads, rtol=1e-5)


# As for the circular schedule: each S with k = S (fewer micro-batches than the 2S - 1
# slots of the ring of stage inputs) and k = 2S (slots reused), on Auto and Explicit
# meshes and under both differentiators; (2, 4, Explicit, fxaccum) is also
# test_tensor_parallel_...[1f1b]'s program.
@pytest.mark.parametrize("stages,k,axis_type,differentiate", schedule_cases(
    (2, 2, AUTO, "jax"), (2, 4, EXPLICIT, "fxaccum"), (4, 4, EXPLICIT, "jax"),
    (4, 8, AUTO, "fxaccum")))
def test_1f1b_matches_the_sequential_model(stages, k, axis_type, differentiate):
  """1F1B (forward kept nothing; the backward is one wavefront scan): exact against the
  stages in a Python loop on one device, as GPipe is; S = 2 with tensor-parallel stages."""
  (loss, grads), _ = run(stages, k, axis_type, differentiate=differentiate, schedule="1f1b")
  ref_loss, ref_grads = expected(stages, k)
  assert_tree_close(loss, ref_loss, rtol=1e-5)
  assert_tree_close(grads, ref_grads, rtol=1e-5)


def vjp_temp_bytes(schedule, k, rows_per_micro_batch=2, width=32, tokens=16):
  """Compiled temp bytes of the pipeline's vjp with respect to the stage params, x and the
  output cotangent passed in (sharded over data), at a fixed micro-batch size."""
  stages = 4
  mesh = jax.make_mesh((2, stages), ("data", "stage"), axis_types=(AxisType.Auto,) * 2)
  rng = np.random.default_rng(0)
  params = {"w1": rng.normal(size=(stages, width, 4 * width)).astype(np.float32),
            "w2": rng.normal(size=(stages, 4 * width, width)).astype(np.float32)}
  x = rng.normal(size=(2 * k * rows_per_micro_batch, tokens, width)).astype(np.float32)

  def stage_fn(p, h):
    return h + jnp.tanh(h @ p["w1"]) @ p["w2"]

  def vjp(p, x, dy):
    return jax.vjp(lambda p: fxaccum.pipeline(stage_fn, p, x, micro_batches=k,
                                              schedule=schedule), p)[1](dy)[0]

  with jax.set_mesh(mesh):
    args = (jax.device_put(params, NamedSharding(mesh, P("stage"))),
            *jax.device_put((x, x), NamedSharding(mesh, P("data"))))
    return jax.jit(vjp).lower(*args).compile().memory_analysis().temp_size_in_bytes


def test_1f1b_activation_memory_does_not_grow_with_k():
  """At a fixed micro-batch size (the batch grows with k), 1F1B's backward keeps at most
  2S - 1 stage inputs: its temp memory at k = 32 is within 1.25x of k = 4's. GPipe's (the
  negative control) keeps k + S - 1 and grows."""
  one_f_one_b = {k: vjp_temp_bytes("1f1b", k) for k in (4, 32)}
  gpipe = {k: vjp_temp_bytes("gpipe", k) for k in (4, 32)}
  assert one_f_one_b[32] <= 1.25 * one_f_one_b[4], one_f_one_b
  assert gpipe[32] >= 2 * gpipe[4], gpipe


def test_gpipe_hands_activations_one_way():
  """GPipe's permute pairs are s -> s + 1 only: nothing travels from the last stage back
  to the first."""
  _, (step, args, mesh) = run(4, 4)
  text = compiled_step(step, args, mesh).as_text()
  pairs = {line.split("source_target_pairs=")[1].split("}}")[0]
           for line in text.splitlines() if "collective-permute" in line
           and "source_target_pairs=" in line}
  assert pairs and all("{3,0}" not in p and "{7,4}" not in p for p in pairs), pairs


def test_mean_of_micro_batch_means_is_wrong_on_this_data():
  """Negative control: the skewed padding makes a per-micro-batch mean differ."""
  params, batch = make_params(4), make_batch(4)
  means = []
  for i in range(4):
    part = jax.tree.map(lambda a, i=i: a[i::4], batch)
    if part["mask"].sum():
      means.append(token_sums(params, part, sequential).value())
  assert abs(float(np.mean(means)) - float(expected(4, 4)[0])) > 1e-2


def test_one_data_reduction_and_one_permute_per_iteration():
  """GPipe with k a multiple of S streams x and the outputs over the stages: per forward
  iteration activations right, inputs and outputs left, then S - 1 iterations that move
  the last outputs home; per backward iteration cotangents left, output cotangents and
  x's gradients right (home within the scan); nothing activation-sized is summed over
  `stage`, and the head and loss after the pipeline run sharded over the stages."""
  stages, k = 4, 4
  _, (step, args, mesh) = run(stages, k)
  report = report_of(step, args, mesh)
  assert report.reductions("loop", axes="data") == []
  # The stage gradients in one data-axis reduction (all-reduces, which XLA combines;
  # fxaccum's buckets are for reduce-scatters, which XLA:CPU does not combine). The head's
  # and the embedding's gradients are summed over (data, stage) in another: they run on
  # activations sharded over both.
  assert len([c for c in report.reductions("top") if c.axes == ("data",)]) == 1, (
      report.summary())
  # Over `stage` only the loss and the head's and embedding's small gradients (1028 B):
  # no activations (the whole batch's are 8 KiB here).
  assert all(c.bytes <= 1028 for c in report.select(fxaccum.diagnostics.REDUCTIONS)
             if "stage" in c.axes), report.summary()
  permutes = report.select("collective-permute")
  assert {c.axes for c in permutes} == {("stage",)}
  runs = sorted(c.executions for c in permutes)
  assert runs == [stages - 1] + [k + stages - 1] * 6, report.summary()
  assert fxaccum.diagnostics.bubble_fraction(stages, k) == pytest.approx(3 / 7)


def test_gpipe_with_k_below_s_sums_outputs_over_the_stages():
  """k not a multiple of S: x stays gathered over `stage` and the outputs are summed over
  it (the unstreamed GPipe), one permute per iteration each way."""
  stages, k = 4, 2
  _, (step, args, mesh) = run(stages, k)
  report = report_of(step, args, mesh)
  permutes = report.select("collective-permute")
  assert len(permutes) == 2 and {c.executions for c in permutes} == {k + stages - 1}


def test_remat_stores_less_than_every_intermediate():
  def temp(remat):
    _, (step, args, mesh) = run(4, 8, remat=remat)
    return report_of(step, args, mesh).memory.temp_bytes
  assert temp(True) < temp(False)


def bad_call(stages=None, k=2, x_rows=BATCH, fn=block, stage_axis="stage", **schedule):
  mesh = jax.make_mesh((2, 4), ("data", "stage"))
  params = make_params(stages or 4)["stages"]
  x = jnp.ones((x_rows, TOKENS, DIM))
  with jax.set_mesh(mesh):
    jax.jit(lambda p, x: fxaccum.pipeline(fn, p, x, micro_batches=k, stage_axis=stage_axis,
                                          **schedule)).lower(params, x)


@pytest.mark.parametrize("kwargs,error,match", [
    ({"stages": 2}, ValueError, r"leading dimension of 4, the size of the mesh axis 'stage'"),
    ({"k": 0}, ValueError, "micro_batches must be a positive int"),
    ({"k": 1.5}, TypeError, "micro_batches must be a positive int"),
    ({"x_rows": 18}, ValueError, "over 2 data-parallel devices and micro_batches=2"),
    ({"fn": lambda p, h: h[..., :4]}, ValueError, "stage_fn must return activations like"),
    ({"fn": lambda p, h: h.astype(jnp.bfloat16)}, ValueError, "bfloat16"),
    ({"stage_axis": "pipe"}, ValueError, "needs one with the stage axis 'pipe'"),
    ({"schedule": "1f1b-ish"}, ValueError,
     r"schedule must be one of \('gpipe', 'circular', '1f1b'\)"),
    ({"schedule": "1f1b", "repeats": 2}, ValueError, "repeats=2 needs schedule='circular'"),
    ({"repeats": 2}, ValueError, "repeats=2 needs schedule='circular'"),
    ({"schedule": "circular", "repeats": 0}, ValueError, "repeats must be a positive int"),
    ({"schedule": "circular", "repeats": 2, "k": 4}, ValueError,
     r"needs leading dimensions \(repeats, stages\) = \(2, 4\), found \(4, 8\)"),
    ({"schedule": "circular", "repeats": 2, "k": 2}, ValueError,
     "needs micro_batches >= the 4 stages"),
])
def test_errors_name_the_fix(kwargs, error, match):
  with pytest.raises(error, match=match):
    bad_call(**kwargs)


def test_params_without_a_leading_stage_dimension():
  mesh = jax.make_mesh((2, 4), ("data", "stage"))
  with jax.set_mesh(mesh), pytest.raises(ValueError, match=r"\['w'\] has shape \(\)"):
    fxaccum.pipeline(block, {"w": jnp.float32(1)}, jnp.ones((8, DIM)), micro_batches=2)


def test_idle_iterations_put_no_nan_into_the_gradient():
  """A stage with an infinite derivative at 0: the idle iterations must not feed it zeros
  (their cotangent is 0, and 0 * inf = NaN)."""
  def stage(p, h):
    return p["w"] * jnp.sqrt(h)

  stages = {"w": jnp.full((4,), 1.5)}
  x = jnp.linspace(0.5, 2.0, 32).reshape(16, 2)
  mesh = jax.make_mesh((2, 4), ("data", "stage"), axis_types=(AxisType.Auto,) * 2)

  def loss(p, x, body):
    return jnp.sum(body(p, x))

  def loop(p, h):
    for s in range(4):
      h = stage({"w": p["w"][s]}, h)
    return h

  ref = jax.grad(loss)(stages, x, loop)
  with jax.set_mesh(mesh):
    got = jax.jit(jax.grad(loss), static_argnums=2)(stages, x, lambda p, h: fxaccum.pipeline(
        stage, p, h, micro_batches=4))
  assert_tree_close(got, ref, rtol=1e-5)


@pytest.mark.parametrize("spec", [P(("data", "stage")), P("data")], ids=["data_stage", "data"])
def test_streamed_output_keeps_the_inputs_sharding(spec):
  """On an Explicit mesh, x sharded over (data, stage) comes back sharded so (no
  collective over the stages for it); x sharded over data only comes back over data.
  Both equal the stages in a Python loop."""
  mesh = jax.make_mesh((2, 4), ("data", "stage"), axis_types=(AxisType.Explicit,) * 2)
  params = make_params(4)["stages"]
  x = np.random.default_rng(2).normal(size=(BATCH, TOKENS, DIM)).astype(np.float32)
  with jax.set_mesh(mesh), jax.default_matmul_precision("highest"):
    placed = jax.device_put(params, NamedSharding(mesh, P("stage")))
    y = jax.jit(lambda p, x: fxaccum.pipeline(block, p, x, micro_batches=8))(
        placed, jax.device_put(x, NamedSharding(mesh, spec)))
  assert tuple(jax.typeof(y).sharding.spec) == (spec[0], None, None)
  with jax.default_matmul_precision("highest"):
    assert_tree_close(y, sequential(params, x), rtol=1e-5)


@pytest.mark.parametrize("schedule", ["gpipe", "circular", "1f1b"])
def test_tensor_parallel_stages_on_an_explicit_mesh_gather_no_params(schedule):
  """Stage params sharded over `model`, a free Explicit axis: neither they nor their
  gradients are all-gathered over it (JAX's plain partially manual shard_map gathered them
  at the boundary: 6 all-gathers over `model` in this step), and the result is exact."""
  repeats = 2 if schedule == "circular" else 1
  (loss, grads), (step, args, mesh) = run(2, 4, AxisType.Explicit, schedule=schedule,
                                          repeats=repeats)
  rep = report_of(step, args, mesh)
  assert rep.select("all-gather", axes="model") == [], rep.summary()
  assert jax.typeof(grads["stages"]["w1"]).sharding.spec[-1] == "model"
  ref_loss, ref_grads = expected(2, 4, repeats if schedule == "circular" else 0)
  assert_tree_close(loss, ref_loss, rtol=1e-5)
  assert_tree_close(grads, ref_grads, rtol=1e-5)


def streamed_inputs(k, rows_per_micro_batch=2, width=32, tokens=16):
  """Stage params and x for streamed_vjp_bytes: a fixed micro-batch, k of them."""
  rng = np.random.default_rng(0)
  params = {"w1": rng.normal(size=(4, width, 4 * width)).astype(np.float32) / 8,
            "w2": rng.normal(size=(4, 4 * width, width)).astype(np.float32) / 16}
  x = rng.normal(size=(2 * k * rows_per_micro_batch, tokens, width)).astype(np.float32)
  return params, x


def streamed_stage(p, h):
  return h + jnp.tanh(h @ p["w1"]) @ p["w2"]


@functools.cache
def streamed_reference(k):
  """The vjp of the 4 stages in a loop on one device (cotangent x), for streamed_inputs(k):
  the same for every schedule and sharding of x."""
  def vjp(params, x):
    return jax.vjp(lambda p, x: jax.lax.fori_loop(
        0, 4, lambda s, h: streamed_stage(jax.tree.map(lambda a: a[s], p), h), x),
        params, x)[1](x)

  with jax.default_matmul_precision("highest"):
    return jax.jit(vjp)(*streamed_inputs(k))


def streamed_vjp_bytes(k, spec, schedule="1f1b"):
  """Argument + temp bytes of the pipeline's vjp w.r.t. the stage params and x on an
  Explicit (data 2, stage 4) mesh, x and the output cotangent typed ``spec``, a fixed
  micro-batch; the result checked against the stages in a loop."""
  mesh = jax.make_mesh((2, 4), ("data", "stage"), axis_types=(AxisType.Explicit,) * 2)
  params, x = streamed_inputs(k)

  def vjp(p, x, dy):
    return jax.vjp(lambda p, x: fxaccum.pipeline(streamed_stage, p, x, micro_batches=k,
                                                 schedule=schedule), p, x)[1](dy)

  with jax.set_mesh(mesh), jax.default_matmul_precision("highest"):
    args = (jax.device_put(params, NamedSharding(mesh, P("stage"))),
            *jax.device_put((x, x), NamedSharding(mesh, spec)))
    compiled = jax.jit(vjp).lower(*args).compile()
    got = compiled(*args)
  assert_tree_close(got, streamed_reference(k), rtol=1e-5)
  if spec == P(("data", "stage")):  # x's gradient stays with its stage's share
    assert tuple(jax.typeof(got[1]).sharding.spec)[0] == ("data", "stage")
  memory = compiled.memory_analysis()
  return memory.argument_size_in_bytes + memory.temp_size_in_bytes


def test_1f1b_streams_x_sharded_over_the_stages():
  """x and the cotangent typed over (data, stage): each stage holds 1/S of them and of x's
  gradient (inputs travel left, cotangents right, x's gradients home), exact. Per extra
  micro-batch, argument + temp bytes grow by under half of what x sharded over data only
  (every stage holding the whole local batch) costs."""
  one_micro_batch = 2 * 16 * 32 * 4  # rows x tokens x width x f32, per data device
  growth = {}
  for name, spec in (("streamed", P(("data", "stage"))), ("data_only", P("data"))):
    low, high = streamed_vjp_bytes(4, spec), streamed_vjp_bytes(32, spec)
    growth[name] = (high - low) / 28 / one_micro_batch
  assert growth["streamed"] < 0.5 * growth["data_only"], growth


def test_gpipe_streamed_memory_grows_by_its_stash_and_shares():
  """Streamed GPipe's own backward pass reads the output cotangent and writes x's gradient
  in place: argument + temp bytes grow per extra micro-batch by its stash (one stage input
  per iteration) and the shares of x and of the cotangent, 1.5 micro-batches, within
  issue 23's 1/S of the 6.0-6.5 before streaming (JAX's transpose of the forward scan
  kept copies: 2.07)."""
  one_micro_batch = 2 * 16 * 32 * 4
  low = streamed_vjp_bytes(4, P(("data", "stage")), schedule="gpipe")
  high = streamed_vjp_bytes(32, P(("data", "stage")), schedule="gpipe")
  assert (high - low) / 28 / one_micro_batch <= 1.6


def test_reverse_over_reverse_through_the_custom_backward_passes():
  """Streamed GPipe's and 1F1B's backward passes are custom_vjp rules: a Hessian-vector
  product by jax.grad of jax.grad through them equals the one through the stages in a
  loop (forward mode is documented as unsupported there)."""
  mesh = jax.make_mesh((2, 4), ("data", "stage"), axis_types=(AxisType.Auto,) * 2)
  rng = np.random.default_rng(5)
  params = {"w": (rng.normal(size=(4, 8, 8)) / 3).astype(np.float32)}
  x = rng.normal(size=(16, 8)).astype(np.float32)
  vector = {"w": rng.normal(size=(4, 8, 8)).astype(np.float32)}

  def stage_fn(p, h):
    return jnp.tanh(h @ p["w"])

  def hvp(body):
    loss = lambda p: jnp.sum(body(p, x) ** 2)  # noqa: E731
    return jax.grad(lambda p: jnp.vdot(jax.grad(loss)(p)["w"], vector["w"]))(params)

  with jax.default_matmul_precision("highest"):
    ref = jax.jit(lambda: hvp(lambda p, h: jax.lax.fori_loop(
        0, 4, lambda s, h: stage_fn(jax.tree.map(lambda a: a[s], p), h), h)))()
    for schedule in ("gpipe", "1f1b"):
      with jax.set_mesh(mesh):
        got = jax.jit(lambda schedule=schedule: hvp(lambda p, h: fxaccum.pipeline(
            stage_fn, p, h, micro_batches=4, schedule=schedule)))()
      assert_tree_close(got, ref, rtol=1e-4)


def closure_inputs():
  rng = np.random.default_rng(6)
  w = (rng.normal(size=(4, 8, 8)) / 3).astype(np.float32)
  return w, rng.normal(size=(16, 8)).astype(np.float32)


@functools.cache
def closure_reference():
  """The gradient of the 4 stages in a loop, scale 1.5, on closure_inputs(): the reference
  of every case of the test below (jitted, computed once)."""
  w, x = closure_inputs()

  def looped(w, scale):
    h = x
    for s in range(4):
      h = jnp.tanh(h @ w[s]) * scale
    return jnp.sum(h ** 2)

  return jax.jit(jax.grad(looped))(w, np.float32(1.5))


@pytest.mark.parametrize("schedule, k", [("gpipe", 4), ("gpipe", 2), ("circular", 4),
                                         ("1f1b", 4)])
def test_a_differentiated_value_stage_fn_closes_over_names_the_fix(schedule, k):
  """jax.grad with respect to a value stage_fn closes over failed deep inside JAX (a
  leaked tracer or a mesh mismatch): a ValueError now says to pass it in stage_params.
  Closing over a value that is not differentiated still works."""
  mesh = jax.make_mesh((2, 4), ("data", "stage"), axis_types=(AxisType.Auto,) * 2)
  w, x = closure_inputs()

  def loss(w, scale):
    stages = w[None] if schedule == "circular" else w
    y = fxaccum.pipeline(lambda q, h: jnp.tanh(h @ q) * scale, stages, x, micro_batches=k,
                         schedule=schedule)
    return jnp.sum(y ** 2)

  with jax.set_mesh(mesh):
    with pytest.raises(ValueError, match="closes over a value that is being differentiated"):
      jax.jit(jax.grad(loss, argnums=1))(w, jnp.float32(1.5))
    got = jax.jit(jax.grad(loss))(w, jnp.float32(1.5))  # scale traced, not differentiated
  assert_tree_close(got, closure_reference(), rtol=1e-4)


@pytest.mark.parametrize("schedule, k, remat", [("gpipe", 4, True), ("1f1b", 2, True),
                                                ("gpipe", 4, False)])
def test_integer_leaves_are_refused_by_the_schedules_own_backward_pass(schedule, k, remat):
  """An integer leaf of x (a mask passed from stage to stage) or of stage_params met the
  float0 cotangents JAX gives it deep inside 1F1B's and streamed GPipe's backward pass
  ("Called add with a float0 array", or a stage_fn "mapping int32 to void"): a ValueError
  now names the leaf and the fix. GPipe with remat=False, differentiated by JAX, takes
  them and matches the sequential stages."""
  mesh = jax.make_mesh((2, 4), ("data", "stage"), axis_types=(AxisType.Auto,) * 2)
  rng = np.random.default_rng(7)
  w = (rng.normal(size=(4, 4, 4)) / 2).astype(np.float32)
  x = {"h": rng.normal(size=(16, 4)).astype(np.float32),
       "m": np.arange(16, dtype=np.int32) % 3}

  def stage_fn(q, h):
    return {"h": jnp.tanh(h["h"] @ q) * (h["m"][:, None] + 1), "m": h["m"]}

  def loss(w):
    y = fxaccum.pipeline(stage_fn, w, x, micro_batches=k, schedule=schedule, remat=remat)
    return jnp.sum(y["h"] ** 2)

  def looped(w):
    h = x
    for s in range(4):
      h = stage_fn(w[s], h)
    return jnp.sum(h["h"] ** 2)

  with jax.set_mesh(mesh):
    if remat:
      with pytest.raises(ValueError, match=r"floating-point leaves only; found x\['m'\]"):
        jax.jit(jax.grad(loss))(w)
      return
    got = jax.jit(jax.grad(loss))(w)
  assert_tree_close(got, jax.grad(looped)(w), rtol=1e-4)
