"""One partition's Arrow record batches -> a stream of torch mini-batches.

This is the bridge every engine uses inside its Spark tasks (``df.mapInArrow(task)``): the
partition is read once into contiguous numpy arrays straight from the Arrow buffers (no per-row
Python objects), validated (nulls, ragged rows, NaN/inf, label range), and then served as
shuffled mini-batches per epoch.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Iterator, Sequence

import numpy as np
import pyarrow as pa
import torch

from ..errors import DataError
from .memory import address_headroom, memory_error

__all__ = ["ShardData", "as_batch", "column_chunks", "column_to_numpy", "spec_row_bytes",
           "storage_dtype"]



def storage_dtype(t: pa.DataType) -> np.dtype:
    """How a feature column is held between reading and the batch: binary columns (one
    image's pixel bytes per row) and arrays of uint8 stay uint8, other integers (token ids:
    arrays or scalars of int8..int64, uint16..uint64) keep their Arrow type, everything else
    float32."""
    if pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_fixed_size_binary(t):
        return np.dtype(np.uint8)
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        t = t.value_type
    if pa.types.is_integer(t):
        return np.dtype(t.to_pandas_dtype())
    return np.dtype(np.float32)


def as_batch(x: np.ndarray, y: np.ndarray | None, transform=None
             ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One mini-batch's rows (storage dtypes) -> tensors: uint8 features become float32 in
    [0, 1], other integers int64 (ids, exact), floats are passed as they are;
    ``transform(x, y)`` replaces this conversion (the user's own decoding or augmentation) and
    returns the tensors itself."""
    if transform is not None:
        return transform(x, y)
    if x.dtype == np.uint8:
        xt = torch.from_numpy(x).to(torch.float32).div_(255.0)
    elif x.dtype.kind in "iu":
        xt = torch.from_numpy(x.astype(np.int64, copy=False))
    else:
        xt = torch.from_numpy(x)
    return xt, None if y is None else torch.from_numpy(y)


def check_columns(names: Sequence[str], features: str, label: str | None, where: str) -> None:
    missing = [c for c in [features] + ([label] if label else []) if c not in names]
    if missing:
        raise DataError(f"column(s) {missing} not found in the {where}; it has "
                        f"{list(names)}; set features=/label= to the right names")


def check_labels(y: np.ndarray, label: str, num_classes: int | None, where: str,
                 row0: int = 0) -> None:
    """Class ids in 0..num_classes-1 (rows numbered from row0 in the error)."""
    if num_classes is None:
        return
    if y.dtype.kind != "i":
        raise DataError(f"column '{label}' must hold integer class ids for "
                        f"num_classes={num_classes}, got {y.dtype}")
    bad = np.flatnonzero((y < 0) | (y >= num_classes))
    if len(bad):
        r = int(bad[0])
        raise DataError(f"column '{label}': row {row0 + r} of the {where} has label "
                        f"{int(y[r])}, outside 0..{num_classes - 1}; fix the labels "
                        f"or set num_classes")


def column_chunks(col: pa.Array | pa.ChunkedArray | Sequence[pa.Array], name: str,
                  shape: Sequence[int] = (), where: str = "partition",
                  dtype: np.dtype | None = None) -> list[np.ndarray]:
    """Arrow column (an array, a chunked array or a list of chunks) -> validated numpy chunks.

    Chunks are zero-copy, read-only views of the Arrow buffers where the type allows (a cast
    to ``dtype`` copies); empty chunks are dropped. Rows are numbered across chunks in errors.
    """
    chunks = col.chunks if isinstance(col, pa.ChunkedArray) else \
        [col] if isinstance(col, pa.Array) else list(col)
    views, row0 = [], 0
    for chunk in chunks:
        if len(chunk):
            views.append(_chunk_view(chunk, name, shape, where, row0, dtype))
        row0 += len(chunk)
    if len({v.shape[1:] for v in views}) > 1:
        raise ragged_rows(name, where, {v.shape[1] for v in views})
    return views


