"""Optimizers beyond torch's built-ins, and the by-name factory the jobs use."""

from .cg import NonlinearCG
from .factory import OPTIMIZERS, make_optimizer

__all__ = ["OPTIMIZERS", "NonlinearCG", "make_optimizer"]
