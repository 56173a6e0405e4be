"""Scores of predicted masks: IoU and Dice per image, and the Airbus ship challenge's
object-level F2 (seed 000's metric): the ships of an image are the connected components of its
mask (8-connected); at each IoU threshold t in 0.5, 0.55, ..., 0.95 a predicted ship matching a true one
with IoU > t is a true positive, unmatched predictions false positives, unmatched truths false
negatives, F2(t) = 5 TP / (5 TP + 4 FN + FP); an image scores the mean over t (1 when it has
no ships and none is predicted, 0 when it has none and some are), and a set the mean over
images."""

from __future__ import annotations

import numpy as np

__all__ = ["THRESHOLDS", "components", "dice", "f2_score", "iou"]

THRESHOLDS = np.arange(0.5, 1.0, 0.05)


def components(mask: np.ndarray) -> list[np.ndarray]:
    """The 8-connected components of a boolean mask (a thin diagonal hull stays one ship),
    as boolean masks."""
    mask = np.asarray(mask, bool)
    seen = np.zeros_like(mask)
    out = []
    h, w = mask.shape
    for y0, x0 in zip(*np.nonzero(mask)):
        if seen[y0, x0]:
            continue
        comp = np.zeros_like(mask)
        stack = [(y0, x0)]
        seen[y0, x0] = True
        while stack:
            y, x = stack.pop()
            comp[y, x] = True
            for yy, xx in ((y + dy, x + dx) for dy in (-1, 0, 1) for dx in (-1, 0, 1)):
                if 0 <= yy < h and 0 <= xx < w and mask[yy, xx] and not seen[yy, xx]:
                    seen[yy, xx] = True
                    stack.append((yy, xx))
        out.append(comp)
    return out


def iou(pred: np.ndarray, true: np.ndarray) -> float:
    """Intersection over union of two boolean masks (1 when both are empty)."""
    pred, true = np.asarray(pred, bool), np.asarray(true, bool)
    union = (pred | true).sum()
    return 1.0 if union == 0 else float((pred & true).sum() / union)


def dice(pred: np.ndarray, true: np.ndarray) -> float:
    """2 |P ∩ T| / (|P| + |T|) (1 when both are empty)."""
    pred, true = np.asarray(pred, bool), np.asarray(true, bool)
    total = pred.sum() + true.sum()
    return 1.0 if total == 0 else float(2 * (pred & true).sum() / total)


def f2_score(pred: np.ndarray, true: np.ndarray, thresholds=THRESHOLDS) -> float:
    """One image's object-level F2 averaged over the IoU thresholds."""
    ps, ts = components(pred), components(true)
    if not ts:
        return 1.0 if not ps else 0.0
    if not ps:
        return 0.0
    m = np.array([[iou(p, t) for t in ts] for p in ps])        # predictions x truths
    scores = []
    for th in thresholds:
        hit = m > th
        tp = int(hit.any(0).sum())                  # truths matched (IoU > 0.5: one each)
        fn = len(ts) - tp
        fp = int((~hit.any(1)).sum())
        scores.append(5 * tp / (5 * tp + 4 * fn + fp))
    return float(np.mean(scores))
