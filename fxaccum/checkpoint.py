"""Orbax checkpoints of fxaccum states: mid-window resume, re-sharding, mismatch errors.

Orbax's standard handlers do the I/O; this module adds what they lack for accumulation:

* a restore target that takes every array's sharding from a freshly built state (``like``),
  so accumulators come back co-sharded with the params on whatever mesh you restore to;
* a canonical, mesh-independent form of per-device (deferred-sync) accumulators: their sum
  over devices. Restoring on another number of devices puts the sum in the first device's
  slot (the window's mean is unchanged, up to float rounding); restoring on the same number
  of devices uses the raw per-device sums, saved beside it, so the resume is bit-exact;
* a schema-versioned ``fxaccum`` metadata item, checked on restore together with
  ``every_k`` and the tree, with errors that say what differs and how to proceed.

Saves are asynchronous, as in Orbax: :func:`save` returns once the write has started; call
``manager.wait_until_finished()`` before the process exits (:func:`restore` waits for
pending saves itself). Orbax writes each step to a temporary directory and renames it when
complete, so a save interrupted by a crash leaves the previous step as ``latest_step``.

Example:
  >>> import tempfile, jax.numpy as jnp, optax, orbax.checkpoint as ocp, fxaccum
  >>> tx = optax.chain(fxaccum.accumulate(4), optax.adam(1e-3))
  >>> state = fxaccum.TrainState.create(apply_fn=None, params={"w": jnp.ones(3)}, tx=tx)
  >>> state = state.apply_gradients(grads={"w": jnp.ones(3)})   # mid-window
  >>> manager = ocp.CheckpointManager(tempfile.mkdtemp())
  >>> fxaccum.checkpoint.save(manager, 1, state)
  True
  >>> fresh = fxaccum.TrainState.create(apply_fn=None, params={"w": jnp.zeros(3)}, tx=tx)
  >>> restored = fxaccum.checkpoint.restore(manager, 1, fresh)
  >>> int(restored.micro_step), restored.params["w"]
  (1, Array([1., 1., 1.], dtype=float32))
"""

# The implementation: fxaccum.integrations.orbax.
from fxaccum.integrations.orbax import *  # noqa: E402, F403
from fxaccum.integrations.orbax import __all__  # noqa: E402, F401
