import itertools

import numpy as np
import pyarrow as pa
import pytest
import torch

from spark_dl.data import ShardData, arrays_to_arrow
from spark_dl.errors import DataError


def _batch(x, y):
    return arrays_to_arrow(np.asarray(x, np.float32), np.asarray(y))


def test_round_trip_and_shapes():
    x = np.random.default_rng(0).random((10, 784), dtype=np.float32)
    y = np.arange(10) % 10
    shard = ShardData.from_arrow([_batch(x[:4], y[:4]), _batch(x[4:], y[4:])], shape=(1, 28, 28),
                                 num_classes=10)
    assert shard.features.shape == (10, 1, 28, 28) and shard.labels.dtype == np.int64
    np.testing.assert_array_equal(shard.features.reshape(10, -1), x)
    xs, ys = zip(*shard.batches(4, shuffle=False))
    assert [len(b) for b in xs] == [4, 4, 2]
    assert isinstance(xs[0], torch.Tensor) and xs[0].dtype == torch.float32
    assert torch.cat(ys).tolist() == y.tolist()
    assert shard.num_batches(4) == 3 and shard.num_batches(4, drop_last=True) == 2
    assert [len(b) for b, _ in shard.batches(4, drop_last=True)] == [4, 4]


def test_shuffle_is_a_permutation_that_changes_per_epoch_and_repeats_per_seed():
    x = np.arange(100, dtype=np.float32).reshape(100, 1)
    shard = ShardData(x, np.arange(100))
    def order(seed, epoch):
        return torch.cat([y for _, y in shard.batches(7, seed=seed, epoch=epoch)]).tolist()
    e0, e1 = order(0, 0), order(0, 1)
    assert sorted(e0) == list(range(100)) and sorted(e1) == list(range(100))
    assert e0 != e1 and e0 != list(range(100))
    assert order(0, 0) == e0 and order(1, 0) != e0
    for xb, yb in shard.batches(7, seed=3):          # features stay aligned with labels
        assert xb[:, 0].long().tolist() == yb.tolist()


def test_empty_partition_gives_no_batches():
    shard = ShardData.from_arrow([], shape=(784,))
    assert len(shard) == 0 and list(shard.batches(8)) == []
    empty = _batch(np.zeros((0, 784)), np.zeros(0, np.int64))
    assert len(ShardData.from_arrow([empty])) == 0


def test_nan_is_named_with_row_and_column():
    x = np.zeros((5, 4), np.float32)
    x[3, 2] = np.nan
    with pytest.raises(DataError, match=r"'features': row 3 .*NaN"):
        ShardData.from_arrow([_batch(x, np.zeros(5, np.int64))])
    x[3, 2] = np.inf
    with pytest.raises(DataError, match="row 3"):
        ShardData.from_arrow([_batch(x, np.zeros(5, np.int64))])


def test_label_out_of_range():
    with pytest.raises(DataError, match=r"row 2 .*label 10, outside 0..9"):
        ShardData.from_arrow([_batch(np.zeros((3, 2)), [1, 2, 10])], num_classes=10)
    with pytest.raises(DataError, match="label -1"):
        ShardData.from_arrow([_batch(np.zeros((3, 2)), [-1, 2, 3])], num_classes=10)


def test_ragged_rows():
    col = pa.array([[0.0, 1.0], [2.0], [3.0, 4.0]], pa.list_(pa.float32()))
    b = pa.RecordBatch.from_arrays([col, pa.array([0, 1, 2])], ["features", "label"])
    with pytest.raises(DataError, match=r"row 1 .* 1 values, expected 2"):
        ShardData.from_arrow([b])
    with pytest.raises(DataError, match=r"row 0 .* 2 values, expected 784"):
        ShardData.from_arrow([b], shape=(784,))


def test_nulls_and_missing_columns_and_wrong_types():
    col = pa.array([[0.0, 1.0], None], pa.list_(pa.float32()))
    b = pa.RecordBatch.from_arrays([col, pa.array([0, 1])], ["features", "label"])
    with pytest.raises(DataError, match="null at row 1"):
        ShardData.from_arrow([b])
    with pytest.raises(DataError, match=r"\['pixels'\] not found"):
        ShardData.from_arrow([b], features="pixels")
    s = pa.RecordBatch.from_arrays([pa.array(["a"]), pa.array([0])], ["features", "label"])
    with pytest.raises(DataError, match="Arrow type string"):
        ShardData.from_arrow([s])


def test_fixed_size_lists_and_vector_targets():
    vals = pa.array(np.arange(12, dtype=np.float32))
    fx = pa.FixedSizeListArray.from_arrays(vals, 4)
    b = pa.RecordBatch.from_arrays([fx, fx], ["features", "target"])
    shard = ShardData.from_arrow([b], label="target", shape=(2, 2), label_shape=(4,))
    assert shard.features.shape == (3, 2, 2) and shard.labels.shape == (3, 4)


