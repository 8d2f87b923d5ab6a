"""Pipeline parallelism: ``pipeline`` streams micro-batches through stages over a mesh axis.

Owns the schedules (GPipe, circular, 1F1B) and ``bubble_fraction`` (:mod:`.schedules`). May
import the shared modules (``fxaccum.split``, ``meshes``, ``reductions``). Imported by
``fxaccum`` (on first use) and ``fxaccum.diagnostics``.
"""

from fxaccum.pipelining.schedules import bubble_fraction, pipeline

__all__ = ["bubble_fraction", "pipeline"]
