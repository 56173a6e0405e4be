"""``LocalSGD``: its options and its driver half (one barrier stage; replica 0 returns the
replicas' average; the checkpoints, every replica's model, are the tasks')."""

from __future__ import annotations

from typing import ClassVar

from ...errors import ConfigError
from ...optim.average import check_average
from ...runtime.amp import check_amp
from ...runtime.loop import FitParts
from ...runtime.stage import RESULT_SCHEMA, LocalStepConfig
from ..base import FitResult, Job, Run, Strategy, check_int, options, run_barrier
from . import task as _task

__all__ = ["LocalSGD"]


@options
class LocalSGD(Strategy):
    """Local SGD: every replica steps fit's optimizer on its own shard and, every ``every``
    steps, the replicas average their parameters and floating-point buffers (one all-reduce,
    weighted by the rows each trained on since the last average). With ``outer_lr`` /
    ``outer_momentum`` the average is an outer step instead: the change since the last
    average, mean over the replicas, is the outer gradient of an SGD step with Nesterov's
    momentum (DiLoCo, Douillard et al. 2023; ``outer_lr=0.7, outer_momentum=0.9`` there).
    Defaults: ``every=8``, ``outer_lr=1``, ``outer_momentum=0`` (the plain average).
    ``every=1`` without an outer step is AllReduce's update, with a parameter average in place
    of a gradient sum. ``amp``: None, "bf16" or "fp16" autocast of the local steps.
    ``average``: the model validated and returned is the replicas' mean of their weights'
    moving averages over that fraction of an epoch (AllReduce's ``average``; default 0: the
    last weights). The last steps of a fit are averaged too: the result is one model.
    docs/guides/localsgd.md has the bytes and the accuracy against AllReduce."""

    name = "localsgd"
    every: int = 8
    outer_lr: float = 1.0
    outer_momentum: float = 0.0
    amp: str | None = None
    average: float = 0.0
    hints: ClassVar[dict] = {"sync_every": "LocalSGD averages every `every` steps",
                             "partitions": "model parallelism (partitions=F) runs with "
                                           "Downpour"}

    def check(self) -> None:
        check_int("every", self.every, 1)
        if not (isinstance(self.outer_lr, (int, float)) and self.outer_lr > 0):
            raise ConfigError(f"outer_lr must be a number > 0, got {self.outer_lr!r}; 1 is "
                              f"the plain average")
        if not (isinstance(self.outer_momentum, (int, float)) and
                0 <= self.outer_momentum < 1):
            raise ConfigError(f"outer_momentum must be in [0, 1), got "
                              f"{self.outer_momentum!r}; 0 is the plain average")
        check_amp(self.amp, "float32")
        check_average(self.average)

    def check_job(self, job: Job) -> None:
        check_amp(self.amp, job.stage["dtype"])
        if job.train["optimizer"] in ("lbfgs", "cg"):
            raise ConfigError(f"optimizer {job.train['optimizer']!r} searches along a line on "
                              f"every replica's own loss, which LocalSGD's averages do not "
                              f"fit; use sgd, adam, adagrad or rmsprop")

    def run(self, job: Job) -> FitResult:
        run = Run(job, self, {**job.stage, **job.train})
        parts = FitParts(job.model_fn, job.loss_fn, str(run.path), job.validation)
        task = _task.make_task(LocalStepConfig(**job.stage, **job.train), self, parts,
                               run.secret, run.serve().address)
        job.say(f"localsgd (every {self.every} step(s), outer lr {self.outer_lr}, momentum "
                f"{self.outer_momentum}): {job.replicas} replica(s), run directory {run.path}")
        return run_barrier(job, run, task, RESULT_SCHEMA,
                           f"localsgd every={self.every}, {job.replicas} replica(s)")
