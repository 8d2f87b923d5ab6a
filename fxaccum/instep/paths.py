"""Which view runs the loss: per device (the fast path) or on the global micro-batch.

* ``"device"``: the loss runs on each device's rows inside a region manual over the data
  axes; gradients are summed locally and reduced once after the micro-batch loop. Exact
  only for losses that are sums or means of per-example terms.
* ``"global"``: the loss runs on the global micro-batch, as ``jax.value_and_grad`` runs
  it; exact for every loss. The compiler places the data-axis reductions (once per
  micro-batch on ``Auto`` meshes); on ``Explicit`` meshes params used only in matmuls
  against batch rows are typed ``reduced`` so their gradients are reduced once per step.

``view="auto"`` (the default) takes the device view only when :mod:`fxaccum.analysis`
proves it gives the global result, from the loss traced at two micro-batch sizes (a
division by the number of examples and by a constant that happens to equal it look alike
at one size). Every traced call records its :class:`Path`, named in the compiled program,
so :func:`fxaccum.diagnostics.report` can say which view ran and why.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import re
from collections.abc import Iterator, Sequence
from typing import Literal

from fxaccum import analysis as analysis_lib

__all__ = ["ONE_DEVICE", "Path", "View", "amend", "classify", "entry", "record", "recorded"]

View = Literal["auto", "global", "device"]

# The reason on a mesh whose data axes hold one device, for either view: true for every
# loss there (the analysis reads one size only, so how values scale is not known).
ONE_DEVICE = ("one data-parallel device: its rows are the global micro-batch, so the device "
              "and global views run the loss on the same rows (nothing is added up over "
              "devices)")


@dataclasses.dataclass(frozen=True)
class Path:
  """How one traced ``fxaccum.value_and_grad`` call runs its loss.

  Attributes:
    view: ``"device"`` (per-device loss, one reduction after the loop) or ``"global"``
      (the loss on the global micro-batch).
    reason: why this view was taken, e.g. the first operation found to mix examples.
    data_axes: the data-parallel mesh axes of the batch.
    reduced_leaves: in the global view, how many differentiated leaves were kept
      ``reduced`` through the loop (their gradients reduced once, after it).
    leaves: how many leaves were differentiated.
    fsdp: for params sharded over a data axis, the strategy that gathered and reduced
      them and why (e.g. ``"zero3: params stacked over layers are scanned: ..."``), or
      ``""`` where fxaccum placed none (no such params, or the global view, where the
      compiler places them).

  Example:
    >>> from fxaccum.diagnostics import Path
    >>> p = Path("global", "a matmul pairs different examples", ("data",), 2, 3)
    >>> print(p)
    global view over ('data',): a matmul pairs different examples (2 of 3 leaves reduced once)
  """

  view: Literal["device", "global"]
  reason: str
  data_axes: tuple[str, ...]
  reduced_leaves: int = 0
  leaves: int = 0
  fsdp: str = ""

  def __str__(self) -> str:
    extra = (f" ({self.reduced_leaves} of {self.leaves} leaves reduced once)"
             if self.view == "global" and self.data_axes else "")
    fsdp = f"; FSDP {self.fsdp}" if self.fsdp else ""
    return f"{self.view} view over {self.data_axes}: {self.reason}{extra}{fsdp}"


_PATHS: dict[int, Path] = {}
_IDS = itertools.count()
_SCOPE = re.compile(r"fxaccum_path_(\d+)")
_ENTRIES: list[str] = []  # who runs the in-step calls traced now (fxaccum.micro_batched)


@contextlib.contextmanager
def entry(name: str) -> Iterator[None]:
  """Paths recorded in this context name ``name`` (e.g. ``fxaccum.micro_batched(tower)
  backward``) as the caller of their in-step call; a global view there adds that the
  function runs on each global micro-batch, so its batch statistics are the micro-batch's."""
  _ENTRIES.append(name)
  try:
    yield
  finally:
    _ENTRIES.pop()


