"""One block of the parameter server's flat parameter vector: its values, its own lock, version
counter and server-side optimizer (a torch optimizer on that block, so the arithmetic is
exactly torch's), and the sync round being collected.

Averaged parameters (``average`` = a > 0): besides its parameters x each shard keeps their
exponential moving average over about a epochs of mini-batch steps, x̄ <- x̄ + k (x - x̄) /
(a E_t) after every push of k mini-batch steps, where E_t = min(E, t) for the t mini-batch
steps applied so far (x̄ = x while a E_t <= k). So in the first epoch the average covers the
last fraction a of the trajectory so far, not the initial values and the steep first steps
(which a model validated a quarter epoch in would otherwise mix in; docs/guides/downpour.md,
"Averaged server"); from the first epoch on it is the last a E mini-batch steps, whatever
the push size (a Boosting key of n_push mini-batches, a Downpour push of n_push). Workers
always fetch x; the server's ``parameters()`` (the model the driver validates and returns)
is x̄: it damps the last iterates' noise, which asynchronous pushes add to
(docs/guides/downpour.md, "Averaged server"). The average is spark_dl.optim.average's
``WeightAverage``, the replicas' own: it takes x every a E_t / 32 mini-batch steps with the
weight of those steps and folds in the rest when read, so that the lerp is not a pass over
the shard every push (docs/guides/fit.md, "Averaged weights").

Clipped pushes (``clip`` = c): a step's gradient (the push's, as scaled) is cut to at most c
times the running mean of the steps' gradient norms on this shard, r <- r + 0.05 (|g| - r)
over the clipped norms, from the 21st step on (the first 20 only build r). A stale push of an
oscillation that a delay has made unstable grows step by step; the cap stops that growth
before it runs away (docs/design/0005-clipped-pushes.md).

Look-ahead (``ahead``; Downpour's staleness rule "dana"): the workers keep a momentum m_w
over their own pushes (ramped up from 0, each reports it to the server as it changes), so
each worker's next push will step m_w times its last one besides its new gradient, and in
an asynchronous fit the other workers' next pushes land before a worker's own. The shard
keeps every worker's momentum step to come, m_w x its last step's gradient (as scaled and
clipped: a cut spike is not looked ahead at either), and their sum S; a worker fetches
x - lr S, the point where those steps are about to take x, so that its gradient is taken
about where it will be applied (DANA-Zero: Hakimi et al., "Taming Momentum in a Distributed
Asynchronous Environment", 2019). The driver validates x̄ (or x), never the look-ahead.
Approximations: a worker's next push is taken to be scaled as its last (a short last push of
an epoch, or staleness_lr's 1 / tau, scales it otherwise), and a worker that leaves (its
connection closes) leaves S without a new version, so a worker that asks "if newer" sees
that at the next push.
"""

from __future__ import annotations

import copy
import math
import threading
from collections import Counter

import torch

from ...optim.average import WeightAverage
from ...optim.schedule import LRSchedule

__all__ = ["SERVER_OPTIMIZERS", "Ahead", "Shard"]

SERVER_OPTIMIZERS = ("sgd", "momentum", "adagrad", "adam", "rmsprop")


class Ahead:
    """The look-ahead of a shard (see the module doc): worker (its connection) -> its momentum
    step to come, and their sum, kept by updates and summed anew every RESUM updates (the
    rounding of additions and subtractions would otherwise build up over a fit's pushes)."""

    RESUM = 1024

    def __init__(self, like: torch.Tensor):
        self.terms: dict[object, torch.Tensor] = {}
        self.sum = torch.zeros_like(like)
        self.updates = 0

    def record(self, worker, step: torch.Tensor, momentum: float) -> None:
        """``worker``'s push just stepped ``step`` (the gradient as scaled and clipped): its
        next push steps ``momentum`` times that besides its new gradient."""
        term = self.terms.get(worker)
        if term is None:
            term = self.terms[worker] = torch.zeros_like(self.sum)
        self.sum.sub_(term)
        torch.mul(step, momentum, out=term)
        self.sum.add_(term)
        self.updates += 1
        if self.updates % self.RESUM == 0:
            self._resum()

    def forget(self, worker) -> None:
        """``worker`` pushes no more (its connection closed; a retried task connects anew,
        its buffer empty)."""
        if self.terms.pop(worker, None) is not None:
            self._resum()

    def _resum(self) -> None:
        self.sum.zero_()
        for term in self.terms.values():
            self.sum.add_(term)

    def values(self, param: torch.Tensor, lr: float) -> torch.Tensor:
        """What a worker fetches: ``param`` - lr x the sum, a new tensor."""
        return torch.add(param.detach(), self.sum, alpha=-lr)


