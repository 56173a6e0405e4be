"""Patch pairs for super-resolution: alignment, augmentation, degradations."""

import numpy as np
import pytest

from spark_dl.errors import ConfigError
from spark_dl.superres.images import bicubic
from spark_dl.superres.prepare import Degradation, degrade, dihedral, make_pairs


def test_pairs_are_aligned_and_augmented():
    g = np.random.default_rng(0)
    y = g.random((40, 56)).astype(np.float32)
    hr, lr_clean, lr = make_pairs(y, 32, 2, 8, Degradation("none"), g, augment=False)
    # 32x32 windows at stride 8 in 40x56: 2 rows x 4 columns
    assert hr.shape == (8, 32, 32) and lr_clean.shape == lr.shape == (8, 16, 16)
    assert np.array_equal(hr[5], y[8:40, 8:40])
    assert np.allclose(lr_clean[5], np.clip(bicubic(hr[5], (16, 16)), 0, 1))
    assert np.array_equal(lr, lr_clean)                       # kind "none"
    hr8, _, _ = make_pairs(y, 32, 2, 8, Degradation("none"), g, augment=True)
    # 4 orientations keep 40x56 (8 patches each), 4 turn it to 56x40 (also 8)
    assert len(hr8) == 64
    assert len({a.tobytes() for a in dihedral(np.arange(4.0).reshape(2, 2))}) == 8
    _hr3, lr3, _ = make_pairs(y, 30, 3, 10, Degradation(), g, augment=False)
    assert lr3.shape[1:] == (10, 10)
    with pytest.raises(ConfigError, match="the scale 3 must divide the patch size 32"):
        make_pairs(y, 32, 3, 8, Degradation(), g)
    assert make_pairs(y[:20, :20], 32, 2, 8, Degradation(), g)[0].shape == (0, 32, 32)


def test_degradations():
    g = np.random.default_rng(1)
    gray = np.full((200, 16, 16), 0.5, np.float32)
    noisy = degrade(gray, Degradation("gaussian", sigma=20), g)
    assert abs(float((noisy - gray).std()) - 20 / 255) < 0.002
    sp = degrade(gray, Degradation("salt_pepper", amount=0.1), g)
    hit = sp != 0.5
    assert abs(hit.mean() - 0.1) < 0.01 and set(np.unique(sp[hit])) <= {0.0, 1.0}
    assert np.allclose(degrade(gray, Degradation("blur", blur=1.5), g), gray, atol=1e-6)
    edge = np.zeros((1, 16, 16), np.float32)
    edge[:, :, 8:] = 1
    blurred = degrade(edge, Degradation("blur", blur=1.0), g)
    assert 0 < blurred[0, 0, 7] < 0.5 < blurred[0, 0, 8] < 1
    assert degrade(edge, Degradation("blur+gaussian"), g).min() >= 0
    with pytest.raises(ConfigError, match="degradation kind 'fog' is unknown"):
        Degradation("fog")
