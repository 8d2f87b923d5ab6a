"""Cross-step accumulation == the same optimizer on the k-times larger batch."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training import train_state
from helpers import assert_tree_close

import fxaccum

K, STEPS, MICRO = 4, 3, 8  # calls per window, optimizer steps, examples per call


class MLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(2)(nn.tanh(nn.Dense(16)(x)))


def data(calls, seed=0, micro=MICRO):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(calls, micro, 4)).astype(np.float32)
  y = rng.normal(size=(calls, micro, 2)).astype(np.float32)
  return x, y


MODEL = MLP()
PARAMS = jax.jit(MODEL.init)(jax.random.key(0), jnp.ones((1, 4)))  # op by op: 2 s at import


def mse(params, x, y):
  return jnp.mean((MODEL.apply(params, x) - y) ** 2)


OPTIMIZERS = {
    "adam": lambda: optax.adam(1e-2),
    "adamw_warmup_cosine": lambda: optax.adamw(
        optax.warmup_cosine_decay_schedule(0.0, 1e-2, 2, 10), weight_decay=0.1),
    "sgd_momentum": lambda: optax.sgd(0.1, momentum=0.9),
    "clip_then_adam": lambda: optax.chain(optax.clip_by_global_norm(0.05), optax.adam(1e-2)),
}


def large_batch_reference(inner, x, y, k=K):
  """The inner optimizer on the k-times larger batch: one step per window (jitted: op by
  op, the optimizer's update dispatched dozens of small programs per step)."""
  @jax.jit
  def step(params, state, xb, yb):
    updates, state = inner.update(jax.grad(mse)(params, xb, yb), state, params)
    return optax.apply_updates(params, updates), state

  params, state = PARAMS, inner.init(PARAMS)
  for i in range(x.shape[0] // k):
    params, state = step(params, state, x[i * k:(i + 1) * k].reshape(-1, 4),
                         y[i * k:(i + 1) * k].reshape(-1, 2))
  return params, state


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_linen_train_state_matches_large_batch(name):
  x, y = data(K * STEPS)
  state = fxaccum.TrainState.create(
      apply_fn=MODEL.apply, params=PARAMS,
      tx=optax.chain(fxaccum.accumulate(K), OPTIMIZERS[name]()))

  @jax.jit
  def train_step(state, x, y):
    return state.apply_gradients(grads=jax.grad(mse)(state.params, x, y))

  for call in range(K * STEPS):
    state = train_step(state, x[call], y[call])
    assert int(state.step) == (call + 1) // K  # optimizer steps, not calls
    assert bool(fxaccum.is_boundary(state.opt_state)) == ((call + 1) % K == 0)
  ref_params, ref_state = large_batch_reference(OPTIMIZERS[name](), x, y)
  assert_tree_close(state.params, ref_params, rtol=1e-6)
  assert_tree_close(state.opt_state[1], ref_state, rtol=1e-6)
  counts = [c for path, c in jax.tree_util.tree_flatten_with_path(state.opt_state[1])[0]
            if "count" in jax.tree_util.keystr(path)]
  assert bool(counts) == (name != "sgd_momentum")  # sgd's TraceState has no count
  assert all(int(c) == STEPS for c in counts)  # Adam and schedules: once per window
  acc = state.opt_state[0]
  assert int(acc.optimizer_step) == STEPS and int(acc.micro_step) == 0


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_nnx_optimizer_matches_large_batch(name):
  x, y = data(K * STEPS)

  class NNXMLP(nnx.Module):
    def __init__(self, rngs):
      self.a, self.b = nnx.Linear(4, 16, rngs=rngs), nnx.Linear(16, 2, rngs=rngs)

    def __call__(self, x):
      return self.b(jnp.tanh(self.a(x)))

  def loss(model, x, y):
    return jnp.mean((model(x) - y) ** 2)

  model = NNXMLP(nnx.Rngs(0))
  ref_model = nnx.clone(model)
  opt = fxaccum.Optimizer(model, optax.chain(fxaccum.accumulate(K), OPTIMIZERS[name]()),
                          wrt=nnx.Param)

  @nnx.jit
  def train_step(model, opt, x, y):
    return opt.update(model, nnx.grad(loss)(model, x, y))

  updates = []
  for call in range(K * STEPS):
    updates.append(train_step(model, opt, x[call], y[call]))
    assert bool(fxaccum.is_boundary(opt.opt_state)) == ((call + 1) % K == 0)
  assert int(opt.step[...]) == STEPS and int(opt.micro_step) == 0

  ref_opt = nnx.Optimizer(ref_model, OPTIMIZERS[name](), wrt=nnx.Param)

  @nnx.jit
  def ref_step(ref_model, ref_opt, xb, yb):
    return ref_opt.update(ref_model, nnx.grad(loss)(ref_model, xb, yb))

  for step in range(STEPS):
    xb, yb = x[step * K:(step + 1) * K].reshape(-1, 4), y[step * K:(step + 1) * K].reshape(-1, 2)
    ref_updates = ref_step(ref_model, ref_opt, xb, yb)
    # update returns what nnx.Optimizer.update returns: the step's updates (zeros between)
    assert_tree_close(updates[(step + 1) * K - 1], ref_updates, rtol=1e-5)
    assert not any(np.any(u) for u in jax.tree.leaves(updates[step * K]))
  assert_tree_close(nnx.state(model, nnx.Param), nnx.state(ref_model, nnx.Param), rtol=1e-6)
  assert_tree_close(nnx.as_pure(opt.opt_state)[1], nnx.as_pure(ref_opt.opt_state), rtol=1e-6)


def test_same_params_as_optax_multisteps():
  x, y = data(K * STEPS)
  tx = optax.chain(fxaccum.accumulate(K), optax.adam(1e-2))
  params, opt_state = PARAMS, tx.init(PARAMS)
  multi = optax.MultiSteps(optax.adam(1e-2), every_k_schedule=K)
  m_params, m_state = PARAMS, multi.init(PARAMS)

  # Both jitted: op by op, each call dispatched hundreds of small programs (30 s).
  @jax.jit
  def ours(params, opt_state, x, y):
    return fxaccum.apply_gradients(tx, jax.grad(mse)(params, x, y), opt_state, params)

  @jax.jit
  def theirs(m_params, m_state, x, y):
    updates, m_state = multi.update(jax.grad(mse)(m_params, x, y), m_state, m_params)
    return optax.apply_updates(m_params, updates), m_state

  for call in range(K * STEPS):
    params, opt_state = ours(params, opt_state, x[call], y[call])
    m_params, m_state = theirs(m_params, m_state, x[call], y[call])
  assert_tree_close(params, m_params, rtol=1e-6)


def weighted_loss(params, x, y, mask):
  per_example = jnp.mean((MODEL.apply(params, x) - y) ** 2, axis=-1)
  return fxaccum.Weighted(jnp.sum(mask * per_example), jnp.sum(mask))


def test_weighted_calls_with_uneven_and_zero_token_counts():
  x, y = data(K)
  counts = [7, 1, 0, 3]  # a zero-token call included
  mask = (np.arange(MICRO)[None] < np.array(counts)[:, None]).astype(np.float32)
  tx = optax.chain(fxaccum.accumulate(K), optax.sgd(1.0))
  params, opt_state = PARAMS, tx.init(PARAMS)
  grad_fn = jax.jit(fxaccum.grad(weighted_loss, micro_batches=1, batch_argnums=(1, 2, 3)))
  apply = jax.jit(fxaccum.apply_gradients, static_argnums=0)  # op by op: 3 s
  for call in range(K):
    g = grad_fn(params, x[call], y[call], mask[call])
    params, opt_state = apply(tx, g, opt_state, PARAMS, weight=mask[call].sum())
  # Reference: the token mean over the whole window, one SGD step of lr 1.
  ref_grad = jax.grad(lambda p: weighted_loss(p, x.reshape(-1, 4), y.reshape(-1, 2),
                                              mask.reshape(-1)).value())(PARAMS)
  ref = jax.tree.map(lambda p, g: p - g, PARAMS, ref_grad)
  assert_tree_close(params, ref, rtol=1e-6)

  # Negative control: the same calls weighed equally give a visibly different step.
  tx2 = optax.chain(fxaccum.accumulate(K), optax.sgd(1.0))
  naive, state2 = PARAMS, tx2.init(PARAMS)
  for call in range(K):
    naive, state2 = apply(tx2, grad_fn(PARAMS, x[call], y[call], mask[call]), state2, PARAMS)
  delta = lambda p: np.concatenate([np.ravel(a - b) for a, b in  # noqa: E731
                                    zip(jax.tree.leaves(p), jax.tree.leaves(PARAMS), strict=True)])
  rel = np.max(np.abs(delta(naive) - delta(ref))) / np.max(np.abs(delta(ref)))
  assert rel > 1e-2


def test_in_step_inside_cross_step_is_exact():
  """micro_batches=m inside accumulate(n): m*n micro-batches, token-weighted, exactly."""
  m, n = 2, 3
  x, y = data(n, micro=8)
  rng = np.random.default_rng(3)
  mask = (rng.random((n, 8)) < 0.5).astype(np.float32)
  mask[1] = 0.0  # one whole call without tokens
  tx = optax.chain(fxaccum.accumulate(n), optax.sgd(1.0))
  params, opt_state = PARAMS, tx.init(PARAMS)
  grad_fn = jax.jit(fxaccum.grad(weighted_loss, micro_batches=m, batch_argnums=(1, 2, 3)))
  for call in range(n):
    params, opt_state = fxaccum.apply_gradients(
        tx, grad_fn(PARAMS, x[call], y[call], mask[call]), opt_state, PARAMS,
        weight=mask[call].sum())
  ref_grad = jax.jit(jax.grad(lambda p: weighted_loss(p, x.reshape(-1, 4), y.reshape(-1, 2),
                                                      mask.reshape(-1)).value()))(PARAMS)
  assert_tree_close(params, jax.tree.map(lambda p, g: p - g, PARAMS, ref_grad), rtol=1e-6)


def test_every_k_schedule():
  schedule = lambda step: jnp.where(step == 0, 1, jnp.where(step == 1, 2, 3))  # noqa: E731
  windows = [1, 2, 3]
  x, y = data(sum(windows))
  tx = optax.chain(fxaccum.accumulate(schedule), optax.adam(1e-2))
  state = fxaccum.TrainState.create(apply_fn=MODEL.apply, params=PARAMS, tx=tx)
  train_step = jax.jit(lambda state, x, y: state.apply_gradients(
      grads=jax.grad(mse)(state.params, x, y)))
  steps_seen = []
  for call in range(sum(windows)):
    state = train_step(state, x[call], y[call])
    steps_seen.append(int(state.step))
  assert steps_seen == [1, 1, 2, 2, 2, 3]

  inner = optax.adam(1e-2)

  @jax.jit
  def ref_step(params, inner_state, xb, yb):
    updates, inner_state = inner.update(jax.grad(mse)(params, xb, yb), inner_state, params)
    return optax.apply_updates(params, updates), inner_state

  params, inner_state, start = PARAMS, inner.init(PARAMS), 0
  for w in windows:
    params, inner_state = ref_step(params, inner_state, x[start:start + w].reshape(-1, 4),
                                   y[start:start + w].reshape(-1, 2))
    start += w
  assert_tree_close(state.params, params, rtol=1e-6)


def test_skip_nonfinite_drops_the_call():
  """A skipped call is as if it never happened (optax.MultiSteps' semantics): the window
  ends after K good calls, on their mean."""
  x, y = data(K + 1)
  grad_fn = jax.jit(jax.grad(mse))
  apply = jax.jit(fxaccum.apply_gradients, static_argnums=0)  # op by op: 3 s
  tx = optax.chain(fxaccum.accumulate(K, skip_nonfinite=True), optax.sgd(1.0))
  params, opt_state = PARAMS, tx.init(PARAMS)
  for call in range(K + 1):
    g = grad_fn(PARAMS, x[call], y[call])
    if call == 2:
      g = jax.tree.map(lambda a: a.at[(0,) * a.ndim].set(jnp.nan), g)
    params, opt_state = apply(tx, g, opt_state, PARAMS)
    if call == K - 1:  # K calls, one skipped: the window is not complete
      assert int(opt_state[0].optimizer_step) == 0 and int(opt_state[0].micro_step) == K - 1
  kept = [c for c in range(K + 1) if c != 2]
  ref_grad = jax.grad(mse)(PARAMS, x[kept].reshape(-1, 4), y[kept].reshape(-1, 2))
  assert_tree_close(params, jax.tree.map(lambda p, g: p - g, PARAMS, ref_grad), rtol=1e-6)
  assert int(opt_state[0].skipped) == 1 and int(opt_state[0].optimizer_step) == 1

  # Without skip_nonfinite the NaN reaches the params (the documented default).
  tx = optax.chain(fxaccum.accumulate(K), optax.sgd(1.0))
  params, opt_state = PARAMS, tx.init(PARAMS)
  for call in range(K):
    g = grad_fn(PARAMS, x[call], y[call])
    g = jax.tree.map(lambda a: a.at[(0,) * a.ndim].set(jnp.nan), g) if call == 2 else g
    params, opt_state = apply(tx, g, opt_state, PARAMS)
  assert any(bool(jnp.isnan(p).any()) for p in jax.tree.leaves(params))


def test_bf16_params_with_f32_adam_moments():
  x, y = data(K * 2)
  params16 = jax.tree.map(lambda p: p.astype(jnp.bfloat16), PARAMS)
  tx = optax.chain(fxaccum.accumulate(K), optax.adam(1e-2, mu_dtype=jnp.float32))
  state = fxaccum.TrainState.create(apply_fn=MODEL.apply, params=params16, tx=tx)

  @jax.jit
  def train_step(state, x, y):
    return state.apply_gradients(grads=jax.grad(mse)(state.params, x, y))

  for call in range(K * 2):
    state = train_step(state, x[call], y[call])
  assert all(p.dtype == jnp.bfloat16 for p in jax.tree.leaves(state.params))
  ref_params, _ = large_batch_reference(optax.adam(1e-2), x, y)
  assert_tree_close(jax.tree.map(lambda p: p.astype(jnp.float32), state.params), ref_params,
                    rtol=3e-2, floor=3e-2)


def test_donated_state_is_aliased_and_scan_over_calls():
  x, y = data(K * 2)
  tx = optax.chain(fxaccum.accumulate(K), optax.adam(1e-2))
  state = fxaccum.TrainState.create(apply_fn=MODEL.apply, params=PARAMS, tx=tx)

  def train_step(state, x, y):
    return state.apply_gradients(grads=jax.grad(mse)(state.params, x, y))

  rep = fxaccum.diagnostics.report(jax.jit(train_step, donate_argnums=0), state, x[0], y[0])
  state_bytes = sum(jnp.asarray(a).nbytes for a in jax.tree.leaves(state))  # as jit sees them
  assert rep.memory.alias_bytes >= state_bytes, (rep.memory, state_bytes)

  # lax.scan over calls gives the same result as a Python loop of jitted calls.
  scanned, _ = jax.jit(lambda s, x, y: jax.lax.scan(
      lambda s, xy: (train_step(s, *xy), None), s, (x, y)))(state, x, y)
  looped, jitted = state, jax.jit(train_step)
  for call in range(K * 2):
    looped = jitted(looped, x[call], y[call])
  assert_tree_close(scanned.params, looped.params, rtol=1e-6)
  assert int(scanned.step) == int(looped.step) == 2


def test_train_step_compiles_once_as_with_flax_train_state():
  """The jitted train step traces once over a run, as it does with flax's own TrainState
  (the reference): ``step`` keeps the type ``create`` gave it (a weakly typed 0)."""
  x, y = data(K * 2)
  traces = {}
  for name, cls, tx in [("flax", train_state.TrainState, optax.adam(1e-2)),
                        ("fxaccum", fxaccum.TrainState,
                         optax.chain(fxaccum.accumulate(K), optax.adam(1e-2)))]:
    state = cls.create(apply_fn=MODEL.apply, params=PARAMS, tx=tx)

    @jax.jit
    def train_step(state, x, y, name=name):
      traces[name] = traces.get(name, 0) + 1  # runs only when jit traces
      return state.apply_gradients(grads=jax.grad(mse)(state.params, x, y))

    for call in range(K + 1):  # a window's boundary and the next window's first call
      state = train_step(state, x[call], y[call])
  assert traces == {"flax": 1, "fxaccum": 1}, traces
  assert int(state.step) == 1

def test_ungated_use_fails_loudly():
  tx = optax.chain(fxaccum.accumulate(K), optax.adam(1e-2))
  grads = jax.grad(mse)(PARAMS, *[a[0] for a in data(1)])
  with pytest.raises(RuntimeError, match="fxaccum.TrainState.*fxaccum.Optimizer.*apply_grad"):
    tx.update(grads, tx.init(PARAMS), PARAMS)
  stock = train_state.TrainState.create(apply_fn=MODEL.apply, params=PARAMS, tx=tx)
  with pytest.raises(RuntimeError, match="outside a gate"):
    stock.apply_gradients(grads=grads)
  with pytest.raises(RuntimeError, match="outside a gate"):
    jax.jit(lambda s: s.apply_gradients(grads=grads))(stock)
  model = nnx.Linear(4, 2, rngs=nnx.Rngs(0))
  opt = nnx.Optimizer(model, tx, wrt=nnx.Param)
  with pytest.raises(RuntimeError, match="outside a gate"):
    opt.update(model, nnx.grad(lambda m: jnp.mean(m(jnp.ones((2, 4))) ** 2))(model))


def test_gate_errors():
  grads = jax.grad(mse)(PARAMS, *[a[0] for a in data(1)])
  with pytest.raises(ValueError, match="0 fxaccum.accumulate transformations"):
    fxaccum.apply_gradients(optax.adam(1e-2), grads, optax.adam(1e-2).init(PARAMS), PARAMS)
  tx = optax.chain(fxaccum.accumulate(K), optax.adam(1e-2))
  with pytest.raises(ValueError, match="tree structure does not match"):
    fxaccum.apply_gradients(tx, {"other": 1.0}, tx.init(PARAMS), PARAMS)
  with pytest.raises(ValueError, match="every_k must be a positive int"):
    fxaccum.accumulate(0)
  with pytest.raises(TypeError, match="per-device partial sums and needs"):
    tx2 = optax.chain(fxaccum.accumulate(K, data_axes="data"), optax.sgd(1.0))
    mesh = jax.make_mesh((8,), ("data",))
    with jax.set_mesh(mesh):
      fxaccum.apply_gradients(tx2, grads, tx2.init(PARAMS), PARAMS)


def test_nnx_scan_over_calls_matches_a_loop():
  x, y = data(K * 2)

  def build():
    model = nnx.Linear(4, 2, rngs=nnx.Rngs(0))
    return model, fxaccum.Optimizer(
        model, optax.chain(fxaccum.accumulate(K), optax.adam(1e-2)), wrt=nnx.Param)

  def loss(model, x, y):
    return jnp.mean((model(x) - y) ** 2)

  def one_call(model, opt, x, y):
    opt.update(model, nnx.grad(loss)(model, x, y))

  model, opt = build()

  @nnx.jit
  def run_all(model, opt, xs, ys):
    @nnx.scan(in_axes=(nnx.Carry, 0, 0), out_axes=nnx.Carry)
    def body(carry, x, y):
      model, opt = carry
      one_call(model, opt, x, y)
      return model, opt

    body((model, opt), xs, ys)

  run_all(model, opt, x, y)
  ref_model, ref_opt = build()
  ref_call = nnx.jit(one_call)  # one wrapper: nnx.jit(one_call) in the loop compiled 8 times
  for call in range(K * 2):
    ref_call(ref_model, ref_opt, x[call], y[call])
  assert int(opt.step[...]) == int(ref_opt.step[...]) == 2
  assert_tree_close(nnx.state(model, nnx.Param), nnx.state(ref_model, nnx.Param), rtol=1e-6)


def test_calls_counts_every_call_for_per_call_randomness():
  """``state.step`` counts optimizer steps, so fold_in(key, step) repeats within a window
  (the negative control); ``state.calls`` gives every call its own key, skipped calls too."""
  tx = optax.chain(fxaccum.accumulate(4, skip_nonfinite=True), optax.sgd(0.1))
  state = fxaccum.TrainState.create(apply_fn=None, params=jnp.zeros(2), tx=tx)
  apply = jax.jit(lambda state, grad: state.apply_gradients(grads=grad))  # op by op: 1 s
  key = jax.random.key(0)
  by_step, by_calls = set(), set()
  for call in range(8):
    by_step.add(tuple(np.asarray(jax.random.key_data(jax.random.fold_in(key, state.step)))))
    by_calls.add(tuple(np.asarray(jax.random.key_data(jax.random.fold_in(key, state.calls)))))
    grad = jnp.full(2, jnp.nan) if call == 5 else jnp.ones(2)
    state = apply(state, grad)
  assert len(by_calls) == 8 and len(by_step) == 2
  assert int(state.calls) == 8 and int(state.step) == 1 and int(state.micro_step) == 3
  assert int(state.opt_state[0].skipped) == 1
