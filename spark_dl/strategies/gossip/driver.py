"""``Gossip``: RD-PSGD's options and its driver half (one barrier stage; replica 0 returns the
replicas' average; the checkpoints, every replica's model, are the tasks')."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

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
from .rounds import TOPOLOGIES as ROUND_TOPOLOGIES
from .rounds import check_alpha

__all__ = ["TOPOLOGIES", "Gossip"]

TOPOLOGIES = dict.fromkeys(ROUND_TOPOLOGIES, 2)   # topology -> the fewest replicas
SQRT_FROM = 8                            # "auto" scales by sqrt(replicas) from this many on


def auto_rule(rule: str, auto: bool, replicas: int, topology: str, alpha: float) -> str:
    """Gossip's rule for fit's lr_scaling: "auto" is the optimizer's rule, but square-root
    scaling for SGD from SQRT_FROM replicas on, where a ring mixes too slowly for the linearly
    scaled rate. The exponential graph with ``alpha=1`` averages exactly every log2(replicas)
    rounds and keeps the linear rule (the measurements: docs/guides/gossip.md)."""
    fast_mixing = topology == "exponential" and alpha == 1
    return "sqrt" if auto and rule == "linear" and replicas >= SQRT_FROM and not fast_mixing \
        else rule


@options
class Gossip(Strategy):
    """Decentralized SGD without a server (RD-PSGD, seed 003): every replica keeps its own
    model and, every ``sync_every`` steps, averages with its neighbours on ``topology`` only
    the coordinates of a Bernoulli(``alpha``) mask that all replicas share (x_i <- sum_j W_ji
    x_j on those; "ring": 1/3 itself, 1/3 each neighbour; "exponential", the one-peer
    exponential graph: 1/2 itself, 1/2 replica i - 2^(k mod ceil(log2 n)) in round k, one
    peer a round), then takes its local step (fit's
    optimizer, momentum and weight decay). ``alpha=1`` is D-PSGD; the paper's 0.1 sends a
    tenth of the bytes. Defaults: the exponential graph with whole models (``alpha=1``),
    which mixes fast enough for the linearly scaled rate (docs/guides/gossip.md);
    ``topology="ring", alpha=0.1`` is the paper's setting, a fifth of the bytes a round. The result is the replicas' average; the
    history reports the consensus distance (mean squared distance of the replicas to it) and
    the bytes each replica sent. ``amp``: None, "bf16" or "fp16" autocast of the local steps
    (float32 weights; the rounds mix float32 values). ``average``: each replica keeps its
    weights' moving average over the last ``average`` of an epoch's steps, and the model
    validated and returned is the replicas' mean of those (AllReduce's ``average``; default
    0.1, 0: the last weights)."""

    name = "gossip"
    alpha: float = 1.0
    topology: str = "exponential"
    sync_every: int = 1
    amp: str | None = None
    average: float | None = None
    hints: ClassVar[dict] = {"partitions": "model parallelism (partitions=F) runs with Downpour",
             "n_push": "gossip has no parameter server; sync_every sets how often it mixes"}

    def check(self) -> None:
        try:
            check_alpha(self.alpha)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        check_choice("topology", self.topology, tuple(TOPOLOGIES))
        check_int("sync_every", self.sync_every, 1)
        check_amp(self.amp, "float32")
        check_average(self.average)

    def check_job(self, job: Job) -> None:
        check_amp(self.amp, job.stage["dtype"])
        if job.train["optimizer"] not in ("sgd", "adam", "adagrad", "rmsprop"):
            raise ConfigError(f"optimizer {job.train['optimizer']!r} takes several evaluations "
                              f"per step, which gossip's one round per step does not fit; use "
                              f"sgd, adam, adagrad or rmsprop")

    def tasks(self, job: Job) -> int:
        replicas = super().tasks(job)
        if replicas < TOPOLOGIES[self.topology]:
            raise ConfigError(f"topology {self.topology!r} needs at least "
                              f"{TOPOLOGIES[self.topology]} replicas, got replicas={replicas}: "
                              f"give replicas=2 or more (and as many partitions), or train one "
                              f"replica with strategy='allreduce'")
        return replicas

    def run(self, job: Job) -> FitResult:
        train = {**job.train, "lr_scaling": auto_rule(
            job.train["lr_scaling"], job.plan.get("lr_scaling_auto", False), job.replicas,
            self.topology, float(self.alpha))}
        options = dataclasses.replace(self, alpha=float(self.alpha), average=float(
            DEFAULT_AVERAGE if self.average is None else self.average))
        run = Run(job, self, {**job.stage, **train})
        parts = FitParts(job.model_fn, job.loss_fn, str(run.path), job.validation)
        task = _task.make_task(LocalStepConfig(**job.stage, **train), options, parts,
                               run.secret, run.serve().address)
        job.say(f"gossip (alpha={self.alpha}, {self.topology}, every {self.sync_every} "
                f"step(s)): {job.replicas} replica(s), run directory {run.path}")
        return run_barrier(job, run, task, RESULT_SCHEMA,
                           f"gossip alpha={self.alpha}, {job.replicas} replica(s)")
