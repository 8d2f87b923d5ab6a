"""Which mesh axes are data axes, local accumulation, and the single reduction.

In its per-device view (:mod:`fxaccum.instep.paths`), fxaccum accumulates gradients inside a
``jax.shard_map`` that is manual over the data axes only (every other mesh axis, e.g. a
tensor- or sequence-parallel one, stays under the compiler's control). Inside, replicated
params are cast to "varying" so that ``jax.grad`` yields the local partial gradient
instead of inserting an all-reduce per micro-batch, and the one data-axis reduction is
issued explicitly after the loop. XLA:CPU never hoists an all-reduce out of a loop, so
relying on the compiler is not an option.

Layout detection (``data_axes=None``):

* The mesh is the ``jax.set_mesh`` context mesh, else the mesh of the arguments'
  ``NamedSharding`` (concrete arrays, or traced values on an ``Explicit`` mesh).
* The data axes are the mesh axes the batch's axis 0 is sharded over, read from the
  batch's sharding where JAX exposes it: concrete arrays (eager calls) and ``Explicit``
  mesh axes (sharding in types). Inside ``jax.jit`` JAX does not expose the sharding of
  ``Auto`` axes while tracing; for those, the conventional data-axis names
  ``replica``, ``data``, ``batch``, ``dp`` and ``fsdp`` present in the mesh are taken.
  Pass ``data_axes=`` to override.
* A differentiated leaf is *FSDP-sharded* if its sharding names a data axis (read the same
  way); inside ``jax.jit`` on an ``Auto`` mesh that is not visible, and the caller's hints
  (``param_shardings=``, flax NNX sharding metadata: :func:`param_hints`) are used; without
  them such leaves are treated as replicated over the data axes (gathered once per step).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

__all__ = [
    "CONVENTIONAL_DATA_AXES", "DataDims", "Layout", "as_data_axes", "axes_of_type", "conform",
    "explicit", "find_mesh", "known_spec", "missing_axes", "layout_of", "linen_rules_without",
    "linen_rules_without_manual_axes", "named_axes", "shard_map_keeping_axes", "spec_axes",
    "spec_entry", "tracks_varying", "vary", "varying_axes",
]

#: Auto mesh axes assumed to carry the batch when JAX cannot show its sharding.
CONVENTIONAL_DATA_AXES = ("replica", "data", "batch", "dp", "fsdp")

# (dimension, data axes it is sharded over) for every sharded dimension of a leaf.
DataDims = tuple[tuple[int, tuple[str, ...]], ...]


@dataclasses.dataclass(frozen=True)
class Layout:
  """Where the batch and the differentiated leaves live, as fxaccum sees them.

  Attributes:
    mesh: the mesh (concrete or abstract), or None when there is none.
    data_axes: the mesh axes the batch's axis 0 is split over; ``()`` means no
      data-parallel reduction is fxaccum's to place (single device, or no data axes).
    param_dims: for each differentiated leaf (flattened), its dimensions sharded over
      data axes; ``()`` for a leaf replicated over the data axes.
    param_specs: for each differentiated leaf, its full PartitionSpec where JAX does not
      show it but the caller did (``param_shardings=``, NNX metadata); else None.
    device_blocker: why no region manual over the data axes can hold the params (a
      dimension sharded over data and other axes together), or None.
    manual: the data axes are already manual: fxaccum runs inside the caller's
      ``shard_map``, where each device's loss is its shard of a global loss.
  """

  mesh: Any
  data_axes: tuple[str, ...]
  param_dims: tuple[DataDims, ...]
  param_specs: tuple[P | None, ...] = ()
  device_blocker: str | None = None
  manual: bool = False

  @property
  def data_devices(self) -> int:
    """Number of devices the batch fxaccum sees is split over (1 inside the caller's
    shard_map: there it sees its device's rows)."""
    if not self.data_axes or self.manual:
      return 1
    return math.prod(self.mesh.shape[a] for a in self.data_axes)

  def param_spec(self, index: int) -> P:
    """The ``shard_map`` in/out spec (data axes only) of differentiated leaf ``index``."""
    dims = dict(self.param_dims[index])
    if not dims:
      return P()
    entries: list[Any] = [None] * (max(dims) + 1)
    for dim, axes in dims.items():
      entries[dim] = spec_entry(axes)
    return P(*entries)


def _named_sharding(leaf: Any) -> tuple[NamedSharding | None, bool]:
  """The leaf's NamedSharding and whether its Auto axes are known (concrete arrays)."""
  if isinstance(leaf, jax.Array) and not isinstance(leaf, jax.core.Tracer):
    sharding = getattr(leaf, "sharding", None)
    return (sharding if isinstance(sharding, NamedSharding) else None), True
  try:
    sharding = jax.typeof(leaf).sharding
  except (TypeError, AttributeError):
    return None, False
  if isinstance(sharding, NamedSharding) and sharding.mesh.axis_names:
    return sharding, False
  return None, False


def axes_of_type(mesh: Any, axis_type: AxisType) -> set[str]:
  """The axes of ``mesh`` of type ``axis_type`` (``Explicit``, ``Manual``, ``Auto``)."""
  return {a for a, t in zip(mesh.axis_names, mesh.axis_types, strict=True) if t == axis_type}


def explicit(mesh: Any, axes: Sequence[str]) -> bool:
  """Whether ``axes`` are some axes of ``mesh``, all of them ``Explicit``."""
  return bool(axes) and set(axes) <= axes_of_type(mesh, AxisType.Explicit)


def _known_axes(sharding: NamedSharding, concrete: bool) -> set[str]:
  """Mesh axes whose sharding the spec really describes."""
  mesh = sharding.mesh
  return set(mesh.axis_names) if concrete else axes_of_type(mesh, AxisType.Explicit)


def known_spec(leaf: Any) -> tuple[Any, ...]:
  """The leaf's PartitionSpec entries, one per dimension, on the mesh axes whose sharding
  is known (any axis of a concrete array; Explicit axes of a traced one); None elsewhere."""
  ndim = len(jax.typeof(leaf).shape)
  sharding, concrete = _named_sharding(leaf)
  if sharding is None:
    return (None,) * ndim
  known = _known_axes(sharding, concrete)
  entries = []
  for entry in [*sharding.spec] + [None] * (ndim - len(sharding.spec)):
    axes = tuple(a for a in spec_axes(entry) if a in known)
    entries.append(spec_entry(axes))
  return tuple(entries)


def spec_axes(entry: Any) -> tuple[str, ...]:
  """The mesh axes of one PartitionSpec entry (None, a name or a tuple of names)."""
  if entry is None:
    return ()
  return tuple(entry) if isinstance(entry, tuple) else (entry,)


def named_axes(spec: Any) -> set[str]:
  """The mesh axes a PartitionSpec (or its entries) names."""
  return {a for entry in spec for a in spec_axes(entry)}


def spec_entry(axes: Sequence[str]) -> Any:
  """The PartitionSpec entry over ``axes`` (the inverse of :func:`spec_axes`)."""
  return None if not axes else axes[0] if len(axes) == 1 else tuple(axes)


def find_mesh(leaves: Sequence[Any]) -> Any:
  """The ``jax.set_mesh`` context mesh, else the mesh of the first leaf with a NamedSharding."""
  context = jax.sharding.get_abstract_mesh()
  if context.axis_names:
    return context
  for leaf in leaves:
    sharding, _ = _named_sharding(leaf)
    if sharding is not None:
      return sharding.mesh
  return None


def manual_axes() -> set[str]:
  """The mesh axes that are manual where this is traced (inside a ``shard_map``)."""
  mesh = jax.sharding.get_abstract_mesh()
  return _manual_axes(mesh) if mesh.axis_names else set()


def linen_rules_without_manual_axes() -> contextlib.AbstractContextManager[None]:
  """flax linen's logical axis rules with the axes that are manual here mapped to nothing.

  A linen param made with ``nn.with_logical_partitioning`` constrains its sharding on every
  ``apply`` (flax checks the param against its init function, under the active
  ``nn_partitioning.axis_rules``), and ``nn.with_logical_constraint`` constrains an
  activation (MaxText: ``activation_batch`` -> the data axes). Inside the per-device
  region the data axes are manual and a constraint naming them is an error, although the
  per-device value is whole there.
  """
  return linen_rules_without(manual_axes())


@contextlib.contextmanager
def linen_rules_without(axes: Iterable[str]) -> Iterator[None]:
  """flax linen's logical axis rules with ``axes`` mapped to nothing: as the per-device
  region sees them where ``axes`` are its manual data axes (see
  :func:`linen_rules_without_manual_axes`). (Without flax linen loaded there are no such
  rules: fxaccum loads no flax of its own.)"""
  if "flax.linen" not in sys.modules:
    yield
    return
  from flax.linen import partitioning as nn_partitioning  # loaded already

  rules = nn_partitioning.get_axis_rules()
  manual = set(axes)
  if not rules or not manual:
    yield
    return

  def kept(target):
    names = (target,) if isinstance(target, str) else tuple(target or ())
    names = tuple(a for a in names if a not in manual)
    return names[0] if len(names) == 1 else names or None

  with nn_partitioning.axis_rules(tuple((name, kept(target)) for name, target in rules)):
    yield


def _batch_varying(batch_leaves: Sequence[Any]) -> set[str]:
  """The manual axes some batch leaf varies over (inside a shard_map that checks it)."""
  return set().union(*(varying_axes(leaf) for leaf in batch_leaves)) if batch_leaves else set()


def _manual_axes(mesh: Any) -> set[str]:
  return axes_of_type(mesh, AxisType.Manual)


def as_data_axes(data_axes: Any, who: str = "data_axes") -> tuple[str, ...] | None:
  """``data_axes`` as every entry point takes it: ``None`` (infer), one mesh axis name, or
  a sequence of distinct names (``()``: none), normalized to a tuple."""
  if data_axes is None:
    return None
  if isinstance(data_axes, str):
    return (data_axes,)
  if not isinstance(data_axes, (tuple, list)) or not all(isinstance(a, str) for a in data_axes):
    raise TypeError(
        f"{who} must be a mesh axis name or a tuple of them (or () for none), got "
        f"{data_axes!r}.")
  if len(set(data_axes)) != len(data_axes):
    raise ValueError(f"{who} names an axis twice: {tuple(data_axes)}.")
  return tuple(data_axes)


def missing_axes(mesh: Any, axes: Sequence[str]) -> list[str]:
  """The names in ``axes`` that ``mesh`` does not have."""
  return [a for a in axes if a not in mesh.axis_names]


def layout_of(
    diff_leaves: Sequence[Any],
    batch_leaves: Sequence[Any],
    other_leaves: Sequence[Any],
    data_axes: tuple[str, ...] | None,
    hints: Sequence[P | None] = (),
) -> Layout:
  """Works out the :class:`Layout` of a call; see the module docstring for the rules.

  ``hints`` give, per differentiated leaf, a PartitionSpec to use where the leaf's own
  sharding is not visible (``Auto`` mesh axes inside ``jax.jit``).
  """
  hints = tuple(hints) or (None,) * len(diff_leaves)
  unsharded = tuple(() for _ in diff_leaves)
  mesh = find_mesh([*batch_leaves, *diff_leaves, *other_leaves])
  if mesh is None:
    if data_axes:
      raise ValueError(
          f"data_axes={data_axes} was given but no mesh was found: call inside "
          "`with jax.set_mesh(mesh):` or pass arrays placed with a NamedSharding."
      )
    return Layout(None, (), unsharded, hints)
  manual = _manual_axes(mesh)
  if data_axes is None:
    axes = _inferred_axes(mesh, batch_leaves, manual)
  elif _given_axes_are_manual(mesh, data_axes, manual):
    return Layout(mesh, tuple(data_axes), unsharded, hints, manual=True)
  else:
    axes = tuple(data_axes)
  dims_and_problems = [_data_dims(leaf, axes, hint)
                       for leaf, hint in zip(diff_leaves, hints, strict=True)]
  blocker = next((problem for _, problem in dims_and_problems if problem), None)
  param_dims = tuple(dims for dims, _ in dims_and_problems)
  return Layout(mesh if axes else None, axes, param_dims, hints, blocker)


def _given_axes_are_manual(mesh: Any, data_axes: tuple[str, ...], manual: set[str]) -> bool:
  """Whether the given data axes are manual here (all of them); errors name the fix."""
  unknown = missing_axes(mesh, data_axes)
  if unknown:
    raise ValueError(
        f"data_axes names {unknown}, which the mesh does not have; its axes are "
        f"{tuple(mesh.axis_names)}. Pass data_axes=None to infer them from the batch's "
        "sharding, or name existing axes."
    )
  inside = [a for a in data_axes if a in manual]
  if inside and len(inside) != len(data_axes):
    raise ValueError(
        f"data_axes {tuple(data_axes)} mixes axes that are manual here ({inside}: "
        "fxaccum is called inside a shard_map over them) with axes that are not; name "
        "either the manual axes the batch is split over, or none of them.")
  return bool(inside)


def _inferred_axes(mesh: Any, batch_leaves: Sequence[Any], manual: set[str]) -> tuple[str, ...]:
  """The data axes read from the batch (``data_axes=None``); inside a shard_map manual
  over axes the batch may be split over, the caller must say how losses combine."""
  if manual and not tracks_varying(tuple(a for a in mesh.axis_names if a in manual)):
    names = tuple(a for a in mesh.axis_names if a in manual)
    raise ValueError(
        f"fxaccum is called inside a shard_map that is manual over {names} with "
        "check_vma=False (or inside jax.pmap, which is one), so no value says whether "
        "the batch is split over those axes or what each device's loss is a part of. "
        "Say it: data_axes=(the axes the batch is split over) makes each device's loss "
        "its shard of one global loss (fxaccum sums totals and counts over those axes "
        "and reduces the gradients once, after the loop), data_axes=() keeps every "
        "device's result its own, as jax.value_and_grad there does (e.g. a pmap train "
        "step that then takes lax.pmean of the gradients).")
  varying = _batch_varying(batch_leaves) & manual
  if varying:
    names = tuple(a for a in mesh.axis_names if a in varying)
    raise ValueError(
        f"fxaccum is called inside a shard_map that is manual over {names}, and the batch "
        f"is split over them. Say how the per-device losses combine: "
        f"data_axes={names} makes each device's loss its shard of one global loss "
        "(return this device's fxaccum.Weighted(total, count); fxaccum sums totals and "
        "counts over those axes and reduces the gradients once, after the loop), "
        "data_axes=() keeps every device's result its own.")
  return infer_data_axes(mesh, batch_leaves, manual)


def param_hints(diff: Sequence[Any], param_shardings: Sequence[Any] | None) -> tuple[
    P | None, ...]:
  """Per flattened differentiated leaf: the PartitionSpec the caller gave for it.

  From ``param_shardings`` (one tree, or tree prefix, of PartitionSpec / NamedSharding /
  None per differentiated argument) or else from flax NNX ``Variable`` sharding metadata
  (``out_sharding``, with the active logical axis rules applied); None where neither says.
  """
  if param_shardings is not None:
    try:
      full = jax.tree.broadcast(tuple(param_shardings), tuple(diff),
                                is_leaf=lambda x: x is None or _is_spec(x))
    except (ValueError, TypeError) as err:
      raise ValueError(
          "param_shardings must have the structure of the differentiated argument(s) (a "
          "tuple of them for a tuple argnums), or be a prefix of it, with PartitionSpec, "
          f"NamedSharding or None leaves: {err}") from None
    specs = jax.tree.structure(tuple(diff)).flatten_up_to(full)  # type: ignore[attr-defined]
    return tuple(s.spec if isinstance(s, NamedSharding) else s for s in specs)
  nnx = sys.modules.get("flax.nnx")  # NNX Variables exist only where flax NNX is loaded
  if nnx is None:
    return (None,) * len(jax.tree.leaves(tuple(diff)))
  hints: list[P | None] = []
  for node in jax.tree.leaves(tuple(diff), is_leaf=lambda x: isinstance(x, nnx.Variable)):
    spec = None
    if isinstance(node, nnx.Variable) and node.get_metadata().get("out_sharding"):
      spec = nnx.get_partition_spec(node).get_value()
    hints.extend([spec] * len(jax.tree.leaves(node)))
  return tuple(hints)


def _is_spec(x: Any) -> bool:
  return isinstance(x, (P, NamedSharding))


def infer_data_axes(mesh: Any, batch_leaves: Sequence[Any], manual: set[str]) -> tuple[str, ...]:
  found: set[str] = set()
  unknown: set[str] = set()
  for leaf in batch_leaves:
    sharding, concrete = _named_sharding(leaf)
    if sharding is None:
      unknown |= set(mesh.axis_names)
      continue
    known = _known_axes(sharding, concrete)
    spec = sharding.spec
    if len(spec):
      found |= set(spec_axes(spec[0])) & known
    unknown |= set(mesh.axis_names) - known
  unknown -= found | manual
  found |= {a for a in CONVENTIONAL_DATA_AXES if a in unknown}
  return tuple(a for a in mesh.axis_names if a in found)


def _data_dims(leaf: Any, data_axes: tuple[str, ...],
               hint: P | None = None) -> tuple[DataDims, str | None]:
  """The leaf's data-sharded dimensions, and why it cannot enter a data-manual region."""
  if not data_axes:
    return (), None
  sharding, concrete = _named_sharding(leaf)
  if sharding is not None and set(data_axes) <= _known_axes(sharding, concrete):
    spec = sharding.spec
  elif hint is not None:
    spec = hint
  elif sharding is not None:
    spec = sharding.spec
  else:
    return (), None
  dims = []
  for dim, entry in enumerate(spec):
    axes = spec_axes(entry)
    on_data = tuple(a for a in axes if a in data_axes)
    if on_data and len(on_data) != len(axes):
      return (), (
          f"a differentiated leaf of shape {jax.typeof(leaf).shape} is sharded over {axes} on "
          f"dimension {dim}, mixing data axes {on_data} with other axes")
    if on_data:
      dims.append((dim, on_data))
  return tuple(dims), None


def conform(x: Any, spec: P, data_axes: tuple[str, ...]) -> Any:
  """Reshards a leaf typed on an Explicit mesh so its data-axis sharding is ``spec``.

  ``shard_map`` requires its in_specs to equal the argument types on Explicit axes (e.g.
  a batch typed replicated when ``data_axes`` says it is split); non-data axes are kept.
  Leaves without Explicit data axes are returned unchanged.
  """
  sharding, _ = _named_sharding(x)
  # An array placed on one device (e.g. jnp.stack's result) has no mesh in its type; on
  # the context mesh it is typed replicated.
  mesh = sharding.mesh if sharding is not None else jax.sharding.get_abstract_mesh()
  if not mesh.axis_names:
    return x
  if not axes_of_type(mesh, AxisType.Explicit) & set(data_axes):
    return x
  ndim = len(jax.typeof(x).shape)
  have = sharding.spec if sharding is not None else P()
  current = [*have] + [None] * (ndim - len(have))
  wanted = [*spec] + [None] * (ndim - len(spec))
  entries = []
  for have, want in zip(current, wanted, strict=True):
    axes = spec_axes(want) + tuple(a for a in spec_axes(have) if a not in data_axes)
    entries.append(spec_entry(axes))
  if tuple(entries) == tuple(current):
    return x
  return jax.sharding.reshard(x, P(*entries))


def varying_axes(x: Any) -> frozenset[str]:
  """The manual axes ``x`` (a value or an abstract value) varies over inside a shard_map."""
  aval = x if isinstance(x, jax.core.ShapedArray) else jax.typeof(x)
  return frozenset(aval.manual_axis_type.varying)


def tracks_varying(axes: tuple[str, ...]) -> bool:
  """Whether the enclosing shard_map types values as varying over ``axes`` (its
  ``check_vma=True``); with ``check_vma=False`` no value says what it varies over."""
  return bool(axes) and bool(varying_axes(lax.pcast(jnp.zeros(()), axes, to="varying")))


def vary(x: Any, axes: tuple[str, ...]) -> Any:
  """Casts every leaf to vary over ``axes`` (a no-op for axes it already varies over).

  Inside ``shard_map``, ``jax.grad`` with respect to an *invariant* (replicated) value
  sums the cotangent over the devices, i.e. an all-reduce per micro-batch; with respect
  to a *varying* one it returns the local partial gradient.
  """
  if not axes:
    return x

  def cast(leaf):
    missing = tuple(a for a in axes if a not in varying_axes(leaf))
    return lax.pcast(leaf, missing, to="varying") if missing else leaf

  return jax.tree.map(cast, x)


def _entries(x: Any) -> list[Any]:
  """The typed PartitionSpec entries of ``x``, one per dimension."""
  aval = jax.typeof(x)
  spec = getattr(getattr(aval, "sharding", None), "spec", None)
  partitions = list(spec.partitions) if spec is not None else []
  return partitions + [None] * (len(aval.shape) - len(partitions))


def _only(entries: Sequence[Any], keep: Callable[[str], bool]) -> P:
  out = []
  for entry in entries:
    axes = tuple(a for a in spec_axes(entry) if keep(a))
    out.append(spec_entry(axes))
  return P(*out)


def _abstract(mesh: Any) -> Any:
  context = jax.sharding.get_abstract_mesh()
  return context if context.axis_names else getattr(mesh, "abstract_mesh", mesh)


def kept_axes(mesh: Any, axis_names: set[str]) -> tuple[str, ...]:
  """The ``Explicit`` axes of ``mesh`` (or of the context mesh) outside ``axis_names``:
  those :func:`shard_map_keeping_axes` keeps across a region manual over ``axis_names``."""
  abstract = _abstract(mesh)
  types = dict(zip(abstract.axis_names, abstract.axis_types, strict=True))
  return tuple(a for a in abstract.axis_names
               if a not in axis_names and types[a] == AxisType.Explicit)


def shard_map_keeping_axes(body: Callable[..., Any], *, mesh: Any, in_specs: Any,
                           out_specs: Any, axis_names: set[str],
                           check_vma: bool = True) -> Callable[..., Any]:
  """``jax.shard_map(body, ...)`` manual over ``axis_names``, whose arguments and results
  keep their sharding on the mesh's other ``Explicit`` axes (e.g. a tensor-parallel
  ``model`` axis) across the region's boundary.

  JAX (0.10, Shardy) lowers a partially manual shard_map on a mesh without ``Auto`` axes
  with *closed, replicated* dimensions on the non-manual axes: every argument sharded over
  them is all-gathered on entry (and sliced again inside), every such result all-gathered
  on exit, although their types inside say they stay sharded. Around the shard_map those
  axes are made ``Auto`` (open dimensions: nothing moves), and inside the body ``Explicit``
  again with the arguments' own specs, so ``body`` sees the types it would see without
  this wrapper. Without such axes this is plain ``jax.shard_map``. ``check_vma`` is
  ``jax.shard_map``'s.
  """
  abstract = _abstract(mesh)
  kept = kept_axes(mesh, axis_names)
  if not kept:
    return jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                         axis_names=axis_names, check_vma=check_vma)
  auto = {a: AxisType.Auto for a in kept}
  kept_types = {a: AxisType.Explicit for a in kept}
  seen: dict[str, Any] = {}

  def inner(*args):
    with jax.sharding.use_abstract_mesh(
        jax.sharding.get_abstract_mesh().update_axis_types(kept_types)):
      args = jax.sharding.reshard(args, seen["in"])
      out = body(*args)
      seen["out"] = jax.tree.map(_entries, out)
    return jax.sharding.reshard(out, jax.tree.map(lambda _: P(), out))

  def outer(*args):
    seen["in"] = jax.tree.map(lambda a: _only(_entries(a), lambda x: x in kept), args)
    boundary = abstract.update_axis_types(auto)
    with jax.sharding.use_abstract_mesh(boundary):
      args = jax.sharding.reshard(args, jax.tree.map(
          lambda a: _only(_entries(a), lambda x: x not in kept), args))
      out = jax.shard_map(inner, mesh=boundary, in_specs=in_specs, out_specs=out_specs,
                          axis_names=axis_names, check_vma=check_vma)(*args)

    def merged(o, inside):  # the result's data-axis entries (out_specs), then the kept
      entries = []          # axes' entries it had inside the body
      for mapped_entry, inner_entry in zip(_entries(o), inside, strict=True):
        axes = spec_axes(mapped_entry) + tuple(a for a in spec_axes(inner_entry) if a in kept)
        entries.append(spec_entry(axes))
      return P(*entries)

    return jax.sharding.reshard(out, jax.tree.map(merged, out, seen["out"]))

  return outer
