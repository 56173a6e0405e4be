"""Heterogeneous replicas in a synchronous step: the global batch split in proportion to each
replica's measured speed (seed 001, §E of the seed notes), so that all finish their share of a
step together instead of waiting for the slowest: the split (split.py), each replica's speed
and memory measured (speed.py), its rows per step and the rows moved to match (rows.py),
and a replica's side of a balanced stage (balancer.py)."""

from .balancer import Balancer
from .rows import ROW_MODES, balanced_batches, move_plan, move_rows, rebatch, row_targets
from .speed import activation_bytes, measure, memory_cap, profile
from .split import BALANCE_MODES, check_balance, equal_time_split, split

__all__ = [
    "BALANCE_MODES",
    "ROW_MODES",
    "Balancer",
    "activation_bytes",
    "balanced_batches",
    "check_balance",
    "equal_time_split",
    "measure",
    "memory_cap",
    "move_plan",
    "move_rows",
    "profile",
    "rebatch",
    "row_targets",
    "split",
]