def ragged_rows(name: str, where: str, lengths) -> DataError:
    """The error for a column whose chunks hold rows of different lengths."""
    return DataError(f"column '{name}': rows of the {where} have different lengths "
                     f"{sorted(lengths)}; give shape= or fix the ragged rows")


def column_to_numpy(col: pa.Array | pa.ChunkedArray | Sequence[pa.Array], name: str,
                    shape: Sequence[int] = (), where: str = "partition",
                    dtype: np.dtype | None = None) -> np.ndarray:
    """Arrow column -> one writable numpy array (n, *shape), validated (see column_chunks).

    Scalar columns (shape ``()``) keep their numeric kind (integers -> int64, floats ->
    float32) unless ``dtype`` is given; list / fixed-size-list columns of numbers become
    float32 rows of ``prod(shape)`` values, reshaped to ``shape``.
    """
    views = column_chunks(col, name, shape, where, dtype)
    if not views:
        return np.zeros((0, *shape), dtype or np.float32)
    return _join(views)


def _torch_view(arr: np.ndarray) -> torch.Tensor:
    """A tensor sharing ``arr``'s memory, read-only Arrow buffers included; never written."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "The given NumPy array is not writable")
        return torch.from_numpy(arr)


def _join(chunks: list[np.ndarray]) -> np.ndarray:
    """The one copy: Arrow chunks -> one writable array.

    np.concatenate, not torch.cat: a fresh large torch tensor costs several times more, its
    pages being faulted in one by one.
    """
    if len(chunks) == 1 and chunks[0].flags.writeable:
        return chunks[0]
    return np.concatenate(chunks)


def _row_length(lengths: np.ndarray, shape, name: str, where: str, row0: int, unit: str,
                fix: str) -> int:
    """The length every row must have (from ``shape``, else the first row's); a DataError
    naming the first row that differs."""
    want = int(np.prod(shape)) if len(shape) else (int(lengths[0]) if len(lengths) else 0)
    bad = np.flatnonzero(lengths != want)
    if len(bad):
        r = int(bad[0])
        raise DataError(f"column '{name}': row {row0 + r} of the {where} has "
                        f"{int(lengths[r])} {unit}, expected {want} (shape "
                        f"{tuple(shape) or (want,)}); {fix}")
    return want


def _chunk_view(col: pa.Array, name: str, shape: Sequence[int], where: str, row0: int,
                dtype: np.dtype | None = None) -> np.ndarray:
    """One Arrow chunk -> a (possibly read-only) numpy view, validated; rows numbered from row0."""
    n = len(col)
    if col.null_count:
        row = row0 + int(np.flatnonzero(col.is_null().to_numpy(zero_copy_only=False))[0])
        raise DataError(f"column '{name}' has a null at row {row} of the {where}; "
                        f"drop or fill missing rows before training (df.dropna(subset=['{name}']))")
    t = col.type
    if pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_fixed_size_binary(t):
        if pa.types.is_fixed_size_binary(t):
            lengths = np.full(n, t.byte_width)
            data = np.frombuffer(col.buffers()[1], np.uint8)[col.offset * t.byte_width:]
            first = 0
        else:
            offsets = np.frombuffer(col.buffers()[1], np.int64 if pa.types.is_large_binary(t)
                                    else np.int32)[col.offset:col.offset + n + 1]
            lengths, first = np.diff(offsets), int(offsets[0])
            data = np.frombuffer(col.buffers()[2], np.uint8)
        want = _row_length(lengths, shape, name, where, row0, "bytes",
                           "every row must hold one image of the same size; fix or filter the "
                           "odd rows")
        arr = data[first:first + n * want].reshape((n, *shape) if len(shape) else (n, want))
        dtype = dtype or np.uint8
    elif pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        if pa.types.is_fixed_size_list(t):
            lengths = np.full(n, t.list_size)
        else:
            lengths = np.diff(col.offsets.to_numpy())
        want = _row_length(lengths, shape, name, where, row0, "values",
                           "rows must all have the same length; fix or filter the ragged rows")
        values = col.flatten()
        if values.null_count:
            raise DataError(f"column '{name}' holds null elements inside its arrays in the "
                            f"{where}; fill them before training")
        if not (pa.types.is_floating(values.type) or pa.types.is_integer(values.type)):
            raise DataError(f"column '{name}' holds arrays of {values.type}; expected numbers")
        arr = values.to_numpy(zero_copy_only=False)
        arr = arr.reshape((n, *shape) if len(shape) else (n, want))
        dtype = dtype or np.float32
    elif pa.types.is_integer(t) or pa.types.is_floating(t):
        arr = col.to_numpy()
        if len(shape):
            raise DataError(f"column '{name}' holds scalars but shape {tuple(shape)} was "
                            f"given; use an array column or drop the shape")
        dtype = dtype or (np.int64 if pa.types.is_integer(t) else np.float32)
    else:
        raise DataError(f"column '{name}' has Arrow type {t}; expected numbers, arrays of "
                        f"numbers (array<float> or an ML vector converted with "
                        f"vector_to_array) or binary (uint8 pixel bytes)")
    with np.errstate(over="ignore"):
        arr = arr.astype(dtype, copy=False)  # cast first: 1e300 as float32 is inf, caught below
    # Fast path: a finite sum means every value is finite; otherwise find the row.
    if arr.dtype.kind == "f" and n and not torch.isfinite(_torch_view(arr).sum()):
        finite = np.isfinite(arr.reshape(n, -1)).all(axis=1)
        if not finite.all():
            r = row0 + int(np.flatnonzero(~finite)[0])
            raise DataError(f"column '{name}': row {r} of the {where} holds NaN or inf; "
                            f"clean the data (e.g. filter with isnan) before training")
    return arr


def spec_row_bytes(spec: tuple) -> tuple[int, int]:
    """(feature bytes, label bytes) of one row of a shard whose ``spec()`` this is (label
    bytes 0 without labels)."""
    shape, dtype, lab = spec
    x = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
    return x, 0 if lab is None else int(np.prod(lab[0], dtype=np.int64)) * np.dtype(lab[1]).itemsize


class ShardData:
    """The rows of one partition in memory, as torch-ready arrays.

    features: (n, *shape), one contiguous writable array in its storage dtype (float32, uint8
    for pixel bytes, or the column's integer type: converted per batch); labels: (n,) int64 for classes, float32 for
    targets, or None. ``batches()`` yields ``(x, y)`` torch tensors.
    """

    kind = "memory"

    def __init__(self, features: np.ndarray | Sequence[np.ndarray],
                 labels: np.ndarray | None = None):
        if not isinstance(features, np.ndarray):
            features = _join(list(features))
        if labels is not None and len(labels) != len(features):
            raise ValueError(f"features has {len(features)} rows but labels {len(labels)}")
        self.features, self.labels = features, labels

    @classmethod
    def from_arrow(cls, batches: Iterable[pa.RecordBatch], features: str = "features",
                   label: str | None = "label", shape: Sequence[int] = (),
                   label_shape: Sequence[int] = (), num_classes: int | None = None,
                   where: str = "partition") -> ShardData:
        """Read all record batches of a partition (an empty partition gives 0 rows). A
        partition larger than the task's memory raises a ResourceError that names the fix
        (``spark_dl.data.stream.open_shard`` streams it from local disk instead)."""
        read, room = 0, address_headroom()
        try:
            kept = []
            for b in batches:
                if b.num_rows:
                    kept.append(b)
                    read += b.nbytes
                    # the rows and their joined copy must fit under the worker's memory cap:
                    # stop with the reason rather than let the allocator kill the worker
                    if room is not None and 2 * read > room:
                        raise MemoryError(f"{2 * read / 2**20:.0f} MiB needed, "
                                          f"{room / 2**20:.0f} MiB left under the cap")
            for b in kept[:1]:
                check_columns(b.schema.names, features, label, where)
            if not kept:
                dim = tuple(shape) if len(shape) else (0,)
                empty_y = np.zeros((0, *label_shape),
                                   np.int64 if not label_shape else np.float32)
                return cls(np.zeros((0, *dim), np.float32), empty_y if label else None)
            x = column_chunks([b.column(features) for b in kept], features, shape, where,
                              storage_dtype(kept[0].schema.field(features).type))
            y = None
            if label:
                y = column_to_numpy([b.column(label) for b in kept], label, label_shape, where)
                check_labels(y, label, num_classes, where)
            return cls(x, y)
        except (MemoryError, pa.ArrowMemoryError) as e:
            raise memory_error(where, read, e) from None

    @classmethod
    def from_spec(cls, spec: tuple) -> ShardData:
        """No rows, of the kind ``spec()`` describes."""
        shape, dtype, lab = spec
        return cls(np.zeros((0, *shape), dtype),
                   None if lab is None else np.zeros((0, *lab[0]), lab[1]))

    def spec(self) -> tuple:
        """(feature shape, feature dtype, label (shape, dtype) or None)."""
        return (self.features.shape[1:], self.features.dtype,
                None if self.labels is None else (self.labels.shape[1:], self.labels.dtype))

    def empty_batch(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A batch of 0 rows of this shard's kind (converted like every batch)."""
        return as_batch(self.features[:0], None if self.labels is None else self.labels[:0])

    def close(self) -> None:
        """Nothing to free (a StreamShard closes its spill files)."""

    def __len__(self) -> int:
        return len(self.features)

    # -- rows moved between replicas (spark_dl.balance.move_rows) ---------------------------

    def tail(self, k: int, chunk_bytes: int = 64 << 20
             ) -> Iterator[tuple[np.ndarray, np.ndarray | None]]:
        """The last ``k`` rows, in order, as (features, labels) chunks of about
        ``chunk_bytes`` (views, not copies)."""
        n, per = len(self), max(1, chunk_bytes // max(sum(spec_row_bytes(self.spec())), 1))
        for lo in range(n - k, n, per):
            hi = min(lo + per, n)
            yield self.features[lo:hi], None if self.labels is None else self.labels[lo:hi]

    def truncate(self, n: int) -> None:
        """Keep the first ``n`` rows."""
        self.features = self.features[:n]
        self.labels = None if self.labels is None else self.labels[:n]

    def extend(self, chunks: Iterable[tuple[np.ndarray, np.ndarray | None]]) -> None:
        """Rows appended at the end (one copy of the shard, made once for all chunks)."""
        chunks = list(chunks)
        if chunks:
            self.features = np.concatenate([self.features, *(x for x, _ in chunks)])
            if self.labels is not None:
                self.labels = np.concatenate([self.labels, *(y for _, y in chunks)])

    def num_batches(self, batch_size: int, drop_last: bool = False) -> int:
        n = len(self)
        return n // batch_size if drop_last else -(-n // batch_size)

    def batches(self, batch_size: int, shuffle: bool = True, seed: int = 0, epoch: int = 0,
                drop_last: bool = False, skip: int = 0, transform=None
                ) -> Iterator[tuple[torch.Tensor, torch.Tensor | None]]:
        """Mini-batches of one epoch; the order depends only on (seed, epoch). ``skip``: start
        after that many batches of it (a retried task going on where its last attempt was).
        ``transform(x, y)``: numpy rows -> tensors, instead of the default conversion."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if skip < 0:
            raise ValueError(f"skip must be >= 0, got {skip}")
        n = len(self)
        order = np.random.default_rng([seed, epoch]).permutation(n) if shuffle else None
        for start in range(skip * batch_size, self.num_batches(batch_size, drop_last)
                           * batch_size, batch_size):
            if order is None:
                rows = np.arange(start, min(start + batch_size, n))
            else:
                rows = np.sort(order[start:start + batch_size])      # sorted: cache-friendly
            yield as_batch(self.features[rows],
                           None if self.labels is None else self.labels[rows], transform)
