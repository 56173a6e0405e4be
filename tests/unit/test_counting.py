"""Counting scenes and MCNN (seed 002): density maps integrate to the object count, both MCNN
variants give maps of the right size, the count metrics, and a bad map size's message."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from spark_dl.data.counting import density_map, scene, scenes
from spark_dl.errors import DataError
from spark_dl.models.mcnn import MCNN
from spark_dl.recipes.counting import DensityLoss, count_errors


@pytest.mark.parametrize("down", [1, 2, 4])
def test_density_maps_integrate_to_the_count(down):
    g = np.random.default_rng(0)
    for n in (0, 1, 2, 7, 40):
        pts = g.uniform(0, 48, (n, 2))
        if n:
            pts[:min(n, 2)] = np.array([[0.2, 0.3], [47.9, 47.5]])[:min(n, 2)]  # on the border
        m = density_map(pts, 48, down)
        assert m.shape == (48 // down, 48 // down)
        assert abs(float(m.sum()) - n) <= 1e-4


def test_the_kernel_adapts_to_the_neighbours():
    # a tight cluster and a lone point: the cluster's kernels are narrow (beta x the mean
    # distance to the 3 nearest, 0.3 x 2.3 px), the lone one's wide (0.3 x ~40 px, capped at
    # size / 4)
    m = density_map([[10, 10], [12, 10], [10, 12], [12, 12], [40, 40]], 48)
    assert abs(m.sum() - 5) < 1e-4
    assert m[8:14, 8:14].sum() > 3.9                        # the cluster's mass stays put
    assert m[38:43, 38:43].sum() < 0.2                      # the lone one spreads out


def test_scenes_are_deterministic_and_annotated():
    a, b = scene(5, seed=1, size=48), scene(5, seed=1, size=48)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    img, dmap, pts = a
    assert img.shape == (3, 48, 48) and img.dtype == np.uint8 and dmap.shape == (12, 12)
    assert abs(dmap.sum() - len(pts)) < 1e-4
    x, maps, counts = scenes(0, 30, seed=2, size=32, max_objects=10)
    assert x.shape == (30, 3, 32, 32) and maps.shape == (30, 64)
    assert counts.max() <= 10 and counts.min() >= 0
    assert np.allclose(maps.sum(1), counts, atol=1e-4)
    with pytest.raises(DataError, match="not a multiple of down=4"):
        density_map([[1, 1]], 30, 4)


@pytest.mark.parametrize("variant,side", [("pool", 12), ("deconv", 48)])
def test_mcnn_maps(variant, side):
    m = MCNN(3, variant)
    out = m(torch.rand(2, 3, 48, 48))
    assert out.shape == (2, 1, side, side)
    assert MCNN.count(out).shape == (2,)
    with pytest.raises(ValueError, match="multiples of 4"):
        m(torch.rand(1, 3, 30, 30))


def test_a_density_map_of_the_wrong_resolution_is_a_clear_error():
    loss = DensityLoss(100.0)
    with pytest.raises(DataError, match=r"maps are \(1, 48, 48\) but the model outputs "
                                        r"\(1, 12, 12\).*mcnn-deconv: full"):
        loss(torch.zeros(2, 1, 12, 12), torch.zeros(2, 1, 48, 48))


def test_count_errors_by_bin():
    e = count_errors([0.5, 9.0, 12.0, 33.0], [0, 10, 10, 30])
    assert e["mae"] == pytest.approx((0.5 + 1 + 2 + 3) / 4)
    assert e["rmse"] == pytest.approx(np.sqrt((0.25 + 1 + 4 + 9) / 4))
    bins = {b["counts"]: b for b in e["bins"]}
    assert bins["0"]["mae"] == 0.5 and "relative_error" not in bins["0"]
    assert bins["1-10"]["relative_error"] == pytest.approx((0.1 + 0.2) / 2)
    assert bins["21-30"]["scenes"] == 1 and "31+" not in bins and "11-20" not in bins
