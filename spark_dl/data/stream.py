"""A partition larger than the task's memory: spilled once to local disk, streamed back per epoch.

``open_shard`` is what every engine's task calls on the Arrow record batches Spark hands it.
It reads them once, validates every chunk like the in-memory bridge (nulls, ragged rows,
NaN/inf, label range), and either keeps them in memory (``ShardData``) or writes them, in their
storage dtype (pixel bytes stay uint8), to a spill file in Spark's local directory
(``StreamShard``). ``data="auto"`` keeps the partition in memory until it outgrows a quarter of
the task's memory headroom, then spills what it holds and streams the rest.

Each epoch a ``StreamShard`` reads its file back window by window: a random order of chunks,
then a shuffle buffer of at most ``buffer_rows`` rows whose rows are served in a random order.
Every row comes once per epoch; the order depends only on (seed, epoch), so a retried task that
skips the batches it already trained replays the same ones. When the buffer holds the whole
shard the batches are exactly those of ``ShardData.batches`` for the same seed.

The spill files are unlinked as soon as they are opened: the task reads and writes them through
its descriptors, and the kernel frees their blocks when the task ends, finished, failed or
killed.
"""

from __future__ import annotations

import errno
import os
import queue
import re
import tempfile
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence

import numpy as np
import pyarrow as pa
import torch

from ..errors import ConfigError, DataError, ResourceError
from .bridge import (
    ShardData,
    _chunk_view,
    as_batch,
    check_columns,
    ragged_rows,
    read_labels,
    spec_row_bytes,
    storage_dtype,
)
from .memory import is_memory_error, memory_error, memory_headroom

__all__ = ["DATA_MODES", "StreamShard", "open_shard", "parse_buffer", "spill_directory"]

DATA_MODES = ("auto", "memory", "stream")
CHUNK_BYTES = 4 << 20          # rows are read back in chunks of about this size
AUTO_FRACTION = 0.25           # auto: stream once the partition outgrows this part of headroom


def parse_buffer(value: int | str, row_bytes: int | None = None) -> int | tuple[int, str]:
    """``shuffle_buffer`` -> rows. An int is rows; a string is a size ("256MB", "1g"), turned
    into rows once the row size is known (``row_bytes``); without it, checked and returned."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ConfigError(f"shuffle_buffer must be a number of rows (int) or a size such as "
                          f"'256MB', got {value!r}")
    if isinstance(value, int):
        if value < 1:
            raise ConfigError(f"shuffle_buffer must be >= 1 row, got {value}")
        return value
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)i?b?\s*", value.lower())
    if not m or float(m.group(1)) <= 0:
        raise ConfigError(f"shuffle_buffer={value!r} is not a size such as '256MB' or '1g' "
                          f"(or give a number of rows)")
    size = float(m.group(1)) * {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30,
                                "t": 1 << 40}[m.group(2)]
    if row_bytes is None:
        return value
    return max(1, int(size // max(row_bytes, 1)))


def spill_directory(partition: int = 0) -> str:
    """Spark's local directory of this executor (``SPARK_LOCAL_DIRS``, set for Python workers
    from spark.local.dir / the cluster manager's), one of several by partition; else the
    system's temporary directory."""
    dirs = [d for d in os.environ.get("SPARK_LOCAL_DIRS", "").split(",") if d]
    return dirs[partition % len(dirs)] if dirs else tempfile.gettempdir()


