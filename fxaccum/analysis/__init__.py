"""The view analysis: whether a loss may run per device, read from its jaxpr.

A rule table: the interpreter (:mod:`.interpreter`) walks a jaxpr and asks, for each
equation, the rule the registry (:mod:`.registry`) holds for its primitive; the rules
(:mod:`.rules`, by family) are pure functions of a small context that return kinds plus
findings. Pairing the global trace with the per-device one is its own pass
(:mod:`.pairing`). Also here: the kinds of values (:mod:`.kinds`), what is read off one
equation (:mod:`.eqns`), and the watch on a symbolic-size trace (:mod:`.symbolic`). May
import ``fxaccum.jaxprs`` and JAX only. Imported by ``fxaccum.instep``.
"""

from fxaccum.analysis.interpreter import (
    Analysis,
    Const,
    Rows,
    Stat,
    Top,
    analyze,
    depends_on,
    mixing,
)
from fxaccum.analysis.kinds import Kind

__all__ = ["Analysis", "Const", "Kind", "Rows", "Stat", "Top", "analyze", "depends_on",
           "mixing"]
