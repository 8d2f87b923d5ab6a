"""The Orbax integration, public as :mod:`fxaccum.checkpoint` (its docstring says what it
adds to Orbax and how to use it)."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from flax import nnx

from fxaccum import meshes, reductions
from fxaccum.crossstep import accumulation
from fxaccum.integrations import train_states

__all__ = ["SCHEMA_VERSION", "save", "restore", "CheckpointMismatchError"]

#: Version of the saved layout; bumped when AccumulateState or the items change
#: (2: ``AccumulateState.calls``; a TrainState saves every pytree field).
SCHEMA_VERSION = 2
_STATE, _META, _PER_DEVICE = "state", "fxaccum", "fxaccum_per_device"


class CheckpointMismatchError(ValueError):
  """The checkpoint does not fit the state it is restored into (see the message).

  Raised by :func:`restore` for a checkpoint without fxaccum metadata, another schema
  version, another ``every_k`` or another tree; the message names what differs.

  Example:
    >>> import tempfile, jax.numpy as jnp, optax, orbax.checkpoint as ocp, fxaccum
    >>> def make(k):
    ...   tx = optax.chain(fxaccum.accumulate(k), optax.sgd(0.1))
    ...   return fxaccum.TrainState.create(apply_fn=None, params=jnp.zeros(2), tx=tx)
    >>> manager = ocp.CheckpointManager(tempfile.mkdtemp())
    >>> _ = fxaccum.checkpoint.save(manager, 1, make(4))
    >>> fxaccum.checkpoint.restore(manager, 1, make(8))
    Traceback (most recent call last):
      ...
    fxaccum.checkpoint.CheckpointMismatchError: ... saved with accumulate(every_k=4) ...
  """

  __module__ = "fxaccum.checkpoint"  # its public home, as tracebacks should name it


@dataclasses.dataclass
class _View:
  """A state as a plain pytree of arrays, with what save/restore need to know about it."""

  tree: Any
  tx: Any
  params: Any  # the params inside ``tree`` (to read accumulate's config and shardings)
  opt_state: Any = None  # the optimizer state inside ``tree`` (raw pytrees)


def _view(state: Any, model: Any = None, tx: Any = None) -> _View:
  if isinstance(state, train_states.Optimizer):
    if model is None:
      raise TypeError(
          "Saving or restoring an fxaccum.Optimizer needs its model too: "
          "fxaccum.checkpoint.save(manager, step, optimizer, model=model).")
    params = nnx.as_pure(nnx.state(model, state.wrt, graph=state.graph))
    tree: dict[str, Any] = {"model": nnx.as_pure(nnx.state(model)),
                            "optimizer": nnx.as_pure(nnx.state(state))}
    return _View(tree, state.tx, params, tree["optimizer"]["opt_state"])
  if isinstance(state, train_states.TrainState):
    # Every pytree field, also those of a subclass (e.g. batch_stats, dynamic_scale).
    tree = {f.name: getattr(state, f.name) for f in dataclasses.fields(state)
            if f.metadata.get("pytree_node", True)}
    return _View(tree, state.tx, state.params, state.opt_state)
  if _accumulate_states(state):
    if tx is None:
      raise TypeError(
          "This state holds an fxaccum.AccumulateState but is not a TrainState or "
          "Optimizer, so fxaccum cannot see its every_k: pass the optax chain, "
          "save(manager, step, state, tx=tx) and restore(..., tx=tx), and the state as "
          "(params, opt_state) (or a dict with 'params' and 'opt_state').")
    params, opt_state = _params_and_opt_state(state)
    return _View(state, tx, params, opt_state)
  return _View(state, None, None)


def _params_and_opt_state(state: Any) -> tuple[Any, Any]:
  if isinstance(state, dict) and {"params", "opt_state"} <= set(state):
    return state["params"], state["opt_state"]
  if isinstance(state, (tuple, list)) and len(state) == 2:
    return state[0], state[1]
  raise TypeError(
      "A raw state with an fxaccum.AccumulateState must be (params, opt_state) or a dict "
      "with 'params' and 'opt_state', so its optimizer can be read.")


def _accumulate_states(tree: Any) -> list[tuple[str, accumulation.AccumulateState]]:
  is_state = lambda x: isinstance(x, accumulation.AccumulateState)  # noqa: E731
  flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_state)[0]
  return [(jax.tree_util.keystr(path), x) for path, x in flat if is_state(x)]


def _describe(view: _View) -> dict[str, Any]:
  """The ``fxaccum`` metadata item: schema and each AccumulateState's configuration: its
  ``every_k``, or for a schedule the length of the window it is in."""
  accumulators = {}
  config = None
  if view.tx is not None and _accumulate_states(view.tree):
    config = accumulation.probe_config(view.tx, view.opt_state, view.params, {})
  for index, (path, state) in enumerate(_accumulate_states(view.tree)):
    entry = {"index": index,
             # Per-device (deferred-sync) accumulators carry a device axis, also on the weight.
             "devices": int(jnp.shape(state.weight)[0]) if jnp.ndim(state.weight) else None}
    if config is not None and not callable(config.every_k):
      entry["every_k"] = config.every_k
    if config is not None and not isinstance(state.optimizer_step, jax.ShapeDtypeStruct):
      step = int(state.optimizer_step[...])
      entry.update(optimizer_step=step, window=int(config.window(jnp.int32(step))))
    accumulators[path] = entry
  return {"schema": SCHEMA_VERSION, "accumulators": accumulators}


def _canonical(tree: Any, meta: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
  """``tree`` with per-device accumulators summed over devices, and the raw ones apart."""
  raw = {}

  def canon(path, x):
    if isinstance(x, accumulation.AccumulateState):
      cfg = meta["accumulators"].get(jax.tree_util.keystr(path), {})
      if cfg.get("devices"):  # Orbax item keys: plain names, so the position
        raw[str(cfg["index"])] = {"accumulator": x.accumulator, "weight": x.weight}
        if isinstance(x.weight, jax.ShapeDtypeStruct):  # a restore target: shapes only
          summed = jax.eval_shape(_sum_devices, raw[str(cfg["index"])])
        else:
          # One program, awaited: independent collective dispatches back to back can
          # deadlock XLA:CPU's rendezvous on simulated devices.
          summed = jax.block_until_ready(_sum_devices(raw[str(cfg["index"])]))
        return x._replace(**summed)
    return x

  canonical = jax.tree_util.tree_map_with_path(
      canon, tree, is_leaf=lambda x: isinstance(x, accumulation.AccumulateState))
  return canonical, raw


_sum_devices = jax.jit(reductions.sum_slots)


def save(manager: ocp.CheckpointManager, step: int, state: Any, *, model: Any = None,
         tx: Any = None, overwrite: bool = False, force: bool = False) -> bool:
  """Saves ``state`` at ``step`` with Orbax's standard handlers (asynchronously).

  Args:
    manager: an ``orbax.checkpoint.CheckpointManager`` (absolute directory).
    step: the checkpoint's step number (e.g. the number of calls so far, so mid-window
      checkpoints get distinct numbers).
    state: an ``fxaccum.TrainState``, an ``fxaccum.Optimizer`` (pass ``model=``) or any
      pytree of arrays (e.g. an in-step ``(params, opt_state)``). ``every_k`` (for a
      schedule: the length of the current window) is recorded and checked on restore.
    model: the NNX model of an ``fxaccum.Optimizer``.
    tx: the optax chain of a raw ``(params, opt_state)`` state that holds an
      ``fxaccum.AccumulateState`` (required there, to record ``every_k``).
    overwrite: replace an existing checkpoint at ``step``; without it saving an existing
      step is an error (Orbax would skip it silently).
    force: passed to ``manager.save``.

  Returns:
    Whether Orbax started a save (``manager.save``'s result).

  Example:
    >>> import tempfile, jax.numpy as jnp, optax, orbax.checkpoint as ocp, fxaccum
    >>> tx = optax.chain(fxaccum.accumulate(2), optax.sgd(0.1))
    >>> state = fxaccum.TrainState.create(apply_fn=None, params=jnp.zeros(2), tx=tx)
    >>> manager = ocp.CheckpointManager(tempfile.mkdtemp())
    >>> for call in range(3):   # numbered by call: mid-window checkpoints stay distinct
    ...   state = state.apply_gradients(grads=jnp.ones(2))
    ...   _ = fxaccum.checkpoint.save(manager, call + 1, state)
    >>> manager.wait_until_finished()   # saves are asynchronous
    >>> manager.all_steps()
    [1, 2, 3]
  """
  if not manager.directory.is_absolute():
    raise ValueError(
        f"The checkpoint directory {str(manager.directory)!r} is relative; Orbax needs an "
        "absolute path (a relative one fails later, in its background thread). Build the "
        "manager with an absolute path, e.g. ocp.CheckpointManager(os.path.abspath(dir)).")
  if step in manager.all_steps():
    if not overwrite:
      raise ValueError(
          f"Step {step} is already saved in {manager.directory}; Orbax would skip this save "
          "and keep the old one. Save under a new step number, or pass overwrite=True.")
    manager.wait_until_finished()
    manager.delete(step)
  view = _view(state, model, tx)
  meta = _describe(view)
  canonical, raw = _canonical(view.tree, meta)
  items = {_STATE: ocp.args.StandardSave(_key_data(canonical)),
           _META: ocp.args.JsonSave(meta)}
  if raw:
    items[_PER_DEVICE] = ocp.args.StandardSave(raw)
  return manager.save(step, args=ocp.args.Composite(**items), force=force)


def restore(manager: ocp.CheckpointManager, step: int | None, like: Any, *,
            model: Any = None, tx: Any = None, mesh: Any = None) -> Any:
  """Restores step ``step`` (``None``: the latest) onto the layout of ``like``.

  Args:
    manager: the ``CheckpointManager`` the state was saved with.
    step: the step to restore, or ``None`` for ``manager.latest_step()``.
    like: a freshly built state of the same kind as the saved one (or its
      ``jax.eval_shape``): an ``fxaccum.TrainState``, an ``fxaccum.Optimizer`` (with
      ``model=``; both are updated in place) or a raw pytree. Every array is restored
      with ``like``'s sharding; accumulators take their params' sharding.
    model: the NNX model of an ``fxaccum.Optimizer``.
    tx: the optax chain of a raw ``(params, opt_state)`` target (as for :func:`save`).
    mesh: a concrete mesh to rebuild shardings that are on an abstract mesh (e.g. from
      ``nnx.eval_shape`` under ``jax.set_mesh``); default: the ``jax.set_mesh`` mesh.

  Returns:
    The restored state: a ``TrainState`` or raw pytree, or ``like`` itself (updated in
    place, together with ``model``) for an ``fxaccum.Optimizer``.

  Raises:
    FileNotFoundError: no such step (the message lists the saved ones), an incomplete
      step (a save that did not finish), or no checkpoint at all in the directory.
    CheckpointMismatchError: no fxaccum metadata, another schema version, another
      ``every_k`` or another tree; the message names what differs.

  Example:
    >>> import tempfile, jax, jax.numpy as jnp, optax, orbax.checkpoint as ocp, fxaccum
    >>> tx = optax.chain(fxaccum.accumulate(4), optax.adam(1e-3))
    >>> make = lambda: fxaccum.TrainState.create(apply_fn=None, params=jnp.zeros(2), tx=tx)
    >>> manager = ocp.CheckpointManager(tempfile.mkdtemp())
    >>> _ = fxaccum.checkpoint.save(manager, 1, make().apply_gradients(grads=jnp.ones(2)))
    >>> like = jax.eval_shape(make)   # shapes and shardings only: nothing is allocated
    >>> restored = fxaccum.checkpoint.restore(manager, None, like)   # None: the latest step
    >>> int(restored.micro_step), restored.opt_state[0].accumulator
    (1, Array([1., 1.], dtype=float32))
  """
  manager.wait_until_finished()
  step = _existing_step(manager, step)
  saved_meta = None
  if (manager.directory / str(step) / _META).exists():
    saved_meta = manager.restore(step, args=ocp.args.Composite(
        **{_META: ocp.args.JsonRestore()}))[_META]
  view = _view(like, model, tx)
  meta = _describe(view)
  _check(saved_meta, meta, manager, view, step)

  canonical_like, raw_like = _canonical(view.tree, meta)
  target = _abstract(_key_data(canonical_like), view.params, mesh)
  restore_items = {_STATE: ocp.args.StandardRestore(target)}
  assert saved_meta is not None  # _check raised otherwise
  same_devices = {str(cfg["index"]) for key, cfg in meta["accumulators"].items()
                  if cfg.get("devices")
                  and saved_meta["accumulators"][key].get("devices") == cfg["devices"]}
  if raw_like and same_devices:
    restore_items[_PER_DEVICE] = ocp.args.StandardRestore(
        _abstract({k: v for k, v in raw_like.items() if k in same_devices}, None, mesh))
  out = manager.restore(step, args=ocp.args.Composite(**restore_items))
  restored = _keys_like(out[_STATE], canonical_like)
  tree = _expand(restored, view.tree, out.get(_PER_DEVICE) or {}, meta)
  return _rebuild(like, model, tree)


def _existing_step(manager: ocp.CheckpointManager, step: int | None) -> int:
  """``step`` (None: the latest) if the directory holds it complete; else an error that
  says what is there."""
  steps = manager.all_steps()
  if not steps:
    raise FileNotFoundError(
        f"No checkpoint in {manager.directory}: it holds no complete step. Check the path "
        "(ocp.CheckpointManager creates a missing directory; construct it with "
        "options=ocp.CheckpointManagerOptions(create=False) to be told instead).")
  if step is None:
    return manager.latest_step()
  if step not in steps:
    partial = (manager.directory / str(step)).exists()
    why = ("is incomplete: a save that did not finish (e.g. killed), or a step Orbax was "
           "deleting" if partial else "does not exist")
    raise FileNotFoundError(
        f"Checkpoint step {step} in {manager.directory} {why}. Saved steps: "
        f"{_listing(set(steps), 20)}; restore one of them (None: the latest).")
  return step


def _check(saved_meta, meta, manager, view, step) -> None:
  if saved_meta is None:
    raise CheckpointMismatchError(
        f"Checkpoint step {step} has no fxaccum metadata: it was not written by "
        "fxaccum.checkpoint.save. Restore its arrays with Orbax directly "
        "(manager.restore(step)) and copy the params into a fresh state.")
  if saved_meta.get("schema") != SCHEMA_VERSION:
    raise CheckpointMismatchError(
        f"Checkpoint step {step} has fxaccum schema {saved_meta.get('schema')}, this fxaccum "
        f"reads schema {SCHEMA_VERSION}. Restore it with the fxaccum version that wrote it, "
        "or restore only the params with Orbax and start a new accumulation window.")
  saved_acc, acc = saved_meta.get("accumulators", {}), meta["accumulators"]
  if set(saved_acc) != set(acc):
    raise CheckpointMismatchError(
        f"Checkpoint step {step} holds AccumulateStates at {sorted(saved_acc)}, the target at "
        f"{sorted(acc)}. Build the target with the same optax chain as the saved state.")
  config = (accumulation.probe_config(view.tx, view.opt_state, view.params, {})
            if view.tx is not None and acc else None)
  for key in acc:
    saved = saved_acc[key]
    if config is None or "window" not in saved:
      continue
    # The window the saved state is in, and the target's at that optimizer step.
    window = int(config.window(jnp.int32(saved["optimizer_step"])))
    if window != saved["window"]:
      what = (f"accumulate(every_k={saved['every_k']})" if "every_k" in saved else
              f"an every_k schedule giving {saved['window']} calls at optimizer step "
              f"{saved['optimizer_step']}")
      target = (f"every_k={config.every_k}" if not callable(config.every_k) else
                f"a schedule giving {window} calls there")
      raise CheckpointMismatchError(
          f"Checkpoint step {step} was saved with {what} at {key}; the target uses "
          f"{target}. Restore with the same every_k (or schedule), or restore at a window "
          "boundary (micro_step 0) after rebuilding the optimizer state.")
  # Read from the files: a fresh manager has no handlers registered to report it.
  saved_tree = ocp.StandardCheckpointHandler().metadata(
      manager.directory / str(step) / _STATE).tree
  saved_paths = _paths_and_shapes(saved_tree)
  target_paths = _paths_and_shapes(_key_data(_canonical(view.tree, meta)[0]))
  if saved_paths != target_paths:
    raise CheckpointMismatchError(
        f"Checkpoint step {step} and the target differ: only in the checkpoint: "
        f"{_listing(set(saved_paths) - set(target_paths))}; only in the target: "
        f"{_listing(set(target_paths) - set(saved_paths))} (path, shape). Build the target "
        "like the saved state (same model, params and optax chain).")


def _listing(items: set, shown: int = 5) -> str:
  ordered = sorted(items)
  more = f" and {len(ordered) - shown} more" if len(ordered) > shown else ""
  return f"{ordered[:shown]}{more}"


def _paths_and_shapes(tree: Any) -> set[tuple[str, tuple[int, ...]]]:
  leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
  out = set()
  for path, leaf in leaves:
    # Orbax's metadata spells sequence keys like dict keys; compare on key names only.
    names = tuple(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k))))
                  for k in path)
    out.add((".".join(names), tuple(getattr(leaf, "shape", jnp.shape(leaf)))))
  return out


def _sharding_of(leaf: Any, mesh: Any, default: Any = None) -> Any:
  sharding = getattr(leaf, "sharding", None) or default
  if isinstance(sharding, jax.sharding.NamedSharding) and not isinstance(
      sharding.mesh, jax.sharding.Mesh):
    concrete = mesh if mesh is not None else jax.sharding.get_mesh()
    if not getattr(concrete, "axis_names", None):
      raise ValueError(
          "The restore target has shardings on an abstract mesh (e.g. from nnx.eval_shape "
          "under jax.set_mesh); pass mesh= the concrete mesh to restore onto.")
    sharding = jax.sharding.NamedSharding(concrete, sharding.spec)
  return sharding


def _abstract(tree: Any, params: Any, mesh: Any) -> Any:
  """ShapeDtypeStructs with ``tree``'s shardings; accumulator leaves take the params'."""
  # Leaves without a sharding (e.g. TrainState's Python-int step) are replicated on the
  # target's mesh; leaving them to Orbax would restore the saved topology.
  target_mesh = mesh or meshes.find_mesh(jax.tree.leaves(tree))
  default = jax.sharding.SingleDeviceSharding(jax.devices()[0]) if target_mesh is None \
      else jax.sharding.NamedSharding(target_mesh, jax.sharding.PartitionSpec())
  param_shardings = None if params is None else jax.tree.map(
      lambda p: _sharding_of(p, mesh, default), params)

  def leaf(x, sharding=None):
    return jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x),
                                sharding=sharding or _sharding_of(x, mesh, default))

  def node(x):
    if isinstance(x, accumulation.AccumulateState):
      acc = x.accumulator
      if param_shardings is not None and jax.tree.structure(acc) == jax.tree.structure(
          param_shardings):
        acc = jax.tree.map(leaf, acc, param_shardings)  # co-sharded with the params
      else:
        acc = jax.tree.map(leaf, acc)
      return x._replace(accumulator=acc, **{f: leaf(getattr(x, f)) for f in
                                            ("micro_step", "optimizer_step", "weight",
                                             "skipped", "calls")})
    return leaf(x)

  return jax.tree.map(node, tree, is_leaf=lambda x: isinstance(x, accumulation.AccumulateState))


def _expand(canonical: Any, like_tree: Any, raw: dict[str, Any], meta: dict[str, Any]) -> Any:
  """Back from canonical form to ``like_tree``'s layout (per-device slots where needed)."""

  def expand(path, restored, like):
    if not isinstance(like, accumulation.AccumulateState):
      return restored
    if jnp.shape(like.weight) == ():  # not per-device
      return restored
    key = str(meta["accumulators"][jax.tree_util.keystr(path)]["index"])
    if key in raw:
      return restored._replace(accumulator=raw[key]["accumulator"], weight=raw[key]["weight"])

    # The sum in the first device's slot, zeros elsewhere: one program, placed like `like`.
    targets = (like.accumulator, like.weight)
    slots = jax.jit(
        lambda totals: jax.tree.map(
            lambda total, slot: jnp.zeros(slot.shape, slot.dtype).at[0].set(total), totals,
            targets),
        out_shardings=jax.tree.map(lambda slot: slot.sharding, targets))
    accumulator, weight = jax.block_until_ready(slots((restored.accumulator, restored.weight)))
    return restored._replace(accumulator=accumulator, weight=weight)

  is_state = lambda x: isinstance(x, accumulation.AccumulateState)  # noqa: E731
  return jax.tree_util.tree_map_with_path(expand, canonical, like_tree, is_leaf=is_state)


def _rebuild(like: Any, model: Any, tree: Any) -> Any:
  if isinstance(like, train_states.Optimizer):
    nnx.update(model, tree["model"])
    nnx.update(like, tree["optimizer"])
    return like
  if isinstance(like, train_states.TrainState):
    return like.replace(**tree)
  return tree


def _is_key(x: Any) -> bool:
  return jax.dtypes.issubdtype(getattr(x, "dtype", None), jax.dtypes.prng_key)


def _key_data(tree: Any) -> Any:
  """``tree`` with typed PRNG keys (e.g. NNX ``Rngs``) as their raw data, which Orbax
  stores; abstract keys become abstract data."""
  def data(x):
    if not _is_key(x):
      return x
    if isinstance(x, jax.ShapeDtypeStruct):
      shape = jax.eval_shape(jax.random.key_data, x).shape
      return jax.ShapeDtypeStruct(shape, jnp.uint32, sharding=x.sharding)
    return jax.random.key_data(x)
  return jax.tree.map(data, tree)


def _keys_like(tree: Any, like: Any) -> Any:
  """Restored raw key data back into typed keys, with the implementation of ``like``'s."""
  def key(x, like_leaf):
    if not _is_key(like_leaf):
      return x
    impl = (jax.random.key_impl(like_leaf) if isinstance(like_leaf, jax.Array)
            else like_leaf.dtype._impl)  # an abstract key: its dtype names the impl
    return jax.random.wrap_key_data(x, impl=impl)
  return jax.tree.map(key, tree, like)

