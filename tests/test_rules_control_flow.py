"""The control-flow rules on per-example losses (issue 34): flax's ``nn.RNN`` scan over
time, ``lax.map`` with ``batch_size=`` (a scan over blocks of examples) and a
``while_loop`` under ``jax.vmap`` (one predicate per example), each with its mixing
variant refused. Tiny ``jax.make_jaxpr`` traces, no mesh (the rule harness of helpers.py)."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import ROWS, Case, case_id, check_case, kinds_of, no, ok
from jax import lax

from fxaccum.analysis import Rows, Stat
from fxaccum.analysis.kinds import Blocked, Top, join, plain

SEQS = jax.ShapeDtypeStruct((ROWS, 5, 3), jnp.float32)  # ROWS sequences of 5 steps
_LSTM = nn.RNN(nn.LSTMCell(8))
_LSTM_VARS = _LSTM.init(jax.random.key(0), np.zeros((1, 5, 3), np.float32))


def _halve(r):  # per example: halve until the norm is at most 1
  return lax.while_loop(lambda c: jnp.sum(c ** 2) > 1.0, lambda c: c * 0.5, r)


def _halvings(r):  # per example: how many halvings, from an unbatched counter
  return lax.while_loop(lambda c: jnp.sum(c[0] ** 2) > 1.0,
                        lambda c: (c[0] * 0.5, c[1] + 1), (r, 0))[1]


def _blocks_mean(x, w):  # lax.map's loss and its gradient
  return jax.value_and_grad(lambda w: jnp.mean(lax.map(
      lambda r: jnp.sum(jnp.tanh(r @ w) ** 2), x, batch_size=4)))(w)


CASES = [
    # flax nn.RNN(nn.LSTMCell): a scan over time, its carry per example
    ok("scan", lambda x, w: _LSTM.apply(_LSTM_VARS, x), batch=SEQS),
    no("scan", lambda x, w: lax.scan(lambda c, r: (0.9 * c + r, c), jnp.zeros(4), x)[1],
       reason="carries state from one to the next"),
    # lax.map with batch_size: a scan over blocks of examples
    ok("reshape", lambda x, w: lax.map(lambda r: jnp.tanh(r @ w), x, batch_size=4)),
    ok("scan", _blocks_mean),
    no("scan", lambda x, w: lax.map(lambda r: r - x.mean(0), x, batch_size=4),
       reason="reads the whole batch"),
    no("scan", lambda x, w: lax.map(lambda r: jnp.sum(r) + 0 * jnp.sum(x), x, batch_size=4)
       .sum(), reason="reads the whole batch"),
    no("scan", lambda x, w: lax.scan(lambda c, b: (c + jnp.sum(x), None), 0.0,
                                     x.reshape(2, 4, 4))[0], reason="reads the whole batch"),
    no("scan", lambda x, w: lax.scan(lambda c, b: (c, b - b.mean(0)), 0.0,
                                     x.reshape(2, 4, 4))[1].reshape(ROWS, 4),
       reason="statistic"),
    no("scan", lambda x, w: lax.scan(lambda c, b: (c + b, None), jnp.zeros((4, 4)),
                                     x.reshape(2, 4, 4))[0], reason="rows of different blocks"),
    no("scan", lambda x, w: lax.scan(lambda c, b: (c * b, None), jnp.ones((4, 4)),
                                     x.reshape(2, 4, 4))[0], reason="from one block to the next"),
    no("reshape", lambda x, w: jnp.sum(x.reshape(2, 4, 4), axis=1),
       reason="splits the batch axis"),
    no("reshape", lambda x, w: x.reshape(2, 4, 4).reshape(4, ROWS),
       reason="splits the batch axis"),
    # a while_loop under vmap: one predicate per example
    ok("while", lambda x, w: jax.vmap(_halve)(x)),
    ok("while", lambda x, w: jax.vmap(_halvings)(x)),
    no("while", lambda x, w: jax.vmap(lambda r: lax.while_loop(
        lambda c: jnp.sum(c ** 2) > jnp.mean(x ** 2), lambda c: c * 0.5, r))(x),
       reason="trip count depends on the batch"),
    no("while", lambda x, w: jax.vmap(_halve)(x - x.mean(0)), reason="trip count"),
]


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_control_flow_rule(case: Case):
  check_case(case)


def test_kinds_through_blocks_and_per_example_loops():
  """Rows come back as rows, sums over blocks are statistics, a per-example counter of a
  vmapped while_loop is rows."""
  assert kinds_of(lambda x, w: lax.map(lambda r: 2 * r, x, batch_size=4)) == (Rows(0),)
  value, grad = kinds_of(_blocks_mean)
  assert isinstance(value, Stat) and isinstance(grad, Stat) and not grad.mixed
  (counter,) = kinds_of(lambda x, w: jax.vmap(_halvings)(x))
  assert counter == Rows(0)


def test_blocked_is_a_plain_top_to_other_rules():
  """Blocked rows are Top to every rule but the reshape and the scan over blocks: a join
  with anything else, or any other op, forgets the blocks."""
  blocked = Blocked("split", 0.0, 0, 4)
  assert isinstance(blocked, Top) and plain(blocked) == Top("split")
  assert join(blocked, blocked) == blocked
  assert type(join(blocked, Top("other"))) is Top
  (out,) = kinds_of(lambda x, w: jnp.tanh(x.reshape(2, 4, 4)))
  assert type(out) is Top
