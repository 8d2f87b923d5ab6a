"""fxaccum.micro_batched: contrastive losses over micro-batched towers are the large batch's.

References are plain ``jax.value_and_grad`` of the same loss with plain towers (never
fxaccum), jitted once per loss and shared by the parametrized cases.
"""

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import AXIS_TYPES, assert_tree_close, mesh_of
from jax import lax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import fxaccum
from fxaccum import diagnostics

N, D_IMG, VOCAB, T, WIDTH, LAYERS, EMBED = 64, 12, 32, 6, 16, 4, 8


def residual_tower(p, x, key=None, rate=0.0):
  """A residual MLP tower, its layers run by lax.scan (optionally with dropout)."""
  h = x @ p["w_in"]

  def layer(h, wb):
    w, b, i = wb
    h = h + jnp.tanh(h @ w + b)
    if key is not None:
      keep = jax.random.bernoulli(jax.random.fold_in(key, i), 1 - rate, h.shape)
      h = jnp.where(keep, h / (1 - rate), 0.0)
    return h, None

  h, _ = lax.scan(layer, h, (p["w"], p["b"], jnp.arange(p["w"].shape[0])))
  return h @ p["w_out"]


def text_tower(p, tokens):
  """Integer tokens: mean of their embeddings (one-hot, which needs no out_sharding on an
  Explicit mesh), then a residual tower."""
  counts = jnp.mean(jax.nn.one_hot(tokens, p["embed"].shape[0]), axis=1)
  return residual_tower(p["mlp"], counts @ p["embed"])


def tower_params(key, d_in):
  k = jax.random.split(key, 3)
  return {"w_in": jax.random.normal(k[0], (d_in, WIDTH)) / np.sqrt(d_in),
          "w": jax.random.normal(k[1], (LAYERS, WIDTH, WIDTH)) / np.sqrt(WIDTH),
          "b": jnp.zeros((LAYERS, WIDTH)),
          "w_out": jax.random.normal(k[2], (WIDTH, EMBED)) / np.sqrt(WIDTH)}


def make_problem(seed=0):
  k = jax.random.split(jax.random.key(seed), 5)
  params = {"img": tower_params(k[0], D_IMG),
            "txt": {"embed": jax.random.normal(k[1], (VOCAB, D_IMG)),
                    "mlp": tower_params(k[2], D_IMG)},
            "t": jnp.log(jnp.float32(10.0)), "bias": jnp.float32(-2.0)}
  batch = {"img": jax.random.normal(k[3], (N, D_IMG)),
           "tok": jax.random.randint(k[4], (N, T), 0, VOCAB)}
  return params, batch


def normalize(z):
  return z / jnp.linalg.norm(z, axis=-1, keepdims=True)


def similarities(a, b):
  """``a @ b.T``, all of ``b`` on every device (on an Explicit mesh JAX wants it said)."""
  mesh = jax.typeof(b).sharding.mesh
  if AxisType.Explicit in getattr(mesh, "axis_types", ()):
    b = jax.sharding.reshard(b, P())
  return a @ b.T


def clip_loss(params, batch, towers):
  img_tower, txt_tower = towers
  zi = normalize(img_tower(params["img"], batch["img"]))
  zt = normalize(txt_tower(params["txt"], batch["tok"]))
  logits = jnp.exp(params["t"]) * similarities(zi, zt)
  diagonal = jnp.sum(logits * jnp.eye(logits.shape[0]), axis=1)  # (no gather: Explicit)
  return (jnp.mean(jax.nn.logsumexp(logits, axis=1) - diagonal)
          + jnp.mean(jax.nn.logsumexp(logits, axis=0) - diagonal)) / 2


def siglip_loss(params, batch, towers):
  img_tower, txt_tower = towers
  zi = normalize(img_tower(params["img"], batch["img"]))
  zt = normalize(txt_tower(params["txt"], batch["tok"]))
  logits = jnp.exp(params["t"]) * similarities(zi, zt) + params["bias"]
  labels = 2 * jnp.eye(logits.shape[0]) - 1
  return -jnp.sum(jax.nn.log_sigmoid(labels * logits)) / logits.shape[0]


