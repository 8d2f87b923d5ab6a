"""How the per-device view gathers and reduces params sharded over a data axis (FSDP).

Three strategies, named after the ZeRO stage whose memory they have during the step (the
optimizer state is the caller's):

* ``"zero1"``: each param gathered once per step (the compiler hoists the gathers above the
  micro-batch loop), its gradient summed whole on every device and reduce-scattered once
  per step. The least communication; whole params and whole float32 gradients live.
* ``"zero2"``: gathered once per step, the gradient reduce-scattered in every micro-batch.
  Whole params live, gradients sharded.
* ``"zero3"``: gathered where the loss uses it (one layer at a time inside a scan over
  stacked layers) and again in the backward pass, the gradient reduce-scattered in every
  micro-batch (:mod:`fxaccum.instep.gather`). The least memory; twice the gathers per
  micro-batch.

``fsdp="auto"`` takes zero3 where the loss scans over stacked layers and zero2 elsewhere
(:func:`choose`); zero1 only when asked. In the global view the compiler places every
FSDP collective.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

__all__ = ["STRATEGIES", "Choice", "Fsdp", "Strategy", "choose", "forced"]

Strategy = Literal["zero1", "zero2", "zero3"]
Fsdp = Literal["auto", "zero1", "zero2", "zero3"]
STRATEGIES: tuple[Fsdp, ...] = ("auto", "zero1", "zero2", "zero3")


class Choice(NamedTuple):
  """The strategy a step takes for its FSDP params, and why."""

  strategy: Strategy
  reason: str


def forced(fsdp: Strategy) -> Choice:
  """The strategy ``fsdp=`` names."""
  return Choice(fsdp, f"fsdp='{fsdp}'")


def choose(stacked: bool, blocker: str | None) -> Choice:
  """The strategy of ``fsdp="auto"`` for a loss that scans over stacked FSDP layers or not
  (``stacked``: :func:`fxaccum.instep.gather.per_layer`).

  zero3 where the loss scans over stacked FSDP layers: it gathers one layer at a time,
  where zero2 holds the whole params through the step (about twice the large batch's peak
  on that layout). Elsewhere zero2: for unrolled layers the compiler's schedule decides
  how much zero3's gathering where used lowers the peak (on XLA:CPU, which runs an
  unrolled program's gathers at its start: -2 to 27 % measured), while its second
  gather per micro-batch costs time (up to 1.8x measured). ``blocker``: why zero3
  cannot run this step (then zero2).
  """
  if blocker:
    return Choice("zero2", f"gathered once per step: {blocker}")
  if stacked:
    return Choice("zero3", "params stacked over layers are scanned: gathered one layer at "
                  "a time, where used")
  return Choice("zero2", "gathered once per step: no FSDP param is scanned over as stacked "
                "layers (name fsdp='zero3' to gather unrolled layers where used)")
