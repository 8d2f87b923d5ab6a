"""A tiny decoder-only Transformer LM in flax linen, structured like Flax's ``examples/lm1b``.

Test fixture (plain JAX + flax linen, independent of fxaccum). It reproduces the parts of the
lm1b example that matter for sharded gradient accumulation:

* a ``TransformerConfig`` dataclass, a decoder stack of pre-LayerNorm blocks (attention + MLP),
  fixed sinusoidal position embeddings, right-shifted inputs and a padding + causal mask;
* every parameter is created through ``nn.with_logical_partitioning(init, names)`` with logical
  names ``vocab``, ``embed``, ``mlp``, ``heads``, ``kv``;
* activations carry ``nn.with_logical_constraint(x, ('activation_batch', ...))`` annotations;
* logical axis rules map ``activation_batch`` to the data-parallel mesh axes and ``embed`` to
  ``fsdp`` (FSDP: every parameter is sharded over ``fsdp`` along its ``embed`` dimension);
* lm1b's ``setup_initial_state`` shardings: ``jax.eval_shape(model.init)`` ->
  ``nn.get_partition_spec`` -> ``nn.logical_to_mesh_sharding`` (the params are initialized
  once, unsharded, and placed with them: a jitted init per mesh would compile longer than
  the steps under test); and a train-step-style
  ``jax.jit(..., in_shardings=..., out_shardings=..., donate_argnums=0)``.

Sizes are small so that it compiles quickly on CPU: vocab 32, width 16, 1 layer (the
stack's code runs for any number of layers), 2 heads, MLP 32, sequences of 8, batches of
16. Dropout rates are 0 and the model is deterministic, so a
forward pass is a pure function of (params, batch).

Flax 0.12.8 notes:

* ``nn.with_logical_constraint`` (and the constraint in ``LogicallyPartitioned.unbox``) is a
  no-op unless BOTH logical rules are set (``nn.logical_axis_rules``) AND a mesh is in context
  (``jax.set_mesh``; flax checks ``jax.sharding.get_abstract_mesh()``). Both are read in Python
  at trace time, and jit's cache does not see the rules: enter both contexts before the first
  call of a jitted function (``make_grad_step`` does it for you).
* Attention kernels are written as explicit 3-D params rather than ``nn.DenseGeneral`` /
  ``nn.MultiHeadDotProductAttention``: ``DenseGeneral`` calls its kernel initializer on the
  flattened 2-D shape and unboxes it there, so 3 logical names on a 3-D kernel fail under a mesh
  with rules ("One of with_sharding_constraint arguments is incompatible with its sharding
  annotation ..."), while lm1b's 2 names ``('embed', 'kv')`` end up on the wrong dimension of
  the 3-D output kernel (its ``heads`` dimension would be sharded over ``fsdp``).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

VOCAB, EMBED, LAYERS, HEADS, MLP, SEQ, BATCH = 32, 16, 1, 2, 32, 8, 16

# ---------------------------------------------------------------------------------------------
# Logical axis rules.
# ---------------------------------------------------------------------------------------------

# Parameters: only ``embed`` is sharded (FSDP); the other parameter axes stay replicated.
# Activations: the batch dimension is split over every data-parallel mesh axis.
_PARAM_RULES = (
    ("embed", "fsdp"),
    ("vocab", None),
    ("mlp", None),
    ("heads", None),
    ("kv", None),
)
_ACTIVATION_RULES = (
    ("activation_length", None),
    ("activation_embed", None),
    ("activation_mlp", None),
    ("activation_heads", None),
    ("activation_kv", None),
    ("activation_vocab", None),
)

#: For ``jax.make_mesh((2, 4), ("data", "fsdp"))``: batch over data x fsdp, params over fsdp.
RULES_DATA_FSDP = (("activation_batch", ("data", "fsdp")),) + _PARAM_RULES + _ACTIVATION_RULES
#: For ``jax.make_mesh((8,), ("fsdp",))``: batch and params both over fsdp.
RULES_FSDP = (("activation_batch", "fsdp"),) + _PARAM_RULES + _ACTIVATION_RULES

BATCH_AXES = ("activation_batch", "activation_length")
ACT_AXES = ("activation_batch", "activation_length", "activation_embed")


def rules_for(mesh) -> tuple:
  """The logical axis rules for a mesh with axes ``("data", "fsdp")`` or ``("fsdp",)``."""
  names = tuple(mesh.axis_names)
  if names == ("data", "fsdp"):
    return RULES_DATA_FSDP
  if names == ("fsdp",):
    return RULES_FSDP
  raise ValueError(f"no logical rules for mesh axes {names}")


# ---------------------------------------------------------------------------------------------
# Model (lm1b's models.py structure).
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
  """Hyperparameters shared by all modules (lm1b's ``TransformerConfig``, trimmed)."""

  vocab_size: int = VOCAB
  emb_dim: int = EMBED
  num_heads: int = HEADS
  num_layers: int = LAYERS
  qkv_dim: int = EMBED
  mlp_dim: int = MLP
  max_len: int = 16
  dropout_rate: float = 0.0
  attention_dropout_rate: float = 0.0
  deterministic: bool = True
  dtype: Any = jnp.float32
  kernel_init: Callable = nn.initializers.xavier_uniform()
  bias_init: Callable = nn.initializers.normal(stddev=1e-2)


def shift_right(x):
  """Prepends a 0 (BOS/padding id) on the length axis and drops the last position."""
  return jnp.pad(x, ((0, 0), (1, 0)))[:, :-1]


def sinusoid_table(max_len, dim):
  """Fixed (non-learned) sine/cosine position table of shape ``(1, max_len, dim)``."""
  half = dim // 2
  position = np.arange(max_len, dtype=np.float64)[:, None]
  inv_freq = np.exp(-np.log(10000.0) * np.arange(half) / max(half - 1, 1))
  table = np.zeros((max_len, dim), np.float32)
  table[:, :half] = np.sin(position * inv_freq)
  table[:, half:2 * half] = np.cos(position * inv_freq)
  return jnp.asarray(table[None])


def _layer_norm(config, name=None):
  return nn.LayerNorm(
      dtype=config.dtype,
      name=name,
      scale_init=nn.with_logical_partitioning(nn.initializers.ones, ("embed",)),
      bias_init=nn.with_logical_partitioning(nn.initializers.zeros, ("embed",)),
  )


class MlpBlock(nn.Module):
  """Dense(embed -> mlp), ReLU, Dense(mlp -> embed)."""

  config: TransformerConfig

  @nn.compact
  def __call__(self, x):
    cfg = self.config
    h = nn.Dense(
        cfg.mlp_dim,
        dtype=cfg.dtype,
        kernel_init=nn.with_logical_partitioning(cfg.kernel_init, ("embed", "mlp")),
        bias_init=nn.with_logical_partitioning(cfg.bias_init, ("mlp",)),
        name="wi",
    )(x)
    h = nn.relu(h)
    h = nn.with_logical_constraint(h, ("activation_batch", "activation_length", "activation_mlp"))
    h = nn.Dropout(rate=cfg.dropout_rate)(h, deterministic=cfg.deterministic)
    out = nn.Dense(
        x.shape[-1],
        dtype=cfg.dtype,
        kernel_init=nn.with_logical_partitioning(cfg.kernel_init, ("mlp", "embed")),
        bias_init=nn.with_logical_partitioning(cfg.bias_init, ("embed",)),
        name="wo",
    )(h)
    return nn.Dropout(rate=cfg.dropout_rate)(out, deterministic=cfg.deterministic)


class SelfAttention(nn.Module):
  """Multi-head self-attention with 3-D kernels ``(embed, heads, kv)`` / ``(heads, kv, embed)``."""

  config: TransformerConfig

  @nn.compact
  def __call__(self, x, mask):
    cfg = self.config
    head_dim = cfg.qkv_dim // cfg.num_heads
    # fan-in over embed, fan-out over heads x kv (the 2-D xavier of lm1b's flattened kernels).
    in_init = nn.initializers.xavier_uniform(in_axis=0, out_axis=(1, 2))
    out_init = nn.initializers.xavier_uniform(in_axis=(0, 1), out_axis=2)
    qkv_shape = (x.shape[-1], cfg.num_heads, head_dim)
    head_axes = ("activation_batch", "activation_length", "activation_heads", "activation_kv")

    def project(name):
      kernel = self.param(
          name, nn.with_logical_partitioning(in_init, ("embed", "heads", "kv")), qkv_shape)
      y = jnp.einsum("ble,ehd->blhd", x, jnp.asarray(kernel, cfg.dtype))
      return nn.with_logical_constraint(y, head_axes)

    query, key, value = project("query"), project("key"), project("value")
    y = nn.dot_product_attention(
        query, key, value, mask=mask, dropout_rate=cfg.attention_dropout_rate,
        deterministic=cfg.deterministic, dtype=cfg.dtype,
        dropout_rng=None if cfg.deterministic or cfg.attention_dropout_rate == 0 else
        self.make_rng("dropout"))
    y = nn.with_logical_constraint(y, head_axes)
    out_kernel = self.param(
        "out", nn.with_logical_partitioning(out_init, ("heads", "kv", "embed")),
        (cfg.num_heads, head_dim, x.shape[-1]))
    return jnp.einsum("blhd,hde->ble", y, jnp.asarray(out_kernel, cfg.dtype))


class DecoderBlock(nn.Module):
  """Pre-LayerNorm block: x + Attn(LN(x)), then + Mlp(LN(.)) (lm1b's EncoderDecoder1DBlock)."""

  config: TransformerConfig

  @nn.compact
  def __call__(self, inputs, decoder_mask):
    cfg = self.config
    inputs = nn.with_logical_constraint(inputs, ACT_AXES)
    x = _layer_norm(cfg)(inputs)
    x = SelfAttention(cfg, name="attention")(x, decoder_mask)
    x = nn.Dropout(rate=cfg.dropout_rate)(x, deterministic=cfg.deterministic)
    x = nn.with_logical_constraint(x + inputs, ACT_AXES)
    z = MlpBlock(cfg)(_layer_norm(cfg)(x))
    return nn.with_logical_constraint(x + z, ACT_AXES)


class TransformerLM(nn.Module):
  """Decoder-only LM: ``inputs`` (batch, length) int tokens, 0 = padding -> logits."""

  config: TransformerConfig

  @nn.compact
  def __call__(self, inputs):
    cfg = self.config
    inputs = inputs.astype(jnp.int32)
    # Padding mask (lm1b: tokens > 0) combined with the causal mask.
    decoder_mask = nn.combine_masks(
        nn.make_attention_mask(inputs > 0, inputs > 0, dtype=cfg.dtype),
        nn.make_causal_mask(inputs, dtype=cfg.dtype),
    )
    embed = nn.Embed(
        num_embeddings=cfg.vocab_size,
        features=cfg.emb_dim,
        embedding_init=nn.with_logical_partitioning(
            nn.initializers.normal(stddev=1.0), ("vocab", "embed")),
        name="embed",
    )
    y = embed(shift_right(inputs))
    y = y + sinusoid_table(cfg.max_len, cfg.emb_dim)[:, :inputs.shape[1]]
    y = nn.Dropout(rate=cfg.dropout_rate)(y, deterministic=cfg.deterministic)
    y = nn.with_logical_constraint(y.astype(cfg.dtype), ACT_AXES)
    for layer in range(cfg.num_layers):
      y = DecoderBlock(cfg, name=f"block_{layer}")(y, decoder_mask)
    y = _layer_norm(cfg, name="final_norm")(y)
    logits = nn.Dense(
        cfg.vocab_size,
        dtype=cfg.dtype,
        kernel_init=nn.with_logical_partitioning(cfg.kernel_init, ("embed", "vocab")),
        bias_init=nn.with_logical_partitioning(cfg.bias_init, ("vocab",)),
        name="logits",
    )(y)
    logits = nn.with_logical_constraint(
        logits, ("activation_batch", "activation_length", "activation_vocab"))
    return logits.astype(jnp.float32)


# ---------------------------------------------------------------------------------------------
# Data.
# ---------------------------------------------------------------------------------------------


def make_batch(seed: int = 0, batch: int = BATCH, seq: int = SEQ, k: int = 4,
               lengths=None) -> dict:
  """Numpy LM batch ``{"inputs", "targets", "weights"}`` with skewed padding.

  Tokens are in ``[1, VOCAB)``, padding is 0 at the end of a row. As in lm1b the model shifts
  ``inputs`` right itself, so ``targets == inputs`` and ``weights = (targets > 0)`` (float32).
  Default lengths: every 3rd row (0, 3, 6, ...) is full, the rest hold 1-3 tokens, rows
  2, 7, 12, ... are all padding, and if ``k > 1`` so is every row ``r`` with ``r % k == k - 1``
  (with a strided split ``rows[i::k]`` micro-batch ``k - 1`` has no tokens at all). Pass
  ``lengths`` (``batch`` ints in ``[0, seq]``) to override.
  """
  rng = np.random.default_rng(seed)
  if lengths is None:
    lengths = rng.integers(1, 4, size=batch)
    lengths[::3] = seq
    lengths[2::5] = 0
    if k > 1:
      lengths[np.arange(batch) % k == k - 1] = 0
  lengths = np.asarray(lengths)
  assert lengths.shape == (batch,) and lengths.min() >= 0 and lengths.max() <= seq
  tokens = rng.integers(1, VOCAB, size=(batch, seq)).astype(np.int32)
  weights = (np.arange(seq)[None, :] < lengths[:, None]).astype(np.float32)
  tokens = np.where(weights > 0, tokens, 0).astype(np.int32)
  return {"inputs": tokens, "targets": tokens.copy(), "weights": weights}


# ---------------------------------------------------------------------------------------------
# Initialisation and shardings (lm1b's utils.setup_initial_state).
# ---------------------------------------------------------------------------------------------


def make_model(config: TransformerConfig | None = None) -> TransformerLM:
  return TransformerLM(config or TransformerConfig())


def batch_sharding(mesh, rules) -> NamedSharding:
  """``NamedSharding`` of a ``(batch, length)`` array: rows over the data-parallel axes."""
  return nn.logical_to_mesh_sharding(P(*BATCH_AXES), mesh, rules)


def init(mesh=None, rules=None, seed: int = 0, model: TransformerLM | None = None):
  """Returns ``(model, params, param_shardings)``.

  ``params`` is the unboxed ``"params"`` collection (plain ``jax.Array`` leaves) of a jitted
  ``model.init`` (compiled once per model), placed on ``mesh`` with ``param_shardings``
  (FSDP-sharded over ``fsdp`` along each parameter's ``embed`` dimension): new buffers on
  each call, for a step that donates them. ``param_shardings`` is a pytree of
  ``NamedSharding`` with the structure of ``params``. With ``mesh=None`` the params are on
  the default device and ``param_shardings`` is None. Values do not depend on the mesh.
  """
  model = model or make_model()
  params = _init_params(model)(jax.random.PRNGKey(seed))
  if mesh is None:
    return model, params, None
  rules = rules_for(mesh) if rules is None else rules
  param_shardings = _param_shardings(model, mesh, rules)
  return model, jax.device_put(params, param_shardings), param_shardings


def _dummy_inputs():
  return jnp.ones((BATCH, SEQ), jnp.int32)


@functools.cache
def _init_params(model):
  """``model.init``'s unboxed params, jitted once per model (compiling an init per mesh
  costs more than the steps the tests compile; the values are the same on any mesh)."""
  return jax.jit(lambda rng: nn.unbox(model.init(rng, _dummy_inputs())["params"]))


@functools.cache
def _param_shardings(model, mesh, rules):
  """lm1b's ``setup_initial_state`` shardings: ``jax.eval_shape(model.init)`` ->
  ``nn.get_partition_spec`` -> ``nn.logical_to_mesh_sharding``."""
  abstract = jax.eval_shape(model.init, jax.random.PRNGKey(0), _dummy_inputs())["params"]
  logical_specs = nn.get_partition_spec(abstract)  # from the LogicallyPartitioned leaves
  return nn.logical_to_mesh_sharding(logical_specs, mesh, rules)


# ---------------------------------------------------------------------------------------------
# Loss (lm1b's compute_weighted_cross_entropy without label smoothing).
# ---------------------------------------------------------------------------------------------


def token_sums(model, params, batch):
  """``(sum(weights * token cross-entropy), sum(weights))`` for one forward pass."""
  logits = model.apply({"params": params}, batch["inputs"])
  onehot = jax.nn.one_hot(batch["targets"], logits.shape[-1], dtype=logits.dtype)
  nll = -jnp.sum(onehot * jax.nn.log_softmax(logits), axis=-1)
  weights = jnp.asarray(batch["weights"], nll.dtype)
  return jnp.sum(nll * weights), jnp.sum(weights)


def reference_loss(model, params, batch):
  """Token-mean cross-entropy of the full batch: ``total / max(count, 1)``."""
  total, count = token_sums(model, params, batch)
  return total / jnp.maximum(count, 1.0)


def make_grad_step(model, mesh, rules, param_shardings, loss_fn=reference_loss,
                   donate: bool = True):
  """lm1b-style jitted step ``(params, batch) -> (loss, grads)``.

  ``jax.jit(jax.value_and_grad(...), in_shardings=(param_shardings, batch_sharding),
  out_shardings=(None, param_shardings), donate_argnums=0)``; each call runs inside
  ``with jax.set_mesh(mesh), nn.logical_axis_rules(rules):`` so the logical constraints apply
  when it is traced. With ``donate=True`` the ``params`` passed in are consumed.
  """
  step = jax.jit(
      jax.value_and_grad(lambda p, b: loss_fn(model, p, b)),
      in_shardings=(param_shardings, batch_sharding(mesh, rules)),
      out_shardings=(None, param_shardings),
      donate_argnums=(0,) if donate else (),
  )

  def run(params, batch):
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
      return step(params, batch)

  run.jitted = step
  return run
