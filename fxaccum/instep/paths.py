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
at one size); that decision is :mod:`fxaccum.instep.decision`'s. This module holds the
:class:`Path` a call took and its registry: every traced call records its path, named in
the compiled program, so :func:`fxaccum.diagnostics.report` can say which view ran and why.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import re
from collections.abc import Iterator
from typing import Literal

__all__ = ["Path", "View", "entry", "record", "recorded"]

View = Literal["auto", "global", "device"]


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


def recorded(hlo_text: str) -> list[Path]:
  """The paths of the fxaccum calls compiled into ``hlo_text``, in first-seen order."""
  ids = dict.fromkeys(int(i) for i in _SCOPE.findall(hlo_text))
  return [_PATHS[i] for i in ids if i in _PATHS]
