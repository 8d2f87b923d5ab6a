"""A tiny transformer LM with Ulysses sequence-parallel attention (plain JAX, no fxaccum).

Tokens are sharded over the ``seq`` mesh axis (and the batch over ``data``). Everything but
attention is per-token, so GSPMD runs it on the local sequence shard. Attention is a
``jax.shard_map`` that is manual over ``seq`` only (``data`` stays automatic): an
``all_to_all`` over ``seq`` trades the sequence sharding of q/k/v for a heads sharding, each
device attends over the full sequence with ``HEADS / seq`` heads, and a second
``all_to_all`` trades back (DeepSpeed-Ulysses). Its gradient is a second such shard_map
(``jax.custom_vjp``), so the loss can also be differentiated inside a shard_map that is
manual over ``data`` (as fxaccum's is). Works on Auto and Explicit meshes with axes
``("data", "seq")`` whose ``seq`` size divides ``HEADS``.

``token_sums_plain`` is the same math with ordinary full attention and no ``shard_map``: a
single-device reference.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

VOCAB, WIDTH, HEADS, HIDDEN, SEQ, BATCH = 64, 32, 4, 64, 16, 16
HEAD_DIM = WIDTH // HEADS


def batch_spec() -> P:
  """How the batch's (batch, seq) arrays are placed: rows over ``data``, tokens over ``seq``."""
  return P("data", "seq")


def make_params(seed: int = 0) -> dict:
  """Float32 parameters of a one-block pre-LN transformer LM (replicated everywhere)."""
  rng = np.random.default_rng(seed)

  def dense(fan_in, *shape):
    return (rng.normal(size=(fan_in, *shape)) / np.sqrt(fan_in)).astype(np.float32)

  def vec(n, scale=0.1, base=0.0):
    return (base + scale * rng.normal(size=(n,))).astype(np.float32)

  return {
      "embed": (rng.normal(size=(VOCAB, WIDTH)) * 0.5).astype(np.float32),
      "pos": (rng.normal(size=(SEQ, WIDTH)) * 0.1).astype(np.float32),
      "ln1": {"scale": vec(WIDTH, base=1.0), "bias": vec(WIDTH)},
      "attn": {
          "wq": dense(WIDTH, HEADS, HEAD_DIM),
          "wk": dense(WIDTH, HEADS, HEAD_DIM),
          "wv": dense(WIDTH, HEADS, HEAD_DIM),
          "wo": (rng.normal(size=(HEADS, HEAD_DIM, WIDTH)) / np.sqrt(WIDTH)).astype(np.float32),
      },
      "ln2": {"scale": vec(WIDTH, base=1.0), "bias": vec(WIDTH)},
      "mlp": {"w1": dense(WIDTH, HIDDEN), "b1": vec(HIDDEN),
              "w2": dense(HIDDEN, WIDTH), "b2": vec(WIDTH)},
      "ln_f": {"scale": vec(WIDTH, base=1.0), "bias": vec(WIDTH)},
      "head": dense(WIDTH, VOCAB),
  }


def make_batch(seed: int = 0, batch: int = BATCH, seq: int = SEQ) -> dict:
  """Numpy ``inputs``/``targets`` (int32, (batch, seq)) and a skewed float32 ``weights`` mask.

  Rows are right-padded with very different lengths: row 1 is all padding, row 0 is full,
  some rows hold 1-3 tokens, and rows 4k+2 stop at ``3 * seq // 4`` so the last quarter of
  the sequence (tokens 12..15 for seq=16: a whole ``seq`` shard when seq=4) is padding.
  """
  rng = np.random.default_rng(seed)
  inputs = rng.integers(0, VOCAB, size=(batch, seq)).astype(np.int32)
  targets = np.roll(inputs, -1, axis=1)
  targets[:, -1] = rng.integers(0, VOCAB, size=batch)
  lengths = rng.integers(1, seq + 1, size=batch)
  lengths[0] = seq
  lengths[1] = 0  # an all-padding row
  lengths[3::5] = rng.integers(1, 4, size=len(lengths[3::5]))  # very short rows
  lengths[2::4] = np.minimum(lengths[2::4], 3 * seq // 4)  # last quarter all padding
  weights = (np.arange(seq)[None, :] < lengths[:, None]).astype(np.float32)
  return {"inputs": inputs, "targets": targets.astype(np.int32), "weights": weights}


def _layer_norm(x, p, eps=1e-5):
  mean = jnp.mean(x, axis=-1, keepdims=True)
  var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
  return (x - mean) * jax.lax.rsqrt(var + eps) * p["scale"] + p["bias"]


def _attend(q, k, v, weights):
  """Causal softmax attention over the full sequence: q/k/v (B, T, H, Dh), weights (B, T).

  Keys that are padding are masked; every query always sees itself, so no softmax row is
  empty (padded queries' outputs get zero loss weight anyway).
  """
  t = q.shape[1]
  scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1]).astype(np.float32)
  pos = np.arange(t)
  causal = pos[:, None] >= pos[None, :]
  mask = (causal[None] & (weights[:, None, :] > 0)) | np.eye(t, dtype=bool)[None]
  scores = jnp.where(mask[:, None], scores, -1e9)
  probs = jax.nn.softmax(scores, axis=-1)
  return jnp.einsum("bhqk,bkhd->bqhd", probs, v)