class Shard:
    def __init__(self, values: torch.Tensor, optimizer: str, lr: float, momentum: float,
                 lr_decay: float = 1.0, average: float = 0.0,
                 schedule: LRSchedule | None = None, clip: float | None = None,
                 ahead: bool = False):
        self.param = torch.nn.Parameter(values.clone(), requires_grad=False)
        self.ahead = Ahead(self.param) if ahead else None         # see "Look-ahead"
        self.average = average
        self.clip = clip
        self.norm_mean, self.norm_steps, self.clipped = 0.0, 0, 0      # see "Clipped pushes"
        self.averaged = None                  # x̄, see the module doc
        if average > 0:
            self.averaged = WeightAverage([self.param], average, 0)
        self.param.grad = torch.zeros_like(self.param)
        opts = {"sgd": lambda: torch.optim.SGD([self.param], lr=lr),
                "momentum": lambda: torch.optim.SGD([self.param], lr=lr, momentum=momentum),
                "adagrad": lambda: torch.optim.Adagrad([self.param], lr=lr),
                "adam": lambda: torch.optim.Adam([self.param], lr=lr),
                "rmsprop": lambda: torch.optim.RMSprop([self.param], lr=lr)}
        self.opt = opts[optimizer]()
        # SGD, with or without momentum: its step done here, op for op as torch's
        # single-tensor SGD does it (state in the optimizer's own state dict), without the
        # wrapper's per-call bookkeeping, which the server would serialize
        self._sgd = optimizer in ("sgd", "momentum")
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

    def apply(self, grad: torch.Tensor, scale: float = 1.0, steps: int = 1,
              epoch_steps: int = 0, summed: int = 1) -> None:
        """One optimizer step on ``grad * scale``, the sum of ``summed`` mini-batch mean
        gradients, counted as ``steps`` mini-batch steps."""
        lr = self.opt.param_groups[0]["lr"] = self.lr_now(epoch_steps)
        g = self.param.grad
        if scale != 1.0:
            torch.mul(grad, scale, out=g)
        else:
            g.copy_(grad)
        if self.clip is not None:
            self._clip(g)
        self.abs_sum += float(torch.linalg.vector_norm(g, 1)) / summed
        self.abs_steps += 1
        if self._sgd:
            self._sgd_step(g, lr)
        else:
            self.opt.step()
        if self.averaged is not None:             # mini-batch steps, k = this push's
            self.averaged.update(steps, epoch_steps)
        self.steps += steps
        self.version += 1
        if self.on_step is not None:
            self.on_step(self, epoch_steps)

    @property
    def avg(self) -> torch.Tensor | None:
        """x̄ as of the last push (None without an average); under the lock."""
        return None if self.averaged is None else self.averaged.current()[0]

    def state(self) -> dict:
        """What a checkpoint keeps of this shard (under its lock): its values, average,
        optimizer state, version, steps and clip's running norm."""
        return {"values": self.param.detach().clone(),
                "average": None if self.avg is None else self.avg.clone(),
                "optimizer": copy.deepcopy(self.opt.state_dict()), "version": self.version,
                "steps": self.steps, "norm": (self.norm_mean, self.norm_steps)}

    def load_state(self, values: torch.Tensor, optimizer: dict, version: int, steps: int,
                   average: torch.Tensor | None, norm: tuple[float, int]) -> None:
        """Restore what ``state()`` kept (under its lock), the optimizer's settings this
        shard's own (load_optimizer)."""
        self.norm_mean, self.norm_steps = float(norm[0]), int(norm[1])
        self.param.data.copy_(values)
        self.load_optimizer(optimizer)
        self.version, self.steps = int(version), int(steps)
        if self.averaged is not None:     # none saved: the average starts at x
            self.load_average(average)

    def load_optimizer(self, saved: dict) -> None:
        """A checkpoint's optimizer state under this shard's own settings (torch's
        load_state_dict takes the saved ones too): the momentum the fit's staleness rule
        gives now, the saved buffer dropped where that momentum is 0."""
        settings = [{k: v for k, v in g.items() if k != "params"}
                    for g in self.opt.param_groups]
        self.opt.load_state_dict(saved)
        for group, mine in zip(self.opt.param_groups, settings):
            group.update(mine)
        if self._sgd and self.opt.param_groups[0]["momentum"] == 0:
            self.opt.state[self.param].pop("momentum_buffer", None)

    def load_average(self, saved: torch.Tensor | None) -> None:
        """A checkpoint's x̄ (None: the average restarts at x), after its steps are set."""
        self.averaged.steps = self.steps
        self.averaged.load_state_dict(None if saved is None else
                                      {"values": [saved], "steps": self.steps})

    def _sgd_step(self, g: torch.Tensor, lr: float) -> None:
        """torch.optim.SGD's step (dampening 0, no weight decay, no Nesterov: how this shard
        builds it), the same ops in the same order, so the values are bit for bit torch's."""
        momentum = self.opt.param_groups[0]["momentum"]
        if momentum != 0:
            state = self.opt.state[self.param]
            buf = state.get("momentum_buffer")
            if buf is None:
                buf = state["momentum_buffer"] = g.detach().clone()
            else:
                buf.mul_(momentum).add_(g, alpha=1)
            g = buf
        self.param.add_(g, alpha=-lr)

    CLIP_AFTER, CLIP_WEIGHT = 20, 0.05      # steps that only build the running norm; its EMA

    def _clip(self, g: torch.Tensor) -> None:
        """Cut ``g`` to ``clip`` x the running mean norm (see the module doc), in place."""
        norm = float(torch.linalg.vector_norm(g))
        if not math.isfinite(norm):
            return                              # the server refuses such pushes before this
        if self.norm_steps >= self.CLIP_AFTER and norm > self.clip * self.norm_mean:
            g.mul_(self.clip * self.norm_mean / norm)
            norm = self.clip * self.norm_mean
            self.clipped += 1
        self.norm_mean = norm if self.norm_steps == 0 else \
            self.norm_mean + self.CLIP_WEIGHT * (norm - self.norm_mean)
        self.norm_steps += 1

    def epoch_lr(self, epoch: int, epoch_steps: int) -> float:
        """The rate of the last step of ``epoch`` (1-based), as the history records it."""
        return self.schedule.at(epoch - 1.0 / max(epoch_steps, 1))

    def fetched(self, epoch_steps: int) -> torch.Tensor:
        """The values a worker fetches, a copy (under the lock): x, or its look-ahead."""
        if self.ahead is None:
            return self.param.detach().clone()
        return self.ahead.values(self.param, self.lr_now(epoch_steps))

    def lr_now(self, epoch_steps: int) -> float:
        """The schedule's rate after the steps applied so far (epochs of ``epoch_steps``)."""
        return self.schedule.at(self.steps / epoch_steps if epoch_steps > 0 else 0.0)
