"""Batch inference for any trained network: a pandas UDF over Arrow batches of rows.

    from spark_dl.inference import predict_udf
    classify = predict_udf(res.model, input_shape=(1, 28, 28), output="class")
    df.withColumn("digit", classify("features"))

    upscale = predict_udf(cascade, input_shape=(1, 16, 16))        # (1, 32, 32) per row
    tiles.withColumn("hr", upscale("lr"))                          # array<float> of 1024

The module travels once, as bytes in the UDF's closure; each Python worker unpickles it the
first time it runs the UDF (kept per worker, as ``pyspark.ml.functions.predict_batch_udf``
keeps its models), then runs batches of ``batch_size`` rows through it under
``torch.inference_mode``. Rows are array<float> (or array<double>) columns of
``prod(input_shape)`` values, in the model's dtype, Spark ML vector columns of that size (dense
or sparse: VectorAssembler's output), converted in the Python worker, or integer arrays (token
ids: array<int>, array<bigint>), which reach it as int64, as in training; a row of another
length fails the query with a message naming both lengths.
"""

from __future__ import annotations

import io
import math
import uuid
from collections.abc import Callable, Iterator

import numpy as np
import pandas as pd
from torch import nn

__all__ = ["predict_udf"]

_OUTPUTS = ("tensor", "class", "probabilities")


def predict_udf(model: nn.Module, input_shape, *, output: str = "tensor",
                batch_size: int = 256, threads: int = 1, device: str = "cpu"):
    """A function of one column (name or Column) giving ``model``'s predictions.

    input_shape: the shape of one row's sample, e.g. (1, 28, 28); the column holds its
      ``prod(input_shape)`` values flattened: an array column, or Spark ML vectors of that size
      (dense or sparse).
    output: "tensor" (the model's output per row, flattened, array<float>), "class" (the arg max
      of the outputs, as a double: Spark ML's prediction column type) or "probabilities"
      (softmax of the outputs, array<float>).
    threads: torch CPU threads per Python worker (1: Spark runs one worker per task slot).
    device: "cpu" or "cuda" (the executor's first visible GPU).
    """
    import torch
    from pyspark.sql.functions import pandas_udf
    from pyspark.sql.types import ArrayType, DoubleType, FloatType

    if output not in _OUTPUTS:
        raise ValueError(f"output must be one of {_OUTPUTS}, got {output!r}")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    shape = tuple(int(d) for d in input_shape)
    n = math.prod(shape)
    if not shape or any(d < 1 for d in shape):
        raise ValueError(f"input_shape must list positive sizes, got {input_shape!r}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    buf = io.BytesIO()
    torch.save(model.to("cpu"), buf)
    blob = buf.getvalue()                      # plain bytes: the closure holds no module
    key = uuid.uuid4().hex                     # this UDF's network in a worker's cache

    def make_predict_fn():                     # on the executor, once per Python worker
        import torch
        torch.set_num_threads(threads)
        dev = torch.device(device)
        net = torch.load(io.BytesIO(blob), weights_only=False).to(dev).eval()
        dtype = next(net.parameters()).dtype

        def predict(x: np.ndarray) -> np.ndarray:
            with torch.inference_mode():
                t = torch.from_numpy(np.ascontiguousarray(x))
                t = t.to(dev, dtype if t.is_floating_point() else torch.int64)
                y = net(t.reshape(len(t), *shape))
                if output == "class":
                    return y.argmax(1).cpu().numpy().astype(np.float64)
                if output == "probabilities":
                    y = torch.softmax(y, 1)
                return y.reshape(len(y), -1).float().cpu().numpy()
        return predict

    def predict_batches(batches: Iterator[pd.Series]) -> Iterator[pd.Series]:
        from spark_dl.inference import _predictor, _rows  # the worker's module: its cache
        predict = _predictor(key, make_predict_fn)
        for batch in batches:
            for lo in range(0, len(batch), batch_size):
                y = predict(_rows(batch.iloc[lo:lo + batch_size], n, shape))
                yield pd.Series(y if output == "class" else list(y))

    udf = pandas_udf(predict_batches,
                     DoubleType() if output == "class" else ArrayType(FloatType()))

    def apply(col):
        """The predictions of ``col`` (a name or a Column: arrays or ML vectors of ``n``
        values); a row of another length fails the query with a message naming its length
        and the expected one."""
        from pyspark.sql import functions as F
        return udf(F.col(col) if isinstance(col, str) else col)
    return apply


_CACHE: dict = {}                              # per Python worker: UDF key -> predict function
_CACHED = 4


def _predictor(key: str, make: Callable[[], Callable]) -> Callable:
    """The worker's predict function of a UDF, made the first time (the last few kept)."""
    fn = _CACHE.pop(key, None) or make()
    _CACHE[key] = fn
    while len(_CACHE) > _CACHED:
        _CACHE.pop(next(iter(_CACHE)))
    return fn


def _rows(part, n: int, shape: tuple) -> np.ndarray:
    """A batch of a UDF's input, (m, n): a Series of arrays (stacked in their own dtype, as
    predict_batch_udf stacks them), or the DataFrame of an ML vector column's fields (how pandas
    UDFs get VectorUDT), decoded to float32 as fit's tasks decode them; a null row or one of
    another length is a ValueError naming it."""
    import pyarrow as pa

    from spark_dl.data.bridge import column_to_numpy, row_lengths
    if isinstance(part, pd.DataFrame):
        values, lengths = _lengths(part["values"])
        col = pa.StructArray.from_arrays(
            [pa.array(part["type"].astype(np.float64).fillna(1).to_numpy(np.int8)),
             pa.array(part["size"].astype(np.float64).fillna(0).to_numpy(np.int32)),
             _list(_lengths(part["indices"]), np.int32),
             _list((values, lengths), np.float64)],
            ["type", "size", "indices", "values"])
        nulls = part["type"].isna().to_numpy()
        lengths = row_lengths(col)
    else:
        values, lengths = _lengths(part)
        nulls = lengths < 0
    if nulls.any():
        raise ValueError("spark_dl.predict_udf: a null row; drop or fill missing rows first "
                         "(df.dropna(subset=[...]))")
    bad = np.flatnonzero(lengths != n)
    if len(bad):
        raise ValueError(f"spark_dl.predict_udf: a row of {int(lengths[bad[0]])} values, but "
                         f"the model takes input_shape={shape}, {n} values per row; pass the "
                         f"column of flattened samples, or the right input_shape")
    if isinstance(part, pd.DataFrame):
        return column_to_numpy(col, "input", (n,), "batch", np.float32, finite=False)
    return np.vstack(values).reshape(len(values), n)     # integers (ids) as they are


def _lengths(series) -> tuple[np.ndarray, np.ndarray]:
    """A Series of arrays (None for null): (its values, each one's length, -1 for None)."""
    values = series.to_numpy()
    return values, np.fromiter((-1 if v is None else len(v) for v in values), np.int64,
                               len(values))


def _list(values_lengths, dtype):
    """Arrays of a pandas column (None: empty) as one Arrow list array, without a copy per
    element."""
    import pyarrow as pa
    values, lengths = values_lengths
    offsets = np.zeros(len(values) + 1, np.int32)
    np.cumsum(np.maximum(lengths, 0), out=offsets[1:])
    kept = [v for v in values if v is not None and len(v)]
    flat = np.concatenate(kept).astype(dtype, copy=False) if kept else np.zeros(0, dtype)
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat))
