"""The per-replica seed: every replica (or Boosting data key) shuffles its rows with its own
stream, the same on a retry or a resume."""

from __future__ import annotations

__all__ = ["replica_seed"]


def replica_seed(seed: int, rank: int) -> int:
    """The seed of replica (or data key) ``rank`` in a fit seeded with ``seed``."""
    return seed * 1000003 + rank
