"""Gradient clipping that keeps a scaled learning rate stable.

The linear scaling rule (schedule.py) runs a fit near the edge of stability as k grows: a
step whose gradient norm jumps well above its recent level can throw the weights to chance
(docs/design/0010-scaled-rate-clip.md).
``grad_clip`` bounds such steps:

    None or 0   off
    x > 0       the update's gradient norm is cut to x (torch.nn.utils.clip_grad_norm_)
    "auto"      relative: when the rate is scaled (k = replicas x accumulate > 1), the norm is
                cut to FACTOR times its running mean m (m_0 = the first nonzero norm; m <-
                BETA m + (1 - BETA) min(n, FACTOR m)); off when the rate is not scaled, so one
                replica without accumulation trains as a plain loop does

The running mean goes into the fit's checkpoints: a resumed fit cuts as the uninterrupted one
would.

The relative rule needs no knowledge of the model's gradient scale: a healthy fit crosses
twice its running mean on a few percent of its steps, a step that
would throw the weights out of their basin does. Downpour's and Boosting's servers cut their
pushes by the same rule (their ``clip``, default 2; transport/ps/shard.py, which lets the mean
build for 20 steps first). It acts on the update's gradient: AllReduce's global mean (the same
on every replica, so they stay identical), a Gossip replica's own. On a GPU nothing is read
back to the host per step.
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
    whether the fit's rate is scaled (k > 1), which turns "auto" on. On a CPU the bookkeeping
    is Python arithmetic on the norm (reading it costs nothing there); on a GPU it stays in
    tensors, so that no step waits for the device (``tensors``: that way whatever the device)."""

    def __init__(self, grad_clip, scaled: bool, device, tensors: bool | None = None,
                 line_search: bool = False):
        self.fixed = float(grad_clip) if isinstance(grad_clip, (int, float)) and grad_clip \
            and not line_search else None          # L-BFGS and CG pick their own steps
        self.relative = grad_clip == "auto" and scaled and not line_search
        self.on = self.fixed is not None or self.relative
        self.host = torch.device(device).type == "cpu" if tensors is None else not tensors
        zeros = [torch.zeros((), dtype=torch.float64, device=device) for _ in range(3)]
        self._mean, self._steps, self._clipped = (0.0, 0, 0) if self.host else zeros

    @property
    def mean(self) -> float:
        """The running mean of the gradient norms (relative rule)."""
        return float(self._mean)

    def __call__(self, grads: list[torch.Tensor], norm: torch.Tensor | None = None) -> None:
        """Cut ``grads``; ``norm``: the update's gradient norm when ``grads`` are only this
        replica's part of it (FSDP's shards), else theirs."""
        if not self.on or not grads:
            return
        if norm is None:
            norm = torch.linalg.vector_norm(grads[0]) if len(grads) == 1 else \
                torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))
        if self.host:
            self._host_step(grads, float(norm))
        else:
            self._device_step(grads, norm.to(torch.float64))

    def state(self) -> dict:
        """The running mean and counts, for a checkpoint (plain numbers)."""
        return {"mean": float(self._mean), "steps": int(self._steps),
                "clipped": int(self._clipped)}

    def load(self, state: dict | None) -> None:
        """Go on from a checkpoint's ``state()`` (None: one from before the cut existed)."""
        if not state:
            return
        if self.host:
            self._mean, self._steps, self._clipped = (float(state["mean"]), int(state["steps"]),
                                                      int(state["clipped"]))
        else:
            for t, k in ((self._mean, "mean"), (self._steps, "steps"),
                         (self._clipped, "clipped")):
                t.fill_(float(state[k]))

    def _host_step(self, grads, norm: float) -> None:
        if not math.isfinite(norm):            # fp16's scaler skips this step
            return
        limit = self.fixed if self.fixed is not None else \
            FACTOR * self._mean if self._mean > 0 else math.inf     # none yet (or all zero)
        if norm > limit:
            torch._foreach_mul_(grads, limit / norm)
            self._clipped += 1
        if self.relative:
            self._mean = BETA * self._mean + (1 - BETA) * min(norm, limit) if self._mean > 0 \
                else norm
        self._steps += 1

    def _device_step(self, grads, norm: torch.Tensor) -> None:
        finite = torch.isfinite(norm)
        if self.fixed is not None:
            limit = torch.full_like(norm, self.fixed)
        else:
            limit = torch.where(self._mean > 0, FACTOR * self._mean,
                                torch.full_like(norm, math.inf))
        cut = finite & (norm > limit)
        scale = torch.where(cut, limit / norm.clamp(min=1e-30), torch.ones_like(norm))
        torch._foreach_mul_(grads, scale.to(grads[0].dtype))
        self._clipped += cut
        if self.relative:
            seen = torch.minimum(norm, limit)
            mean = torch.where(self._mean > 0, BETA * self._mean + (1 - BETA) * seen, norm)
            self._mean.copy_(torch.where(finite, mean, self._mean))
        self._steps += finite

    def describe(self) -> dict:
        """For info.json: the rule and how many steps it cut (one host read, at the end)."""
        rule = None if not self.on else f"max norm {self.fixed:g}" if self.fixed is not None \
            else f"relative: {FACTOR:g} x the running mean norm"
        return {"rule": rule, "clipped_steps": int(self._clipped) if self.on else 0,
                "steps": int(self._steps) if self.on else 0}
