"""The server's shard versions on a memory-mapped page, for the workers on the driver's own
machine (local mode, or executors beside the driver): a worker that wants values newer than
its own (Boosting's fresh values, before each mini-batch) reads the versions there and asks
the server only when one has moved, where it otherwise sent a request and read a reply for
each mini-batch, four system calls that mostly answered "unchanged".

The board is a hint, never a source of values: the values still come over the
authenticated channel, and a worker's versions only ever come from the server's replies, so
a board that lies can make a worker ask more, or take the newer values at its next push
rather than mid-key, nothing else. It is a file in the run directory, made new for each fit
(the driver's user's alone, 0600), of the fit's token and one int64 per shard, which the
server writes after each step (an aligned 8-byte store) and a worker maps read-only. A
worker on another machine (the host's name and boot id differ), one that cannot map it, or
one that finds another fit's token there, goes on asking the server.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import platform
import secrets
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
    return f"{platform.node()}/{boot}"


class VersionBoard:
    """The server's side: the fit's ``token`` and ``shards`` versions, 0 at first, in a new
    file at ``path`` (one left there, by an earlier fit of the run directory, is replaced).
    Raises OSError where the file cannot be made or mapped (then there is no board)."""

    def __init__(self, path: str | Path, shards: int):
        self.path = Path(path)
        self.token = secrets.randbits(63)
        self.path.unlink(missing_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL
                     | getattr(os, "O_NOFOLLOW", 0), 0o600)
        try:
            # written, not just sized: a full disk fails here, not as a SIGBUS on a store
            os.write(fd, np.array([self.token] + [0] * shards, np.int64).tobytes())
            self._map = mmap.mmap(fd, 8 * (shards + 1))
        except BaseException:
            os.close(fd)
            self.path.unlink(missing_ok=True)
            raise
        os.close(fd)
        self._v = np.frombuffer(self._map, dtype=np.int64)[1:]

    def ticket(self) -> tuple[str, str, int]:
        """What a worker needs to find and check the board: (its path, this machine's
        ``host_id()``, the fit's token), for ``BoardReader.open``."""
        return str(self.path), host_id(), self.token

    def write(self, shard: int, version: int) -> None:
        v = self._v
        if v is not None:                  # a push that raced the server's close: dropped
            v[shard] = version

    def close(self) -> None:
        """Removed (a worker still reading its own mapping reads the last versions, and
        asks the server from then on only if they differ from its own)."""
        self._v = None
        self.path.unlink(missing_ok=True)
        with contextlib.suppress(BufferError):   # a view still held: unmapped when freed
            self._map.close()


class BoardReader:
    """A worker's side: the versions the server last wrote, read from the mapped page."""

    def __init__(self, values: np.ndarray):
        self._v = values

    @classmethod
    def open(cls, ticket: tuple[str, str, int] | None, shards: int) -> BoardReader | None:
        """The board of ``ticket`` (``VersionBoard.ticket()``: path, machine, token) when
        this worker runs on that machine, can map the file and finds there the fit's token
        and ``shards`` versions; else None (ask the server every time)."""
        if ticket is None:
            return None
        path, host, token = ticket
        if host != host_id():
            return None
        try:
            with open(path, "rb") as f:
                page = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError):
            return None
        values = np.frombuffer(page, dtype=np.int64) if len(page) % 8 == 0 else None
        if values is None or len(values) != shards + 1 or int(values[0]) != token:
            return None
        return cls(values[1:])

    def version(self, shard: int) -> int:
        return int(self._v[shard])
