"""Seed 000's pieces: synthetic ship scenes and masks, the bottleneck U-Net, the focal + Dice
loss against a hand computation, the Airbus F2 metric on a worked example, and gradient
accumulation over micro-batches."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from spark_dl.data.ships import ship_batch, ship_scene
from spark_dl.errors import DataError
from spark_dl.models.unet import Bottleneck, FocalDiceLoss, UNet
from spark_dl.segmentation import components, dice, f2_score, iou


def test_ship_scenes_are_deterministic_with_masks_of_their_ships():
    a, b = ship_scene(7, seed=1), ship_scene(7, seed=1)
    assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1]) and a[2] == b[2]
    x, m, s = ship_batch(0, 40, seed=2, size=48)
    assert x.shape == (40, 3, 48, 48) and x.dtype == np.uint8 and m.shape == (40, 48, 48)
    assert set(np.unique(m)) <= {0.0, 1.0}
    assert (s == 0).sum() >= 10                         # many empty scenes, as in Airbus
    for mask, n in zip(m, s):                           # hulls never touch: one part a ship
        assert len(components(mask)) == n


def test_bottleneck_block_and_unet_shapes():
    blk = Bottleneck(3, 16)
    assert blk(torch.rand(2, 3, 20, 20)).shape == (2, 16, 20, 20)
    with pytest.raises(ValueError, match="must exceed in"):
        Bottleneck(16, 16)
    net = UNet(3, (8, 16, 32))
    out = net(torch.rand(2, 3, 32, 32))
    out = out.detach()
    assert out.shape == (2, 1, 32, 32) and 0 < float(out.min()) and float(out.max()) < 1
    with pytest.raises(ValueError, match="multiples of 4"):
        net(torch.rand(1, 3, 30, 30))


def test_focal_dice_loss_by_hand():
    p = torch.tensor([0.9, 0.2], dtype=torch.float64).view(1, 1, 1, 2)
    y = torch.tensor([1.0, 0.0], dtype=torch.float64).view(1, 1, 1, 2)
    focal = (-(0.1 ** 2) * math.log(0.9) - (0.2 ** 2) * math.log(0.8)) / 2
    dice_ = (2 * 0.9 + 1) / (0.9 + 0.2 + 1 + 1)
    assert float(FocalDiceLoss(10, 2)(p, y)) == pytest.approx(10 * focal - math.log(dice_),
                                                                  abs=1e-12)
    with pytest.raises(DataError, match=r"masks are .* but the model outputs"):
        FocalDiceLoss()(p, torch.zeros(1, 1, 2, 2, dtype=torch.float64))


def test_f2_on_a_worked_example():
    true = np.zeros((8, 8), bool)
    true[0:2, 0:2] = True                               # ship A
    true[5, 2:5] = True                                 # ship B, 3 pixels
    pred = np.zeros((8, 8), bool)
    pred[0:2, 0:2] = True                               # A exactly (IoU 1)
    pred[5, 2:4] = True                                 # 2 of B's 3 pixels (IoU 2/3)
    pred[7, 7] = True                                   # a false positive (not touching)
    # t = 0.5 .. 0.65: TP 2, FN 0, FP 1 -> 10/11; t = 0.7 .. 0.95: TP 1, FN 1, FP 2 -> 5/11
    assert f2_score(pred, true) == pytest.approx((4 * 10 / 11 + 6 * 5 / 11) / 10)
    empty = np.zeros((8, 8), bool)
    assert f2_score(empty, empty) == 1.0 and f2_score(pred, empty) == 0.0
    assert f2_score(empty, true) == 0.0
    assert iou(pred, true) == pytest.approx(6 / 8) and dice(pred, true) == pytest.approx(12 / 14)


def test_accumulated_micro_batches_equal_one_big_batch():
    """What a boosting worker pushes after k micro-batches (Downpour's n_push: the sum of
    n_i x the gradient of each micro-batch's mean loss, divided by the samples) is the gradient
    of the k-times batch (float64; the per-pixel focal loss; group norms are per sample)."""
    torch.manual_seed(0)
    net = UNet(3, (4, 8)).double()
    loss = FocalDiceLoss(alpha=1.0)

    def focal(p, y):                                    # the decomposable (mean) part
        pt = torch.where(y > 0.5, p, 1 - p).clamp(1e-6, 1 - 1e-6)
        return (-(1 - pt) ** loss.gamma * torch.log(pt)).mean()
    x = torch.rand(8, 3, 8, 8, dtype=torch.float64)
    y = (torch.rand(8, 1, 8, 8) > 0.8).double()
    net.zero_grad()
    focal(net(x), y).backward()
    big = [p.grad.clone() for p in net.parameters()]
    net.zero_grad()
    for i in range(0, 8, 2):                            # k = 4 micro-batches of 2
        (focal(net(x[i:i + 2]), y[i:i + 2]) * 2).backward()
    for p, g in zip(net.parameters(), big):
        assert torch.allclose(p.grad / 8, g, atol=1e-12, rtol=0)


def test_focal_dice_loss_is_finite_under_bf16():
    p = torch.tensor([0.9999, 0.00001, 0.5], dtype=torch.bfloat16).view(1, 1, 1, 3)
    y = torch.tensor([1.0, 0.0, 1.0], dtype=torch.bfloat16).view(1, 1, 1, 3)
    assert torch.isfinite(FocalDiceLoss()(p, y))
