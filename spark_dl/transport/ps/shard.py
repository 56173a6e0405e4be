"""One block of the parameter server's flat parameter vector: its values, its own lock, version
counter and server-side optimizer (a torch optimizer on that block, so the arithmetic is
exactly torch's), and the sync round being collected.

Averaged parameters (``average`` = a > 0): besides its parameters x each shard keeps their
exponential moving average over about a x (an epoch's pushes), x̄ <- x̄ + (x - x̄) / (a E_t)
after every step, where E_t = min(E, t) for the t mini-batch steps applied so far (x̄ = x while
a E_t <= 1). So in the first epoch the average covers the last fraction a of the trajectory
so far, not the initial values and the steep first steps (which a model validated a quarter
epoch in would otherwise mix in; docs/guides/downpour.md, "Averaged server"); from the first
epoch on it is the last a E pushes. Workers always fetch x; the server's
``parameters()`` (the model the driver validates and returns) is x̄: it damps the last
iterates' noise, which asynchronous pushes add to (docs/benchmarks.md, "Downpour SGD").

Lookahead (the server's ``lookahead``): a worker's push lands tau versions after the values
it was computed on (tau ~ W - 1 for W equally fast workers). With a momentum server the
steps in between are predictable: each moves the parameters by about lr v (v the momentum
buffer, torch's x <- x - lr v), so a worker is sent x - tau_w lr v, the server's position
when its next push is expected to land, with tau_w the running mean of that worker's
measured staleness (weight prediction, as SpecTrain does for pipelined stages, Chen et al.
2018; DANA, Hakimi et al. 2019, for asynchronous momentum). Its gradient is then taken about
where it is applied. ``ahead`` holds tau_w per worker; the staleness counts stay those of
the values the worker was sent (their version).
"""

from __future__ import annotations

import threading
from collections import Counter

import torch

from ...optim.schedule import LRSchedule

__all__ = ["SERVER_OPTIMIZERS", "Shard"]

SERVER_OPTIMIZERS = ("sgd", "momentum", "adagrad", "adam", "rmsprop")


class Shard:
    def __init__(self, values: torch.Tensor, optimizer: str, lr: float, momentum: float,
                 lr_decay: float = 1.0, average: float = 0.0,
                 schedule: LRSchedule | None = None):
        self.param = torch.nn.Parameter(values.clone(), requires_grad=False)
        self.average = average
        self.avg = values.clone() if average > 0 else None     # x̄, see the module doc
        self.param.grad = torch.zeros_like(self.param)
        opts = {"sgd": lambda: torch.optim.SGD([self.param], lr=lr),
                "momentum": lambda: torch.optim.SGD([self.param], lr=lr, momentum=momentum),
                "adagrad": lambda: torch.optim.Adagrad([self.param], lr=lr),
                "adam": lambda: torch.optim.Adam([self.param], lr=lr),
                "rmsprop": lambda: torch.optim.RMSprop([self.param], lr=lr)}
        self.opt = opts[optimizer]()
        # the rate per fractional epoch of steps applied (its warmup and decay)
        self.schedule = schedule or LRSchedule(lr, decay=lr_decay)
        self.on_step = None             # called after every step, under the lock (snapshots)
        self.steps = 0                  # mini-batch steps applied (a push of k counts k)
        self.done: Counter = Counter()  # worker -> its mini-batch steps applied (sync: taken)
        self.lock = threading.Condition()
        self.version = 0
        # sync mode: the round being collected
        self.round_sum: torch.Tensor | None = None       # allocated by the first sync push
        self.round_count = 0.0
        self.round_workers: set[int] = set()
        # sum over applied steps of the mean gradient's |g| summed over the shard (Fig. 4.3b)
        self.abs_sum, self.abs_steps = 0.0, 0
        self.ahead: dict[int, float] = {}   # lookahead: worker -> running mean staleness

    def apply(self, grad: torch.Tensor, scale: float = 1.0, steps: int = 1,
              epoch_steps: int = 0, summed: int = 1) -> None:
        """One optimizer step on ``grad * scale``, the sum of ``summed`` mini-batch mean
        gradients, counted as ``steps`` mini-batch steps."""
        self.opt.param_groups[0]["lr"] = self.lr_now(epoch_steps)
        self.param.grad.copy_(grad)
        if scale != 1.0:
            self.param.grad.mul_(scale)
        self.abs_sum += float(self.param.grad.abs().sum()) / summed
        self.abs_steps += 1
        self.opt.step()
        if self.avg is not None:
            span = self.average * min(epoch_steps, self.steps + steps)
            if span > 1:
                self.avg.lerp_(self.param.detach(), 1.0 / span)
            else:
                self.avg.copy_(self.param.detach())
        self.steps += steps
        self.version += 1
        if self.on_step is not None:
            self.on_step(self, epoch_steps)

    AHEAD_WEIGHT = 0.1                  # of the latest push in the running mean staleness

    def note_staleness(self, worker: int, staleness: int) -> None:
        """A push of ``worker`` landed ``staleness`` versions after its values (lookahead's
        running mean; the first push sets it)."""
        was = self.ahead.get(worker)
        self.ahead[worker] = float(staleness) if was is None else \
            was + self.AHEAD_WEIGHT * (staleness - was)

    def values_for(self, worker: int | None = None) -> torch.Tensor:
        """A copy of the values to send ``worker`` (call under the lock): the current ones,
        or with lookahead (``worker`` given) where the next ``ahead[worker]`` steps are
        expected to take them, x - tau lr v (see the module doc)."""
        out = self.param.detach().clone()
        tau = self.ahead.get(worker, 0.0) if worker is not None else 0.0
        buf = self.opt.state.get(self.param, {}).get("momentum_buffer") if tau > 0 else None
        if buf is not None:
            out.sub_(buf, alpha=tau * self.opt.param_groups[0]["lr"])
        return out

    def epoch_lr(self, epoch: int, epoch_steps: int) -> float:
        """The rate of the last step of ``epoch`` (1-based), as the history records it."""
        return self.schedule.at(epoch - 1.0 / max(epoch_steps, 1))

    def lr_now(self, epoch_steps: int) -> float:
        """The schedule's rate after the steps applied so far (epochs of ``epoch_steps``)."""
        return self.schedule.at(self.steps / epoch_steps if epoch_steps > 0 else 0.0)
