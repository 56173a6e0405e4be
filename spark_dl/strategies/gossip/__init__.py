"""RD-PSGD: decentralized gossip of a shared random mask of coordinates (driver half:
driver.py; task half: task.py; the rounds themselves: rounds.py)."""

from .driver import Gossip

__all__ = ["Gossip"]
