"""LocalSGD's task half: the replica loop's hooks. Every replica steps on its own; every
``every`` steps the replicas average (spark_dl.runtime.buffers.replica_mean) and, with an outer
optimizer, take an outer step from the values of the last average:

    x̄ = Σ_i n_i x_i / Σ_i n_i              (n_i: the rows replica i trained on since then)
    Δ = x_anchor − x̄                          (the outer gradient)
    x_anchor ← SGD(outer_lr, outer_momentum, nesterov)(x_anchor, Δ);  x_i ← x_anchor

With ``outer_lr=1`` and no momentum that is the plain average, x_i ← x̄.
"""

from __future__ import annotations

import time

import torch
from torch import nn

from spark_dl.runtime.buffers import replica_mean, sync_buffers
from spark_dl.runtime.loop import FitParts, Hooks, ReplicaLoop, replica_task
from spark_dl.runtime.stage import LocalStepConfig

__all__ = ["LocalSGDHooks", "make_task"]


def make_task(cfg: LocalStepConfig, options, parts: FitParts, secret: str,
              channel: tuple[str, int] | None):
    """The function ``df.mapInArrow(task, RESULT_SCHEMA, barrier=True)`` runs on every task;
    ``options``: the ``LocalSGD``."""
    return replica_task(cfg, options, LocalSGDHooks, parts, secret, channel)


class LocalSGDHooks(Hooks):
    """Local steps, and every ``every`` steps the average (or the outer step)."""

    name = "localsgd"
    agree = False

    def build(self, loop: ReplicaLoop) -> None:
        cfg = self.options
        self.flat = loop.flat             # the replica's parameters, one buffer
        self.outer = None
        if cfg.outer_lr != 1.0 or cfg.outer_momentum != 0.0:
            self.anchor = nn.Parameter(self.flat.detach().clone())
            self.outer = torch.optim.SGD([self.anchor], lr=cfg.outer_lr,
                                         momentum=cfg.outer_momentum,
                                         nesterov=cfg.outer_momentum > 0)
        self.rows = self.since = self.averages = self.bytes_sent = 0
        self.average_s = 0.0

    def step(self, loop: ReplicaLoop, micro: list, totals: torch.Tensor) -> None:
        opt, precision = loop.opt, loop.precision
        opt.zero_grad()
        for x, y in micro:
            loss = loop.forward_loss(x, y)
            precision.scale_loss(loss).backward()
            totals[0] += loss.detach().to(torch.float64) * len(x)
            totals[1] += len(x)
            self.rows += len(x)
        grads = [p.grad for p in loop.model.parameters() if p.grad is not None]
        if micro and precision.unscale(grads):       # (skipped when fp16 overflowed)
            if loop.clip.on:
                loop.clip(grads)
            opt.step()
        self.since += 1
        if (loop.step_index + 1) % self.options.every == 0:
            self.synchronize(loop)

    @torch.no_grad()
    def synchronize(self, loop: ReplicaLoop) -> None:
        """The replicas' average, or the outer step from it. A collective."""
        t0 = time.perf_counter()
        flat = self.flat
        mean = replica_mean(flat, weight=float(self.rows))
        self.bytes_sent += (flat.numel() + 1) * flat.element_size()
        floats = [b for b in loop.model.buffers() if b.is_floating_point()]
        if floats:
            sync_buffers(loop.model, loop.world, loop.device, weight=float(self.rows))
            self.bytes_sent += (sum(b.numel() for b in floats) + 1) * 8
        if self.outer is not None:
            with torch.enable_grad():
                self.anchor.grad = self.anchor.detach() - mean    # Δ, the outer gradient
                self.outer.step()
            mean = self.anchor.detach()
        flat.copy_(mean)
        self.rows = self.since = 0
        self.averages += 1
        self.average_s += time.perf_counter() - t0

    def finish(self, loop: ReplicaLoop) -> None:
        if self.since:                    # the last steps too: the result is one model
            self.synchronize(loop)

    def row(self, loop: ReplicaLoop) -> dict:
        return {"averages": self.averages, "bytes_sent_per_replica": self.bytes_sent}

    def state(self, loop: ReplicaLoop) -> dict:
        out = {"rows": self.rows, "since": self.since, "averages": self.averages,
               "bytes_sent": self.bytes_sent}
        if self.outer is not None:
            out.update(anchor=self.anchor.detach().cpu(), outer=self.outer.state_dict())
        return out

    @torch.no_grad()
    def restore(self, loop: ReplicaLoop, state: dict) -> None:
        self.rows, self.since = state["rows"], state["since"]
        self.averages, self.bytes_sent = state["averages"], state["bytes_sent"]
        if self.outer is not None:
            self.anchor.copy_(state["anchor"].to(self.anchor.device))
            self.outer.load_state_dict(state["outer"])

    def info(self, loop: ReplicaLoop) -> dict:
        cfg = self.options
        return {"every": cfg.every, "outer_lr": cfg.outer_lr,
                "outer_momentum": cfg.outer_momentum, "averages": self.averages,
                "bytes_sent": self.bytes_sent, "timings": {"average_s": self.average_s}}
