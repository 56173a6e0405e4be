"""The partition -> torch batch bridge inside real Spark tasks."""

from collections.abc import Iterator

import pyarrow as pa
import pytest
from pyspark.errors import PythonException

from spark_dl.data import mnist_dataframe


def _consume(features="features", num_classes=10, batch_size=32):
    def _task(batches: Iterator[pa.RecordBatch]):
        from pyspark import TaskContext

        from spark_dl.data import ShardData
        shard = ShardData.from_arrow(batches, features, "label", shape=(1, 28, 28),
                                     num_classes=num_classes,
                                     where=f"partition {TaskContext.get().partitionId()}")
        n = 0
        s = 0.0
        for x, y in shard.batches(batch_size, seed=0, epoch=0):
            assert tuple(x.shape[1:]) == (1, 28, 28)
            n += len(x)
            s += float(y.sum())
        yield pa.RecordBatch.from_pydict({"rows": [n], "label_sum": [s]})
    return _task


def test_every_row_reaches_exactly_one_task_even_with_empty_partitions(spark, mnist):
    x, y = mnist
    df = mnist_dataframe(spark, x[:5], y[:5], partitions=1).repartition(8)  # >= 3 empty
    out = df.mapInArrow(_consume(), "rows long, label_sum double").collect()
    assert len(out) == 8
    assert sum(r.rows for r in out) == 5 and sum(r.label_sum for r in out) == float(y[:5].sum())
    assert sum(r.rows == 0 for r in out) >= 3


def test_bad_labels_fail_the_task_with_a_clear_message(spark, mnist):
    x, y = mnist
    df = mnist_dataframe(spark, x[:50], y[:50], partitions=2)
    with pytest.raises(PythonException, match=r"label \d, outside 0..1; fix the labels"):
        df.mapInArrow(_consume(num_classes=2), "rows long, label_sum double").collect()


def test_nan_rows_from_spark(spark):
    df = spark.createDataFrame([([0.0] * 784, 1), ([float("nan")] * 784, 2)],
                               "features array<float>, label long").coalesce(1)
    with pytest.raises(PythonException, match="row 1 of the partition 0 holds NaN"):
        df.mapInArrow(_consume(), "rows long, label_sum double").collect()


def test_ragged_rows_from_spark(spark):
    df = spark.createDataFrame([([0.0] * 784, 1), ([0.0] * 780, 2)],
                               "features array<float>, label long").coalesce(1)
    with pytest.raises(PythonException, match="row 1 of the partition 0 has 780 values"):
        df.mapInArrow(_consume(), "rows long, label_sum double").collect()
