import gzip

import numpy as np
import pytest

from spark_dl.data import load_mnist, read_idx
from spark_dl.errors import DataError

from ..conftest import MNIST_IMAGES, MNIST_LABELS


def _idx(arr: np.ndarray, magic_type=0x08) -> bytes:
    head = bytes([0, 0, magic_type, arr.ndim]) + b"".join(d.to_bytes(4, "big") for d in arr.shape)
    return head + arr.astype(np.uint8).tobytes()


def test_reads_shipped_mnist():
    x, y = load_mnist(MNIST_IMAGES, MNIST_LABELS)
    assert x.shape == (10000, 28, 28) and x.dtype == np.uint8
    assert y.shape == (10000,) and set(np.unique(y)) == set(range(10))
    assert y[:5].tolist() == [7, 2, 1, 0, 4]            # the well-known first test labels


def test_raw_and_gzip_give_the_same_array(tmp_path):
    arr = np.arange(2 * 3 * 4).reshape(2, 3, 4)
    (tmp_path / "a.idx").write_bytes(_idx(arr))
    (tmp_path / "a.idx.gz").write_bytes(gzip.compress(_idx(arr)))
    np.testing.assert_array_equal(read_idx(tmp_path / "a.idx"), arr)
    np.testing.assert_array_equal(read_idx(tmp_path / "a.idx.gz"), arr)


def test_wrong_magic(tmp_path):
    p = tmp_path / "bad.idx"
    p.write_bytes(b"PK\x03\x04" + bytes(20))
    with pytest.raises(DataError, match="bad IDX magic"):
        read_idx(p)


def test_swapped_files_are_named():
    with pytest.raises(DataError, match=r"expected 2051.*swapped"):
        load_mnist(MNIST_LABELS, MNIST_IMAGES)


def test_truncated_data(tmp_path):
    p = tmp_path / "t.idx"
    p.write_bytes(_idx(np.zeros((10, 28, 28)))[:-100])
    with pytest.raises(DataError, match="truncated"):
        read_idx(p)


def test_truncated_gzip(tmp_path):
    p = tmp_path / "t.idx.gz"
    p.write_bytes(gzip.compress(_idx(np.zeros((10, 28, 28))))[:-30])
    with pytest.raises(DataError, match="gzip"):
        read_idx(p)


def test_count_mismatch(tmp_path):
    (tmp_path / "x").write_bytes(_idx(np.zeros((3, 28, 28))))
    (tmp_path / "y").write_bytes(_idx(np.zeros(4)))
    with pytest.raises(DataError, match=r"3 images but .* 4 labels"):
        load_mnist(tmp_path / "x", tmp_path / "y")


def test_missing_file(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        read_idx(tmp_path / "nope.gz")
