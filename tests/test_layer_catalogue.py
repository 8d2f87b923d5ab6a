"""flax's layer catalogue in train mode, at k = 1, 2, 4 on Auto and Explicit 8-device meshes
(issue 40, item 2).

Each layer of ``tests/layer_catalogue.py`` must give the value, gradients and state after the
step of nnx.value_and_grad / jax.value_and_grad called on the k global micro-batches one
after another (the reference there), or be refused with an error naming the layer. The case
table and the reference live in layer_catalogue.py; ``python -m tests.layer_catalogue``
prints the same sweep as a table.
"""

import re

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType
from layer_catalogue import (
  BY_NAME,
  CASES,
  KS,
  MESHES,
  first_line,
  max_rel_error,
  micro,
  nnx_loss,
  reference,
  run_case,
)

RTOL = 1e-5  # float32, relative to each leaf's largest reference magnitude

#: Cases whose scan over time makes them the slowest to compile (one RNN case stays fast).
SLOW = {"nnx.RNN(GRUCell)", "nnx.Bidirectional(RNN(GRUCell))", "nn.RNN(LSTMCell)"}
#: (mesh, k) every case runs at in the suite: the whole batch as one micro-batch, one row
#: per device per micro-batch, and the Explicit mesh in between. The layers that write
#: their own params run at every (mesh, k); `python -m tests.layer_catalogue` sweeps every
#: layer at every (mesh, k) (the table in docs/notes/analysis_coverage.md), in about 6 minutes.
SUITE = {("Auto", 1), ("Auto", 4), ("Explicit", 2)}
EVERYWHERE = {"nnx.WeightNorm", "nnx.SpectralNorm"}


def params():
  for case in CASES:
    for k in KS:
      for mesh in MESHES:
        if case.name not in EVERYWHERE and (mesh, k) not in SUITE:
          continue
        marks = [pytest.mark.slow] if case.name in SLOW else []
        yield pytest.param(case.name, k, mesh, marks=marks, id=f"{case.name}-k{k}-{mesh}")


@pytest.mark.parametrize(("name", "k", "mesh"), list(params()))
def test_layer_matches_the_sequential_reference(name, k, mesh):
  """Value, gradients and the state after the step equal the sequential reference's within
  RTOL; or, for a layer fxaccum cannot reproduce, a ValueError/TypeError naming it."""
  case = BY_NAME[name]
  result = run_case(case, k, MESHES[mesh])
  if mesh == "Explicit" and case.explicit_error is not None:
    # flax's own error on an Explicit mesh, raised without fxaccum too: passed through.
    assert result.error is not None, f"{name} ran on an Explicit mesh: drop explicit_error"
    assert re.search(case.explicit_error, str(result.error)), first_line(result.error, 400)
    return
  pattern = case.refused(k)
  if pattern is not None:
    assert result.error is not None, f"{name} at k={k} ran; expected a refusal"
    assert isinstance(result.error, (ValueError, TypeError)), first_line(result.error, 400)
    assert re.search(pattern, str(result.error)), first_line(result.error, 400)
    return
  if result.error is not None:
    raise result.error
  errors = {"value": result.value, "grads": result.grads, "state": result.state}
  assert max(errors.values()) <= RTOL, (name, k, mesh, errors)


def test_weight_norm_without_threading_the_written_kernel_differs():
  """Negative control: nnx.WeightNorm writes its normalized kernel, which the next
  micro-batch reads. Differentiating every micro-batch at the initial module (the behaviour
  before the written value was threaded) gives other gradients, by far more than RTOL; the
  sequential reference and fxaccum agree."""
  case, k = BY_NAME["nnx.WeightNorm"], 2
  batch = case.data()
  stale = [nnx.to_pure_dict(nnx.grad(nnx_loss)(case.make(k), micro(batch, i, k)))
           for i in range(k)]
  stale = jax.tree.map(lambda *g: np.mean(np.stack(g), axis=0), *stale)
  _, want, _ = reference(case.name, k)
  assert max_rel_error(stale, want) > 100 * RTOL
  assert run_case(case, k, AxisType.Auto).grads <= RTOL


def test_sow_and_rng_counts_follow_the_micro_batches():
  """The state compared above is not trivially equal: k sown values; RNG counts at k
  (Dropout: one mask per call) and 2k (LSTMCell's carry: c and h drawn per call)."""
  k = 4
  for name, path, count in [("sow (nnx.Intermediate)", ("hidden_mean",), k),
                            ("nnx.Dropout", ("body", "layers", 1, "rngs", "count"), k),
                            ("nnx.RNN(LSTMCell)", ("rnn", "rngs", "count"), 2 * k)]:
    state = reference(name, k)[2]
    for key in path:
      state = state[key]
    assert (len(state) if name.startswith("sow") else int(state)) == count, (name, state)
