"""Mixed precision for every strategy: one ``MixedPrecision`` a replica, the autocast of the
forward pass (bf16 or fp16) with the model's float32 weights as the master copy, and fp16's
dynamic loss scale, the same rule for a local step's gradients (AllReduce, Gossip, LocalSGD)
and for a push's flat gradient (Downpour, Boosting)."""

from __future__ import annotations

import contextlib

import torch

from ..errors import ConfigError

__all__ = ["AMP_MODES", "MixedPrecision", "autocast", "check_amp"]

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