def ntxent_loss(params, batch, towers, tau=0.5):
  """SimCLR: one shared tower on two views of each image."""
  tower = towers[0]
  n = batch["img"].shape[0]
  z = normalize(jnp.concatenate([tower(params["img"], batch["img"]),
                                 tower(params["img"], jnp.flip(batch["img"], axis=1))]))
  sim = similarities(z, z) / tau - 1e9 * jnp.eye(2 * n)
  positives = jnp.roll(jnp.eye(2 * n), n, axis=1)  # view i's other view: row i +- n
  return jnp.mean(jax.nn.logsumexp(sim, axis=1) - jnp.sum(sim * positives, axis=1))


LOSSES = {"clip": clip_loss, "siglip": siglip_loss, "ntxent": ntxent_loss}
PLAIN = (residual_tower, text_tower)


def micro(k, **kw):
  return tuple(fxaccum.micro_batched(t, micro_batches=k, **kw) for t in PLAIN)


def all_losses(towers):
  """The value and gradients of every loss, in one program."""
  return lambda p, b: {name: jax.value_and_grad(loss)(p, b, towers)
                       for name, loss in LOSSES.items()}


@functools.cache
def references():
  params, batch = make_problem()
  return jax.device_get(jax.jit(all_losses(PLAIN))(params, batch))


def reference(name):
  return references()[name]


def on_mesh(tree, mesh, batch=False):
  spec = P("data") if batch else P()
  return jax.tree.map(lambda a: jax.device_put(a, NamedSharding(mesh, spec)), tree)


@pytest.mark.slow  # compiles several steps (about 5 s or more)
@pytest.mark.parametrize("k", [4, 8])
@pytest.mark.parametrize("axis_type", AXIS_TYPES, ids=["auto", "explicit"])
def test_contrastive_losses_equal_the_large_batch(axis_type, k):
  """CLIP (two towers, learnable temperature), SigLIP and NT-Xent (one shared tower)."""
  params, batch = make_problem()
  mesh = mesh_of((8,), ("data",), axis_type)
  with jax.set_mesh(mesh):
    args = on_mesh(params, mesh), on_mesh(batch, mesh, batch=True)
    results = jax.jit(all_losses(micro(k)))(*args)
  for name, (value, grads) in results.items():
    ref_value, ref_grads = reference(name)
    np.testing.assert_allclose(value, ref_value, rtol=1e-5, err_msg=name)
    assert_tree_close(grads, ref_grads, rtol=1e-5)


def mean_of_micro_batch_losses(params, batch, k, loss):
  """What value_and_grad(micro_batches=k) computes: each micro-batch's own loss."""
  parts = [loss(params, jax.tree.map(lambda a, i=i: a[i::k], batch), PLAIN) for i in range(k)]
  return sum(parts) / k


def test_negative_control_mean_of_micro_batch_losses_differs():
  params, batch = make_problem()
  ref_value, ref_grads = reference("clip")
  value, grads = jax.jit(jax.value_and_grad(
      lambda p, b: mean_of_micro_batch_losses(p, b, 8, clip_loss)))(params, batch)
  assert abs(value - ref_value) > 1e-2 * abs(ref_value)
  with pytest.raises(AssertionError):
    assert_tree_close(grads, ref_grads, rtol=1e-2)


def per_micro_batch(fun, k, *args, key=None):
  """The contract, written out in plain JAX: fun on rows i::k with fold_in(key, i)."""
  outs = [fun(*[a[i::k] for a in args],
              *(() if key is None else (jax.random.fold_in(key, i),))) for i in range(k)]
  out = jnp.stack(outs, axis=1)  # (n / k, k, ...): row j * k + i is micro-batch i's row j
  return out.reshape(-1, *out.shape[2:])


