"""The parameter server's values at marks of an epoch, for fit's ``validate_every`` under
Downpour and Boosting: copied by the server's own steps, validated after training."""

from __future__ import annotations

import threading
import time

import torch

from ..losses import val_metrics

__all__ = ["ServerSnapshots"]


class ServerSnapshots:
    """The server's validated parameters every ``every`` of an epoch: the step after which
    every shard has crossed a mark copies the parameters; ``evals()`` validates the copies
    after training, so that validation neither stalls the pushes nor takes the driver's
    cores from the server. Each eval's train_seconds runs from the first step the server
    applied."""

    def __init__(self, ps, every: float):
        self.ps, self.every = ps, every
        # (epoch, seconds, parameters, buffers)
        self.taken: list[tuple[float, float, torch.Tensor, torch.Tensor]] = []
        self.t0, self.mark = None, every         # the first step's time, the next mark
        self._lock = threading.Lock()

    def start(self) -> ServerSnapshots:
        for shard in self.ps.shards:
            shard.on_step = self._on_step
        return self

    def _on_step(self, shard, epoch_steps: int) -> None:
        """After a step of ``shard`` (under its lock). One step at a time takes a copy; a
        step that finds another taking one leaves it (no lock held while waiting for a
        second shard's: two shards' steps never wait on each other)."""
        if not self._lock.acquire(blocking=False):
            return
        try:
            if self.t0 is None:
                self.t0 = time.perf_counter()
            t = min(s.steps for s in self.ps.shards) / epoch_steps if epoch_steps else 0.0
            if epoch_steps and t >= self.mark - 1e-9:
                self.taken.append((t, time.perf_counter() - self.t0, self.ps.parameters(),
                                   self.ps.buffers()))
                while self.mark <= t + 1e-9:
                    self.mark += self.every
        finally:
            self._lock.release()

    def stop(self) -> None:
        for shard in self.ps.shards:
            shard.on_step = None

    def evals(self, layout, net, val, loss_fn, classify: bool) -> list[dict]:
        out = []
        for t, seconds, values, buffers in self.taken:
            layout.load(values.to(next(net.parameters()).dtype), buffers)
            out.append({"epoch": round(t, 6), "train_seconds": seconds,
                        **val_metrics(net, val, loss_fn, classify)})
        return out