def record(path: Path) -> str:
  """Registers ``path``; returns the ``jax.named_scope`` name that marks it in HLO."""
  if _ENTRIES:
    note = ("; it runs on each global micro-batch, so any statistics over its rows are the "
            "micro-batch's (ghost batch statistics)" if path.view == "global" else "")
    path = dataclasses.replace(path, reason=f"{_ENTRIES[-1]}: {path.reason}{note}")
  index = next(_IDS)
  _PATHS[index] = path
  return f"fxaccum_path_{index}"


def amend(scope: str, **changes: object) -> None:
  """Changes fields of the path :func:`record` registered as ``scope`` (e.g. the FSDP
  strategy, chosen while the region it names is traced)."""
  index = int(scope.removeprefix("fxaccum_path_"))
  _PATHS[index] = dataclasses.replace(_PATHS[index], **changes)  # type: ignore[arg-type]


def recorded(hlo_text: str) -> list[Path]:
  """The paths of the fxaccum calls compiled into ``hlo_text``, in first-seen order."""
  ids = dict.fromkeys(int(i) for i in _SCOPE.findall(hlo_text))
  return [_PATHS[i] for i in ids if i in _PATHS]


Role = Literal["total", "weight", "aux", "aux_total", "aux_weight", "aux_sum", "aux_concat",
               "aux_max", "aux_min", "state", "state_update", "param_update", "sown", "grad"]


def _lam(kind: analysis_lib.Kind) -> float | None:
  """``e`` such that per-device results add up to ``D ** e`` times the global one.

  A sum over examples times ``n ** p`` gives ``e = -p`` (a sum: 0, a mean: 1); a
  batch-independent ``c * n ** r`` is counted once per device: ``e = 1 - r``. None for a
  value that mixes examples or keeps the batch axis.
  """
  if isinstance(kind, analysis_lib.Const):
    return None if kind.exp is None else 1 - kind.exp
  if isinstance(kind, analysis_lib.Stat) and kind.mixed is None and kind.exp is not None:
    return -kind.exp
  return None


def _concat_problem(rows: analysis_lib.Rows) -> str:
  """Why per-example rows that mix no examples still cannot be a Concat aux leaf."""
  if rows.dim != 0:
    return f"a Concat aux leaf holds the examples on axis {rows.dim}, not on axis 0"
  if rows.exp is None:
    return "a Concat aux leaf is scaled by a value that is no power of the micro-batch size"
  if rows.exp != 0:
    return ("a Concat aux leaf scales with the micro-batch size (e.g. per-example values "
            "divided by the number of rows): per device, by the device's share of it")
  return "a Concat aux leaf holds the examples in another order (e.g. reversed)"


