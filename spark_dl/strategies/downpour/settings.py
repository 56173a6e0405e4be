"""What a Downpour fit runs with, worked out on the driver before its tasks start: the server's
optimizer, the staleness rule's values, overlap, clip and average (``Settings``), the column
widths of model-parallel replicas, the tasks' config and the parameter server."""

from __future__ import annotations

import dataclasses
import json

from ...transport.ps import ParameterServer, StepRule
from ..base import Job
from ..ps_rules import (
    StalenessPlan,
    lr_schedule,
    plan_staleness,
    server_average,
    server_clip,
    server_optimizer_for,
)
from ..ps_worker import WorkerPlan

__all__ = ["Settings", "column_widths", "make_server", "settings", "task_options",
           "worker_plan"]


@dataclasses.dataclass(frozen=True)
class Settings:
    """The server's optimizer, averaging span and clip; ``overlap`` as the tasks get it (None:
    each task decides by its device), ``overlapped`` as the rule assumes; the rule's plan."""

    server_optimizer: str
    average: float
    clip: float | None
    overlap: bool | None
    overlapped: bool
    plan: StalenessPlan


def settings(strategy, job: Job) -> Settings:
    """``strategy``'s (a Downpour) settings for ``job``'s replicas."""
    replicas, partitions = job.replicas, job.plan["partitions"]
    mode, momentum = strategy.mode, job.train["momentum"]
    server_optimizer = strategy.server_optimizer or \
        server_optimizer_for(job.train["optimizer"], momentum)
    overlap = strategy.overlap          # None: the task turns it on if it runs on a GPU
    if overlap is None and (mode != "async" or partitions != 1 or
                            strategy.overlap_diverges(job, replicas)):
        overlap = False
    overlapped = strategy.on_gpus(job) if overlap is None else overlap
    plan = plan_staleness(strategy.staleness, momentum, replicas, mode, server_optimizer,
                          overlapped)
    if overlap is None and plan.worker_momentum:
        overlap = overlapped      # the tasks overlap as the server's rate assumes
    return Settings(server_optimizer, server_average(strategy.average, mode),
                    server_clip(strategy.clip, replicas, mode), overlap, overlapped, plan)


def column_widths(strategy, job: Job, run) -> tuple[list | tuple | None, list | None]:
    """(each partition's share of the columns, the probe's measured speeds): ``widths`` as
    given, or for "speed" the rates a probe stage measures (kept in the run directory, so
    that a resumed fit keeps its layout)."""
    widths = strategy.widths
    kept = run.path / "widths.json"
    if widths == "speed" and kept.exists() and job.stage["resume"]:
        return json.loads(kept.read_text()), None
    if widths != "speed":
        return widths, None
    from ...planning.cost_model import partition_speeds, probe_task_speeds
    measured = probe_task_speeds(job.spark, job.replicas * job.plan["partitions"])
    widths = partition_speeds([m["flops"] for m in measured], job.plan["partitions"])
    kept.write_text(json.dumps(widths))
    job.say(f"downpour: column widths ∝ the partitions' measured speeds "
            f"{[round(w / 1e9, 2) for w in widths]} GFLOP/s")
    return widths, measured


def task_options(strategy, s: Settings, widths):
    """``strategy`` (a Downpour) with the values its driver resolved, as its tasks get it."""
    return dataclasses.replace(
        strategy, n_push=1 if strategy.mode == "sync" else strategy.n_push,
        wire_dtype=strategy.wire_dtype or ("bfloat16" if strategy.amp else "float32"),
        overlap=s.overlap, widths=None if widths is None else tuple(float(w) for w in widths),
        balance=strategy.balance if strategy.balance in (None, "speed") else
        tuple(float(w) for w in strategy.balance))


def worker_plan(options, s: Settings, buffers: tuple) -> WorkerPlan:
    """The workers' WorkerPlan: ``options`` as task_options resolved them, the staleness
    rule's worker half, the (name, shape) of the running statistics they report."""
    return WorkerPlan(wire_dtype=options.wire_dtype, amp=options.amp, buffers=buffers,
                      worker_momentum=s.plan.worker_momentum, look_ahead=s.plan.look_ahead)


def make_server(strategy, job: Job, s: Settings, layout, net, secret: bytes):
    """(the parameter server, its shards, its rate's schedule): shard p holds partition p's
    slices of a split replica, else ``ps_shards`` blocks (default 1, 4 from a million
    parameters on)."""
    replicas, partitions, mode = job.replicas, job.plan["partitions"], strategy.mode
    numel = sum(p.numel() for p in net.parameters() if p.requires_grad)
    shards = partitions if partitions > 1 else \
        strategy.ps_shards or (4 if numel >= 1_000_000 else 1)
    schedule = lr_schedule(job, replicas, mode, s.plan.rate)
    rule = StepRule(optimizer=s.server_optimizer, lr=job.train["lr"] * s.plan.rate,
                    momentum=s.plan.server_momentum, lr_decay=job.train["lr_decay"],
                    schedule=schedule, push_scaling=job.train["lr_scaling"],
                    average=s.average, clip=s.clip, staleness_lr=s.plan.staleness_lr,
                    ahead=s.plan.look_ahead)
    ps = ParameterServer(layout.flatten(), secret, job.host, rule=rule, mode=mode,
                         workers=replicas * partitions, shards=shards, bounds=layout.bounds,
                         max_staleness=strategy.max_staleness,
                         timeout_s=job.stage["timeout_s"], buffers=layout.flatten_buffers())
    return ps, shards, schedule