@pytest.mark.slow  # compiles several steps (about 5 s or more)
def test_dropout_keys_are_folded_per_micro_batch_and_match_in_the_backward():
  params, batch = make_problem()
  key, k = jax.random.key(3), 4
  tower = functools.partial(residual_tower, rate=0.3)

  def loss(img_tower, p, x, key):
    z = normalize(img_tower(p, x, key))
    return jax.nn.logsumexp(4 * similarities(z, z), axis=1).mean()

  mb = fxaccum.micro_batched(tower, micro_batches=k, rng_argnums=2)
  value, grads = jax.jit(jax.value_and_grad(functools.partial(loss, mb)))(
      params["img"], batch["img"], key)
  def contract(p, x, key):
    return per_micro_batch(lambda x, kk: tower(p, x, kk), k, x, key=key)
  ref_value, ref_grads = jax.jit(jax.value_and_grad(functools.partial(loss, contract)))(
      params["img"], batch["img"], key)
  np.testing.assert_allclose(value, ref_value, rtol=1e-5)
  assert_tree_close(grads, ref_grads)
  # One key for the whole batch would give other masks.
  whole, _ = jax.value_and_grad(functools.partial(loss, tower))(params["img"], batch["img"], key)
  assert abs(whole - ref_value) > 1e-3


def batch_norm_tower(p, x):
  """Mixes the rows of its batch: train-mode batch normalization of the first layer."""
  h = x @ p["w_in"]
  h = (h - h.mean(0)) / jnp.sqrt(h.var(0) + 1e-5)
  return jnp.tanh(h) @ p["w_out"]


def test_ghost_batch_norm_is_per_micro_batch_and_reported():
  params, batch = make_problem()
  k, mesh = 4, mesh_of((8,), ("data",), AxisType.Explicit)

  def loss(tower, p, x):
    z = normalize(tower(p, x))
    return jax.nn.logsumexp(4 * similarities(z, z), axis=1).mean()

  def contract(p, x):
    return per_micro_batch(functools.partial(batch_norm_tower, p), k, x)
  ref_value, ref_grads = jax.jit(jax.value_and_grad(functools.partial(loss, contract)))(
      params["img"], batch["img"])
  mb = fxaccum.micro_batched(batch_norm_tower, micro_batches=k)
  step = jax.jit(jax.value_and_grad(functools.partial(loss, mb)))
  with jax.set_mesh(mesh):
    args = on_mesh(params["img"], mesh), on_mesh(batch["img"], mesh, batch=True)
    value, grads = step(*args)
    rep = diagnostics.report(step, *args)
  np.testing.assert_allclose(value, ref_value, rtol=1e-5)
  assert_tree_close(grads, ref_grads)
  whole = loss(batch_norm_tower, params["img"], batch["img"])
  assert abs(whole - ref_value) > 1e-3  # statistics over the whole batch differ
  backward = [p for p in rep.paths if "backward" in p.reason]
  assert backward and backward[0].view == "global", rep.summary()
  assert "ghost batch statistics" in backward[0].reason


def test_input_gradient_flows_to_the_batch():
  params, batch = make_problem()

  def loss(towers, p, x, tok):
    return clip_loss(p, {"img": x, "tok": tok}, towers)

  def grad(towers):  # the integer tokens get float0 gradients
    return jax.jit(jax.grad(functools.partial(loss, towers), argnums=(0, 1, 2),
                            allow_int=True))(params, batch["img"], batch["tok"])

  (g_params, g_x, g_tok), (ref_params, ref_x, _) = grad(micro(4)), grad(PLAIN)
  assert g_tok.dtype == jax.dtypes.float0
  assert_tree_close(g_x, ref_x)
  assert_tree_close(g_params, ref_params)
  assert float(jnp.max(jnp.abs(ref_x))) > 1e-4  # the reference input gradient is not 0


def test_rows_not_divisible_is_a_clear_error():
  params, batch = make_problem()
  mesh = mesh_of((8,), ("data",), AxisType.Explicit)
  tower = fxaccum.micro_batched(residual_tower, micro_batches=16)
  with jax.set_mesh(mesh), pytest.raises(ValueError, match=r"64.*micro_batches=16"):
    tower(on_mesh(params["img"], mesh), on_mesh(batch["img"], mesh, batch=True))
  with pytest.raises(ValueError, match=r"64.*micro_batches=3"):
    fxaccum.micro_batched(residual_tower, micro_batches=3)(params["img"], batch["img"])