def classify(outputs: Sequence[analysis_lib.Kind], roles: Sequence[Role],
             summed: bool = False) -> tuple[str | None, str]:
  """Whether per-device results combine into the global ones.

  Per device, fxaccum adds up the totals and the weights (a scalar loss has weight 1)
  and divides once. That is the global ratio when total and weight scale alike from the
  devices to the whole (both sums over examples, or both means); a loss returned as
  ``fxaccum.Sum`` (``summed``) has its totals only added up, so it must be a sum over
  examples. Each gradient must add up from the devices like the total (the gradient of a
  mean is a mean, whatever derivative rules produced it). A plain aux leaf, averaged
  with the devices' weights, must be batch-independent, or a mean while the weight is a
  constant.

  Returns:
    ``(problem, what)``: why the device view would differ (None if it would not), and
    what the loss is (``"sum"`` or ``"mean"`` of per-example terms) when it would not.
  """
  lams = [_lam(k) for k in outputs]
  for kind, role, lam in zip(outputs, roles, lams, strict=True):
    if role == "state_update":
      return ("the loss updates module state (e.g. BatchNorm statistics, RNG counts): per "
              "device, every device would update its own copy"), ""
    if role == "param_update":
      return ("the loss writes a differentiated variable (e.g. nnx.WeightNorm, "
              "nnx.SpectralNorm write their normalized kernel): each micro-batch reads it "
              "as the previous one wrote it, on the global micro-batch"), ""
    if role == "sown":
      return "the loss sows values into the module (Module.sow)", ""
    if role == "aux_concat":
      if not (isinstance(kind, analysis_lib.Rows) and kind.dim == 0 and kind.mixed is None
              and kind.exp == 0 and kind.order == 0):
        return _mixed_reason(kind, role) if not isinstance(kind, analysis_lib.Rows) or (
            kind.mixed) else _concat_problem(kind), ""
      continue
    if role == "state":
      continue
    if role in ("aux_max", "aux_min"):
      extreme = role.removeprefix("aux_")
      if not _extremum_over_examples(kind, extreme):
        return (f"a {extreme.capitalize()} aux leaf is no {extreme}imum over the examples of "
                "per-example values (per device, it would be another device's value, "
                "not the batch's)"), ""
      continue
    if lam is None:
      return _mixed_reason(kind, role), ""
    if role == "aux_sum" and lam != 0:
      return ("a Sum aux leaf is no sum over examples (per device it would be counted once "
              "per device)"), ""
  total_lam = lams[roles.index("total")]
  if summed and total_lam != 0:
    return ("a loss returned as fxaccum.Sum is added up over the devices, but it is no sum "
            "over examples (e.g. a mean over this micro-batch: per device it would be "
            "counted once per device)"), ""
  for kind, role, lam in zip(outputs, roles, lams, strict=True):
    if role == "grad" and lam != total_lam and not (
        isinstance(kind, analysis_lib.Const) and kind.value == 0):
      return ("a gradient does not add up over the devices like the loss (e.g. a custom "
              "derivative rule that scales with the number of examples)"), ""
  pairs = [(i, i + 1) for i, role in enumerate(roles)
           if role == "aux_total" or (role == "total" and not summed)]
  for a, b in pairs:
    if lams[a] != lams[b]:
      what = "loss" if roles[a] == "total" else "Weighted aux leaf"
      return (f"the {what}'s total and weight scale differently with the number of examples "
              f"(e.g. a sum over examples divided by a constant count), so per-device "
              f"results would not add up to the global ratio"), ""
  weight = outputs[roles.index("weight")]
  weight_constant = isinstance(weight, analysis_lib.Const) and weight.exp == 0
  for kind, role, lam in zip(outputs, roles, lams, strict=True):
    if role == "aux" and not (isinstance(kind, analysis_lib.Const) and kind.exp == 0) and not (
        lam == 1 and weight_constant):
      return ("a plain aux leaf depends on the batch while the loss is weighted: per-device "
              "values averaged with the devices' weights differ from the global value; "
              "return it as fxaccum.Weighted"), ""
  return None, "sum" if lams[0] == 0 else "mean" if lams[0] == 1 else "ratio"


def _extremum_over_examples(kind: analysis_lib.Kind, extreme: str) -> bool:
  """Whether a value combines over devices by its maximum (``extreme="max"``) or minimum:
  batch-independent, or that extremum over examples of values independent of their number."""
  if isinstance(kind, analysis_lib.Const):
    return kind.exp == 0
  return isinstance(kind, analysis_lib.Stat) and kind.extreme == extreme and kind.exp == 0


def _mixed_reason(kind: analysis_lib.Kind, role: Role) -> str:
  what = {"total": "the loss", "weight": "the loss's weight", "aux": "an aux leaf",
          "grad": "a gradient",
          "aux_total": "a Weighted aux leaf", "aux_weight": "a Weighted aux leaf's weight",
          "aux_sum": "a Sum aux leaf", "aux_concat": "a Concat aux leaf",
          "aux_max": "a Max aux leaf", "aux_min": "a Min aux leaf"}.get(role, role)
  reason = analysis_lib.mixing(kind)
  if isinstance(kind, analysis_lib.Rows) and reason is None:  # e.g. per-example outputs
    return f"{what} keeps the batch axis, so it is no sum or mean over examples"
  if reason is None:
    return (f"{what} depends on the micro-batch size other than as a sum or mean over its "
            "examples")
  return f"{what} mixes examples: {reason}"
