"""``Boosting``: seed 000's "workers as weak-learner boosters". The parameter server on the
driver applies every push as its own step in arrival order (Downpour's sequential mode); the
training data is cut into keys (chunks of ``n_push`` mini-batches of a Parquet copy of the
DataFrame) which a data-key scheduler on the driver hands out, reshuffled every epoch, one at
a time to whichever worker asks next: a faster worker takes more keys, a restarted worker
gets back the key it held, and every key is trained exactly once per epoch whatever dies
(keys.py). The task half is task.py.

The workers read their keys' rows from Parquet themselves (pyarrow), so the data must be
where every executor can read it: the DataFrame's own files when it is a plain Parquet scan,
else a copy written once to ``data_dir`` (default: the run directory, fine on one machine;
on a cluster give a shared URI: hdfs://, s3a://, an NFS path).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from ...data.device import model_input
from ...errors import ConfigError, DataError
from ...optim.average import check_average
from ...planning.partitions import Layout
from ...resources import map_in_arrow
from ...runtime.amp import check_amp
from ...runtime.loop import FitParts
from ...runtime.stage import StageConfig
from ...transport.ps import SERVER_OPTIMIZERS, KeyLeases, ParameterServer, StepRule
from ..base import (
    FitResult,
    Job,
    Run,
    Strategy,
    check_choice,
    check_int,
    check_server_optimizer,
    options,
)
from ..ps_rules import (
    StalenessPlan,
    check_clip,
    check_staleness,
    lr_schedule,
    plan_staleness,
    server_average,
    server_clip,
    server_optimizer_for,
)
from ..ps_snapshots import ServerSnapshots
from ..ps_worker import WorkerPlan, ramp_length
from . import task as _task
from .data import cut_keys, parquet_files
from .epochs import KeyEpochs
from .keys import KeyScheduler

__all__ = ["Boosting", "staleness_rule"]


@options
class Boosting(Strategy):
    """Seed 000's boosting parameter server with a data-key scheduler. What each option does,
    and the measurements behind the defaults: docs/guides/boosting.md.

    n_push: mini-batches per key (default 2); a worker sums their gradients and pushes once
    per key, the server applies each push as one step in arrival order and the worker
    fetches the result. server_optimizer: "sgd", "momentum", "adagrad", "adam", "rmsprop"
    (default: from fit's ``optimizer`` and ``momentum``). lease_s: a key leased to a worker
    that has not pushed it after this long goes to the next worker that asks, and its late
    push is dropped (default 300). data_dir: where the DataFrame's Parquet copy goes when it
    is not a plain Parquet scan (default: the run directory; on a cluster a URI every
    executor reads). amp: None (the default), "bf16" or "fp16" (autocast forward passes,
    float32 on the server, bfloat16 on the wire). staleness: Downpour's rules (default
    "dana": fit's momentum at the workers and the look-ahead of their momentum steps in
    every fetch; spark_dl.strategies.ps_rules). local (SGD servers, default True): a worker
    steps its copy by each mini-batch of a key before taking the next one's gradient, so
    that a push sums the gradients of k sequential steps; False: k gradients of the values
    it holds. fresh (default: True with several workers): before each mini-batch of a key a
    worker whose server has moved takes the new values less its own local steps of the key.
    average: the model validated, checkpointed and returned is the server's moving average
    over this fraction of an epoch (default 0.1); the workers fetch the last values. clip: a
    push's step gradient at most this multiple of the running mean norm (default 2 with
    several workers, off with one; 0: off)."""

    name = "boosting"
    nesterov = False
    n_push: int = 2
    server_optimizer: str | None = None
    lease_s: float = 300.0
    data_dir: str | None = None
    amp: str | None = None
    staleness: str = "dana"
    local: bool = True
    fresh: bool | None = None
    average: float | None = None
    clip: float | None = None

    def check(self) -> None:
        check_int("n_push", self.n_push, 1)
        check_clip(self.clip, True)
        check_staleness(self.staleness)
        if not isinstance(self.local, bool):
            raise ConfigError(f"local must be True or False, got {self.local!r}")
        if self.fresh is not None and not isinstance(self.fresh, bool):
            raise ConfigError(f"fresh must be None (the default: on with several workers), "
                              f"True or False, got {self.fresh!r}")
        check_average(self.average)
        check_choice("server_optimizer", self.server_optimizer, (None, *SERVER_OPTIMIZERS))
        if not isinstance(self.lease_s, (int, float)) or not self.lease_s > 0:
            raise ConfigError(f"lease_s must be a number of seconds > 0, got {self.lease_s!r}")
        check_amp(self.amp, "float32")

    def check_job(self, job: Job) -> None:
        check_server_optimizer(job, "Boosting", self.server_optimizer)
        if job.stage["transform"] is not None:
            raise ConfigError("Boosting reads its keys' rows from Parquet in the tasks and "
                              "converts them itself: fit(transform=...) is not supported, "
                              "transform the DataFrame instead")
        check_amp(self.amp, job.stage["dtype"])

    def barrier(self, job: Job) -> bool:
        return False

    def run(self, job: Job) -> FitResult:
        workers, stage = job.replicas, job.stage
        momentum = job.train["momentum"]
        server_optimizer = self.server_optimizer or \
            server_optimizer_for(job.train["optimizer"], momentum)
        plan = plan_staleness(self.staleness, momentum, workers, "async", server_optimizer)
        run = Run(job, self, {**stage, "server_optimizer": server_optimizer,
                              "lr": job.train["lr"], "lr_decay": job.train["lr_decay"],
                              "momentum": momentum, "server_momentum": plan.server_momentum,
                              "worker_momentum": plan.worker_momentum,
                              "look_ahead": plan.look_ahead})
        key_rows = self.n_push * stage["batch_size"]
        files = parquet_files(job, Path(self.data_dir) if self.data_dir else run.path / "data",
                              run.say)
        keys = cut_keys(files, key_rows)
        if not keys:
            raise DataError("the DataFrame's Parquet files hold no rows: nothing to train on")
        ckpt = run.checkpoint                 # read and checked to be Boosting's by Run
        start_epoch = int(ckpt["epoch"]) if ckpt is not None else 0
        torch.manual_seed(stage["seed"])
        net = job.model_fn().to(job.dtype)
        layout = Layout(net, 1, None)
        scheduler = KeyScheduler(len(keys), stage["epochs"], workers, seed=stage["seed"],
                                 lease_s=self.lease_s, start_epoch=start_epoch)
        schedule = lr_schedule(job, 1, "sequential", plan.rate)  # each push its own step
        fresh = workers > 1 if self.fresh is None else self.fresh
        ps = self._server(job, run, layout, plan, server_optimizer, schedule,
                          KeyLeases(scheduler), fresh)
        ps.epoch_steps = len(keys) * self.n_push   # mini-batch steps of an epoch (lr_decay)
        if ckpt is not None:
            _resume(ps, ckpt, run, start_epoch)
        val = None
        if job.validation is not None:
            val = (model_input(torch.as_tensor(job.validation[0]), "cpu", job.dtype),
                   torch.as_tensor(job.validation[1]))
        epochs = KeyEpochs(run, ps, ps.keys, scheduler, len(keys), start_epoch,
                           list(ckpt["history"]) if ckpt is not None else [], layout, net, val)
        channel = run.serve(epochs.on_message)
        # local steps: plain SGD on the worker, for the servers whose step is lr x gradient
        local = self.local and server_optimizer in ("sgd", "momentum") and \
            self.amp != "fp16" and job.train["lr_scaling"] == "linear"
        task = _task.make_task(
            StageConfig(**job.stage), dataclasses.replace(self, local=local, fresh=fresh),
            self._worker_plan(job, layout, plan, keys, start_epoch),
            FitParts(job.model_fn, job.loss_fn, str(run.path)), run.secret.encode(),
            ps.address, channel.address, keys, rate=schedule if local else None,
            board=None if ps.board is None else ps.board.ticket())
        job.say(f"boosting: {len(keys)} keys of {key_rows} rows ({self.n_push} mini-batches) "
                f"from {len(files)} Parquet file(s), {workers} worker(s), parameter server "
                f"{ps.address[0]}:{ps.address[1]} ({server_optimizer}), run directory "
                f"{run.path}")
        job.tracker.start(run.path, run.config)
        snapshots = ServerSnapshots(ps, stage["validate_every"]).start() \
            if val is not None else None
        rows = _train(run, job, task, epochs, ps, snapshots)
        evals = [] if snapshots is None else snapshots.evals(
            layout, net, val, job.loss_fn, job.loss_name == "cross_entropy")
        layout.load(ps.parameters().to(job.dtype), ps.buffers())
        reports = sorted((json.loads(r.report) for r in rows), key=lambda r: r["worker"])
        info = {"world": workers, "mode": "sequential", "n_push": self.n_push,
                "staleness": self.staleness, "server_momentum": plan.server_momentum,
                "worker_momentum": plan.worker_momentum, "server_rate": plan.rate,
                "look_ahead": plan.look_ahead, "local_steps": local, "fresh": fresh,
                "average": ps.rule.average,
                "keys": _keys_info(keys, key_rows, files, scheduler),
                "server": ps.stats(), "served": {"parameter_server": list(ps.address)},
                "workers": reports, "devices": [r["device"] for r in reports],
                "rows_per_replica": [r["rows"] for r in reports],
                "total_rows": sum(r["rows"] for r in reports),
                "train_seconds": max((r["task_seconds"] for r in reports), default=0.0),
                "resumed_from_epoch": start_epoch or None, "evals": evals,
                "lr_schedule": {**schedule.describe(), "push_scaling": job.train["lr_scaling"]}}
        return run.finish(net, epochs.history, info, f"boosting PS, {workers} worker(s)")

    def _server(self, job: Job, run: Run, layout, plan: StalenessPlan, server_optimizer: str,
                schedule, leases: KeyLeases, fresh: bool) -> ParameterServer:
        """The sequential server of the keys' pushes; with ``fresh`` values the workers
        beside the driver read its version from a memory-mapped file and ask only when it
        has moved (transport/ps/board.py)."""
        workers = job.replicas
        rule = StepRule(optimizer=server_optimizer, lr=job.train["lr"] * plan.rate,
                        momentum=plan.server_momentum, lr_decay=job.train["lr_decay"],
                        schedule=schedule, push_scaling=job.train["lr_scaling"],
                        average=server_average(self.average, "async"),
                        clip=server_clip(self.clip, workers, "async"),
                        staleness_lr=self.staleness == "lr", ahead=plan.look_ahead)
        return ParameterServer(layout.flatten(), run.secret.encode(), job.host, rule=rule,
                               mode="sequential", workers=workers,
                               timeout_s=job.stage["timeout_s"],
                               buffers=layout.flatten_buffers(), keys=leases,
                               board=run.path / "ps-versions" if fresh else None)

    def _worker_plan(self, job: Job, layout, plan: StalenessPlan, keys: list,
                     start_epoch: int) -> WorkerPlan:
        stage, workers = job.stage, job.replicas
        return WorkerPlan(
            wire_dtype="float64" if stage["dtype"] == "float64" else
            "bfloat16" if self.amp else "float32",
            amp=self.amp, buffers=layout.buffer_spec, worker_momentum=plan.worker_momentum,
            look_ahead=plan.look_ahead,
            momentum_ramp=ramp_length(                 # the epochs to go
                sum(hi - lo for _, lo, hi in keys) * (stage["epochs"] - start_epoch)
                / stage["batch_size"] / workers))


def _resume(ps: ParameterServer, ckpt: dict, run: Run, start_epoch: int) -> None:
    path = run.path / "checkpoint.pt"
    try:
        ps.load_state_dict(ckpt["server"])
    except ValueError as e:
        ps.close()                     # its thread, socket and board with it
        raise ConfigError(f"{path} does not fit this fit's model: {e}; give a new "
                          f"run_dir, or resume=False to start over in this one") from None
    run.say(f"resumed from the checkpoint of epoch {start_epoch} ({path})")


def _train(run: Run, job: Job, task, epochs: KeyEpochs, ps, snapshots) -> list:
    """The workers' Spark stage (one task per worker): their result rows, once the last
    epoch's validation is done; the server closed after it."""
    frame = job.spark.range(0, job.replicas, numPartitions=job.replicas)
    epochs.start()
    try:
        try:
            rows = run.collect(map_in_arrow(frame, task, _task.RESULT_SCHEMA, False,
                                            job.profile))
        except BaseException:
            job.tracker.close(failed=True)
            raise
        epochs.thread.join(timeout=30)           # the last epoch's validation
    finally:
        epochs.stop()
        if snapshots is not None:
            snapshots.stop()
        run.close()
        ps.close()
    return rows


def _keys_info(keys: list, key_rows: int, files: list, scheduler: KeyScheduler) -> dict:
    state = scheduler.state()
    return {"count": len(keys), "rows_per_key": key_rows, "files": len(files),
            "served": [[list(p) for p in ep] for ep in scheduler.served],
            "keys_per_worker": state["keys_per_worker"], "reissued": state["reissued"]}


def staleness_rule(staleness: str, momentum: float, workers: int, server_optimizer: str
                   ) -> tuple[float, float, float]:
    """(the server's momentum, the momentum each worker carries, the server's rate as a
    multiple of fit's) under Downpour's ``staleness`` rule for ``workers`` pushing in turn,
    each push W - 1 versions old as Downpour's asynchronous pushes, never overlapping the
    next step: Boosting(staleness=...) with fit's ``momentum``."""
    plan = plan_staleness(staleness, momentum, workers, "async", server_optimizer)
    return plan.server_momentum, plan.worker_momentum, plan.rate
