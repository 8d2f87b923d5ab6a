"""The view analysis: whether a loss may run per device, read from its jaxpr.

Owns the interpreter that walks a jaxpr and pairs two traces (:mod:`.interpreter`), the
kinds of values it tracks (:mod:`.kinds`), the rule of each primitive (:mod:`.rules`) and
the watch on a symbolic-size trace (:mod:`.symbolic`). May import ``fxaccum.jaxprs`` and
JAX only. Imported by ``fxaccum.instep``.
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
