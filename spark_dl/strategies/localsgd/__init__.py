"""Local SGD with an optional outer Nesterov step (DiLoCo): the replicas step on their own and
average every ``every`` steps."""

from .driver import LocalSGD

__all__ = ["LocalSGD"]
