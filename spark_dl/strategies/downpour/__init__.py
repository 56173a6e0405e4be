"""Downpour SGD against a parameter server, with model-parallel replicas (driver half:
driver.py; task half: task.py and its parameter traffic exchange.py; partitioning:
spark_dl.planning.partitions)."""

from .driver import MODES, STALENESS_RULES, Downpour

__all__ = ["MODES", "STALENESS_RULES", "Downpour"]
