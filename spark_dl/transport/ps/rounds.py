"""Mode "sync" of the parameter server: the server waits for all workers' pushes of a step,
takes their sample-weighted mean and applies it once; pushes computed on older versions are
dropped. Every worker runs the steps of the largest shard, or with balanced rounds (every
worker's step profile in its hello) its share of the global batch, split so that the
workers' steps take as long (spark_dl.balance)."""

from __future__ import annotations

import threading
import time

import torch

from .wire import PSError

__all__ = ["SyncRounds"]


class SyncRounds:
    """The rounds of ``workers`` workers, each waited for at most ``timeout_s``."""

    def __init__(self, workers: int, timeout_s: float):
        self.workers, self.timeout_s = workers, timeout_s
        self.profiles: dict[int, tuple[float, float, int]] = {}  # worker -> (a, c, cap)
        self.split: dict[int, int] | None = None  # balanced: worker -> rows per step

    def hello(self, worker: int, registered: dict[int, tuple[int, int]],
              cv: threading.Condition, stopped: threading.Event) -> tuple[int, int | None]:
        """(steps per epoch, ``worker``'s rows per step: None, its batch, where the rounds
        are not balanced) once every worker has said hello (``registered``: worker -> (rows,
        batch), under ``cv``)."""
        deadline = time.monotonic() + self.timeout_s
        while len(registered) < self.workers and not stopped.is_set():
            if not cv.wait(timeout=max(0.0, deadline - time.monotonic())):
                raise PSError(f"sync mode: only {len(registered)} of {self.workers} workers "
                              f"arrived")
        steps = max(-(-r // b) for r, b in registered.values())
        if not self.profiles:
            return steps, None
        return self._balanced(worker, registered)

    def _balanced(self, worker: int, registered: dict[int, tuple[int, int]]
                  ) -> tuple[int, int]:
        """(steps per epoch, ``worker``'s rows per step) of balanced rounds: the workers'
        global batch split so that their steps take as long, once for the fit (a retried
        worker gets its share again); an epoch is ceil(rows / global batch) rounds."""
        from ...balance import equal_time_split
        ids = sorted(registered)
        total = sum(registered[w][1] for w in ids)
        if self.split is None:
            if set(self.profiles) != set(ids):
                raise PSError(f"balanced sync rounds need every worker's profile; workers "
                              f"{sorted(set(ids) - set(self.profiles))} sent none")
            rows = [w for w in ids if registered[w][0] > 0]   # empty shards: no share
            fns = [lambda b, a=self.profiles[w][0], c=self.profiles[w][1]: a + c * b
                   for w in rows]
            shares = equal_time_split(total, fns, [self.profiles[w][2] for w in rows])
            self.split = dict.fromkeys(ids, 0) | dict(zip(rows, shares))
        rows = sum(r for r, _ in registered.values())
        return max(1, -(-rows // total)), self.split[worker]

    def collect(self, s, worker: int, grad: torch.Tensor, samples: int, steps: int,
                epoch_steps: int, stopped: threading.Event, posted) -> None:
        """``worker``'s push of the round shard ``s`` collects (under its lock): the round's
        last push applies the mean, the others wait for it. ``posted(s)`` after the step."""
        s.done[worker] += steps               # in the round: done, whoever completes it
        if s.round_sum is None:
            s.round_sum = torch.zeros_like(s.param)
        s.round_sum += grad
        s.round_count += samples
        s.round_workers.add(worker)
        target = s.version + 1
        if len(s.round_workers) >= self.workers:
            s.apply(s.round_sum, 1.0 / max(s.round_count, 1.0), steps, epoch_steps)
            posted(s)
            s.round_sum.zero_()
            s.round_count = 0.0
            s.round_workers.clear()
            s.lock.notify_all()
            return
        deadline = time.monotonic() + self.timeout_s
        while s.version < target and not stopped.is_set():
            if not s.lock.wait(timeout=max(0.0, deadline - time.monotonic())):
                raise PSError(f"sync mode: round {target} of shard incomplete after "
                              f"{self.timeout_s} s (a worker is missing)")
