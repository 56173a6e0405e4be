"""``AllReduce``: its options and its driver half (one barrier stage, replica 0 returns the
model; the checkpoints are the tasks')."""

from __future__ import annotations

from ...errors import ConfigError
from ...parallel.stage import RESULT_SCHEMA
from ..base import FitResult, Job, Run, Strategy, check_checkpoint, check_choice, check_int, \
    options, run_barrier
from . import task as _task

__all__ = ["AllReduce"]


@options
class AllReduce(Strategy):
    """Synchronous data parallelism in a barrier stage: every step each replica runs
    ``accumulate`` micro-batches, and the sample-weighted sum of the gradients is all-reduced
    (in buckets of ``bucket_mb``), so every replica steps with the gradient of the global
    batch's mean loss. ``amp``: None, "bf16" or "fp16" autocast with float32 master weights.
    ``transport``: "auto" sums through shared memory when all replicas share a host (CPU),
    else through the process group (gloo on CPU, NCCL on GPU); "process_group" always the
    latter."""

    name = "allreduce"
    accumulate: int = 1
    amp: str | None = None
    transport: str = "auto"
    bucket_mb: float = 25.0

    def check(self) -> None:
        check_int("accumulate", self.accumulate, 1)
        check_choice("amp", self.amp, (None, "bf16", "fp16"))
        check_choice("transport", self.transport, ("auto", "process_group"))
        if not self.bucket_mb > 0:
            raise ConfigError(f"bucket_mb must be > 0, got {self.bucket_mb!r}")

    def check_job(self, job: Job) -> None:
        if self.amp is not None and job.stage["dtype"] == "float64":
            raise ConfigError("amp autocasts float32 weights; use dtype='float32' with amp")

    def run(self, job: Job) -> FitResult:
        cfg = _task.AllReduceConfig(**job.stage, **job.train, accumulate=self.accumulate,
                                    amp=self.amp, transport=self.transport,
                                    bucket_mb=float(self.bucket_mb))
        run = Run(job, self, {**job.stage, **job.train})
        check_checkpoint(run, self.name)
        task = _task.make_task(cfg, job.model_fn, job.loss_fn, run.secret, run.serve().address,
                               str(run.path), job.validation)
        job.say(f"allreduce: {job.replicas} replica(s), run directory {run.path}")
        return run_barrier(job, run, task, RESULT_SCHEMA,
                           f"allreduce, {job.replicas} replica(s)")
