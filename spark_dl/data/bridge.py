"""One partition's Arrow record batches -> a stream of torch mini-batches.

This is the bridge every engine uses inside its Spark tasks (``df.mapInArrow(task)``): the
partition is read once into contiguous numpy arrays straight from the Arrow buffers (no per-row
Python objects), validated (nulls, ragged rows, NaN/inf, label range), and then served as
shuffled mini-batches per epoch. Spark ML's vector columns (``VectorAssembler``'s output) are
decoded here, in the task: dense rows as they are, sparse rows scattered into zeros. Labels that
are class ids may be doubles holding whole numbers (``StringIndexer``'s output): they become
int64.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Iterator, Sequence

import numpy as np
import pyarrow as pa
import torch

from ..errors import DataError
from .memory import address_headroom, memory_error

__all__ = ["ShardData", "as_batch", "column_chunks", "column_to_numpy", "is_ml_vector",
           "read_labels", "row_lengths", "spec_row_bytes", "storage_dtype"]

# how Spark ML's VectorUDT reaches Arrow (mapInArrow, pandas UDFs) and Parquet
_VECTOR_FIELDS = ("type", "size", "indices", "values")
_DENSE, _SPARSE = 1, 0


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


def is_ml_vector(t: pa.DataType) -> bool:
    """Whether ``t`` is a Spark ML vector column as Arrow and Parquet hold it (VectorUDT:
    struct<type: int8, size: int32, indices: array<int32>, values: array<double>>; type 1 is
    dense, its values the row; type 0 sparse, ``size`` values that are zero but at
    ``indices``)."""
    return pa.types.is_struct(t) and \
        sorted(t.field(i).name for i in range(t.num_fields)) == sorted(_VECTOR_FIELDS)


def string_labels(label: str, param: str = "label") -> DataError:
    """The error for a label column of strings: the StringIndexer line that numbers them."""
    return DataError(
        f"column '{label}' holds strings, but the labels must be numbers (class ids "
        f"0..k-1 for a classifier): index them with Spark ML first, "
        f"StringIndexer(inputCol=\"{label}\", outputCol=\"{label}_idx\").fit(df).transform(df) "
        f"(from pyspark.ml.feature import StringIndexer), and pass {param}=\"{label}_idx\"")


def check_labels(y: np.ndarray, label: str, num_classes: int | None, where: str,
                 row0: int = 0) -> None:
    """Class ids in 0..num_classes-1 (rows numbered from row0 in the error)."""
    if num_classes is None:
        return
    if y.dtype.kind not in "iuf":
        raise DataError(f"column '{label}' must hold class ids (whole numbers) for "
                        f"num_classes={num_classes}, got {y.dtype}")
    bad = np.flatnonzero(((y < 0) | (y >= num_classes)).reshape(len(y), -1).any(axis=1))
    if len(bad):
        r = int(bad[0])
        v = np.ravel(y[r])[np.flatnonzero(np.ravel((y[r] < 0) | (y[r] >= num_classes)))[0]]
        raise DataError(f"column '{label}': row {row0 + r} of the {where} has label "
                        f"{_number(v)}, outside 0..{num_classes - 1}; fix the labels "
                        f"or set num_classes")


def _number(v) -> str:
    """A label as the user wrote it: 3 for an integer, 2.5 (or 3.0) for a double."""
    return str(int(v)) if np.asarray(v).dtype.kind in "iu" else repr(float(v))


def read_labels(col: pa.Array | pa.ChunkedArray | Sequence[pa.Array], label: str,
                shape: Sequence[int] = (), where: str = "partition",
                num_classes: int | None = None, class_ids: bool = False,
                row0: int = 0) -> np.ndarray:
    """A label column -> one writable numpy array (n, *shape), validated.

    With ``num_classes``, or ``class_ids`` (a classifier's loss) for a column of scalars, the
    labels are class ids: integers, or floating-point numbers that are whole (Spark ML's
    labels, StringIndexer's output: 0.0, 1.0, ...), given as int64; a value that is not whole,
    or outside 0..num_classes-1, is a DataError naming the column, the row and the value.
    Otherwise integers -> int64, floats -> float32 (targets; array labels under ``class_ids``
    alone stay targets, e.g. class probabilities). Strings are a DataError that shows the
    StringIndexer line to add.
    """
    chunks = col.chunks if isinstance(col, pa.ChunkedArray) else \
        [col] if isinstance(col, pa.Array) else list(col)
    views = []
    for chunk in chunks:
        if len(chunk):
            views.append(_label_view(chunk, label, shape, where, row0, num_classes, class_ids))
        row0 += len(chunk)
    if len({v.shape[1:] for v in views}) > 1:
        raise ragged_rows(label, where, {int(np.prod(v.shape[1:])) for v in views})
    if not views:
        ids = num_classes is not None or not len(shape)
        return np.zeros((0, *shape), np.int64 if ids else np.float32)
    return _join(views)


def _is_strings(t: pa.DataType) -> bool:
    if pa.types.is_dictionary(t):
        t = t.value_type
    return pa.types.is_string(t) or pa.types.is_large_string(t) or \
        (hasattr(pa.types, "is_string_view") and pa.types.is_string_view(t))


def _label_view(col: pa.Array, label: str, shape: Sequence[int], where: str, row0: int,
                num_classes: int | None, class_ids: bool) -> np.ndarray:
    t = col.type
    lists = pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)
    if _is_strings(t.value_type if lists else t):
        raise string_labels(label)
    if num_classes is None and (not class_ids or lists):
        return _chunk_view(col, label, shape, where, row0)
    if not pa.types.is_floating(t.value_type if lists else t):
        y = _chunk_view(col, label, shape, where, row0, np.int64)
        check_labels(y, label, num_classes, where, row0)
        return y
    y = _chunk_view(col, label, shape, where, row0, np.float64)
    flat = y.reshape(len(y), -1)
    off = np.flatnonzero((flat != np.floor(flat)).any(axis=1))
    if len(off):
        r = int(off[0])
        v = flat[r][flat[r] != np.floor(flat[r])][0]
        classes = f"0..{num_classes - 1}" if num_classes is not None else "0, 1, 2 ..."
        raise DataError(f"column '{label}': row {row0 + r} of the {where} has label "
                        f"{float(v)!r}, which is not a class id: class ids are whole numbers "
                        f"({classes}), as StringIndexer makes them; fix the labels, or for "
                        f"targets that are not classes use loss='mse' without num_classes")
    check_labels(y, label, num_classes, where, row0)
    negative = np.flatnonzero((flat < 0).any(axis=1))
    if len(negative):
        r = int(negative[0])
        raise DataError(f"column '{label}': row {row0 + r} of the {where} has label "
                        f"{float(flat[r][flat[r] < 0][0])!r}; class ids are >= 0: fix the "
                        f"labels")
    return y.astype(np.int64)


def column_chunks(col: pa.Array | pa.ChunkedArray | Sequence[pa.Array], name: str,
                  shape: Sequence[int] = (), where: str = "partition",
                  dtype: np.dtype | None = None, finite: bool = True) -> list[np.ndarray]:
    """Arrow column (an array, a chunked array or a list of chunks) -> validated numpy chunks.

    Chunks are zero-copy, read-only views of the Arrow buffers where the type allows (a cast
    to ``dtype`` copies); empty chunks are dropped. Rows are numbered across chunks in errors.
    ``finite``: NaN and inf are a DataError (training rows); False lets them through.
    """
    chunks = col.chunks if isinstance(col, pa.ChunkedArray) else \
        [col] if isinstance(col, pa.Array) else list(col)
    views, row0 = [], 0
    for chunk in chunks:
        if len(chunk):
            views.append(_chunk_view(chunk, name, shape, where, row0, dtype, finite))
        row0 += len(chunk)
    if len({v.shape[1:] for v in views}) > 1:
        raise ragged_rows(name, where, {v.shape[1] for v in views})
    return views


def ragged_rows(name: str, where: str, lengths) -> DataError:
    """The error for a column whose chunks hold rows of different lengths."""
    return DataError(f"column '{name}': rows of the {where} have different lengths "
                     f"{sorted(lengths)}; give shape= or fix the ragged rows")


def row_lengths(col: pa.Array) -> np.ndarray:
    """The number of values in each row of an array or ML vector column (its ``size`` for a
    sparse vector); nulls count 0."""
    t = col.type
    if is_ml_vector(t):
        return _vector_parts(col)[1]
    if pa.types.is_fixed_size_list(t):
        return np.full(len(col), t.list_size)
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        return np.diff(col.offsets.to_numpy())
    raise DataError(f"expected an array or ML vector column, got Arrow type {t}")


def column_to_numpy(col: pa.Array | pa.ChunkedArray | Sequence[pa.Array], name: str,
                    shape: Sequence[int] = (), where: str = "partition",
                    dtype: np.dtype | None = None, finite: bool = True) -> np.ndarray:
    """Arrow column -> one writable numpy array (n, *shape), validated (see column_chunks).

    Scalar columns (shape ``()``) keep their numeric kind (integers -> int64, floats ->
    float32) unless ``dtype`` is given; list / fixed-size-list columns of numbers become
    float32 rows of ``prod(shape)`` values, reshaped to ``shape``.
    """
    views = column_chunks(col, name, shape, where, dtype, finite)
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
                dtype: np.dtype | None = None, finite: bool = True) -> np.ndarray:
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
    elif is_ml_vector(t):
        arr = _vectors(col, name, shape, where, row0, dtype or np.float32)
        dtype = dtype or np.float32
    elif pa.types.is_integer(t) or pa.types.is_floating(t):
        arr = col.to_numpy()
        if len(shape):
            raise DataError(f"column '{name}' holds scalars but shape {tuple(shape)} was "
                            f"given; use an array column or drop the shape")
        dtype = dtype or (np.int64 if pa.types.is_integer(t) else np.float32)
    else:
        raise DataError(f"column '{name}' has Arrow type {t}; expected numbers, arrays of "
                        f"numbers (array<float>), Spark ML vectors or binary (uint8 pixel "
                        f"bytes)")
    with np.errstate(over="ignore"):
        arr = arr.astype(dtype, copy=False)  # cast first: 1e300 as float32 is inf, caught below
    # Fast path: a finite sum means every value is finite; otherwise find the row.
    if finite and arr.dtype.kind == "f" and n and not torch.isfinite(_torch_view(arr).sum()):
        finite = np.isfinite(arr.reshape(n, -1)).all(axis=1)
        if not finite.all():
            r = row0 + int(np.flatnonzero(~finite)[0])
            raise DataError(f"column '{name}': row {r} of the {where} holds NaN or inf; "
                            f"clean the data (e.g. filter with isnan) before training")
    return arr


def _vector_parts(col: pa.StructArray):
    """An ML vector column's (kinds, row lengths, values list, indices list)."""
    fields = dict(zip((col.type.field(i).name for i in range(col.type.num_fields)),
                      col.flatten()))
    kinds = fields["type"].fill_null(_DENSE).to_numpy(zero_copy_only=False)
    values, indices = fields["values"], fields["indices"]
    sizes = fields["size"].fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)
    lengths = np.where(kinds == _DENSE, np.diff(values.offsets.to_numpy()), sizes)
    return kinds, lengths, values, indices


def _vectors(col: pa.StructArray, name: str, shape: Sequence[int], where: str, row0: int,
             dtype: np.dtype) -> np.ndarray:
    """ML vectors -> (n, *shape) rows of ``dtype``: dense rows are their values, sparse rows
    zeros but at their indices; every row must be ``prod(shape)`` long (or the first row's
    length)."""
    n = len(col)
    kinds, lengths, values, indices = _vector_parts(col)
    odd = np.flatnonzero((kinds != _DENSE) & (kinds != _SPARSE))
    if len(odd):
        raise DataError(f"column '{name}': row {row0 + int(odd[0])} of the {where} is an ML "
                        f"vector of unknown type {int(kinds[odd[0]])} (1: dense, 0: sparse)")
    want = _row_length(lengths, shape, name, where, row0, "values",
                       "ML vectors must all have the same size (VectorAssembler's inputCols)")
    v_off = values.offsets.to_numpy().astype(np.int64)
    flat = values.values.to_numpy(zero_copy_only=False)
    lo, hi = int(v_off[0]), int(v_off[-1])
    out_shape = (n, *shape) if len(shape) else (n, want)
    if (kinds == _DENSE).all():                  # VectorAssembler's usual rows: one view
        return flat[lo:hi].reshape(out_shape)
    counts = np.diff(v_off)
    rows = np.repeat(np.arange(n), counts)
    pos = np.arange(lo, hi) - v_off[rows]        # each value's place in its row's values
    cols = pos.copy()
    sparse = kinds[rows] == _SPARSE
    i_off = indices.offsets.to_numpy().astype(np.int64)
    bad = np.flatnonzero((kinds == _SPARSE) & (np.diff(i_off) != counts))
    if len(bad):
        raise DataError(f"column '{name}': row {row0 + int(bad[0])} of the {where} is a sparse "
                        f"vector with {int(np.diff(i_off)[bad[0]])} indices but "
                        f"{int(counts[bad[0]])} values")
    cols[sparse] = indices.values.to_numpy(zero_copy_only=False)[i_off[rows[sparse]]
                                                                 + pos[sparse]]
    out_of = np.flatnonzero((cols < 0) | (cols >= want))
    if len(out_of):
        r = int(rows[out_of[0]])
        raise DataError(f"column '{name}': row {row0 + r} of the {where} is a sparse vector of "
                        f"size {want} with index {int(cols[out_of[0]])}")
    out = np.zeros((n, want), dtype)
    with np.errstate(over="ignore"):
        out[rows, cols] = flat[lo:hi]
    return out.reshape(out_shape)


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
                   where: str = "partition", class_ids: bool = False) -> ShardData:
        """Read all record batches of a partition (an empty partition gives 0 rows). A
        partition larger than the task's memory raises a ResourceError that names the fix
        (``spark_dl.data.stream.open_shard`` streams it from local disk instead). Labels are
        class ids (int64, whole doubles accepted) with ``num_classes`` or ``class_ids``
        (see read_labels)."""
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
                y = read_labels([b.column(label) for b in kept], label, label_shape, where,
                                num_classes, class_ids)
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