def test_batches_gather_across_chunks_exactly():
    rng = np.random.default_rng(1)
    x = rng.random((1000, 6), dtype=np.float32)
    y = rng.integers(0, 10, 1000)
    cuts = [0, 1, 250, 251, 600, 1000]                 # uneven chunks, one of a single row
    chunked = ShardData.from_arrow([_batch(x[a:b], y[a:b]) for a, b in itertools.pairwise(cuts)])
    whole = ShardData(x, y)
    for shuffle in (True, False):
        for (xa, ya), (xb, yb) in zip(chunked.batches(64, shuffle, seed=4, epoch=2),
                                      whole.batches(64, shuffle, seed=4, epoch=2)):
            assert torch.equal(xa, xb) and torch.equal(ya, yb)
            assert xa.numpy().flags.writeable
    np.testing.assert_array_equal(chunked.features, x)


def test_float64_values_that_overflow_float32_are_caught():
    col = pa.array([[1.0, 2.0], [1e300, 0.0]], pa.list_(pa.float64()))
    b = pa.RecordBatch.from_arrays([col, pa.array([0, 1])], ["features", "label"])
    with pytest.raises(DataError, match=r"row 1 .*NaN or inf"):
        ShardData.from_arrow([b])


def test_empty_chunks_are_ignored():
    from spark_dl.data import column_to_numpy
    t = pa.chunked_array([pa.array([], pa.list_(pa.float32())),
                          pa.array([[1.0, 2.0]], pa.list_(pa.float32()))])
    assert column_to_numpy(t, "f").shape == (1, 2)


def test_integer_features_reach_the_model_as_exact_int64():
    """Token ids of 2^24 + 1 and above (not float32 numbers) arrive as they were stored;
    uint8 pixels are still scaled to [0, 1] and floats cast to the fit's dtype."""
    from spark_dl.data.device import model_input
    big = 2**24 + 1 + np.arange(6).reshape(3, 2)                   # int32 (array<int>)
    huge = 2**53 + 1 + np.arange(6).reshape(3, 2)                  # int64 (array<bigint>)
    for ids, arrow in ((big, pa.int32()), (huge, pa.int64())):
        col = pa.ListArray.from_arrays(pa.array([0, 2, 4, 6], pa.int32()),
                                       pa.array(ids.ravel(), arrow))
        shard = ShardData.from_arrow([pa.RecordBatch.from_arrays(
            [col, pa.array([0, 1, 2])], ["features", "label"])], shape=(2,))
        assert shard.features.dtype == arrow.to_pandas_dtype()    # held as stored
        (x, _), = shard.batches(3, shuffle=False)
        assert x.dtype == torch.int64 and x.tolist() == ids.tolist()
        moved = model_input(x, torch.device("cpu"), torch.float64)
        assert moved.dtype == torch.int64 and moved.tolist() == ids.tolist()
    assert float(np.float32(big[0, 0])) != big[0, 0]                # what float32 would do
    pixels = pa.ListArray.from_arrays(pa.array([0, 2], pa.int32()),
                                      pa.array([0, 255], pa.uint8()))
    (x, _), = ShardData.from_arrow([pa.RecordBatch.from_arrays(
        [pixels, pa.array([0])], ["features", "label"])]).batches(1)
    assert x.dtype == torch.float32 and x.tolist() == [[0.0, 1.0]]
    assert model_input(x, torch.device("cpu"), torch.float64).dtype == torch.float64
    scalar = ShardData.from_arrow([pa.RecordBatch.from_arrays(
        [pa.array([2**40 + 1], pa.int64()), pa.array([0])], ["features", "label"])])
    assert next(iter(scalar.batches(1)))[0].tolist() == [2**40 + 1]


VECTOR = pa.struct([("type", pa.int8()), ("size", pa.int32()),
                    ("indices", pa.list_(pa.int32())), ("values", pa.list_(pa.float64()))])


def _vectors(rows):
    """Spark ML vectors as Arrow holds them: a dense row is a list, a sparse one a dict."""
    return pa.array([{"type": 1, "size": None, "indices": None, "values": r}
                     if isinstance(r, list) else
                     {"type": 0, "size": r["size"], "indices": list(r["at"]),
                      "values": list(r["v"])} for r in rows], VECTOR)