@pytest.mark.parametrize("axis_type", AXIS_TYPES, ids=["auto", "explicit"])
def test_per_example_towers_reduce_once_outside_the_loops(axis_type):
  params, batch = make_problem()
  mesh = mesh_of((8,), ("data",), axis_type)
  step = jax.jit(jax.value_and_grad(lambda p, b: clip_loss(p, b, micro(4))))
  with jax.set_mesh(mesh):
    rep = diagnostics.report(step, on_mesh(params, mesh), on_mesh(batch, mesh, batch=True))
  assert rep.reductions(place="loop", axes="data") == [], rep.summary()
  backward = [p for p in rep.paths if "backward" in p.reason]
  assert len(backward) == 2 and all(p.view == "device" for p in backward), rep.summary()


@pytest.mark.slow  # compiles several steps (about 5 s or more)
def test_peak_memory_is_one_micro_batch_of_activations():
  depth, width, n = 64, 32, 512  # activations dominate the params and the n x n logits
  key = jax.random.split(jax.random.key(0), 3)
  p = {"w_in": jax.random.normal(key[0], (width, width)) / 8,
       "w": jax.random.normal(key[1], (depth, width, width)) / 8, "b": jnp.zeros((depth, width)),
       "w_out": jax.random.normal(key[2], (width, width)) / 8}
  params = {"img": p, "txt": {"embed": jnp.ones((VOCAB, width)), "mlp": p},
            "t": jnp.float32(1.0), "bias": jnp.float32(0.0)}
  batch = {"img": jnp.ones((n, width)), "tok": jnp.zeros((n, T), jnp.int32)}
  mesh = mesh_of((8,), ("data",), AxisType.Explicit)

  def peak(towers):
    step = jax.jit(jax.value_and_grad(lambda p, b: clip_loss(p, b, towers)))
    with jax.set_mesh(mesh):
      return diagnostics.report(step, on_mesh(params, mesh),
                                on_mesh(batch, mesh, batch=True)).memory.peak_bytes

  large, k4, k8 = peak(PLAIN), peak(micro(4)), peak(micro(8))
  assert k8 <= 0.5 * large, (large, k4, k8)
  assert k8 <= k4 * 1.05, (large, k4, k8)


def test_module_state_that_changes_is_refused():
  tower = fxaccum.micro_batched(lambda v, x, **kw: x, micro_batches=2)
  with pytest.raises(TypeError, match="mutable"):
    tower({}, jnp.ones((4, 2)), mutable=["batch_stats"])


def contrastive(z):
  z = normalize(z)
  return jax.nn.logsumexp(4 * similarities(z, z), axis=1).mean()


