"""The rules of the view analysis, by family: each module registers its rules, and the
facts of their primitives (``register_facts``), in :mod:`fxaccum.analysis.registry` when
imported, and importing this package fills the tables.

* :mod:`.elementwise`: arithmetic, casts, comparisons, random bits from keys;
* :mod:`.reductions`: sums, maxima, ``argmax``, cumulative and window ops;
* :mod:`.shapes`: broadcasts, reshapes, transposes, concatenations, ``iota``;
* :mod:`.indexing`: slices, padding, ``gather``, ``scatter``, ``sort``;
* :mod:`.contractions`: ``dot_general``, convolutions;
* :mod:`.linalg`: Fourier transforms, the LU decomposition;
* :mod:`.collectives`: collectives and placements (sharding constraints);
* :mod:`.control_flow`: calls, ``shard_map``, ``scan``, ``while``, ``cond``;
* :mod:`.common`: helpers they share.

The rule modules may import :mod:`fxaccum.analysis.registry`, :mod:`fxaccum.analysis.kinds`,
:mod:`fxaccum.analysis.eqns`, :mod:`.common` and ``fxaccum.jaxprs``; never the interpreter.
"""

from fxaccum.analysis.registry import CALL_RULES, RULES
from fxaccum.analysis.rules import (
    collectives,
    contractions,
    control_flow,
    elementwise,
    indexing,
    linalg,
    reductions,
    shapes,
)

__all__ = ["CALL_RULES", "RULES", "collectives", "contractions", "control_flow", "elementwise",
           "indexing", "linalg", "reductions", "shapes"]
