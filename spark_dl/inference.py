"""Batch inference for any trained network through ``pyspark.ml.functions.predict_batch_udf``.

    from spark_dl.inference import predict_udf
    classify = predict_udf(res.model, input_shape=(1, 28, 28), output="class")
    df.withColumn("digit", classify("features"))

    upscale = predict_udf(cascade, input_shape=(1, 16, 16))        # (1, 32, 32) per row
    tiles.withColumn("hr", upscale("lr"))                          # array<float> of 1024

The module travels once, as bytes in the UDF's closure; each Python worker unpickles it the
first time it runs the UDF (predict_batch_udf caches it per worker), then runs Arrow batches of
``batch_size`` rows through it under ``torch.inference_mode``. Rows are array<float> (or
array<double>) columns of ``prod(input_shape)`` values, in the model's dtype, or integer arrays
(token ids: array<int>, array<bigint>), which reach it as int64, as in training; a row of
another length fails the query with a message naming both lengths (checked in the JVM before
the Python worker sees it).
"""

from __future__ import annotations

import io
import math

import numpy as np
from torch import nn

__all__ = ["predict_udf"]

_OUTPUTS = ("tensor", "class", "probabilities")


def predict_udf(model: nn.Module, input_shape, *, output: str = "tensor",
                batch_size: int = 256, threads: int = 1, device: str = "cpu"):
    """A function of one array column (name or Column) giving ``model``'s predictions.

    input_shape: the shape of one row's sample, e.g. (1, 28, 28); the column holds its
      ``prod(input_shape)`` values flattened.
    output: "tensor" (the model's output per row, flattened, array<float>), "class" (the arg max
      of the outputs, as a double: Spark ML's prediction column type) or "probabilities"
      (softmax of the outputs, array<float>).
    threads: torch CPU threads per Python worker (1: Spark runs one worker per task slot).
    device: "cpu" or "cuda" (the executor's first visible GPU).
    """
    import torch
    from pyspark.ml.functions import predict_batch_udf
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

    udf = predict_batch_udf(
        make_predict_fn,
        return_type=DoubleType() if output == "class" else ArrayType(FloatType()),
        batch_size=batch_size, input_tensor_shapes=[[n]])

    def apply(col):
        """The predictions of ``col`` (a name or a Column); a row that is not ``n`` values
        long fails the query with a message naming its length and the expected one."""
        from pyspark.sql import functions as F
        c = F.col(col) if isinstance(col, str) else col
        checked = F.when(F.size(c) == n, c).otherwise(F.raise_error(F.concat(
            F.lit("spark_dl.predict_udf: a row of "), F.size(c).cast("string"),
            F.lit(f" values, but the model takes input_shape={shape}, {n} values per row; "
                  f"pass the column of flattened samples, or the right input_shape"))))
        return udf(checked)
    return apply
