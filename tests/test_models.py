"""Real Flax models (linen and NNX) with dropout, aux metrics, bf16, memory and donation."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import assert_tree_close, mesh_of
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import fxaccum
from fxaccum import diagnostics

VOCAB, SEQ, WIDTH = 32, 16, 32


def lm_batch(batch=16, seed=0):
  rng = np.random.default_rng(seed)
  tokens = rng.integers(0, VOCAB, size=(batch, SEQ + 1)).astype(np.int32)
  lengths = rng.integers(0, SEQ + 1, size=batch)
  lengths[1::4] = 0  # micro-batch 1 (rows 1::4) of k=4 is all padding
  mask = (np.arange(SEQ)[None] < lengths[:, None]).astype(np.float32)
  return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "mask": mask}


def token_metrics(logits, batch):
  losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
  correct = (jnp.argmax(logits, -1) == batch["targets"]).astype(jnp.float32)
  mask = batch["mask"]
  loss = fxaccum.Weighted(jnp.sum(mask * losses), jnp.sum(mask))
  return loss, {"accuracy": fxaccum.Weighted(jnp.sum(mask * correct), jnp.sum(mask)),
                "tokens_per_micro_batch": jnp.sum(mask)}


class LinenBlock(nn.Module):
  """Embedding -> pre-LN causal self-attention -> MLP with dropout -> logits."""

  @nn.compact
  def __call__(self, tokens, *, deterministic):
    x = nn.Embed(VOCAB, WIDTH)(tokens)
    h = nn.LayerNorm()(x)
    x = x + nn.MultiHeadDotProductAttention(num_heads=2)(h, mask=nn.make_causal_mask(tokens))
    h = nn.Dense(2 * WIDTH)(nn.LayerNorm()(x))
    h = nn.Dropout(0.3)(nn.gelu(h), deterministic=deterministic)
    return nn.Dense(VOCAB)(x + nn.Dense(WIDTH)(h))


@functools.cache
def linen_block_params():
  """LinenBlock's params (they do not depend on the batch size), initialized once and
  jitted: op by op, each test's model.init took 3 s."""
  init = functools.partial(LinenBlock().init, deterministic=True)
  return jax.jit(init)(jax.random.key(0), np.zeros((1, SEQ), np.int32))


def per_example_dropout_loss(model, plain_aux):
  def loss_fn(params, batch):
    def one(tokens, key):
      return model.apply(params, tokens[None], deterministic=False, rngs={"dropout": key})[0]
    logits = jax.vmap(one)(batch["inputs"], batch["dropout_key"])
    loss, aux = token_metrics(logits, batch)
    return loss, aux if plain_aux else {"accuracy": aux["accuracy"]}

  return loss_fn


@functools.cache
def per_example_dropout_reference(model):
  """The token mean and metrics on the whole batch: jax.value_and_grad, compiled once for
  both cases below (their losses differ only in the aux leaves they return)."""
  loss_fn = per_example_dropout_loss(model, plain_aux=True)

  def reference(params, batch):
    loss, aux = loss_fn(params, batch)
    return loss.value(), aux

  return jax.jit(jax.value_and_grad(reference, has_aux=True))


@pytest.mark.parametrize("plain_aux", [False, True])
def test_linen_model_with_per_example_dropout_keys_and_aux(plain_aux):
  """Per-example dropout keys keep the loss per-example: with Weighted aux only it runs per
  device (an Explicit mesh, where flax's Embed needs the per-device view). A plain aux leaf
  that depends on the batch is averaged over the global micro-batches with the loss's
  weights, so that step takes the global view (an Auto mesh)."""
  model = LinenBlock()
  batch = lm_batch()
  params = linen_block_params()
  # Per-example dropout keys live in the batch, so they are split exactly like the data.
  batch["dropout_key"] = jax.random.split(jax.random.key(1), batch["inputs"].shape[0])

  loss_fn = per_example_dropout_loss(model, plain_aux)
  (ref_loss, ref_aux), ref_grads = per_example_dropout_reference(model)(params, batch)
  axis_type = AxisType.Auto if plain_aux else AxisType.Explicit
  mesh = mesh_of((8,), ("data",), axis_type)
  sharded = jax.tree.map(lambda a: jax.device_put(a, NamedSharding(mesh, P("data"))), batch)
  with jax.set_mesh(mesh):
    step = jax.jit(fxaccum.value_and_grad(loss_fn, has_aux=True, micro_batches=2))
    (loss, aux), grads = step(params, sharded)
    (path,) = diagnostics.paths(step, params, sharded)
  assert path.view == ("global" if plain_aux else "device"), path
  assert_tree_close((loss, grads), (ref_loss, ref_grads))
  np.testing.assert_allclose(aux["accuracy"], ref_aux["accuracy"].value(), rtol=1e-6)
  if plain_aux:
    # Averaged over the 2 global micro-batches (rows i::2) with the loss's weights, each
    # micro-batch's token count t: sum(t * t) / sum(t).
    tokens = np.array([batch["mask"][i::2].sum() for i in range(2)])
    np.testing.assert_allclose(aux["tokens_per_micro_batch"],
                               np.sum(tokens * tokens) / np.sum(tokens), rtol=1e-6)


