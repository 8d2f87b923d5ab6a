"""A small decoder-only Transformer LM in flax NNX, laid out like Flax's ``examples/gemma``.

Test fixture (no tests here), independent of fxaccum. What it copies from the gemma example
is the *structure*, written anew and shrunk:

* a ``ShardingConfig`` of PartitionSpecs, handed to every module; parameters get theirs as
  ``out_sharding`` metadata (``kernel_metadata=`` / ``embedding_metadata=`` /
  ``nnx.Param(..., out_sharding=...)``), activations get theirs as ``out_sharding=`` on
  ``nnx.Einsum`` / ``nnx.Linear`` / ``nnx.Embed`` calls and on ``jnp.einsum``;
* FSDP: every matrix is split over the ``fsdp`` mesh axis on its model (``embed``) dimension;
  norm scales are replicated; the batch dimension of every activation is split over all
  data-parallel axes of the mesh (``("data", "fsdp")`` or ``"fsdp"``);
* ``Transformer`` = scaled, tied embedding -> ``Block`` x N (pre-norm RMSNorm, causal
  multi-head attention with RoPE, pre-norm gated GELU MLP) -> final RMSNorm -> ``attend``.

The model must be built, and run, inside ``jax.set_mesh(mesh)`` of an ``AxisType.Explicit``
mesh whose axis names include ``fsdp`` (and optionally ``data``); for a single-device
reference use ``one_device_mesh``.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

VOCAB, EMBED, LAYERS, HEADS, HEAD_DIM, MLP = 32, 16, 1, 2, 8, 32
BATCH, SEQ = 16, 8
PAD_ID = 0
DATA_AXES = ("data", "fsdp")  # candidate data-parallel mesh axes, outermost first
FSDP = "fsdp"
_NEG_INF = -2.3819763e38  # finite "minus infinity" for masked attention logits


# --------------------------------------------------------------------------------------
# Sharding configuration (one PartitionSpec per parameter / activation layout)
# --------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ShardingConfig:
  """PartitionSpecs, named by the dimensions they describe (B batch, T/S time, D embed,
  F mlp hidden, N heads, H head dim, V vocab, C the stacked q/k/v index)."""

  emb_vd: P
  qkv_weight_cndh: P
  o_weight_nhd: P
  ffw_weight_df: P
  ffw_weight_fd: P
  norm_d: P
  act_btd: P
  act_btf: P
  act_btv: P
  act_cbtnh: P
  act_btnh: P
  act_btns: P

  @staticmethod
  def fsdp(mesh_axis_names) -> ShardingConfig:
    batch = data_axes(mesh_axis_names)
    return ShardingConfig(
      emb_vd=P(None, FSDP),
      qkv_weight_cndh=P(None, None, FSDP, None),
      o_weight_nhd=P(None, None, FSDP),
      ffw_weight_df=P(FSDP, None),
      ffw_weight_fd=P(None, FSDP),
      norm_d=P(None),
      act_btd=P(batch, None, None),
      act_btf=P(batch, None, None),
      act_btv=P(batch, None, None),
      act_cbtnh=P(None, batch, None, None, None),
      act_btnh=P(batch, None, None, None),
      act_btns=P(batch, None, None, None),
    )


def data_axes(mesh_axis_names):
  """The data-parallel axes among ``mesh_axis_names``: a name, or a tuple of names."""
  axes = tuple(a for a in DATA_AXES if a in tuple(mesh_axis_names))
  if FSDP not in axes:
    raise ValueError(f"mesh needs an {FSDP!r} axis, got {tuple(mesh_axis_names)}")
  return axes[0] if len(axes) == 1 else axes


@dataclasses.dataclass(frozen=True)
class Config:
  vocab: int = VOCAB
  embed: int = EMBED
  layers: int = LAYERS
  heads: int = HEADS
  head_dim: int = HEAD_DIM
  mlp: int = MLP
  rope_base: float = 10_000.0
  shd: ShardingConfig | None = None


# --------------------------------------------------------------------------------------
# Layers
# --------------------------------------------------------------------------------------


class RopeTable(nnx.Variable):
  """Non-trainable constant (RoPE inverse timescales); lands in ``rest``, not ``params``."""


class RMSNorm(nnx.Module):
  """``x / rms(x) * (1 + scale)``, scale initialised to zero (as in Gemma)."""

  def __init__(self, dim: int, *, shd: P, rngs: nnx.Rngs):
    init = nnx.initializers.zeros_init()
    self.scale = nnx.Param(init(rngs.params(), (dim,), jnp.float32), out_sharding=shd)

  def __call__(self, x):
    ms = jnp.mean(jnp.square(x), axis=-1, keepdims=True)
    return x * jax.lax.rsqrt(ms + 1e-6) * (1.0 + self.scale[...])


class ScaledEmbed(nnx.Embed):
  """Token embedding multiplied by ``sqrt(embed)``; ``attend`` gives the tied LM head."""

  def __call__(self, ids, out_sharding=None):
    return super().__call__(ids, out_sharding) * jnp.sqrt(float(self.features))


def apply_rope(x, positions, inv_timescale):
  """Rotary embedding of ``x`` [B, T, N, H] at integer ``positions`` [B, T]."""
  angle = positions[..., None].astype(jnp.float32) * inv_timescale  # [B, T, H/2]
  sin, cos = jnp.sin(angle)[..., None, :], jnp.cos(angle)[..., None, :]
  first, second = jnp.split(x, 2, axis=-1)
  return jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)


class Attention(nnx.Module):
  """Causal multi-head self-attention; q/k/v come from one stacked ``nnx.Einsum``."""

  def __init__(self, cfg: Config, *, rngs: nnx.Rngs):
    shd = cfg.shd
    self.shd = shd
    self.qkv_einsum = nnx.Einsum(
      einsum_str="BTD,CNDH->CBTNH",
      kernel_shape=(3, cfg.heads, cfg.embed, cfg.head_dim),
      kernel_metadata={"out_sharding": shd.qkv_weight_cndh},
      rngs=rngs,
    )
    self.out_einsum = nnx.Einsum(
      einsum_str="BTNH,NHD->BTD",
      kernel_shape=(cfg.heads, cfg.head_dim, cfg.embed),
      kernel_metadata={"out_sharding": shd.o_weight_nhd},
      rngs=rngs,
    )
    self.scale = cfg.head_dim**-0.5

  def __call__(self, x, positions, attn_mask, inv_timescale):
    q, k, v = self.qkv_einsum(x, out_sharding=self.shd.act_cbtnh)
    q = apply_rope(q, positions, inv_timescale) * self.scale
    k = apply_rope(k, positions, inv_timescale)
    logits = jnp.einsum("BTNH,BSNH->BTNS", q, k, out_sharding=self.shd.act_btns)
    logits = jnp.where(attn_mask[:, :, None, :], logits, _NEG_INF)
    probs = jax.nn.softmax(logits, axis=-1)
    encoded = jnp.einsum("BTNS,BSNH->BTNH", probs, v, out_sharding=self.shd.act_btnh)
    return self.out_einsum(encoded, out_sharding=self.shd.act_btd)


class FeedForward(nnx.Module):
  """Gated MLP: ``down(gelu(gate(x)) * up(x))``."""

  def __init__(self, cfg: Config, *, rngs: nnx.Rngs):
    shd = cfg.shd
    self.shd = shd

    def dense(n_in, n_out, spec):
      return nnx.Linear(
        n_in, n_out, use_bias=False, kernel_metadata={"out_sharding": spec}, rngs=rngs
      )

    self.gate_proj = dense(cfg.embed, cfg.mlp, shd.ffw_weight_df)
    self.up_proj = dense(cfg.embed, cfg.mlp, shd.ffw_weight_df)
    self.down_proj = dense(cfg.mlp, cfg.embed, shd.ffw_weight_fd)

  def __call__(self, x):
    gate = nnx.gelu(self.gate_proj(x, out_sharding=self.shd.act_btf))
    hidden = gate * self.up_proj(x, out_sharding=self.shd.act_btf)
    return self.down_proj(hidden, out_sharding=self.shd.act_btd)


class Block(nnx.Module):
  def __init__(self, cfg: Config, *, rngs: nnx.Rngs):
    self.pre_attention_norm = RMSNorm(cfg.embed, shd=cfg.shd.norm_d, rngs=rngs)
    self.attn = Attention(cfg, rngs=rngs)
    self.pre_ffw_norm = RMSNorm(cfg.embed, shd=cfg.shd.norm_d, rngs=rngs)
    self.mlp = FeedForward(cfg, rngs=rngs)

  def __call__(self, x, positions, attn_mask, inv_timescale):
    x = x + self.attn(self.pre_attention_norm(x), positions, attn_mask, inv_timescale)
    return x + self.mlp(self.pre_ffw_norm(x))


class Transformer(nnx.Module):
  """Decoder-only LM: ``logits = model(tokens, positions, attn_mask)``, logits [B, T, V]."""

  def __init__(self, cfg: Config, *, rngs: nnx.Rngs):
    shd = cfg.shd
    self.shd = shd
    self.embedder = ScaledEmbed(
      cfg.vocab, cfg.embed, embedding_metadata={"out_sharding": shd.emb_vd}, rngs=rngs
    )
    self.layers = nnx.List([Block(cfg, rngs=rngs) for _ in range(cfg.layers)])
    self.final_norm = RMSNorm(cfg.embed, shd=shd.norm_d, rngs=rngs)
    half = cfg.head_dim // 2
    self.inv_timescale = RopeTable(cfg.rope_base ** (-jnp.arange(half, dtype=jnp.float32) / half))

  def __call__(self, tokens, positions, attn_mask):
    inv_timescale = self.inv_timescale[...]
    x = self.embedder(tokens, out_sharding=self.shd.act_btd)
    for layer in self.layers:
      x = layer(x, positions, attn_mask, inv_timescale)
    x = self.final_norm(x)
    return self.embedder.attend(x, out_sharding=self.shd.act_btv)


def causal_attn_mask(input_mask):
  """[B, T, S] bool: query t may see key s iff s <= t and key s is not padding."""
  seq = input_mask.shape[-1]
  causal = jnp.tril(jnp.ones((seq, seq), dtype=jnp.bool_))
  return jnp.logical_and(input_mask[:, None, :], causal[None])


def positions_from_mask(input_mask):
  """0-based position of each real token (padding positions repeat the last one)."""
  pos = jnp.cumsum(input_mask.astype(jnp.int32), axis=-1)
  return pos - (pos >= 1)


# --------------------------------------------------------------------------------------
# Fixture API
# --------------------------------------------------------------------------------------


def make_batch(seed: int = 0, batch: int = BATCH, seq: int = SEQ) -> dict:
  """NumPy batch: ``inputs``/``targets`` int32 [batch, seq] (next-token pairs, ``PAD_ID``
  after each row's length) and ``weights`` float32 padding mask. Lengths are skewed: mostly
  1-3 tokens, every 7th row full, rows 2, 7, 12, ... all padding."""
  rng = np.random.default_rng(seed)
  tokens = rng.integers(1, VOCAB, size=(batch, seq + 1)).astype(np.int32)
  lengths = rng.integers(1, 4, size=batch)
  lengths[::7] = seq
  lengths[2::5] = 0
  weights = (np.arange(seq)[None, :] < lengths[:, None]).astype(np.float32)
  inputs = np.where(weights > 0, tokens[:, :-1], PAD_ID).astype(np.int32)
  targets = np.where(weights > 0, tokens[:, 1:], PAD_ID).astype(np.int32)
  return {"inputs": inputs, "targets": targets, "weights": weights}


def batch_spec(mesh) -> P:
  """Batch rows split over every data-parallel axis of ``mesh``; time replicated."""
  return P(data_axes(mesh.axis_names))


def put_batch(batch: dict, mesh) -> dict:
  """``device_put`` every batch array with ``NamedSharding(mesh, batch_spec(mesh))``."""
  sharding = NamedSharding(mesh, batch_spec(mesh))
  return {k: jax.device_put(v, sharding) for k, v in batch.items()}


def one_device_mesh(axis_names=DATA_AXES):
  """A 1-device Explicit mesh with the given axis names (single-device reference runs)."""
  return jax.make_mesh(
    (1,) * len(axis_names),
    tuple(axis_names),
    axis_types=(AxisType.Explicit,) * len(axis_names),
    devices=jax.devices()[:1],
  )


def create(mesh, seed: int = 0):
  """The model for ``mesh`` split into ``(graphdef, params, rest)``: ``params`` the
  ``nnx.Param`` state (each array placed on ``mesh`` per its ``out_sharding`` metadata),
  ``rest`` the other state (the RoPE table). The model's arrays are built once per seed,
  on one device (op by op, building them on 8 devices costs seconds; no value depends on
  the mesh), and placed on ``mesh``."""
  graphdef, params, rest = _built(tuple(mesh.axis_names), seed)
  with jax.set_mesh(mesh):
    specs = nnx.get_partition_spec(params)
    params = jax.tree.map(
      lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec)), params, specs
    )
    rest = jax.tree.map(lambda x: jax.device_put(x, NamedSharding(mesh, P())), rest)
  return graphdef, params, rest


@functools.cache
def _built(axis_names, seed):
  """``(graphdef, params, rest)`` of the ``Transformer`` for mesh axes ``axis_names``: the
  graphdef (its ``ShardingConfig``) from ``nnx.eval_shape``, the arrays from
  :func:`_arrays` (the same for any axis names: the param specs name ``fsdp`` only)."""
  cfg = Config(shd=ShardingConfig.fsdp(axis_names))
  with jax.set_mesh(one_device_mesh(axis_names)):
    graphdef, _, _ = nnx.split(
      nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(params=seed))), nnx.Param, ...
    )
  return graphdef, *_arrays(seed)


@functools.cache
def _arrays(seed):
  """``(params, rest)`` of the ``Transformer`` built on a one-device mesh (``DATA_AXES``)."""
  cfg = Config(shd=ShardingConfig.fsdp(DATA_AXES))

  @jax.jit  # one compile, not one per initializer and shape
  def build():
    _, params, rest = nnx.split(Transformer(cfg, rngs=nnx.Rngs(params=seed)), nnx.Param, ...)
    return params, rest

  with jax.set_mesh(one_device_mesh(DATA_AXES)):
    return build()


def token_xent(graphdef, params, rest, batch):
  """Per-token cross-entropy [B, T] (unweighted)."""
  model = nnx.merge(graphdef, params, rest)
  input_mask = batch["inputs"] != PAD_ID
  logits = model(batch["inputs"], positions_from_mask(input_mask), causal_attn_mask(input_mask))
  logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  return -jnp.take_along_axis(logp, batch["targets"][..., None], axis=-1)[..., 0]


def token_sums(graphdef, params, rest, batch):
  """``(sum(weights * xent), sum(weights))`` over the batch."""
  weights = batch["weights"]
  xent = token_xent(graphdef, params, rest, batch)
  return jnp.sum(weights * xent), jnp.sum(weights)


def reference_loss(graphdef, params, rest, batch):
  """Token-mean cross-entropy: ``total / max(count, 1)``."""
  total, count = token_sums(graphdef, params, rest, batch)
  return total / jnp.maximum(count, 1.0)
