"""The server's shard versions on a page of shared memory, for the workers on the driver's own
machine (local mode, or executors beside the driver): a worker that wants values newer than
its own (Boosting's fresh values, before each mini-batch) reads the versions there and asks
the server only when one has moved, where it otherwise sent a request and read a reply for
each mini-batch, four system calls that mostly answered "unchanged".

The board is a hint, never a source of values: the values still come over the
authenticated channel. It is a file of one int64 per shard in the run directory, the
driver's user's alone (0600), which the server writes after each step (an aligned 8-byte
store) and a worker maps read-only. A worker on another machine (the host's name and boot id
differ), or one that cannot open it, goes on asking the server.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

__all__ = ["BoardReader", "VersionBoard", "host_id"]


def host_id() -> str:
    """This machine: its name and the kernel's boot id (a container's name may repeat);
    equal for processes that can share memory (the barrier tasks' too: runtime/stage.py)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = ""
    return f"{os.uname().nodename}/{boot}"


class VersionBoard:
    """The server's side: ``shards`` versions, 0 at first, at ``path`` (made, or emptied)."""

    def __init__(self, path: str | Path, shards: int):
        self.path = Path(path)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(fd, 8 * shards)
        finally:
            os.close(fd)
        self._v = np.memmap(self.path, dtype=np.int64, mode="r+", shape=(shards,))

    def write(self, shard: int, version: int) -> None:
        self._v[shard] = version

    def close(self) -> None:
        """Unmapped and removed: a worker still reading its own mapping reads the last
        versions, and asks the server from then on only if they differ from its own."""
        self._v = None
        self.path.unlink(missing_ok=True)


class BoardReader:
    """A worker's side: the versions the server last wrote, read from the shared page."""

    def __init__(self, values: np.memmap):
        self._v = values

    @classmethod
    def open(cls, path: str | None, host: str) -> BoardReader | None:
        """The board at ``path`` when this worker runs on the machine ``host`` (``host_id()``
        of the driver) and can map it; else None (ask the server every time)."""
        if not path or host != host_id():
            return None
        try:
            return cls(np.memmap(path, dtype=np.int64, mode="r"))
        except (OSError, ValueError):
            return None

    def version(self, shard: int) -> int:
        return int(self._v[shard])
