"""Learning rates that follow the global batch: the scaling rule and its warmup.

A fit's ``lr`` is the one that suits a single replica's mini-batch of ``batch_size`` rows. A
strategy whose update averages the gradients of ``k`` such mini-batches (AllReduce: replicas x
accumulate; Downpour sync: a round of every replica's push; Gossip: the replicas' average model
moves by their mean gradient) takes that many times fewer updates per epoch, so it scales the
rate (Goyal et al., 2017, "Accurate, Large Minibatch SGD"):

    linear   lr_k = k lr                (SGD, with or without momentum)
    sqrt     lr_k = sqrt(k) lr          (Adam, RMSprop, Adagrad: their steps are normalised)
    none     lr_k = lr

and reaches it by a gradual warmup, linear in the epochs done t (fractional), from lr to lr_k
over ``warmup_epochs`` w; the per-epoch decay d multiplies both:

    lr(t) = d^floor(t) (lr + (lr_k - lr) min(t / w, 1))

"auto" picks the rule by the optimizer (linear for SGD, sqrt for the adaptive ones, none for
L-BFGS and CG, whose line searches choose their own steps) and a warmup that grows with log2 k
to a quarter of the fit (at most two epochs) at k >= 32. With k = 1 the schedule is plain
``lr`` with its decay.
"""

from __future__ import annotations

import dataclasses
import math

from ..errors import ConfigError

__all__ = ["LR_SCALINGS", "LRSchedule", "check_lr_scaling", "resolve_scaling"]

LR_SCALINGS = ("auto", "linear", "sqrt", "none")
_AUTO = {"sgd": "linear", "rmsprop": "sqrt", "adagrad": "sqrt", "adam": "sqrt",
         "momentum": "linear", "lbfgs": "none", "cg": "none"}


def check_lr_scaling(lr_scaling, warmup_epochs, epochs: int) -> None:
    """ConfigErrors for fit's ``lr_scaling`` and ``warmup_epochs`` (before any task starts)."""
    if lr_scaling is not None and lr_scaling not in LR_SCALINGS:
        raise ConfigError(f"lr_scaling must be one of {', '.join(map(repr, LR_SCALINGS))} or "
                          f"None, got {lr_scaling!r}: 'linear' for SGD (Goyal et al.), 'sqrt' "
                          f"for Adam-like optimizers, None to keep lr as given")
    if warmup_epochs == "auto":
        return
    if isinstance(warmup_epochs, bool) or not isinstance(warmup_epochs, (int, float)) or \
            not math.isfinite(warmup_epochs) or warmup_epochs < 0:
        raise ConfigError(f"warmup_epochs must be 'auto' or a number of epochs >= 0, got "
                          f"{warmup_epochs!r}")
    if warmup_epochs > epochs:
        raise ConfigError(f"warmup_epochs={warmup_epochs} is longer than the fit "
                          f"(epochs={epochs}): the rate would never reach its scaled value; "
                          f"use warmup_epochs <= {epochs}, or more epochs")


def resolve_scaling(lr_scaling, optimizer: str) -> str:
    """The rule ``lr_scaling`` means for ``optimizer``: "linear", "sqrt" or "none"."""
    if lr_scaling is None:
        return "none"
    return _AUTO.get(optimizer, "none") if lr_scaling == "auto" else lr_scaling


@dataclasses.dataclass(frozen=True)
class LRSchedule:
    """The rate after ``t`` epochs (fractional) of a fit whose updates average ``k``
    single-replica mini-batches (see the module's formula)."""

    lr: float
    k: float = 1.0
    rule: str = "none"
    warmup_epochs: float | str = "auto"
    decay: float = 1.0
    epochs: int = 1

    @property
    def scaled(self) -> float:
        """lr_k: the rate after warmup, before decay."""
        factor = {"linear": self.k, "sqrt": math.sqrt(self.k), "none": 1.0}[self.rule]
        return self.lr * factor

    @property
    def warmup(self) -> float:
        """The warmup's length in epochs. "auto": none when the rate is not scaled, else
        growing with log2 k up to a quarter of the fit (at most 2 epochs) from k = 32 on,
        Goyal's 8k batch of 32 x 256: a doubled rate is safe almost at once (the thesis CNN at
        batch 32 and lr 0.04 from the first step kept pace, per sample, with batch 16 at 0.02;
        a quarter-epoch warmup cost two replicas most of their first quarter), a 16-fold one
        is not."""
        if self.warmup_epochs != "auto":
            return float(self.warmup_epochs)
        if self.scaled == self.lr or self.k <= 1:
            return 0.0
        return min(0.25 * self.epochs, 2.0) * min(1.0, math.log2(self.k) / 5.0)

    def at(self, t: float) -> float:
        ramp = 1.0 if self.warmup <= 0 else min(max(t, 0.0) / self.warmup, 1.0)
        return self.decay ** math.floor(t) * (self.lr + (self.scaled - self.lr) * ramp)

    def describe(self) -> dict:
        return {"lr": self.lr, "k": self.k, "rule": self.rule, "scaled_lr": self.scaled,
                "warmup_epochs": self.warmup, "lr_decay": self.decay}
