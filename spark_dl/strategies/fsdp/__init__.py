"""Fully sharded data parallelism (FSDP2): every replica holds a shard of each parameter, its
gradient and its optimizer state (driver half: driver.py; task half: task.py; which blocks are
sharded as units: units.py)."""

from .driver import FSDP

__all__ = ["FSDP"]
