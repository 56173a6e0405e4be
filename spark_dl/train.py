"""The single-process reference training loop; distributed engines reuse its pieces."""

from __future__ import annotations

import time
from typing import Iterable

import numpy as np
import torch
from torch import nn

__all__ = ["make_optimizer", "train_epoch", "evaluate"]


def make_optimizer(name: str, params, lr: float, momentum: float = 0.9) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=momentum)
    if name == "adam":
        return torch.optim.Adam(params, lr=lr)
    raise ValueError(f"unknown optimizer {name!r}; choose 'sgd' or 'adam'")


def train_epoch(model: nn.Module, batches: Iterable, optimizer: torch.optim.Optimizer,
                loss_fn=nn.functional.cross_entropy) -> dict:
    """One pass over ``batches`` of (x, y); returns mean loss, samples and seconds."""
    model.train()
    total, n, t0 = 0.0, 0, time.perf_counter()
    for x, y in batches:
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        loss.backward()
        optimizer.step()
        total += loss.item() * len(x)
        n += len(x)
    return {"loss": total / max(n, 1), "samples": n, "seconds": time.perf_counter() - t0}


@torch.no_grad()
def evaluate(model: nn.Module, x: np.ndarray | torch.Tensor, y: np.ndarray | torch.Tensor,
             batch_size: int = 1000) -> dict:
    """Cross-entropy and accuracy of a classifier on (x, y)."""
    model.eval()
    x, y = torch.as_tensor(x, dtype=torch.float32), torch.as_tensor(y, dtype=torch.long)
    loss, correct = 0.0, 0
    for i in range(0, len(x), batch_size):
        logits = model(x[i:i + batch_size])
        loss += float(nn.functional.cross_entropy(logits, y[i:i + batch_size], reduction="sum"))
        correct += int((logits.argmax(1) == y[i:i + batch_size]).sum())
    return {"loss": loss / max(len(x), 1), "accuracy": correct / max(len(x), 1)}