class NNXBlock(nnx.Module):
  def __init__(self, rngs):
    self.embed = nnx.Embed(VOCAB, WIDTH, rngs=rngs)
    self.norm = nnx.LayerNorm(WIDTH, rngs=rngs)
    self.attention = nnx.MultiHeadAttention(num_heads=2, in_features=WIDTH, decode=False,
                                            rngs=rngs)
    self.up = nnx.Linear(WIDTH, 2 * WIDTH, rngs=rngs)
    self.dropout = nnx.Dropout(0.3)
    self.out = nnx.Linear(2 * WIDTH, VOCAB, rngs=rngs)

  def __call__(self, tokens, key):
    x = self.embed(tokens)
    x = x + self.attention(self.norm(x), mask=nnx.make_causal_mask(tokens))
    return self.out(self.dropout(nnx.gelu(self.up(x)), deterministic=False, rngs=key))


def test_nnx_model_with_folded_dropout_keys_and_aux():
  k = 4
  # jitted: op by op, building the module took 1 s more
  graphdef, params, rest = jax.jit(lambda: nnx.split(NNXBlock(nnx.Rngs(0)), nnx.Param, ...))()
  batch = lm_batch()
  key = jax.random.key(7)

  def loss_fn(params, batch, key):
    model = nnx.merge(graphdef, params, rest)
    return token_metrics(model(batch["inputs"], key), batch)

  (loss, aux), grads = jax.jit(fxaccum.value_and_grad(
      loss_fn, has_aux=True, micro_batches=k, rng_argnums=2))(params, batch, key)

  # Independent reference: an explicit Python loop over the micro-batches (rows i::k) with
  # the documented keys fold_in(key, i), summed and divided by the total token count.
  def micro_total(params, micro, sub):
    loss, aux = loss_fn(params, micro, sub)
    return loss.total, (loss.weight, aux)

  micro_value_and_grad = jax.jit(jax.value_and_grad(micro_total, has_aux=True))

  def reference(keys):
    totals, weights, acc_total, grad_sum = 0.0, 0.0, 0.0, None
    for i in range(k):
      micro = jax.tree.map(lambda a, i=i: a[i::k], batch)
      (total, (w, a)), g = micro_value_and_grad(params, micro, keys[i])
      totals, weights = totals + total, weights + w
      acc_total += a["accuracy"].total
      grad_sum = g if grad_sum is None else jax.tree.map(jnp.add, grad_sum, g)
    return totals / weights, jax.tree.map(lambda g: g / weights, grad_sum), acc_total / weights

  ref_loss, ref_grads, ref_accuracy = reference([jax.random.fold_in(key, i) for i in range(k)])
  assert_tree_close((loss, grads), (ref_loss, ref_grads))
  np.testing.assert_allclose(aux["accuracy"], ref_accuracy, rtol=1e-6)

  # Negative control: dropout really differs between micro-batches; the same key in every
  # micro-batch (what an unfolded rng argument gives) is another answer.
  same_key_loss, _, _ = reference([key] * k)
  assert abs(float(same_key_loss) - float(loss)) > 1e-4


def test_bf16_params_with_f32_accumulation():
  model = LinenBlock()
  batch = lm_batch(batch=32)
  params32 = linen_block_params()
  params16 = jax.tree.map(lambda p: p.astype(jnp.bfloat16), params32)

  def loss_fn(params, batch):
    logits = model.apply(params, batch["inputs"], deterministic=True)
    return token_metrics(logits.astype(jnp.float32), batch)[0]

  ref_loss, ref_grads = jax.jit(jax.value_and_grad(lambda p, b: loss_fn(p, b).value()))(
      params32, batch)
  loss, grads = jax.jit(fxaccum.value_and_grad(loss_fn, micro_batches=8))(params16, batch)
  assert all(g.dtype == jnp.bfloat16 for g in jax.tree.leaves(grads))
  np.testing.assert_allclose(loss, ref_loss, rtol=2e-2)
  assert_tree_close(jax.tree.map(lambda g: g.astype(jnp.float32), grads), ref_grads, rtol=5e-2,
                    floor=5e-2)


