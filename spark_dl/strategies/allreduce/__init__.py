"""Synchronous data parallelism: a sample-weighted ring all-reduce of the gradients every step
(driver half: driver.py; task half: task.py)."""

from .driver import AllReduce

__all__ = ["AllReduce"]