def test_ml_vectors_dense_and_sparse_become_rows():
    col = _vectors([[1.0, 2.0, 3.0, 4.0], {"size": 4, "at": [1, 3], "v": [5.0, 6.0]},
                    {"size": 4, "at": [], "v": []}, [7.0, 8.0, 9.0, 10.0]])
    want = np.array([[1, 2, 3, 4], [0, 5, 0, 6], [0, 0, 0, 0], [7, 8, 9, 10]], np.float32)
    b = pa.RecordBatch.from_arrays([col, pa.array([0, 1, 2, 0])], ["features", "label"])
    # chunks that are slices (Arrow offsets), and a shape to reshape to
    shard = ShardData.from_arrow([b.slice(0, 1), b.slice(1, 2), b.slice(3)], shape=(2, 2))
    assert shard.features.dtype == np.float32
    np.testing.assert_array_equal(shard.features.reshape(4, 4), want)
    dense = pa.RecordBatch.from_arrays([col.take([0, 3]), pa.array([0, 1])],
                                       ["features", "label"])
    np.testing.assert_array_equal(ShardData.from_arrow([dense]).features, want[[0, 3]])
    from spark_dl.data import open_shard
    streamed = open_shard([b.slice(0, 2), b.slice(2)], data="stream", shuffle_buffer=4)
    try:
        got = torch.cat([x for x, _ in streamed.batches(4, shuffle=False)])
        np.testing.assert_array_equal(got.numpy(), want)
    finally:
        streamed.close()


def test_ml_vectors_of_other_sizes_and_bad_sparse_rows_are_named():
    def read(*rows, shape=()):
        b = pa.RecordBatch.from_arrays([_vectors(rows), pa.array([0] * len(rows))],
                                       ["features", "label"])
        return ShardData.from_arrow([b], shape=shape)
    with pytest.raises(DataError, match=r"row 1 .* has 5 values, expected 3.*VectorAssembler"):
        read([1.0, 2.0, 3.0], {"size": 5, "at": [0], "v": [1.0]})
    with pytest.raises(DataError, match=r"row 0 .* has 3 values, expected 4 \(shape \(4,\)\)"):
        read([1.0, 2.0, 3.0], shape=(4,))
    with pytest.raises(DataError, match=r"row 1 .*sparse vector of size 3 with index 7"):
        read([1.0, 2.0, 3.0], {"size": 3, "at": [7], "v": [1.0]})
    with pytest.raises(DataError, match=r"row 0 .* holds NaN"):
        read({"size": 2, "at": [1], "v": [float("nan")]})


def _labels(values, type_=None):
    b = pa.RecordBatch.from_arrays([pa.array([[0.0]] * len(values), pa.list_(pa.float32())),
                                    pa.array(values, type_)], ["features", "label"])
    return [b]


def test_double_labels_are_class_ids_when_they_are_whole():
    shard = ShardData.from_arrow(_labels([0.0, 2.0, 1.0]), num_classes=3)
    assert shard.labels.dtype == np.int64 and shard.labels.tolist() == [0, 2, 1]
    # a classifier's loss without num_classes: class ids too; targets stay float32
    assert ShardData.from_arrow(_labels([0.0, 5.0]), class_ids=True).labels.dtype == np.int64
    assert ShardData.from_arrow(_labels([0.5, 5.0])).labels.dtype == np.float32
    # array labels under a classifier's loss alone stay targets (class probabilities)
    soft = ShardData.from_arrow(_labels([[0.25, 0.75], [1.0, 0.0]], pa.list_(pa.float64())),
                                class_ids=True)
    assert soft.labels.dtype == np.float32 and soft.labels.tolist() == [[0.25, 0.75], [1, 0]]
    with pytest.raises(DataError, match=r"column 'label': row 1 .* has label 1.5, which is not "
                                        r"a class id.*whole numbers \(0..2\)"):
        ShardData.from_arrow(_labels([0.0, 1.5, 1.0]), num_classes=3)
    with pytest.raises(DataError, match=r"row 2 .* has label 3.0, outside 0..2"):
        ShardData.from_arrow(_labels([0.0, 1.0, 3.0], pa.float32()), num_classes=3)
    with pytest.raises(DataError, match=r"row 0 .* has label -1.0; class ids are >= 0"):
        ShardData.from_arrow(_labels([-1.0, 1.0]), class_ids=True)


def test_string_labels_show_the_string_indexer_line():
    with pytest.raises(DataError, match=r"column 'y' holds strings.*"
                                        r"StringIndexer\(inputCol=\"y\", outputCol=\"y_idx\"\)"
                                        r"\.fit\(df\)\.transform\(df\).*pass label=\"y_idx\""):
        ShardData.from_arrow([pa.RecordBatch.from_arrays(
            [pa.array([[0.0]], pa.list_(pa.float32())), pa.array(["cat"])], ["features", "y"])],
            label="y")