class _SpillFile:
    """An anonymous file on local disk: created, opened and unlinked at once, so its blocks go
    back to the filesystem when the descriptor closes, however the process ends."""

    def __init__(self, directory: str, where: str):
        self.directory, self.where, self.size = directory, where, 0
        try:
            os.makedirs(directory, exist_ok=True)
            fd, path = tempfile.mkstemp(prefix="spark_dl-spill-", dir=directory)
        except OSError as e:
            raise ResourceError(f"cannot create a spill file for the {where} in {directory}: "
                                f"{e.strerror}; point spark.local.dir (SPARK_LOCAL_DIRS) at a "
                                f"writable local disk") from e
        os.unlink(path)
        self.fd = fd

    def append(self, data: np.ndarray) -> None:
        view = memoryview(np.ascontiguousarray(data)).cast("B")
        need = len(view)
        try:
            free = os.statvfs(self.directory)
            if free.f_bavail * free.f_frsize < need:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            while len(view):
                n = os.pwrite(self.fd, view, self.size)
                view, self.size = view[n:], self.size + n
        except OSError as e:
            if e.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
                raise
            raise ResourceError(
                f"the local disk is full: spilling the {self.where} to {self.directory} "
                f"needs at least {need:,} more bytes ({self.size:,} written so far; "
                f"{e.strerror}); free space there, point spark.local.dir (SPARK_LOCAL_DIRS) at "
                f"a larger disk, or split the data into more partitions") from None

    def truncate(self, size: int) -> None:
        """Keep the first ``size`` bytes (the rest goes back to the filesystem)."""
        os.ftruncate(self.fd, size)
        self.size = size

    def read_into(self, buf: np.ndarray, offset: int) -> None:
        view = memoryview(buf).cast("B")
        while len(view):
            n = os.preadv(self.fd, [view], offset)
            if n == 0:
                raise DataError(f"the spill file of the {self.where} ended early")
            view, offset = view[n:], offset + n

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class StreamShard:
    """The rows of one partition on local disk, served as shuffled mini-batches per epoch.

    Same interface as ``ShardData`` for the engines: ``len``, ``num_batches``, ``batches``,
    ``spec``, ``empty_batch`` and ``close`` (which the engines call when their task ends).
    """

    kind = "stream"

    def __init__(self, where: str, feature_shape: tuple, feature_dtype: np.dtype,
                 label_spec: tuple | None, buffer: int | str, directory: str | None = None):
        self.where, self.feature_shape = where, tuple(feature_shape)
        self.feature_dtype = np.dtype(feature_dtype)
        self.label_spec = None if label_spec is None else (tuple(label_spec[0]),
                                                           np.dtype(label_spec[1]))
        self.directory = directory or spill_directory()
        self.rows = 0
        self._x = _SpillFile(self.directory, where)
        self._y = _SpillFile(self.directory, where) if label_spec is not None else None
        row_bytes = self.row_bytes
        self.buffer_rows = parse_buffer(buffer, row_bytes)
        self.peak_buffer_rows = 0          # the most rows held by batches() at once, for checks

    @property
    def row_bytes(self) -> int:
        return sum(spec_row_bytes(self.spec()))

    def append(self, x: np.ndarray, y: np.ndarray | None) -> None:
        """Rows (validated, in the storage dtypes) at the end of the spill file."""
        assert x.shape[1:] == self.feature_shape and x.dtype == self.feature_dtype
        self._x.append(x)
        if self._y is not None:
            self._y.append(y)
        self.rows += len(x)

    @property
    def spilled_bytes(self) -> int:
        return self._x.size + (self._y.size if self._y is not None else 0)

    def __len__(self) -> int:
        return self.rows

    def spec(self) -> tuple:
        """(feature shape, feature dtype, label (shape, dtype) or None): what a peer needs to
        make an empty batch of this shard's kind."""
        return self.feature_shape, self.feature_dtype, self.label_spec

    def empty_batch(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        return ShardData.from_spec(self.spec()).empty_batch()

    def num_batches(self, batch_size: int, drop_last: bool = False) -> int:
        n = len(self)
        return n // batch_size if drop_last else -(-n // batch_size)

    # -- rows moved between replicas (spark_dl.balance.move_rows) ---------------------------

    def tail(self, k: int, chunk_bytes: int = CHUNK_BYTES
             ) -> Iterator[tuple[np.ndarray, np.ndarray | None]]:
        """The last ``k`` rows, in order, read back in chunks of about ``chunk_bytes``."""
        n, per = len(self), max(1, chunk_bytes // max(self.row_bytes, 1))
        for lo in range(n - k, n, per):
            yield self._read([(lo, min(lo + per, n))])

    def truncate(self, n: int) -> None:
        """Keep the first ``n`` rows (the spill files shrink with them)."""
        x_row, y_row = spec_row_bytes(self.spec())
        self._x.truncate(n * x_row)
        if self._y is not None:
            self._y.truncate(n * y_row)
        self.rows = n

    def extend(self, chunks: Iterable[tuple[np.ndarray, np.ndarray | None]]) -> None:
        """Rows appended to the spill files as they come (memory: one chunk)."""
        for x, y in chunks:
            self.append(x, y)

    def close(self) -> None:
        self._x.close()
        if self._y is not None:
            self._y.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- reading back ------------------------------------------------------------------------

    def _read(self, ranges: list[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray | None]:
        """The rows of ``ranges`` (lo, hi), in that order, read into one array each."""
        size = sum(hi - lo for lo, hi in ranges)
        x = np.empty((size, *self.feature_shape), self.feature_dtype)
        y = None if self._y is None else np.empty((size, *self.label_spec[0]),
                                                  self.label_spec[1])
        at = 0
        for lo, hi in ranges:
            self._x.read_into(x[at:at + hi - lo], lo * (x.nbytes // max(size, 1)))
            if y is not None:
                self._y.read_into(y[at:at + hi - lo], lo * (y.nbytes // max(size, 1)))
            at += hi - lo
        return x, y

    def _windows(self, batch_size: int, shuffle: bool, seed: int, epoch: int):
        """The epoch as windows: [(list of (lo, hi) row ranges, rng or None)]. The rows of a
        window are read together and served in the rng's permutation (in order without)."""
        n, B = len(self), self.buffer_rows
        if n <= B:                 # the whole shard at once: exactly ShardData's order
            return [([(0, n)], np.random.default_rng([seed, epoch]) if shuffle else None)]
        if B < batch_size:
            raise ConfigError(f"shuffle_buffer holds {B} rows, fewer than batch_size "
                              f"{batch_size}; give it at least one batch of rows")
        room = B - (batch_size - 1)            # the tail of a window waits for the next one
        chunk = max(1, min(CHUNK_BYTES // max(self.row_bytes, 1), room // 16))
        ranges = [(lo, min(lo + chunk, n)) for lo in range(0, n, chunk)]
        if not shuffle:
            per = max(1, room // chunk)
            return [(ranges[i:i + per], None) for i in range(0, len(ranges), per)]
        order = np.random.default_rng([seed, epoch, 1]).permutation(len(ranges))
        per = max(1, room // chunk)
        return [([ranges[j] for j in order[i:i + per]],
                 np.random.default_rng([seed, epoch, 2, i // per]))
                for i in range(0, len(order), per)]

    def _rows(self, batch_size: int, shuffle: bool, seed: int, epoch: int, drop_last: bool,
              skip: int) -> Iterator[tuple[np.ndarray, np.ndarray | None]]:
        """The epoch's mini-batches as numpy arrays in the storage dtypes."""
        total = self.num_batches(batch_size, drop_last) * batch_size
        cur = skip * batch_size                  # the epoch's next row to serve
        done = 0                                 # rows of the epoch before this window
        pending: list[tuple] = []                # a batch begun in the last window
        held = 0
        self.peak_buffer_rows = 0
        for ranges, rng in self._windows(batch_size, shuffle, seed, epoch):
            size = sum(hi - lo for lo, hi in ranges)
            if done >= total:
                break
            if done + size <= cur:               # skipped without reading it
                done += size
                continue
            x, y = self._read(ranges)
            self.peak_buffer_rows = max(self.peak_buffer_rows, size + held)
            order = rng.permutation(size) if rng is not None else np.arange(size)
            a, stop = cur - done, min(size, total - done)
            while a < stop:
                take = min(batch_size - held, stop - a)
                idx = order[a:a + take]
                if rng is not None:
                    idx = np.sort(idx)            # sorted: cache-friendly, as ShardData
                pending.append((x[idx], None if y is None else y[idx]))
                a, held = a + take, held + take
                if held == batch_size:
                    yield _joined(pending)
                    pending, held = [], 0
            cur = done + a
            done += size
            del x, y
        if pending:
            yield _joined(pending)

    def batches(self, batch_size: int, shuffle: bool = True, seed: int = 0, epoch: int = 0,
                drop_last: bool = False, skip: int = 0,
                transform: Callable | None = None, prefetch: int | None = None
                ) -> Iterator[tuple[torch.Tensor, torch.Tensor | None]]:
        """Mini-batches of one epoch. ``transform(x, y)`` replaces the conversion (numpy
        arrays in the storage dtypes -> tensors). ``prefetch``: batches read and converted
        ahead by a background thread; default 2 with a transform (the user's decoding
        overlaps the step), else 0: the default conversion costs less inline than a thread
        competing with torch's own threads for the cores. ``skip``: start after that many
        batches."""
        if prefetch is None:
            prefetch = 2 if transform is not None else 0
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if skip < 0:
            raise ValueError(f"skip must be >= 0, got {skip}")
        rows = self._rows(batch_size, shuffle, seed, epoch, drop_last, skip)
        batches = (as_batch(x, y, transform) for x, y in rows)
        return _prefetched(batches, prefetch) if prefetch else batches


def _joined(parts: list[tuple]) -> tuple[np.ndarray, np.ndarray | None]:
    if len(parts) == 1:
        return parts[0]
    return (np.concatenate([p[0] for p in parts]),
            None if parts[0][1] is None else np.concatenate([p[1] for p in parts]))


def _prefetched(items: Iterator, depth: int) -> Iterator:
    """``items`` produced by a background thread, at most ``depth`` ahead; stops the thread
    when the consumer stops early; re-raises its errors here."""
    q: queue.Queue = queue.Queue(depth)
    stop = threading.Event()
    end = object()

    def produce():
        try:
            for item in items:
                while not stop.is_set():
                    try:
                        q.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if stop.is_set():
                    return
            q.put(end)
        except BaseException as e:                # handed to the consumer
            q.put(e)

    thread = threading.Thread(target=produce, daemon=True, name="spark_dl-prefetch")
    thread.start()
    try:
        while True:
            item = q.get()
            if item is end:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
        while thread.is_alive():                  # unblock a producer waiting on a full queue
            try:
                q.get_nowait()
            except queue.Empty:
                pass
            thread.join(0.05)


def open_shard(batches: Iterable[pa.RecordBatch], features: str = "features",
               label: str | None = "label", shape: Sequence[int] = (),
               label_shape: Sequence[int] = (), num_classes: int | None = None,
               where: str = "partition", data: str = "auto", shuffle_buffer: int | str = "256MB",
               directory: str | None = None, memory_budget: int | None = None,
               class_ids: bool = False) -> ShardData | StreamShard:
    """A partition's record batches -> a ShardData (in memory) or a StreamShard (spilled).

    data: "memory" (a partition larger than memory fails with a ResourceError that says so),
    "stream" (always spilled), "auto" (in memory until the rows read outgrow
    ``memory_budget`` bytes, by default a quarter of the task's memory headroom, then spilled).
    Features may be Spark ML vectors; labels are class ids (int64, doubles holding whole
    numbers accepted) with ``num_classes`` or ``class_ids`` (bridge.read_labels).
    """
    if data not in DATA_MODES:
        raise ConfigError(f"data must be one of {', '.join(DATA_MODES)}, got {data!r}")
    parse_buffer(shuffle_buffer)
    if data == "memory":
        return ShardData.from_arrow(batches, features, label, shape, label_shape, num_classes,
                                    where, class_ids)
    budget = 0 if data == "stream" else \
        memory_budget if memory_budget is not None else int(AUTO_FRACTION * memory_headroom())
    held: list[tuple[np.ndarray, np.ndarray | None]] = []
    held_bytes, row0, stream, dtypes, first_shape = 0, 0, None, None, None
    try:
        for b in batches:
            if not b.num_rows:
                continue
            if dtypes is None:
                check_columns(b.schema.names, features, label, where)
                dtypes = storage_dtype(b.schema.field(features).type)
            x = _chunk_view(b.column(features), features, shape, where, row0, dtypes)
            y = None
            if label:
                y = read_labels(b.column(label), label, label_shape, where, num_classes,
                                class_ids, row0)
            if first_shape is None:
                first_shape = x.shape[1:]
            elif x.shape[1:] != first_shape or \
                    (held and y is not None and y.dtype != held[0][1].dtype):
                raise ragged_rows(features, where, {first_shape[0], x.shape[1]})
            row0 += len(x)
            if stream is None:
                held.append((x, y))
                held_bytes += x.nbytes + (y.nbytes if y is not None else 0)
                if held_bytes <= budget:
                    continue
                first_x, first_y = held[0]
                stream = StreamShard(where, first_x.shape[1:], first_x.dtype,
                                     None if first_y is None else
                                     (first_y.shape[1:], first_y.dtype),
                                     shuffle_buffer, directory)
                for hx, hy in held:
                    stream.append(hx, hy)
                held = []
            else:
                stream.append(x, y)
    except BaseException as e:
        if stream is not None:
            stream.close()
        if isinstance(e, Exception) and is_memory_error(e):
            raise memory_error(where, held_bytes, e) from None
        raise
    if stream is not None:
        return stream
    if not held:
        return ShardData.from_arrow([], features, label, shape, label_shape, num_classes, where,
                                    class_ids)
    return ShardData([h[0] for h in held], None if not label else
                     np.concatenate([h[1] for h in held]))
