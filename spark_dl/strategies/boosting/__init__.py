"""The boosting parameter server of seed 000 with its data-key scheduler (driver half:
driver.py; task half: task.py; the scheduler: keys.py)."""

from .driver import Boosting

__all__ = ["Boosting"]
