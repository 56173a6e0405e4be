"""``AllReduce``: its options and its driver half (one barrier stage, replica 0 returns the
model; the checkpoints are the tasks')."""

from __future__ import annotations

import dataclasses

from ...balance import BALANCE_MODES, ROW_MODES, check_balance
from ...errors import ConfigError
from ...optim.average import DEFAULT_AVERAGE, check_average
from ...runtime.amp import check_amp
from ...runtime.loop import FitParts
from ...runtime.stage import RESULT_SCHEMA, LocalStepConfig
from ..base import (
    FitResult,
    Job,
    Run,
    Strategy,
    check_choice,
    check_int,
    options,
    run_barrier,
)
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
    latter.

    ``balance`` (replicas of unequal speed): None, every replica ``batch_size`` rows a step;
    "speed", the global batch (``batch_size`` × replicas) split ∝ each replica's speed, timed
    on its own rows before training, capped by its memory (and ``max_batch``); "adaptive", the
    same, re-split after every epoch from the epoch's step times; or a list of fixed shares,
    one per replica. With a balance an epoch is ceil(rows / global batch) steps, each replica
    drawing its share from its shard. ``balance_rows``: "move" (default), the shards are made
    proportional to the split first, rows lent over the process group, so an epoch is one pass
    over every row; "wrap", no row moves and each replica wraps around its own shard, a fast
    replica's rows coming round more often (spark_dl.balance).

    ``average``: the model validated and returned is the weights' moving average over the
    last ``average`` of an epoch's steps (spark_dl.optim.average; Downpour's ``average``, on
    the replicas); training steps the last weights as before. Default 0.1; 0: the last
    weights; with L-BFGS and CG the default is 0 (docs/design/0004-averaged-weights.md)."""

    name = "allreduce"
    accumulate: int = 1
    amp: str | None = None
    transport: str = "auto"
    bucket_mb: float = 25.0
    balance: str | tuple | None = None
    max_batch: int | None = None
    profile_steps: int = 3
    balance_rows: str = "move"
    average: float | None = None

    def check(self) -> None:
        check_average(self.average)
        check_int("accumulate", self.accumulate, 1)
        check_amp(self.amp, "float32")
        check_choice("transport", self.transport, ("auto", "process_group"))
        check_balance(self.balance)
        check_choice("balance_rows", self.balance_rows, ROW_MODES)
        if self.max_batch is not None:
            check_int("max_batch", self.max_batch, 1)
        check_int("profile_steps", self.profile_steps, 1)
        if not self.bucket_mb > 0:
            raise ConfigError(f"bucket_mb must be > 0, got {self.bucket_mb!r}")

    def check_job(self, job: Job) -> None:
        check_amp(self.amp, job.stage["dtype"])

    def run(self, job: Job) -> FitResult:
        check_balance(self.balance, job.replicas)
        if self.max_batch is not None and self.max_batch < job.stage["batch_size"]:
            raise ConfigError(f"max_batch={self.max_batch} rows per replica cannot hold the "
                              f"global batch of {job.stage['batch_size'] * job.replicas} rows "
                              f"(batch_size={job.stage['batch_size']} x {job.replicas} "
                              f"replicas): raise max_batch or lower batch_size")
        balance = self.balance if self.balance in BALANCE_MODES else tuple(self.balance)
        options = dataclasses.replace(self, bucket_mb=float(self.bucket_mb), balance=balance,
                                      average=float(self._average(job)))
        run = Run(job, self, {**job.stage, **job.train})
        parts = FitParts(job.model_fn, job.loss_fn, str(run.path), job.validation)
        task = _task.make_task(LocalStepConfig(**job.stage, **job.train), options, parts,
                               run.secret, run.serve().address)
        job.say(f"allreduce: {job.replicas} replica(s), run directory {run.path}")
        return run_barrier(job, run, task, RESULT_SCHEMA,
                           f"allreduce, {job.replicas} replica(s)")

    def _average(self, job: Job) -> float:
        """``average``, or by default DEFAULT_AVERAGE; 0 for the optimizers with a line search
        (L-BFGS, CG), whose steps are no mini-batch noise to average away."""
        if self.average is not None:
            return self.average
        return 0.0 if job.train["optimizer"] in ("lbfgs", "cg") else DEFAULT_AVERAGE
