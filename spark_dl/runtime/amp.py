"""Mixed precision for every strategy: autocast of the forward pass (bf16 or fp16) with the
model's float32 weights as the master copy, and fp16's dynamic loss scaling for the engines
that step with a local optimizer (all-reduce, gossip: torch's GradScaler) or push their
gradients to a parameter server (Downpour: ``LossScaler``, the same rule on a flat gradient).
"""

from __future__ import annotations

import contextlib

import torch

from ..errors import ConfigError

__all__ = ["AMP_MODES", "LossScaler", "MixedPrecision", "autocast", "check_amp"]

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


class MixedPrecision:
    """A replica's mixed precision, whatever the strategy: ``autocast()`` for the forward
    pass (bf16 or fp16, the float32 weights the master copy) and fp16's dynamic loss scale.
    The loss is multiplied by ``scale`` before backward (``scale_loss``); ``unscale(grads)``
    divides the gradients (a tensor or a list: a local step's ``.grad``, a push's flat sum)
    by it in place and says whether they are finite: a step or push of inf/NaN is dropped
    by the caller and the scale halved; after ``growth_interval`` clean ones it doubles.
    bf16, float32 and float64 need no scale (1: every call a no-op)."""

    def __init__(self, amp: str | None, device: torch.device | None = None,
                 init_scale: float = 2.0 ** 16, growth_interval: int = 2000):
        self.amp, self.device = amp, device
        self.enabled = amp == "fp16"
        self.scale = init_scale if self.enabled else 1.0
        self.growth_interval, self.good, self.skipped = growth_interval, 0, 0

    def autocast(self):
        """The forward pass's autocast context (a no-op without ``amp``)."""
        return autocast(self.device, self.amp)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale if self.enabled else loss

    __call__ = scale_loss

    def unscale(self, grads) -> bool:
        """Divide ``grads`` by the scale in place; False (and the scale halved) when they
        hold inf or NaN: the caller drops them."""
        if not self.enabled:
            return True
        grads = [grads] if isinstance(grads, torch.Tensor) else list(grads)
        if grads and not bool(torch.stack([torch.isfinite(g).all() for g in grads]).all()):
            self.scale /= 2.0
            self.good, self.skipped = 0, self.skipped + 1
            return False
        torch._foreach_div_(grads, self.scale)
        self.good += 1
        if self.good >= self.growth_interval:
            self.scale *= 2.0
            self.good = 0
        return True

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good": self.good, "skipped": self.skipped}

    def load_state_dict(self, state: dict | None) -> None:
        if state:
            self.scale, self.good, self.skipped = (state["scale"], state["good"],
                                                   state["skipped"])


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
