"""``FSDP``: its options and its driver half (one barrier stage; replica 0 returns the model
gathered whole; the checkpoints, every replica's shards, are the tasks')."""

from __future__ import annotations

from typing import ClassVar

import torch

from ...errors import ConfigError
from ...planning.partitions import UNLIMITED, task_memory
from ...runtime.amp import check_amp
from ...runtime.loop import FitParts
from ...runtime.stage import RESULT_SCHEMA, LocalStepConfig
from ..base import FitResult, Job, Run, Strategy, options, run_barrier
from . import task as _task
from .memory import check_memory, model_estimate
from .units import check_wrap, describe_wrap

__all__ = ["FSDP"]


@options
class FSDP(Strategy):
    """Fully sharded data parallelism (PyTorch FSDP2, ``torch.distributed.fsdp.fully_shard``):
    each of the R replicas keeps 1/R of every parameter, its gradient and its optimizer state,
    and gathers a block's parameters only while the block runs; the step is AllReduce's (the
    sample-weighted mean gradient of the global batch), reduce-scattered to the shards.
    ``wrap``: the blocks sharded as units of their own, then the root: None (each direct child
    that holds parameters, a Sequential's, ModuleList's or ModuleDict's elements in its place;
    modules with tied weights stay in the root), a list of module class names, or a function
    module -> bool. ``reshard_after_forward``: free a block's gathered
    parameters after its forward and gather them again for its backward (less memory, one
    all-gather more per block). ``amp``: None, or "bf16" (bf16 parameters in forward and
    backward, gradients reduced and the optimizer stepped in float32). Checkpoints: every
    replica's shards through torch.distributed.checkpoint, resumable on another number of
    replicas. docs/guides/fsdp.md has when to pick it."""

    name = "fsdp"
    wrap: object = None
    reshard_after_forward: bool = True
    amp: str | None = None
    hints: ClassVar[dict] = {
        "average": "FSDP's replicas hold shards, of which no moving average is kept; "
                   "AllReduce(average=...) keeps one",
        "accumulate": "FSDP steps one mini-batch a replica; raise batch_size instead",
        "partitions": "the column split (partitions=F) runs with Downpour"}

    def check(self) -> None:
        object.__setattr__(self, "wrap", check_wrap(self.wrap))
        if not isinstance(self.reshard_after_forward, bool):
            raise ConfigError(f"reshard_after_forward must be True or False, got "
                              f"{self.reshard_after_forward!r}")
        if self.amp not in (None, "bf16"):
            raise ConfigError(f"FSDP's amp is None or 'bf16' (bf16 parameters, float32 "
                              f"reduction), got {self.amp!r}; fp16's loss scale over sharded "
                              f"gradients is AllReduce(amp='fp16')'s")

    def check_job(self, job: Job) -> None:
        check_amp(self.amp, job.stage["dtype"])
        if job.train["optimizer"] in ("lbfgs", "cg"):
            raise ConfigError(f"optimizer {job.train['optimizer']!r} searches along a line "
                              f"with the whole gradient, which FSDP's replicas hold a shard of "
                              f"each; use sgd, adam, adagrad or rmsprop")
        shape = tuple(job.stage["shape"]) or \
            (tuple(job.validation[0].shape[1:]) if job.validation is not None else ())
        job.plan["units"], job.plan["memory"] = model_estimate(
            _structure(job), self.wrap, job.dtype, job.train["optimizer"],
            job.train["momentum"], self.reshard_after_forward, shape, job.stage["batch_size"])

    def tasks(self, job: Job) -> int:
        """The replicas, and the check that a replica's estimated memory (memory.py) fits a
        task's Python worker: a ResourceError naming the replicas that fit."""
        replicas = super().tasks(job)
        limit = task_memory(job.spark)
        job.plan["limit"] = limit if limit < UNLIMITED else None
        check_memory(job.plan["memory"], replicas, limit, job.slots)
        return replicas

    def describe(self) -> dict:
        return {**super().describe(), "wrap": describe_wrap(self.wrap)}

    def run(self, job: Job) -> FitResult:
        run = Run(job, self, {**job.stage, **job.train})
        parts = FitParts(job.model_fn, job.loss_fn, str(run.path), job.validation)
        task = _task.make_task(LocalStepConfig(**job.stage, **job.train), self, parts,
                               run.secret, run.serve().address)
        units = job.plan["units"]
        job.say(f"fsdp ({len(units)} unit(s) and the root"
                f"{', bf16' if self.amp else ''}): {job.replicas} replica(s), run directory "
                f"{run.path}")
        memory = job.plan["memory"].describe(job.replicas, job.plan["limit"])
        return run_barrier(job, run, task, RESULT_SCHEMA, f"fsdp, {job.replicas} replica(s)",
                           info={"memory_estimate": memory})


def _structure(job: Job) -> torch.nn.Module:
    """The model's modules, built on the meta device (no memory for its weights) where its
    factory allows, else on the CPU."""
    try:
        with torch.device("meta"):
            return job.model_fn()
    except Exception:
        return job.model_fn()

