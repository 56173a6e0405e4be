"""Data keys at the parameter server (Boosting; mode "sequential", one shard): the workers
ask the server for their next key (op "key", reply int64 [status, key, epoch]: status 0 a
key, 1 wait that many milliseconds, 2 finished) and push once per key; a push is applied
only when its worker still holds the key's lease (else it is dropped: the key went to
another worker), and when it completes an epoch the server keeps its state of that moment
for the driver to validate and checkpoint."""

from __future__ import annotations

import threading
import time

import numpy as np

__all__ = ["KeyLeases"]


class KeyLeases:
    """The server's part of a key scheduler (spark_dl.strategies.boosting.keys.KeyScheduler,
    or anything with its ``epoch``, ``next(worker)`` and ``applied(worker)``)."""

    def __init__(self, scheduler):
        self.scheduler = scheduler
        self.states: dict[int, dict] = {}         # epoch -> the server's state at its end
        self._cv = threading.Condition()
        self._closed = False

    def reply(self, worker: int) -> np.ndarray:
        """The answer to ``worker``'s key request (see the module doc)."""
        got = self.scheduler.next(worker)
        reply = [2, 0, 0] if got.get("finished") else \
            [1, max(1, round(got["wait"] * 1000)), 0] if "wait" in got else \
            [0, got["key"], got["epoch"]]
        return np.array(reply, np.int64)

    def take(self, worker: int) -> int | None:
        """``worker``'s push is being applied: the epoch its key belongs to, or None when
        the worker holds no lease (its key went to another: the push must be dropped)."""
        epoch = self.scheduler.epoch
        return None if self.scheduler.applied(worker) is None else epoch

    def ended(self, epoch: int) -> bool:
        """Whether the key just applied, of 0-based ``epoch``, was that epoch's last."""
        return self.scheduler.epoch > epoch

    def keep(self, epoch: int, state: dict) -> None:
        """The server's ``state`` at the end of 1-based ``epoch``."""
        with self._cv:
            self.states[epoch] = state
            self._cv.notify_all()

    def next_epoch_state(self, epoch: int, timeout_s: float) -> dict | None:
        """The server's state_dict() when epoch ``epoch`` (1-based) ended, waiting up to
        ``timeout_s`` for it (None if it did not end, or the server closed)."""
        deadline = time.monotonic() + timeout_s
        with self._cv:
            while epoch not in self.states and not self._closed:
                if not self._cv.wait(timeout=max(0.0, deadline - time.monotonic())):
                    break
            return self.states.pop(epoch, None)

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
