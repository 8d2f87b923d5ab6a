"""The view each loss takes, and that the result is the contract's either way.

Each case names the view fxaccum.value_and_grad must take on an 8-device data mesh and is
checked against the mean of jax.value_and_grad over the global micro-batches. A wrong
"device" verdict fails the numbers too: per device, a sum is off by the device count, a
batch statistic is the device's own.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_tree_close, mesh_of
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import fxaccum
from fxaccum import diagnostics

K, ROWS, DIM, OUT = 2, 64, 4, 3


def per_example(w, b):
  return jnp.sum((b["x"] @ w) ** 2, axis=-1)  # one value per example


@jax.custom_vjp
def clip_gradient(x):
  return x


clip_gradient.defvjp(lambda x: (x, None), lambda _, g: (jnp.clip(g, -1.0, 1.0),))


def weighted(total, weight):
  return fxaccum.Weighted(total, weight)


# name: (loss(w, batch, key), expected view)
CASES = {
    "mean": (lambda w, b, key: jnp.mean(per_example(w, b)), "device"),
    "sum": (lambda w, b, key: jnp.sum(per_example(w, b)), "global"),
    "sum_by_a_constant_equal_to_the_rows": (
        lambda w, b, key: jnp.sum(per_example(w, b)) / (ROWS // K), "global"),
    "sum_by_the_rows": (lambda w, b, key: jnp.sum(per_example(w, b)) / b["x"].shape[0],
                        "device"),
    "sum_of_terms_over_the_rows": (
        lambda w, b, key: jnp.sum(per_example(w, b) / b["x"].shape[0]), "device"),
    "mean_times_the_rows": (lambda w, b, key: jnp.mean(per_example(w, b)) * b["x"].shape[0],
                            "global"),
    "weighted_token_sum": (lambda w, b, key: weighted(jnp.sum(b["m"] * per_example(w, b)),
                                                      jnp.sum(b["m"])), "device"),
    "weighted_by_the_rows": (lambda w, b, key: weighted(jnp.sum(per_example(w, b)),
                                                        b["x"].shape[0]), "device"),
    "weighted_by_a_constant": (lambda w, b, key: weighted(jnp.sum(per_example(w, b)), 5.0),
                               "global"),
    "weighted_mean": (lambda w, b, key: weighted(jnp.mean(per_example(w, b)), 1), "device"),
    "token_mean_as_a_scalar": (
        lambda w, b, key: jnp.sum(b["m"] * per_example(w, b)) / jnp.maximum(jnp.sum(b["m"]),
                                                                            1.0), "global"),
    "mean_plus_l2": (lambda w, b, key: jnp.mean(per_example(w, b)) + 0.1 * jnp.sum(w ** 2),
                     "device"),
    "sum_plus_l2": (lambda w, b, key: jnp.sum(per_example(w, b)) + 0.1 * jnp.sum(w ** 2),
                    "global"),
    "centred": (lambda w, b, key: jnp.mean((b["x"] @ w - jnp.mean(b["x"] @ w, 0)) ** 2),
                "global"),
    "in_batch_negatives": (lambda w, b, key: optax.softmax_cross_entropy_with_integer_labels(
        (b["x"] @ w) @ (b["x"] @ w).T, jnp.arange(b["x"].shape[0])).mean(), "global"),
    "dropout_from_one_key": (lambda w, b, key: jnp.mean(jax.random.bernoulli(
        key, 0.5, (b["x"].shape[0], OUT)) * (b["x"] @ w) ** 2), "global"),
    "dropout_from_per_example_keys": (lambda w, b, key: jnp.mean(jax.vmap(
        lambda x, k: jax.random.bernoulli(k, 0.5, (OUT,)) * (x @ w) ** 2)(b["x"], b["keys"])),
        "device"),
    "position_weights": (lambda w, b, key: jnp.mean(
        per_example(w, b) * jnp.arange(b["x"].shape[0])), "global"),
    "scan_over_layers": (lambda w, b, key: jnp.mean(jax.lax.scan(
        lambda h, _: (jnp.tanh(h @ w @ w.T), None), b["x"], None, length=3)[0] ** 2), "device"),
    "remat": (lambda w, b, key: jnp.mean(jax.checkpoint(per_example)(w, b)), "device"),
    "custom_vjp": (lambda w, b, key: jnp.mean(clip_gradient(per_example(w, b))), "global"),
    "sort_within_examples": (lambda w, b, key: jnp.mean(jnp.sort(b["x"] @ w, axis=-1)[:, -1]),
                             "device"),
    "top_examples": (lambda w, b, key: jnp.mean(jax.lax.top_k(per_example(w, b), 4)[0]),
                     "global"),
    "cumsum_over_the_batch": (lambda w, b, key: jnp.mean(jnp.cumsum(per_example(w, b))),
                              "global"),
    "mean_of_batch_sums": (lambda w, b, key: jnp.mean(jnp.sum(b["x"] @ w, axis=0)), "global"),
    "mean_of_example_sums": (lambda w, b, key: jnp.mean(jnp.sum(b["x"] @ w, axis=1)),
                             "device"),
    "max_over_the_batch": (lambda w, b, key: jnp.max(per_example(w, b)), "global"),
}


def data():
  rng = np.random.default_rng(0)
  mask = (rng.random(ROWS) > 0.3).astype(np.float32)
  return ({"x": rng.normal(size=(ROWS, DIM)).astype(np.float32), "m": mask,
           "keys": jax.random.split(jax.random.key(1), ROWS)},
          rng.normal(size=(DIM, OUT)).astype(np.float32))


def reference(loss, w, batch, key):
  """The contract: the mean over the global micro-batches (each with fold_in(key, i)) of
  jax.value_and_grad; Weighted losses as sum(total) / sum(weight)."""
  parts = []
  for i in range(K):
    micro = jax.tree.map(lambda a, i=i: a[i::K], batch)

    def total_weight(w, micro=micro, i=i):
      out = loss(w, micro, jax.random.fold_in(key, i))
      return (out.total, out.weight) if isinstance(out, fxaccum.Weighted) else (out, 1.0)

    (total, weight), g = jax.value_and_grad(total_weight, has_aux=True)(w)
    parts.append((total, jnp.float32(weight), g))
  totals, weights, grads = zip(*parts, strict=True)
  return sum(totals) / sum(weights), sum(grads) / sum(weights)


@pytest.mark.parametrize("name", CASES)
def test_view_and_exactness(name):
  loss, view = CASES[name]
  batch, w = data()
  key = jax.random.key(2)
  mesh = mesh_of((8,), ("data",), AxisType.Auto)
  f = jax.jit(fxaccum.value_and_grad(loss, micro_batches=K, rng_argnums=2))
  with jax.set_mesh(mesh):
    sharded = jax.tree.map(lambda a: jax.device_put(a, NamedSharding(mesh, P("data"))), batch)
    got = f(w, sharded, key)
    (path,) = diagnostics.paths(f, w, sharded, key)
  assert path.view == view, path
  assert_tree_close(got, reference(loss, w, batch, key))
