"""The gated cross-step's compiled memory: at most ``optax.MultiSteps``' as flax users jit it.

Structural checks on ``compiled.memory_analysis()`` (peak = temp + arguments + outputs -
aliased), never a timing: the step is compiled, not run.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training import train_state

import fxaccum

WIDTH, LAYERS, ROWS, K = 256, 4, 8, 4
LEAF = WIDTH * WIDTH * 4  # bytes of one layer's float32 kernel
PARAMS = LAYERS * (WIDTH + 1) * WIDTH * 4
# The forward's activations: what a step without params-sized temporaries still holds.
ACTIVATIONS = 2 * (LAYERS + 1) * ROWS * WIDTH * 4


class MLP(nnx.Module):
  def __init__(self, rngs):
    self.layers = nnx.List([nnx.Linear(WIDTH, WIDTH, rngs=rngs) for _ in range(LAYERS)])

  def __call__(self, x):
    for layer in self.layers:
      x = jax.nn.relu(layer(x))
    return x


class LinenMLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    for _ in range(LAYERS):
      x = jax.nn.relu(nn.Dense(WIDTH)(x))
    return x


def loss(model, x, y):
  return jnp.mean((model(x) - y) ** 2)


X = jnp.ones((ROWS, WIDTH))


def memory(compiled):
  m = compiled.memory_analysis()
  peak = (m.temp_size_in_bytes + m.argument_size_in_bytes + m.output_size_in_bytes
          - m.alias_size_in_bytes)
  return peak, m.temp_size_in_bytes


def nnx_step(optimizer, tx, donate):
  """The step as NNX users jit it: merge, optimizer.update, split."""
  model = MLP(nnx.Rngs(0))
  graphdef, state = nnx.split((model, optimizer(model, tx, wrt=nnx.Param)))

  def step(state, x, y):
    model, opt = nnx.merge(graphdef, state)
    opt.update(model, nnx.grad(loss)(model, x, y))
    return nnx.split((model, opt))[1]

  return memory(jax.jit(step, donate_argnums=(0,) if donate else ()).lower(state, X, X)
                .compile())


def linen_step(state_class, tx):
  model = LinenMLP()
  state = state_class.create(apply_fn=model.apply, params=model.init(jax.random.key(0), X),
                             tx=tx)

  def step(state, x, y):
    grads = jax.grad(lambda p: loss(lambda v: state.apply_fn(p, v), x, y))(state.params)
    return state.apply_gradients(grads=grads)

  return memory(jax.jit(step, donate_argnums=(0,)).lower(state, X, X).compile())


def naive_gate_step(donate):
  """A cond gate that carries the accumulator through the cond and zeroes it there: the
  negative control, a formulation the bounds below must tell apart."""
  inner = optax.adam(1e-3)
  params = LinenMLP().init(jax.random.key(0), X)

  def step(params, acc, count, inner_state, x, y):
    grads = jax.grad(lambda p: loss(lambda v: LinenMLP().apply(p, v), x, y))(params)
    acc, count = jax.tree.map(jnp.add, acc, grads), count + 1

    def update(ops):
      params, inner_state, acc = ops
      updates, inner_state = inner.update(jax.tree.map(lambda a: a / K, acc), inner_state,
                                          params)
      return (optax.apply_updates(params, updates), inner_state,
              jax.tree.map(jnp.zeros_like, acc))

    out = jax.lax.cond(count == K, update, lambda ops: ops, (params, inner_state, acc))
    return *out, count % K

  args = (params, jax.tree.map(jnp.zeros_like, params), jnp.int32(0), inner.init(params), X, X)
  return memory(jax.jit(step, donate_argnums=(0, 1, 2, 3) if donate else ()).lower(*args)
                .compile())


def gated():
  return optax.chain(fxaccum.accumulate(K), optax.adam(1e-3))


def multisteps():
  return optax.MultiSteps(optax.adam(1e-3), K)


def test_nnx_step_without_donation_holds_no_params_sized_temporary():
  """nnx.jit's default: no donation. MultiSteps writes every output once, at the end, so
  XLA keeps the step's activations in its output buffers (temp 0); the gate's cond results
  cannot host them, so fxaccum may exceed it by the activations, never by params."""
  peak, temp = nnx_step(fxaccum.Optimizer, gated(), donate=False)
  ms_peak, _ = nnx_step(nnx.Optimizer, multisteps(), donate=False)
  naive_peak, naive_temp = naive_gate_step(donate=False)
  assert temp <= ACTIVATIONS < LEAF, (temp, ACTIVATIONS)
  assert peak <= ms_peak + ACTIVATIONS, (peak, ms_peak)
  # Negative control: a cond that carries the accumulator holds a params-sized copy.
  assert naive_temp > PARAMS > ACTIVATIONS, naive_temp
  assert naive_peak > ms_peak + ACTIVATIONS, (naive_peak, ms_peak)


@pytest.mark.parametrize("integration", ["nnx", "linen"])
def test_donated_step_peak_is_at_most_multisteps(integration):
  """Donated state: the peak is at most MultiSteps', with at most one layer's gradient
  (written before its in-place add) and the activations as temporaries."""
  if integration == "nnx":
    peak, temp = nnx_step(fxaccum.Optimizer, gated(), donate=True)
    ms_peak, ms_temp = nnx_step(nnx.Optimizer, multisteps(), donate=True)
  else:
    peak, temp = linen_step(fxaccum.TrainState, gated())
    ms_peak, ms_temp = linen_step(train_state.TrainState, multisteps())
  assert peak <= ms_peak, (peak, ms_peak)
  assert temp <= LEAF + ACTIVATIONS, (temp, LEAF + ACTIVATIONS)
  naive_peak, naive_temp = naive_gate_step(donate=True)
  # Negative control: the naive gate's donated peak is MultiSteps'-like, so the peak
  # alone would not catch it; its temporaries would.
  assert naive_temp > LEAF + ACTIVATIONS, naive_temp
  np.testing.assert_array_less(0, ms_temp)
