"""The data-key scheduler of seed 000's boosting parameter server: the training data is cut
into keys (chunks of rows, e.g. the Parquet files of a dataset); every epoch the driver hands
them out in a new random order, one at a time, to whichever worker asks next, so a faster
worker takes more keys and a late or restarted worker takes the next unserved ones.

Exactly once per epoch: a key leased to a worker is done only when that worker's push for it
has been applied by the parameter server (``applied``, called by the server under its lock,
each worker pushing once per key), so a worker that dies before its push leaves the key
undone, and the key is served again: to the same worker id when Spark retries its task
(``next`` from a worker that still holds a lease returns that key), or to anyone once the
lease is older than ``lease_s``. An epoch ends when all its keys are done; a worker asking
meanwhile waits (``{"wait": seconds}``) rather than run ahead into the next epoch's keys.
"""

from __future__ import annotations

import threading
import time

import numpy as np

from ...errors import ConfigError

__all__ = ["KeyScheduler"]


class KeyScheduler:
    """``n_keys`` keys over ``epochs`` epochs for ``workers`` workers (ids 0..workers-1)."""

    def __init__(self, n_keys: int, epochs: int, workers: int, seed: int = 0,
                 lease_s: float = 300.0, start_epoch: int = 0):
        if workers < 1 or epochs < 1:
            raise ConfigError(f"the key scheduler needs workers >= 1 and epochs >= 1, got "
                              f"workers={workers}, epochs={epochs}")
        if n_keys < workers:
            raise ConfigError(f"{n_keys} data keys for {workers} workers: every worker needs a "
                              f"key to start with; cut the data into more keys (smaller "
                              f"chunks) or use fewer workers")
        self.n_keys, self.epochs, self.workers, self.seed = n_keys, epochs, workers, seed
        self.lease_s = lease_s
        self._lock = threading.Lock()
        self.epoch = start_epoch
        self.served: list[list[tuple[int, int]]] = []  # per epoch: (key, worker) as applied
        self.reissued = 0                              # keys served again after a failure
        self._start(start_epoch)

    def _start(self, epoch: int) -> None:
        self.epoch = epoch
        order = np.random.default_rng([self.seed, epoch]).permutation(self.n_keys)
        self._queue = [int(k) for k in order]          # not yet served, in serving order
        self._leases: dict[int, tuple[int, float]] = {}   # worker -> (key, since)
        self._done: set[int] = set()
        if epoch < self.epochs:
            self.served.append([])

    @property
    def finished(self) -> bool:
        return self.epoch >= self.epochs

    def next(self, worker: int, now: float | None = None) -> dict:
        """The next key for ``worker``: {"key", "epoch"}, {"wait": s} while the epoch's last
        keys are being trained elsewhere, or {"finished": True}."""
        now = time.monotonic() if now is None else now
        with self._lock:
            if self.finished:
                return {"finished": True}
            if worker in self._leases:                 # a retried task: its key again
                key, _ = self._leases[worker]
                self._leases[worker] = (key, now)
                self.reissued += 1
                return {"key": key, "epoch": self.epoch}
            for w, (key, since) in list(self._leases.items()):
                if now - since > self.lease_s:         # a worker gone for good
                    del self._leases[w]
                    self._queue.insert(0, key)
                    self.reissued += 1
            if not self._queue:
                return {"wait": 0.05}
            key = self._queue.pop(0)
            self._leases[worker] = (key, now)
            return {"key": key, "epoch": self.epoch}

    def applied(self, worker: int) -> int | None:
        """The server is applying ``worker``'s push: its leased key is done (returns it). None
        when the worker holds no lease (it outlived its lease, and its key went to another):
        the server must drop that push, or the key would be trained twice. When all of the
        epoch's keys are done the next epoch starts."""
        with self._lock:
            lease = self._leases.pop(worker, None)
            if lease is None:
                return None
            key = lease[0]
            if key in self._done:                      # cannot happen: leases are unique
                raise RuntimeError(f"key {key} applied twice in epoch {self.epoch}")
            self._done.add(key)
            self.served[-1].append((key, worker))
            if len(self._done) == self.n_keys:
                self._start(self.epoch + 1)
            return key

    def state(self) -> dict:
        with self._lock:
            return {"epoch": self.epoch, "done": len(self._done), "leased":
                    {w: k for w, (k, _) in self._leases.items()}, "reissued": self.reissued,
                    "keys_per_worker": [
                        [sum(1 for _, w in ep if w == worker) for worker in range(self.workers)]
                        for ep in self.served]}
