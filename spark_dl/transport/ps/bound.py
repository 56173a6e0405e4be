"""The stale-synchronous bound of the parameter server (``max_staleness`` = S, any mode): a
worker more than S pushes ahead of the slowest registered worker waits for it."""

from __future__ import annotations

import threading
import time

from .wire import PSError

__all__ = ["StalenessBound"]


class StalenessBound:
    """Every worker's pushes so far; ``wait`` holds one that is too far ahead."""

    def __init__(self, max_staleness: int | None, timeout_s: float):
        self.max_staleness, self.timeout_s = max_staleness, timeout_s
        self._clocks: dict[int, int] = {}         # worker -> pushes so far
        self._cv = threading.Condition()
        self.waits = 0                            # pushes held back

    def join(self, worker: int) -> None:
        """A (re)started worker starts at the slowest."""
        with self._cv:
            others = [c for w, c in self._clocks.items() if w != worker]
            self._clocks[worker] = min(others) if others else 0

    def leave(self, worker: int) -> None:
        """A finished worker holds nobody back."""
        with self._cv:
            self._clocks.pop(worker, None)
            self._cv.notify_all()

    def wait(self, worker: int, stopped: threading.Event) -> None:
        """Count ``worker``'s push; hold it while it is more than max_staleness pushes ahead
        of the slowest registered worker."""
        with self._cv:
            clock = self._clocks.get(worker, 0) + 1
            self._clocks[worker] = clock
            self._cv.notify_all()
            deadline = time.monotonic() + self.timeout_s
            held = False
            while not stopped.is_set() and \
                    clock - min(self._clocks.values()) > self.max_staleness:
                held = True
                if not self._cv.wait(timeout=max(0.0, deadline - time.monotonic())):
                    raise PSError(f"worker {worker} waited {self.timeout_s} s for the slowest "
                                  f"worker (max_staleness={self.max_staleness})")
            self.waits += held

    def close(self) -> None:
        with self._cv:
            self._cv.notify_all()
