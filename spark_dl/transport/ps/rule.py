"""How the parameter server turns a push into a step: the shards' optimizer and rate, the
rate's schedule, the scaling of a push of several mini-batches, the average the driver
validates, the clip and the look-ahead (shard.py), and staleness_lr.

The rate follows ``schedule`` (spark_dl.optim.schedule: its warmup and per-epoch decay) over
the fractional epochs applied: an epoch is the mini-batch steps of all workers' shards (sync:
of the largest), counted as the pushes carry them. An asynchronous push of k mini-batches
steps f(k) times their mean gradient (``push_scaling``: linear, sqrt, none). With
``staleness_lr`` a push computed tau >= 2 versions ago takes a step of lr / tau
(staleness-aware async SGD, Zhang et al., IJCAI 2016)."""

from __future__ import annotations

import dataclasses
import math

import torch

from .shard import SERVER_OPTIMIZERS, Shard

__all__ = ["StepRule", "push_factor"]


@dataclasses.dataclass(frozen=True)
class StepRule:
    """The server's step (see the module doc). ``optimizer``: one of SERVER_OPTIMIZERS;
    ``lr``, ``momentum``, ``lr_decay``: its settings (``schedule``, a LRSchedule, replaces
    lr and lr_decay); ``average``: the averaging span in epochs (0: none); ``clip``: the cap
    on a push, a multiple of the running gradient norm (None: none); ``ahead``: the
    look-ahead of the workers' momentum (a plain SGD server)."""

    optimizer: str = "sgd"
    lr: float = 0.01
    momentum: float = 0.9
    lr_decay: float = 1.0
    schedule: object = None
    push_scaling: str = "linear"
    average: float = 0.0
    clip: float | None = None
    staleness_lr: bool = False
    ahead: bool = False

    def __post_init__(self):
        if self.optimizer not in SERVER_OPTIMIZERS:
            raise ValueError(f"unknown server optimizer {self.optimizer!r}; choose one of "
                             f"{', '.join(SERVER_OPTIMIZERS)}")
        if not self.average >= 0:
            raise ValueError(f"average must be >= 0 (a fraction of an epoch), got "
                             f"{self.average}")
        if self.clip is not None and not self.clip > 0:
            raise ValueError(f"clip must be > 0 (a multiple of the running gradient norm), "
                             f"got {self.clip}")
        if self.ahead and not (self.optimizer == "sgd" or
                               (self.optimizer == "momentum" and self.momentum == 0)):
            raise ValueError(f"ahead (the workers' look-ahead) needs a server stepping plain "
                             f"SGD (the momentum is the workers'), got optimizer="
                             f"{self.optimizer!r} with momentum {self.momentum}")

    def for_mode(self, mode: str) -> StepRule:
        """This rule in ``mode``: a sync round averages the replicas' gradients, so no clip
        (no spikes to cut) and no look-ahead (no push stepped on its own)."""
        if mode != "sync":
            return self
        if self.ahead:
            raise ValueError("ahead (the workers' look-ahead, staleness rule 'dana') needs "
                             "pushes stepped one by one: mode='async' or 'sequential', got "
                             "mode='sync'")
        return dataclasses.replace(self, clip=None)

    def shard(self, values: torch.Tensor) -> Shard:
        """A shard of ``values`` stepped by this rule."""
        return Shard(values, self.optimizer, self.lr, self.momentum, self.lr_decay,
                     self.average, self.schedule, self.clip, self.ahead)

    def scale(self, steps: int, samples: int, staleness: int) -> float:
        """The factor on a push summing the per-sample gradients of ``steps`` mini-batches of
        ``samples`` samples in all, computed ``staleness`` versions ago."""
        scale = push_factor(self.push_scaling, steps) / max(samples, 1)
        if self.staleness_lr and staleness > 1:
            scale /= staleness
        return scale


def push_factor(rule: str, steps: int) -> float:
    """f(k) of an asynchronous push that sums k mini-batches' gradients: the step it takes is
    f(k) times their mean (linear: k, as k sequential steps would; sqrt: sqrt(k); none: 1)."""
    return float(steps) if rule == "linear" else math.sqrt(steps) if rule == "sqrt" else 1.0
