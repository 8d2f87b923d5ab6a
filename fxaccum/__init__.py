"""fxaccum: exact, communication-optimal, memory-flat gradient accumulation for JAX."""

from fxaccum import diagnostics
from fxaccum.grad import grad, value_and_grad
from fxaccum.weighted import Weighted

__version__ = "0.1.0"

__all__ = [
    "Weighted",
    "__version__",
    "diagnostics",
    "grad",
    "value_and_grad",
]
