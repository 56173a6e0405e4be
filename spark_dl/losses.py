"""The losses a fit names (``loss="cross_entropy"``, ...) and a model's loss and accuracy on
held-out rows: what every strategy's tasks and driver compute, beside the single-process
trainer (spark_dl.train)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from .errors import DataError

__all__ = ["LOSSES", "cross_entropy", "evaluation_row", "evaluation_sums", "loss_function",
           "sequence_cross_entropy", "val_metrics"]

LOSSES = ("cross_entropy", "sequence_cross_entropy", "mse")


def sequence_cross_entropy(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over every step of (B, T, V) logits against (B, T) class ids."""
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                       target.reshape(-1).long())


def cross_entropy(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """torch's cross entropy; a label out of the model's range is a DataError that says so
    (torch's own is "IndexError: Target 2 is out of bounds")."""
    try:
        return nn.functional.cross_entropy(out, y)
    except (IndexError, RuntimeError) as e:
        if out.dim() < 2 or y.is_floating_point() or not len(y):
            raise
        classes, low, high = out.shape[1], int(y.min()), int(y.max())
        if low >= 0 and high < classes:
            raise
        raise DataError(f"a label of {high if high >= classes else low} in this mini-batch, but "
                        f"the model outputs {classes} scores per row (cross_entropy needs labels "
                        f"in 0..{classes - 1}): build the model with as many outputs as there "
                        f"are classes, and pass num_classes= to check the labels as they are "
                        f"read") from e


def loss_function(name: str) -> Callable:
    if name == "cross_entropy":
        return cross_entropy
    if name == "sequence_cross_entropy":
        return sequence_cross_entropy
    if name == "mse":
        return nn.functional.mse_loss
    raise ValueError(f"unknown loss {name!r}; choose one of {', '.join(LOSSES)} "
                     f"or pass a callable loss(output, target) -> mean loss")


def val_metrics(model, val, loss_fn, classify: bool, batch: int = 1000) -> dict:
    """``model``'s mean loss (and accuracy when ``classify``) on the held-out rows ``val``:
    {"val_loss", "val_accuracy"} (spark_dl.train.evaluate scores a classifier on arrays)."""
    return evaluation_row(evaluation_sums(model, val, loss_fn, classify, batch), classify)


@torch.no_grad()
def evaluation_sums(model, val, loss_fn, classify: bool, batch: int = 1000) -> torch.Tensor:
    """(loss x rows, correct rows, rows) summed over ``val``'s chunks of ``batch`` rows, as
    float64 on the rows' device: sums of disjoint parts of the rows add up to the whole's
    (the named losses are means over rows), so replicas can each take a part."""
    model.eval()
    x, y = val
    sums = torch.zeros(3, dtype=torch.float64, device=x.device)
    for i in range(0, len(x), batch):
        out = model(x[i:i + batch])
        sums[0] += loss_fn(out, y[i:i + batch]).double() * len(out)
        if classify:
            sums[1] += (out.argmax(1) == y[i:i + batch]).sum()
    sums[2] = len(x)
    model.train()
    return sums


def evaluation_row(sums: torch.Tensor, classify: bool) -> dict:
    """{"val_loss", "val_accuracy" when ``classify``} from ``evaluation_sums`` (one host
    synchronisation)."""
    loss, correct, rows = sums.tolist()
    row = {"val_loss": loss / max(rows, 1)}
    if classify:
        row["val_accuracy"] = correct / max(rows, 1)
    return row
