"""The single-process reference training loop; distributed engines reuse its pieces.

    history = train_loop(model, lambda epoch: shard.batches(64, epoch=epoch), optimizer, epochs=5,
                         evaluate_fn=lambda m: evaluate(m, test_x, test_y),
                         checkpoint="run/ckpt.pt")
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np
import torch
from torch import nn

from .optim.factory import make_optimizer, needs_closure

__all__ = ["evaluate", "make_optimizer", "restore_checkpoint", "save_checkpoint",
           "seed_everything", "train_epoch", "train_loop", "train_step"]


def seed_everything(seed: int) -> None:
    """Seed Python, numpy's global generator and torch (CPU and CUDA)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def train_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor,
               optimizer: torch.optim.Optimizer,
               loss_fn=nn.functional.cross_entropy) -> float:
    """One optimizer step on (x, y); closure-based optimizers (L-BFGS, CG) get a closure."""
    def closure():
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        loss.backward()
        return loss
    if needs_closure(optimizer):
        with torch.no_grad():
            before = float(loss_fn(model(x), y))
        optimizer.step(closure)
        return before
    return float(optimizer.step(closure).detach())


def train_epoch(model: nn.Module, batches: Iterable, optimizer: torch.optim.Optimizer,
                loss_fn=nn.functional.cross_entropy) -> dict:
    """One pass over ``batches`` of (x, y); returns mean loss, samples and seconds."""
    model.train()
    total, n, t0 = 0.0, 0, time.perf_counter()
    for x, y in batches:
        total += train_step(model, x, y, optimizer, loss_fn) * len(x)
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


def save_checkpoint(path: str | Path, model: nn.Module, optimizer=None, epoch: int = 0,
                    history: list | None = None) -> None:
    """Atomic write (temporary file, then rename) of model, optimizer, epoch and history."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    torch.save({"model": model.state_dict(),
                "optimizer": optimizer.state_dict() if optimizer is not None else None,
                "epoch": epoch, "history": history or []}, tmp)
    os.replace(tmp, path)


def restore_checkpoint(path: str | Path, model: nn.Module, optimizer=None) -> dict:
    """Restore model (and optimizer) in place; returns the checkpoint's epoch and history."""
    ckpt = torch.load(path, map_location="cpu", weights_only=True)
    model.load_state_dict(ckpt["model"])
    if optimizer is not None and ckpt["optimizer"] is not None:
        optimizer.load_state_dict(ckpt["optimizer"])
    return {"epoch": ckpt["epoch"], "history": ckpt["history"]}


def train_loop(model: nn.Module, batches_fn: Callable[[int], Iterable],
               optimizer: torch.optim.Optimizer, epochs: int,
               loss_fn=nn.functional.cross_entropy,
               evaluate_fn: Callable[[nn.Module], dict] | None = None,
               checkpoint: str | Path | None = None, log: Callable[[str], None] | None = print,
               scheduler=None) -> list:
    """Train in this process for ``epochs`` (spark_dl.fit trains on Spark); history: one dict per epoch (train loss, samples, seconds and
    whatever ``evaluate_fn`` returns, prefixed ``val_``). Checkpoints after every epoch."""
    history = []
    for epoch in range(epochs):
        row = {"epoch": epoch + 1, **train_epoch(model, batches_fn(epoch), optimizer, loss_fn)}
        if scheduler is not None:
            scheduler.step()
        if evaluate_fn is not None:
            row.update({f"val_{k}": v for k, v in evaluate_fn(model).items()})
        history.append(row)
        if checkpoint is not None:
            save_checkpoint(checkpoint, model, optimizer, epoch + 1, history)
        if log is not None:
            log(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                         for k, v in row.items()))
    return history
