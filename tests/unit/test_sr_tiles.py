"""Tiled denoising of whole images and the super-resolution of a whole image."""

import numpy as np
import pytest
import torch

from spark_dl.models import SRCNN
from spark_dl.models.ssda import SSDA
from spark_dl.superres.images import bicubic
from spark_dl.superres.tiles import apply_tiled, self_ensemble, super_resolve, tile_starts


def test_tiles_cover_the_image_and_stitch_back():
    assert tile_starts(40, 16, 8) == [0, 8, 16, 24]
    assert tile_starts(37, 16, 8) == [0, 8, 16, 21]            # the last one flush
    assert tile_starts(16, 16, 8) == [0]
    with pytest.raises(ValueError, match="smaller than a tile"):
        tile_starts(10, 16, 8)
    g = np.random.default_rng(0)
    img = g.random((37, 53)).astype(np.float32)
    assert np.allclose(apply_tiled(img, lambda t: t, 16, 8, batch=5), img, atol=1e-6)
    # each pixel is the mean of the tiles over it: a constant shift per tile survives
    assert np.allclose(apply_tiled(img, lambda t: t + 1, 16, 8), img + 1, atol=1e-6)


def test_super_resolve_shapes_and_the_bicubic_path():
    g = np.random.default_rng(1)
    lr = g.random((20, 28)).astype(np.float32)
    plain = super_resolve(lr, 2)
    assert plain.shape == (40, 56)
    assert np.allclose(plain, np.clip(bicubic(lr, (40, 56)), 0, 1))
    torch.manual_seed(0)
    out = super_resolve(lr, 2, ssda=SSDA(256), cnn=SRCNN())
    assert out.shape == (40, 56) and 0 <= out.min() and out.max() <= 1


def test_self_ensemble_turns_each_output_back_and_averages():
    g = np.random.default_rng(2)
    img = g.random((12, 12)).astype(np.float32)
    assert np.allclose(self_ensemble(lambda v: v, img), img, atol=1e-6)
    # a ramp along the columns, added in each of the 8 orientations, averages to its mean
    ramp = np.linspace(0, 1, 12, dtype=np.float32)[None, :]
    assert np.allclose(self_ensemble(lambda v: v + ramp, img), img + 0.5, atol=1e-6)
    # non-square images keep their shape through the rotations
    wide = g.random((20, 28)).astype(np.float32)
    out = super_resolve(wide, 2, ensemble=True)
    assert out.shape == (40, 56)
    assert np.abs(out - super_resolve(wide, 2)).max() < 1e-3   # bicubic is flip-symmetric


def test_whole_image_path_equals_the_trained_cascade_on_one_patch():
    """super_resolve (evaluation, Spark inference) on an image of one LR patch is the cascade
    the training fits, with and without the noisy skip."""
    from spark_dl.superres.cascade import Cascade
    g = np.random.default_rng(3)
    lr = g.random((16, 16)).astype(np.float32)
    for inputs in (1, 2):
        torch.manual_seed(inputs)
        model = Cascade(16, 2, SSDA(256), SRCNN(inputs=inputs)).eval()
        with torch.no_grad():
            want = model(torch.from_numpy(lr).reshape(1, 256))[0, 0].clamp(0, 1).numpy()
        got = super_resolve(lr, 2, model.ssda, model.cnn)
        assert np.abs(got - want).max() < 1e-4, inputs