class ActivationHeavy(nn.Module):
  """Wide per-token MLP over long sequences: activations dwarf the params."""

  @nn.compact
  def __call__(self, tokens):
    x = nn.Embed(VOCAB, 64)(tokens)
    for _ in range(3):
      x = x + nn.Dense(64)(nn.gelu(nn.Dense(512)(x)))
    return nn.Dense(VOCAB)(x)


def activation_heavy_setup(batch=32, seq=256):
  model = ActivationHeavy()
  rng = np.random.default_rng(0)
  data = {"inputs": rng.integers(0, VOCAB, (batch, seq)).astype(np.int32),
          "targets": rng.integers(0, VOCAB, (batch, seq)).astype(np.int32)}
  params = jax.jit(model.init)(jax.random.key(0), data["inputs"][:1])  # op by op: 2 s

  def loss_fn(params, batch):
    logits = model.apply(params, batch["inputs"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()

  return loss_fn, params, data


def test_temp_memory_shrinks_with_micro_batches():
  loss_fn, params, data = activation_heavy_setup()
  temp = {}
  for k in (1, 2, 8):
    rep = diagnostics.report(jax.jit(fxaccum.value_and_grad(loss_fn, micro_batches=k)),
                             params, data)
    temp[k] = rep.memory.temp_bytes
  accumulator = sum(4 * np.size(p) for p in jax.tree.leaves(params))
  assert temp[8] < temp[2] < temp[1], temp
  assert temp[8] <= temp[1] / 4 + accumulator, temp


@functools.cache
def sgd_and_adam_setup():
  """The model, data, jitted jax.grad and optimizer steps both cases below share (compiled
  once): (loss_fn, params, data, theirs, [(lr, tx, steps, apply)])."""
  loss_fn, params, data = activation_heavy_setup(batch=16, seq=16)
  optimizers = []
  for lr, tx, steps in ((0.1, optax.sgd(0.1), 1), (1e-2, optax.adam(1e-2), 3)):
    @jax.jit
    def apply(grads, opt_state, p, tx=tx):  # op by op, each update took 1 s
      updates, opt_state = tx.update(grads, opt_state, p)
      return optax.apply_updates(p, updates), opt_state

    optimizers.append((lr, tx, steps, apply))
  return loss_fn, params, data, jax.jit(jax.grad(loss_fn)), optimizers


@pytest.mark.parametrize("k", [1, 4])
def test_sgd_and_adam_steps_match_large_batch(k):
  """1 SGD step and 3 Adam steps on micro-batched grads == on the large batch."""
  loss_fn, params, data, theirs, optimizers = sgd_and_adam_setup()
  ours = jax.jit(fxaccum.grad(loss_fn, micro_batches=k))
  for lr, tx, steps, apply in optimizers:
    states = {"ours": (params, tx.init(params)), "theirs": (params, tx.init(params))}
    for _ in range(steps):
      for name, grad_fn in (("ours", ours), ("theirs", theirs)):
        p, opt_state = states[name]
        grads = grad_fn(p, data)
        if name == "ours":
          assert_tree_close(grads, theirs(p, data))  # the same params -> the same grads
        states[name] = apply(grads, opt_state, p)
    # Adam divides each coordinate by sqrt(v): a rounding-level difference in a near-zero
    # gradient coordinate moves its update by a fraction of lr: each update agrees to 1% of lr.
    for got, want in zip(*(jax.tree.leaves(states[n]) for n in ("ours", "theirs")), strict=True):
      np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-2 * lr * steps)


class ConvBatchNorm(nn.Module):
  """imagenet's ResNet in small: a convolution and BatchNorm in train mode."""

  @nn.compact
  def __call__(self, x, train: bool = True):
    x = nn.Conv(8, (3, 3), use_bias=False)(x)
    x = nn.relu(nn.BatchNorm(use_running_average=not train, momentum=0.9)(x))
    return nn.Dense(4)(jnp.mean(x, axis=(1, 2)))


def imagenet_data(rows=32, seed=0):
  rng = np.random.default_rng(seed)
  return {"image": rng.normal(size=(rows, 6, 6, 3)).astype(np.float32),
          "label": rng.integers(0, 4, size=rows).astype(np.int32)}


@pytest.mark.parametrize("k", [1, 4])  # k = 2 took the path k = 4 takes
def test_linen_batch_stats_threaded_in_order_with_state_argnums(k):
  """imagenet's train_step with in-step accumulation: ``batch_stats`` threaded through the
  micro-batches in order (the NNX semantics), as jax.value_and_grad called on the global
  micro-batches one after another gives; the default averages them instead."""
  model, batch = ConvBatchNorm(), imagenet_data()
  variables = jax.jit(model.init)(jax.random.key(0), batch["image"][:2])  # op by op: 1 s

  def loss_fn(params, batch_stats, batch):
    logits, new_model_state = model.apply({"params": params, "batch_stats": batch_stats},
                                          batch["image"], mutable=["batch_stats"])
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
    return loss, (fxaccum.State(new_model_state["batch_stats"]), fxaccum.Concat(logits))

  stats, grads, losses, rows = variables["batch_stats"], [], [], []
  reference = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))  # one shape: one compile
  for i in range(k):
    micro = jax.tree.map(lambda a, i=i: a[i::k], batch)
    (loss, (new_stats, logits)), g = reference(variables["params"], stats, micro)
    stats = new_stats.value
    grads.append(g)
    losses.append(loss)
    rows.append(logits.value)
  mesh = mesh_of((8,), ("data",), AxisType.Auto)
  step = jax.jit(fxaccum.value_and_grad(loss_fn, has_aux=True, micro_batches=k,
                                        batch_argnums=2, state_argnums=1))
  with jax.set_mesh(mesh):
    sharded = jax.tree.map(lambda a: jax.device_put(a, NamedSharding(mesh, P("data"))), batch)
    (loss, (got_stats, logits)), got = step(variables["params"], variables["batch_stats"],
                                           sharded)
    (path,) = diagnostics.paths(step, variables["params"], variables["batch_stats"], sharded)
  assert path.view == "global"
  np.testing.assert_allclose(loss, sum(losses) / k, rtol=1e-5)
  assert_tree_close(got, jax.tree.map(lambda *g: sum(g) / k, *grads))
  assert_tree_close(got_stats, stats)
  want_rows = np.empty_like(np.asarray(logits))
  for i, r in enumerate(rows):
    want_rows[i::k] = r
  np.testing.assert_allclose(logits, want_rows, rtol=1e-5, atol=1e-6)
  if k > 1:  # negative control: averaging the micro-batches' statistics is another thing
    averaged = jax.jit(fxaccum.value_and_grad(lambda p, s, b: (loss_fn(p, s, b)[0], loss_fn(
        p, s, b)[1][0].value), has_aux=True, micro_batches=k, batch_argnums=2))(
            variables["params"], variables["batch_stats"], batch)[0][1]
    assert not np.allclose(jax.tree.leaves(averaged)[0], jax.tree.leaves(stats)[0], rtol=1e-3)


