"""The held-out evaluation of a barrier-stage fit: after every epoch and every
``validate_every`` of an epoch within it."""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from ..data.device import model_input
from .buffers import collective_device, sync_buffers

__all__ = ["Validation", "mid_epoch_steps"]


def mid_epoch_steps(steps: int, every: float) -> set[int]:
    """The steps (0-based) of an epoch of ``steps`` after which a fit that validates every
    ``every`` of an epoch validates before the epoch's end (which always validates)."""
    if every >= 1.0 or steps < 2:
        return set()
    marks, j = set(), 1
    while j * every < 1.0 - 1e-9:
        marks.add(min(max(math.ceil(j * every * steps) - 1, 0), steps - 2))
        j += 1
    return marks


class Validation:
    """The held-out evaluation: after every epoch, and every ``cfg.validate_every`` of an
    epoch within it. ``evals`` lists each with the fractional epoch and the training seconds
    so far; validation's own time is kept out of that clock and out of the epochs' seconds
    (StepReports.pause). ``due(step)`` is the same on every rank, for strategies whose
    validated model takes a collective (Gossip's average).

    Replica 0 reports it. With ``shared`` (replicas that hold the same model: AllReduce) and
    a named loss, each of the ``world`` replicas evaluates its own part of the rows and the
    sums are all-reduced (one collective of 3 numbers): the others would otherwise wait while
    replica 0 evaluates everything, a pause that grows with the replicas (at 16 replicas on
    16 cores, validating a quarter epoch takes as long as training it). With ``lockstep``
    (every forward of the model is a collective: FSDP's shards) every replica evaluates all
    the rows, in the same chunks, on the replicas' mean buffers, and replica 0 reports."""

    def __init__(self, cfg, validation, rank: int, dtype, device, client,
                 steps: int, loss_fn, world: int = 1, shared: bool = False,
                 lockstep: bool = False):
        from ..losses import LOSSES
        self.lockstep = validation is not None and lockstep
        self.on = validation is not None and (rank == 0 or self.lockstep)
        self.report = validation is not None and rank == 0
        self.none = validation is None            # the same on every rank
        self.shared = validation is not None and shared and world > 1 and \
            cfg.loss in LOSSES and not lockstep
        self.marks = mid_epoch_steps(steps, cfg.validate_every) \
            if validation is not None else set()
        self.val = None
        if self.on or self.shared:
            n = len(validation[0])
            lo, hi = (rank * n // world, (rank + 1) * n // world) if self.shared else (0, n)
            self.val = (model_input(torch.as_tensor(validation[0][lo:hi]), device, dtype),
                        torch.as_tensor(validation[1][lo:hi], device=device))
        self.classify = cfg.loss == "cross_entropy"
        self.world, self.device = world, device
        self.client, self.steps, self.loss_fn = client, steps, loss_fn
        self.t0, self.seconds, self.evals = time.perf_counter(), 0.0, []

    def due(self, step: int) -> bool:
        return step in self.marks

    @property
    def by(self) -> str:
        """Who validates (info["validated_by"] of a fit with validation rows)."""
        if self.lockstep:
            return f"{self.world} replicas, all the rows each"
        return f"{self.world} replicas, a part each" if self.shared else "replica 0"

    def maybe(self, model_of: Callable[[], torch.nn.Module], epoch: int, step: int,
              reports) -> None:
        """Validate after ``step`` if one is due there; ``model_of()`` gives the model (read
        only then: an averaged model is made up when it is read)."""
        if self.due(step):
            self.run(model_of, epoch + (step + 1) / self.steps, reports)

    def epoch_end(self, model, epoch: int, reports) -> dict:
        return self.run(model, epoch + 1, reports)

    def run(self, model, t: float, reports) -> dict:
        """Evaluate ``model`` (a module, or a function that makes it: called on every rank
        when the fit validates, never without validation rows, in validation's time) at
        fractional epoch ``t``: the row on replica 0, {} elsewhere. Collective when
        ``shared``: every rank calls it at the same step."""
        if self.none:
            return {}
        start = time.perf_counter()
        if callable(model) and not isinstance(model, torch.nn.Module):
            model = model()                  # (a collective for some strategies)
        if not (self.on or self.shared):
            return {}
        from ..losses import evaluation_row, evaluation_sums
        if self.shared or self.lockstep:   # one model on every replica, statistics too
            sync_buffers(model, self.world, self.device)
        sums = evaluation_sums(model, self.val, self.loss_fn, self.classify)
        if self.shared:
            where = collective_device(sums.device)
            total = sums.to(where)
            dist.all_reduce(total)
            sums = total
        spent = time.perf_counter() - start
        self.seconds += spent
        if t != int(t):
            reports.pause(spent)
        if not self.report:
            return {}
        row = evaluation_row(sums, self.classify)
        self.evals.append({"epoch": round(t, 6),
                           "train_seconds": start - self.t0 - (self.seconds - spent), **row})
        self.client.send({"type": "eval", **self.evals[-1]})
        return row
