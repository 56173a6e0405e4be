"""Downpour SGD against a parameter server, with model-parallel replicas (driver half:
driver.py; task half: task.py; partitioning: plan.py)."""

from .driver import MODES, STALENESS_RULES, Downpour

__all__ = ["MODES", "STALENESS_RULES", "Downpour"]