def test_state_argnums_errors_name_the_fix():
  def loss(w, count, x):
    return jnp.mean(x * w), count + 1

  x = jnp.ones((8, 1))
  with pytest.raises(ValueError, match="needs has_aux=True"):
    fxaccum.value_and_grad(loss, micro_batches=2, batch_argnums=2, state_argnums=1)
  with pytest.raises(TypeError, match="holds 0 fxaccum.State"):
    fxaccum.value_and_grad(loss, has_aux=True, micro_batches=2, batch_argnums=2,
                           state_argnums=1)(jnp.ones(1), jnp.int32(0), x)
  with pytest.raises(TypeError, match="does not match the argument"):
    fxaccum.value_and_grad(
        lambda w, c, x: (jnp.mean(x * w), fxaccum.State(c + 1.0)), has_aux=True,
        micro_batches=2, batch_argnums=2, state_argnums=1)(jnp.ones(1), jnp.int32(0), x)
  with pytest.raises(ValueError, match="overlaps batch_argnums"):
    fxaccum.value_and_grad(loss, has_aux=True, micro_batches=2, state_argnums=1)
  mesh = mesh_of((8,), ("data",), AxisType.Auto)
  with jax.set_mesh(mesh), pytest.raises(ValueError, match="view='device' with state_argnums"):
    jax.jit(fxaccum.value_and_grad(
        lambda w, c, x: (jnp.mean(x * w), fxaccum.State(c + 1)), has_aux=True,
        micro_batches=2, batch_argnums=2, state_argnums=1, view="device"))(
            jnp.ones(1), jnp.int32(0), jax.device_put(jnp.ones((32, 1)),
                                                      NamedSharding(mesh, P("data"))))
