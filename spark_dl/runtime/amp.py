"""Mixed precision for every strategy: autocast of the forward pass (bf16 or fp16) with the
model's float32 weights as the master copy, and fp16's dynamic loss scaling for the engines
that step with a local optimizer (all-reduce, gossip: torch's GradScaler) or push their
gradients to a parameter server (Downpour: ``LossScaler``, the same rule on a flat gradient).
"""

from __future__ import annotations

import contextlib

import torch

from ..errors import ConfigError

__all__ = ["AMP_MODES", "LossScaler", "autocast", "check_amp"]

AMP_MODES = (None, "bf16", "fp16")


def check_amp(amp, dtype: str) -> None:
    if amp not in AMP_MODES:
        raise ConfigError(f"amp must be one of None, 'bf16', 'fp16', got {amp!r}")
    if amp is not None and dtype == "float64":
        raise ConfigError("amp autocasts float32 weights; use dtype='float32' with amp")


def autocast(device: torch.device, amp: str | None):
    """The forward pass's autocast context (a no-op without ``amp``)."""
    if amp is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=torch.bfloat16 if amp == "bf16" else torch.float16)


class LossScaler:
    """fp16's dynamic loss scale for gradients that leave the task (a parameter server's push):
    the loss is multiplied by ``scale`` before backward; before a push the summed gradient is
    divided by it, and a gradient with inf/NaN is dropped (not pushed) and the scale halved;
    after ``growth_interval`` clean pushes it doubles. bf16 and float32 need none (scale 1)."""

    def __init__(self, enabled: bool, init_scale: float = 2.0 ** 16,
                 growth_interval: int = 2000):
        self.enabled = enabled
        self.scale = init_scale if enabled else 1.0
        self.growth_interval, self.good, self.skipped = growth_interval, 0, 0

    def __call__(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale if self.enabled else loss

    def unscale(self, grad: torch.Tensor) -> bool:
        """Divide ``grad`` by the scale in place; False (and the scale halved) when it holds
        inf or NaN: the caller drops it."""
        if not self.enabled:
            return True
        if not bool(torch.isfinite(grad).all()):
            self.scale /= 2.0
            self.good, self.skipped = 0, self.skipped + 1
            return False
        grad.div_(self.scale)
        self.good += 1
        if self.good >= self.growth_interval:
            self.scale *= 2.0
            self.good = 0
        return True