def _ulysses_local(q, k, v, w, axis):
  """``_attend`` on this device's sequence shard, inside a shard_map manual over ``axis``:
  q/k/v (B, T/n, H, Dh), w (B, T/n)."""
  # (B, T/n, H, Dh) -> (B, T, H/n, Dh): split heads, gather sequence.
  def to_heads(x):
    return jax.lax.all_to_all(x, axis, split_axis=2, concat_axis=1, tiled=True)

  w = jax.lax.all_gather(w, axis, axis=1, tiled=True)  # the key mask needs every token
  out = _attend(to_heads(q), to_heads(k), to_heads(v), w)
  # (B, T, H/n, Dh) -> (B, T/n, H, Dh): split sequence, gather heads.
  return jax.lax.all_to_all(out, axis, split_axis=1, concat_axis=2, tiled=True)


def _ulysses_attend(q, k, v, weights, axis, custom_vjp):
  """``_attend`` with q/k/v/weights sharded over ``axis`` along the sequence dimension."""
  local = functools.partial(_ulysses_local, axis=axis)

  # Manual over `axis` only: specs may name only that axis; `data` stays automatic.
  spec = P(None, axis, None, None)
  specs = (spec, spec, spec, P(None, axis))
  forward = jax.shard_map(local, axis_names={axis}, in_specs=specs, out_specs=spec)
  if not custom_vjp:
    return forward(q, k, v, weights)

  # The backward pass as its own shard_map, with jax.vjp inside the body. Differentiating
  # `forward` directly fails to lower (JAX 0.10.2) when the call sits inside a shard_map
  # manual over `data`: the residuals it saves get out_specs P(("data", "seq"), ...), naming
  # the outer manual axis ('... operates on axis "data" which is already bound by a parent
  # sdy.manual_computation op', or under fxaccum '... must have all manual axes come before
  # free axes ... Saw manual axis "seq" after free axis "data"').
  backward = jax.shard_map(lambda q, k, v, w, g: jax.vjp(local, q, k, v, w)[1](g),
                           axis_names={axis}, in_specs=(*specs, spec), out_specs=specs)

  @jax.custom_vjp
  def attend(q, k, v, w):
    return forward(q, k, v, w)

  attend.defvjp(lambda q, k, v, w: (forward(q, k, v, w), (q, k, v, w)),
                lambda res, g: backward(*res, g))
  return attend(q, k, v, weights)


def _forward_sums(params, batch, attend, pos=None):
  inputs, targets, weights = batch["inputs"], batch["targets"], batch["weights"]
  t = inputs.shape[1]
  pos = params["pos"][:t] if pos is None else pos
  # One-hot matmuls instead of gathers: identical math, and no gather sharding rules needed.
  x = jax.nn.one_hot(inputs, VOCAB, dtype=jnp.float32) @ params["embed"] + pos
  h = _layer_norm(x, params["ln1"])
  a = params["attn"]
  q = jnp.einsum("btd,dhk->bthk", h, a["wq"])
  k = jnp.einsum("btd,dhk->bthk", h, a["wk"])
  v = jnp.einsum("btd,dhk->bthk", h, a["wv"])
  x = x + jnp.einsum("bthk,hkd->btd", attend(q, k, v, weights), a["wo"])
  h = _layer_norm(x, params["ln2"])
  m = params["mlp"]
  x = x + jax.nn.gelu(h @ m["w1"] + m["b1"]) @ m["w2"] + m["b2"]
  logits = _layer_norm(x, params["ln_f"]) @ params["head"]
  logp = jax.nn.log_softmax(logits, axis=-1)
  xent = -jnp.sum(jax.nn.one_hot(targets, VOCAB, dtype=jnp.float32) * logp, axis=-1)
  return jnp.sum(weights * xent), jnp.sum(weights)


def token_sums(params, batch, *, mesh_seq_axis: str = "seq", custom_vjp: bool = True):
  """``(sum(weights * xent), sum(weights))`` with Ulysses attention over ``mesh_seq_axis``.

  Needs a mesh with that axis in context (``jax.set_mesh``); its size must divide HEADS and
  the sequence length. Other mesh axes (e.g. ``data``) stay automatic, or may be manual in
  an enclosing shard_map. ``custom_vjp=False`` lets JAX differentiate the shard_map itself:
  fine at top level, but its grad fails inside a shard_map manual over ``data``.
  """
  attend = functools.partial(_ulysses_attend, axis=mesh_seq_axis, custom_vjp=custom_vjp)
  return _forward_sums(params, batch, attend)


def token_sums_per_rank(params, batch, *, seq_axis: str = "seq"):
  """This device's ``(sum(weights * xent), sum(weights))``: per-rank code, inside a
  shard_map manual over the data axes and ``seq_axis``, on this device's rows and sequence
  shard (its position embeddings are the slice at its shard's offset)."""
  t = batch["inputs"].shape[1]
  pos = jax.lax.dynamic_slice_in_dim(params["pos"], jax.lax.axis_index(seq_axis) * t, t)
  attend = functools.partial(_ulysses_local, axis=seq_axis)
  return _forward_sums(params, batch, attend, pos=pos)


def token_sums_plain(params, batch):
  """The same sums as ``token_sums`` with ordinary full attention (no shard_map)."""
  return _forward_sums(params, batch, _attend)
