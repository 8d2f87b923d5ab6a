"""Whether per-device results add up to the global ones, output by output.

Each output of a traced micro-step has a :data:`Role` (the loss's total, an aux leaf, a
gradient, ...); :func:`classify` reads how each scales with the number of examples (from
:mod:`fxaccum.analysis`) and says whether the per-device view would give the global
result, and if not, why. Used by the view decision (:mod:`fxaccum.instep.decision`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from fxaccum import analysis as analysis_lib

__all__ = ["Role", "classify"]


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