def test_linen_apply_function():
  from flax import linen as nn

  class Tower(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.Dense(EMBED)(jnp.tanh(nn.Dense(WIDTH)(x)))

  model, x = Tower(), make_problem()[1]["img"]
  variables = model.init(jax.random.key(0), x)
  def loss(apply, v):
    return contrastive(apply(v, x))
  grads = jax.jit(jax.grad(functools.partial(
      loss, fxaccum.micro_batched(model.apply, micro_batches=4, batch_argnums=1))))(variables)
  assert_tree_close(grads, jax.jit(jax.grad(functools.partial(loss, model.apply)))(variables))


def test_nnx_module_params_and_refused_state():
  from flax import nnx

  model, x = nnx.Sequential(nnx.Linear(D_IMG, WIDTH, rngs=nnx.Rngs(0)), jnp.tanh,
                            nnx.Linear(WIDTH, EMBED, rngs=nnx.Rngs(1))), make_problem()[1]["img"]
  tower = fxaccum.micro_batched(lambda m, x: m(x), micro_batches=4)
  grads = nnx.grad(lambda m: contrastive(tower(m, x)))(model)
  assert_tree_close(nnx.to_pure_dict(grads), nnx.to_pure_dict(
      nnx.grad(lambda m: contrastive(m(x)))(model)))
  norm = nnx.Sequential(nnx.Linear(D_IMG, WIDTH, rngs=nnx.Rngs(0)),
                        nnx.BatchNorm(WIDTH, rngs=nnx.Rngs(1)))
  with pytest.raises(TypeError, match="BatchStat"):
    tower(norm, x)


def test_extra_outputs_any_pytree_of_per_example_leaves():
  params, batch = make_problem()

  def with_aux(p, x):
    z = residual_tower(p, x)
    return {"z": z, "norm": jnp.linalg.norm(z, axis=-1), "argmax": jnp.argmax(z, axis=-1)}

  def loss(tower, p):
    out = tower(p, batch["img"])
    return contrastive(out["z"]) + jnp.mean(out["norm"] ** 2), out["argmax"]

  mb = fxaccum.micro_batched(with_aux, micro_batches=4)
  (value, argmax), grads = jax.jit(jax.value_and_grad(functools.partial(loss, mb),
                                                      has_aux=True))(params["img"])
  (ref, ref_argmax), ref_grads = jax.jit(jax.value_and_grad(
      functools.partial(loss, with_aux), has_aux=True))(params["img"])
  np.testing.assert_allclose(value, ref, rtol=1e-5)
  np.testing.assert_array_equal(argmax, ref_argmax)
  assert_tree_close(grads, ref_grads)


def test_outputs_without_rows_and_batch_keywords_are_clear_errors():
  params, batch = make_problem()
  pooled = fxaccum.micro_batched(lambda p, x: residual_tower(p, x).mean(0), micro_batches=4)
  with pytest.raises(ValueError, match="per-example outputs"):
    pooled(params["img"], batch["img"])
  tower = fxaccum.micro_batched(lambda p, x, *, y: residual_tower(p, x + y), micro_batches=4)
  with pytest.raises(ValueError, match="keyword argument"):
    tower(params["img"], batch["img"], y=batch["img"])


def fsdp_tower(p, x):
  """residual_tower with its matmuls' output sharding spelled out, as JAX asks of weights
  sharded over the batch's axis on an Explicit mesh (FSDP)."""
  def mm(x, w):
    return jnp.einsum("...i,ij->...j", x, w, out_sharding=P("data"))

  def layer(h, wb):
    return h + jnp.tanh(mm(h, wb[0]) + wb[1]), None

  h, _ = lax.scan(layer, mm(x, p["w_in"]), (p["w"], p["b"]))
  return mm(h, p["w_out"])


FSDP_SPECS = {"w_in": P(None, "data"), "w": P(None, None, "data"), "b": P(),
              "w_out": P(None, "data")}


def tower_loss(p, x, tower):
  return contrastive(tower(p, x))


@functools.cache
def fsdp_reference():
  """The image tower's problem and ``jax.value_and_grad`` of its contrastive loss."""
  params, batch = make_problem()
  return params, batch, *jax.jit(jax.value_and_grad(tower_loss), static_argnums=2)(
      params["img"], batch["img"], residual_tower)


def test_fsdp_params_on_an_explicit_mesh_keep_their_sharding():
  params, batch, ref_value, ref_grads = fsdp_reference()
  mesh = mesh_of((8,), ("data",), AxisType.Explicit)
  with jax.set_mesh(mesh):
    sharded = {n: jax.device_put(a, NamedSharding(mesh, FSDP_SPECS[n]))
               for n, a in params["img"].items()}
    tower = fxaccum.micro_batched(fsdp_tower, micro_batches=4)
    value, grads = jax.jit(jax.value_and_grad(functools.partial(tower_loss, tower=tower)))(
        sharded, on_mesh(batch["img"], mesh, batch=True))
  np.testing.assert_allclose(value, ref_value, rtol=1e-5)
  assert_tree_close(grads, ref_grads)
  assert {n: g.sharding.spec for n, g in grads.items()} == {
      n: P(*s, *[None] * (params["img"][n].ndim - len(s))) for n, s in FSDP_SPECS.items()}


def trimmed(spec):
  """``spec`` without trailing Nones (how jit's outputs spell it)."""
  axes = list(spec)
  while axes and axes[-1] is None:
    axes.pop()
  return P(*axes)


def test_fsdp_params_on_an_auto_mesh_inside_jit_keep_their_sharding_with_param_shardings():
  """Inside jax.jit on an Auto mesh JAX does not show the params' sharding: given as
  param_shardings (value_and_grad's spelling), the backward keeps them sharded and
  reduce-scatters their gradients (without it: gathered, replicated gradients)."""
  params, batch, ref_value, ref_grads = fsdp_reference()
  mesh = mesh_of((8,), ("data",), AxisType.Auto)
  tower = fxaccum.micro_batched(residual_tower, micro_batches=4,
                                param_shardings=(FSDP_SPECS, None))
  step = jax.jit(jax.value_and_grad(functools.partial(tower_loss, tower=tower)))
  with jax.set_mesh(mesh):
    args = ({n: jax.device_put(a, NamedSharding(mesh, FSDP_SPECS[n]))
             for n, a in params["img"].items()}, on_mesh(batch["img"], mesh, batch=True))
    rep = diagnostics.report(step, *args)
    value, grads = step(*args)
  np.testing.assert_allclose(value, ref_value, rtol=1e-5)
  assert_tree_close(grads, ref_grads)
  assert {n: trimmed(g.sharding.spec) for n, g in grads.items()} == {
      n: trimmed(s) for n, s in FSDP_SPECS.items()}
  assert rep.count(("reduce-scatter",)) > 0, rep.summary()  # (the strategy value_and_grad picks)
  with pytest.raises(TypeError, match="one tree prefix per positional argument"):
    fxaccum.micro_batched(residual_tower, micro_batches=4, param_shardings=FSDP_SPECS)


def test_nnx_sharding_metadata_on_an_auto_mesh_keeps_gradients_sharded():
  """An NNX module's params carry their sharding (nnx.with_partitioning): read without
  param_shardings, as value_and_grad reads it."""
  from flax import nnx

  def partitioned(*names):
    return nnx.with_partitioning(nnx.initializers.lecun_normal(), names)

  mesh = mesh_of((8,), ("data",), AxisType.Auto)
  x = make_problem()[1]["img"]
  with jax.set_mesh(mesh):
    model = nnx.Sequential(
        nnx.Linear(D_IMG, WIDTH, kernel_init=partitioned(None, "data"), rngs=nnx.Rngs(0)),
        jnp.tanh,
        nnx.Linear(WIDTH, EMBED, kernel_init=partitioned("data", None), rngs=nnx.Rngs(1)))
    state = nnx.state(model)
    nnx.update(model, jax.device_put(state, nnx.get_named_sharding(state, mesh)))
    xs = on_mesh(x, mesh, batch=True)
    tower = fxaccum.micro_batched(lambda m, x: m(x), micro_batches=4)
    grads = nnx.jit(nnx.grad(lambda m, x: contrastive(tower(m, x))))(model, xs)
    ref = nnx.jit(nnx.grad(lambda m, x: contrastive(m(x))))(model, xs)
  assert_tree_close(nnx.to_pure_dict(grads), nnx.to_pure_dict(ref))
  specs = jax.tree.map(lambda g: trimmed(g.sharding.spec), nnx.to_pure_dict(grads))
  assert specs["layers"][0]["kernel"] == P(None, "data"), specs
  assert specs["layers"][2]["kernel"] == P("data"), specs


def dropout_tower(p, x, key):
  return residual_tower(p, x, key, rate=0.5)


def test_a_shared_dropout_key_warns_once_naming_micro_batched_and_rng_argnums():
  """A key outside rng_argnums reaches every micro-batch whole: the same dropout pattern
  each micro-batch (not the large batch's). The warning names micro_batched's own
  argument; with rng_argnums, or a draw without a batch axis, nothing warns."""
  params, batch = make_problem()
  key = jax.random.key(3)

  def caught(tower, p):
    def loss(p):
      return contrastive(tower(p, batch["img"], key))
    with warnings.catch_warnings(record=True) as found:
      warnings.simplefilter("always")
      jax.grad(loss)(p)
      jax.jit(jax.grad(loss))(p)
    return [str(w.message) for w in found if "PRNG key" in str(w.message)]

  shared = caught(fxaccum.micro_batched(dropout_tower, micro_batches=4), params["img"])
  assert len(shared) == 1, shared
  assert "fxaccum.micro_batched(dropout_tower)" in shared[0], shared
  assert "rng_argnums=2" in shared[0], shared
  assert caught(fxaccum.micro_batched(dropout_tower, micro_batches=4, rng_argnums=2),
                params["img"]) == []

  def projected(p, x, key):  # one projection every example shares
    return residual_tower(p, x @ jax.random.normal(key, (D_IMG, D_IMG)))

  assert caught(fxaccum.micro_batched(projected, micro_batches=4), params["img"]) == []
