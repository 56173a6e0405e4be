import numpy as np
import pytest

from spark_dl.data import Distortion, distort_range


def test_samples_depend_only_on_index(mnist):
    x, y = mnist
    a, la = distort_range(x[:100], y[:100], 0, 700, seed=5)
    b, lb = distort_range(x[:100], y[:100], 300, 650, seed=5)     # crosses block boundaries
    np.testing.assert_array_equal(a[300:650], b)
    np.testing.assert_array_equal(la[300:650], lb)
    c, _ = distort_range(x[:100], y[:100], 0, 700, seed=6)
    assert not np.array_equal(a, c)


def test_values_labels_and_that_digits_are_deformed_not_destroyed(mnist):
    x, y = mnist
    src = x[:50].reshape(50, -1) / 255.0
    out, labels = distort_range(x[:50], y[:50], 0, 512, seed=0)
    assert out.shape == (512, 784) and out.dtype == np.float32
    assert out.min() >= 0 and out.max() <= 1 and set(labels) <= set(y[:50])
    # Each distorted digit is closest (of all sources) to a source of its own label far more
    # often than chance, but never a pixel copy.
    d = ((out[:, None, :] - src[None]) ** 2).sum(-1)
    assert (y[:50][d.argmin(1)] == labels).mean() > 0.6
    assert d.min() > 1.0
    ident, _ = distort_range(x[:50], y[:50], 0, 64, seed=0,
                             distortion=Distortion(0, 0, 0, 0, 0, 0))
    assert min(np.abs(ident[i] - src).sum(1).min() for i in range(64)) < 1e-4


def test_bad_distortion_values():
    with pytest.raises(ValueError, match=r"Distortion.rotation"):
        Distortion(rotation=-1)
    with pytest.raises(ValueError, match="scale must be < 1"):
        Distortion(scale=1.5)


def test_empty_range(mnist):
    x, y = mnist
    out, labels = distort_range(x[:10], y[:10], 5, 5, seed=0)
    assert out.shape == (0, 784) and labels.shape == (0,)
