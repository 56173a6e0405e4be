import numpy as np
import pyarrow as pa
import pytest
import torch

from spark_dl.compat import create_from_arrow, to_arrow
from spark_dl.data import (
    ShardData,
    distort_range,
    extended_mnist,
    mnist_dataframe,
    pixels_to_arrow,
)
from spark_dl.data.mnist import to_pixels
from spark_dl.errors import DataError


def _rows(df):
    t = to_arrow(df)
    return ShardData.from_arrow(t.to_batches(), shape=(784,), num_classes=10)


def test_generated_on_executors_and_independent_of_partitioning(spark, mnist):
    x, y = mnist
    a = _rows(extended_mnist(spark, x[:500], y[:500], n=600, partitions=3, seed=1))
    b = _rows(extended_mnist(spark, x[:500], y[:500], n=600, partitions=5, seed=1))
    assert len(a) == 600
    np.testing.assert_array_equal(a.features, b.features)
    ref, ref_y = distort_range(x[:500], y[:500], 0, 600, seed=1)   # the same pure function
    assert a.features.dtype == np.uint8                  # one byte a pixel
    np.testing.assert_array_equal(a.features, to_pixels(ref).reshape(600, 784))
    np.testing.assert_array_equal(a.labels, ref_y)
    floats = _rows(extended_mnist(spark, x[:500], y[:500], n=600, partitions=3, seed=1,
                                  dtype="float32"))
    np.testing.assert_array_equal(floats.features, ref.reshape(600, 784))
    # the bridge's batches: the pixels scaled to [0, 1], within half a grey level of the floats
    xb, _yb = next(a.batches(600, shuffle=False))
    assert xb.dtype == torch.float32 and float((xb - torch.from_numpy(floats.features)).abs()
                                               .max()) <= 0.5 / 255 + 1e-7


def test_partition_counts(spark, mnist):
    x, y = mnist
    df = extended_mnist(spark, x[:100], y[:100], n=1000, partitions=4)
    assert df.rdd.getNumPartitions() == 4
    counts = df.rdd.mapPartitions(lambda rows: [sum(1 for _ in rows)]).collect()
    assert counts == [250, 250, 250, 250]


def test_more_partitions_than_rows(spark, mnist):
    x, y = mnist
    df = extended_mnist(spark, x[:100], y[:100], n=3, partitions=8)
    assert df.count() == 3


def test_bad_source(spark):
    with pytest.raises(DataError, match="needs images"):
        extended_mnist(spark, np.zeros((0, 28, 28), np.uint8), np.zeros(0), n=10, partitions=2)


@pytest.mark.compat
def test_real_digits_dataframe(spark, mnist):
    x, y = mnist
    df = mnist_dataframe(spark, x[:300], y[:300], partitions=3)
    shard = _rows(df.orderBy("label"))
    assert len(shard) == 300 and shard.features.max() == 1.0
    # compat's Arrow paths (pyspark 3.5 and 4.x): binary and long columns make the trip as
    # they went, one batch or several; an empty frame comes back as its schema
    table = pa.Table.from_batches([pixels_to_arrow(x[:6].reshape(6, -1), y[:6])])
    table = pa.concat_tables([table, table.slice(0, 2)])
    assert to_arrow(create_from_arrow(spark, table).coalesce(1)).equals(table)
    empty = to_arrow(df.limit(0))
    assert empty.num_rows == 0 and empty.schema.names == ["features", "label"]


def test_mnist_file_dataframe_reads_its_slice_in_the_executors(spark):
    from spark_dl.data import load_mnist, mnist_file_dataframe

    from ..conftest import MNIST_IMAGES, MNIST_LABELS
    df = mnist_file_dataframe(spark, MNIST_IMAGES, MNIST_LABELS, 100, 130, partitions=3)
    assert df.rdd.getNumPartitions() == 3
    rows = df.toPandas()
    x, y = load_mnist(MNIST_IMAGES, MNIST_LABELS)
    assert list(rows.label) == list(y[100:130])
    assert np.allclose(np.stack(rows.features), x[100:130].reshape(30, -1) / 255.0)
