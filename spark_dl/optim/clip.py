"""Gradient clipping that keeps a scaled learning rate stable.

The linear scaling rule (schedule.py) runs a fit near the edge of stability as k grows: the
thesis CNN at k = 16 (batch 16 per replica, lr 0.02 x 16 = 0.32, momentum 0.9) diverged to
chance in 3 of 9 seeded runs, each time on a step whose gradient norm jumped well above its
recent level (docs/benchmarks.md, "A guard for the scaled rate"). ``grad_clip`` bounds such
steps:

    None or 0   off
    x > 0       the update's gradient norm is cut to x (torch.nn.utils.clip_grad_norm_)
    "auto"      relative: when the rate is scaled (k > 1), the norm is cut to FACTOR times its
                running mean m (m_0 = the first step's norm; m <- BETA m + (1 - BETA) min(n,
                FACTOR m)); off when the rate is not scaled, so one replica trains as a plain
                loop does

The relative rule needs no knowledge of the model's gradient scale: a healthy fit rarely
crosses twice its running mean (1-7% of the steps of the runs above), a step that would
throw the weights out of their basin does. It acts on the update's gradient: AllReduce's
global mean (the same on every replica, so they stay identical), a Gossip replica's own.
Everything stays on the device: no host synchronisation per step.
"""

from __future__ import annotations

import math

import torch

from ..errors import ConfigError

__all__ = ["GradClip", "check_grad_clip"]

FACTOR, BETA = 2.0, 0.95


def check_grad_clip(grad_clip) -> None:
    """A ConfigError for a ``grad_clip`` that is not None, "auto" or a number >= 0."""
    if grad_clip is None or grad_clip == "auto":
        return
    if isinstance(grad_clip, bool) or not isinstance(grad_clip, (int, float)) or \
            not math.isfinite(grad_clip) or grad_clip < 0:
        raise ConfigError(f"grad_clip must be 'auto', None (off) or a maximum gradient norm "
                          f">= 0, got {grad_clip!r}")


class GradClip:
    """Clips lists of gradient tensors in place, by ``grad_clip`` (see the module); ``scaled``:
    whether the fit's rate is scaled (k > 1), which turns "auto" on."""

    def __init__(self, grad_clip, scaled: bool, device):
        self.fixed = float(grad_clip) if isinstance(grad_clip, (int, float)) and grad_clip \
            else None
        self.relative = grad_clip == "auto" and scaled
        self.on = self.fixed is not None or self.relative
        self.mean = torch.zeros((), dtype=torch.float64, device=device)   # running mean norm
        self.steps = torch.zeros((), dtype=torch.float64, device=device)  # finite norms seen
        self.clipped = torch.zeros((), dtype=torch.float64, device=device)

    def __call__(self, grads: list[torch.Tensor]) -> None:
        if not self.on or not grads:
            return
        norm = torch.linalg.vector_norm(
            torch.stack(torch._foreach_norm(grads)).to(torch.float64))
        finite = torch.isfinite(norm)          # non-finite: fp16's scaler skips the step
        if self.fixed is not None:
            limit = torch.full_like(norm, self.fixed)
        else:
            limit = torch.where(self.steps > 0, FACTOR * self.mean,
                                torch.full_like(norm, math.inf))
        cut = finite & (norm > limit)
        scale = torch.where(cut, limit / norm.clamp(min=1e-30), torch.ones_like(norm))
        torch._foreach_mul_(grads, scale.to(grads[0].dtype))
        self.clipped += cut
        if self.relative:
            seen = torch.minimum(norm, limit)
            mean = torch.where(self.steps > 0, BETA * self.mean + (1 - BETA) * seen, norm)
            self.mean.copy_(torch.where(finite, mean, self.mean))
        self.steps += finite

    def describe(self) -> dict:
        """For info.json: the rule and how many steps it cut (one host read, at the end)."""
        rule = f"max norm {self.fixed:g}" if self.fixed is not None else \
            f"relative: {FACTOR:g} x the running mean norm" if self.relative else None
        return {"rule": rule, "clipped_steps": int(self.clipped.item()) if self.on else 0,
                "steps": int(self.steps.item()) if self.on else 0}
