"""Optimizers by name, for configs and jobs."""

from __future__ import annotations

import torch

from .cg import NonlinearCG

__all__ = ["OPTIMIZERS", "load_optimizer_state", "make_optimizer", "needs_closure"]

OPTIMIZERS = ("sgd", "rmsprop", "adagrad", "adam", "lbfgs", "cg")


def make_optimizer(name: str, params, lr: float, momentum: float = 0.9,
                   weight_decay: float = 0.0, max_iter: int = 10,
                   nesterov: bool = False) -> torch.optim.Optimizer:
    """``name`` in OPTIMIZERS; ``momentum`` and ``nesterov`` (its Nesterov form) apply to SGD,
    ``max_iter`` to the closure-based L-BFGS and CG (iterations per step)."""
    if name == "sgd":
        params = list(params)
        if _on_cuda(params):                 # one kernel (below)
            return _fused_if_possible(torch.optim.SGD, params, lr=lr, momentum=momentum,
                                      weight_decay=weight_decay, nesterov=nesterov)
        return torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay,
                               nesterov=nesterov)
    if name == "rmsprop":
        return torch.optim.RMSprop(params, lr=lr, weight_decay=weight_decay)
    if name == "adagrad":
        return torch.optim.Adagrad(params, lr=lr, weight_decay=weight_decay)
    if name == "adam":
        return _fused_if_possible(torch.optim.Adam, list(params), lr=lr,
                                  weight_decay=weight_decay)
    if name == "lbfgs":
        return torch.optim.LBFGS(params, lr=lr, max_iter=max_iter, line_search_fn="strong_wolfe")
    if name == "cg":
        return NonlinearCG(params, lr=lr, max_iter=max_iter)
    raise ValueError(f"unknown optimizer {name!r}; choose one of {', '.join(OPTIMIZERS)}")


def load_optimizer_state(opt: torch.optim.Optimizer, state: dict) -> None:
    """``opt.load_state_dict(state)`` (a checkpoint's), keeping the hyperparameters ``opt`` was
    made with: the checkpoint gives the state (momentum buffers, Adam's moments, step counts)
    and the rate (which the schedule sets again before every step), the fit its ``momentum``,
    ``nesterov``, ``weight_decay``, betas and the rest. torch's load takes every
    hyperparameter from the checkpoint, so a fit resumed with another momentum would step with
    the old one."""
    own = [{key: value for key, value in g.items() if key not in ("params", "lr")}
           for g in opt.param_groups]
    groups = [{**saved, **mine} for saved, mine in zip(state["param_groups"], own)]
    opt.load_state_dict({**state, "param_groups": groups})   # (torch places the state, e.g.
                                                # Adam's step counts, by the flags it loads)


def _on_cuda(params: list) -> bool:
    """Whether the first parameter (of a list of tensors or of param groups) is on CUDA."""
    first = params[0] if params else None
    if isinstance(first, dict):
        first = next(iter(first["params"]), None)
    return first is not None and first.is_cuda


def _fused_if_possible(cls, params: list, **kw) -> torch.optim.Optimizer:
    """``cls(params, fused=True, **kw)`` where this torch has the fused kernel for the params'
    device and dtype (CPU since torch 2.4, CUDA), else the default implementation. The fused
    Adam is the same update in one kernel, several times faster on CPU, which matters when
    every replica steps its own optimizer. SGD is fused on CUDA only (torch 2.4+)."""
    try:
        return cls(params, fused=True, **kw)
    except (RuntimeError, TypeError, ValueError):        # older torch, or an unsupported device
        return cls(params, **kw)


def needs_closure(optimizer: torch.optim.Optimizer) -> bool:
    return isinstance(optimizer, (torch.optim.LBFGS, NonlinearCG))
