"""Optimizers by name, for configs and jobs."""

from __future__ import annotations

import torch

from .cg import NonlinearCG

__all__ = ["OPTIMIZERS", "make_optimizer", "needs_closure"]

OPTIMIZERS = ("sgd", "rmsprop", "adagrad", "adam", "lbfgs", "cg")


def make_optimizer(name: str, params, lr: float, momentum: float = 0.9,
                   weight_decay: float = 0.0, max_iter: int = 10) -> torch.optim.Optimizer:
    """``name`` in OPTIMIZERS; ``momentum`` applies to SGD and RMSprop, ``max_iter`` to the
    closure-based L-BFGS and CG (iterations per step)."""
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay)
    if name == "rmsprop":
        return torch.optim.RMSprop(params, lr=lr, weight_decay=weight_decay)
    if name == "adagrad":
        return torch.optim.Adagrad(params, lr=lr, weight_decay=weight_decay)
    if name == "adam":
        return torch.optim.Adam(params, lr=lr, weight_decay=weight_decay)
    if name == "lbfgs":
        return torch.optim.LBFGS(params, lr=lr, max_iter=max_iter, line_search_fn="strong_wolfe")
    if name == "cg":
        return NonlinearCG(params, lr=lr, max_iter=max_iter)
    raise ValueError(f"unknown optimizer {name!r}; choose one of {', '.join(OPTIMIZERS)}")


def needs_closure(optimizer: torch.optim.Optimizer) -> bool:
    return isinstance(optimizer, (torch.optim.LBFGS, NonlinearCG))
