"""``Downpour``: its options and its driver half (the parameter server on the driver, the
workers as Spark tasks; checkpoints are the server's). What the fit runs with is worked out in
settings.py, its epochs on the driver are epochs.py, the task half is task.py; the server and
its wire protocol are spark_dl.transport.ps, model-parallel replicas
spark_dl.planning.partitions, the staleness rules spark_dl.strategies.ps_rules."""

from __future__ import annotations

import json
from collections import Counter

import torch

from ...balance import check_balance
from ...data.device import model_input
from ...errors import ConfigError, ResourceError
from ...optim.average import check_average
from ...planning.partitions import (
    Layout,
    check_master_backprop,
    model_parallel_algorithm,
    plan_partitions,
)
from ...resources import map_in_arrow
from ...runtime.amp import check_amp
from ...runtime.loop import FitParts
from ...runtime.stage import StageConfig
from ...transport.ps import MODES, SERVER_OPTIMIZERS
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
from ..ps_rules import STALENESS_RULES, check_clip, check_staleness, server_optimizer_for
from ..ps_snapshots import ServerSnapshots
from . import task as _task
from .epochs import ServerEpochs, resume_server
from .settings import column_widths, make_server, settings, task_options, worker_plan

__all__ = ["MODES", "STALENESS_RULES", "Downpour"]


@options
class Downpour(Strategy):
    """Downpour SGD (DistBelief): the tasks train asynchronously against a parameter server on
    the driver. What each option does, and the measurements behind the defaults:
    docs/guides/downpour.md.

    n_fetch / n_push: fetch the parameters / push the accumulated gradients every so many
    steps (default 1 / 1). mode: "async" (the default), "sync" (one averaged update per step
    of all replicas) or "sequential" (every push its own step, fetched right after).
    server_optimizer: "sgd", "momentum", "adagrad", "adam" or "rmsprop" (default: from fit's
    ``optimizer`` and ``momentum``). ps_shards: parameter blocks with their own lock and
    version (default 1, or 4 from a million parameters on). amp: None (the default), "bf16"
    or "fp16": the workers' forward passes autocast, float32 master weights on the server.
    wire_dtype: "float32", "bfloat16" or "float64" (default "bfloat16" with amp, else
    "float32"). max_staleness: a worker more than this many pushes ahead of the slowest
    waits (default None: unbounded). overlap (async): a push travels while the worker
    computes its next step, one more step of staleness (default None: on for workers on a
    GPU, off on CPUs and with partitions > 1).
    staleness (async): how the fit allows for stale pushes (STALENESS_RULES;
    spark_dl.strategies.ps_rules): "dana" (the default) keeps fit's momentum at the workers
    and sends each worker the look-ahead of the momentum steps to come; "halfway" keeps a
    lowered momentum on the server; "lr" divides the step of a push tau >= 2 versions old by
    tau; "none" steps every push plainly.
    average (async): the model validated and returned is the server's moving average over
    this fraction of an epoch (default 0.1); the workers fetch the last values. clip (async,
    sequential): a push's step gradient is cut to at most this multiple of the running mean
    norm (default 2 with several asynchronous replicas, else off; 0: off).
    partitions: F > 1 splits every replica's model by columns over F tasks (a barrier stage
    of replicas x F tasks; modes async and sequential); "auto": the cost model picks F and
    the replicas (default 1). model_parallel (partitions > 1): "collective" (the default:
    each layer's all-gather and all-reduce) or "master" (distributed backpropagation through
    a master, FC nets with cross-entropy). widths (collective): each partition's share of
    every layer's columns, or "speed" (measured by a probe stage; default: even). balance
    (mode="sync"): "speed" or fixed shares per worker, the rounds' global batch split so
    that all finish together (default None)."""

    name = "downpour"
    nesterov = False
    n_fetch: int = 1
    n_push: int = 1
    mode: str = "async"
    server_optimizer: str | None = None
    ps_shards: int | None = None
    wire_dtype: str | None = None
    amp: str | None = None
    max_staleness: int | None = None
    overlap: bool | None = None
    staleness: str = "dana"
    average: float | None = None
    clip: float | None = None
    partitions: int | str = 1
    model_parallel: str = "collective"
    widths: tuple | None = None
    balance: str | tuple | None = None

    def check(self) -> None:
        check_choice("mode", self.mode, MODES)
        check_choice("server_optimizer", self.server_optimizer, (None, *SERVER_OPTIMIZERS))
        check_int("n_fetch", self.n_fetch, 1)
        check_int("n_push", self.n_push, 1)
        if self.ps_shards is not None:
            check_int("ps_shards", self.ps_shards, 1)
        if self.max_staleness is not None:
            check_int("max_staleness", self.max_staleness, 0)
        check_choice("wire_dtype", self.wire_dtype, (None, "float32", "bfloat16", "float64"))
        check_amp(self.amp, "float32")
        if self.amp == "fp16" and self.partitions != 1:
            raise ConfigError("amp='fp16' scales each task's loss on its own, which the "
                              "partitions of a model-parallel replica would not agree on: use "
                              "amp='bf16' (no loss scaling) with partitions > 1")
        if self.partitions != "auto":
            check_int("partitions", self.partitions, 1)
        if self.partitions != 1 and (self.mode == "sync" or self.max_staleness is not None):
            raise ConfigError("partitions > 1 runs modes 'async' and 'sequential' without "
                              "max_staleness (each partition is its own parameter-server "
                              "shard, pushed by the replicas' tasks of that partition)")
        object.__setattr__(self, "model_parallel", model_parallel_algorithm(self.model_parallel))
        if self.balance is not None:
            check_balance(self.balance)
            if self.mode != "sync" or self.balance == "adaptive" or self.partitions != 1:
                raise ConfigError(f"Downpour balances the batch of sync rounds: balance="
                                  f"'speed' or fixed shares with mode='sync' and partitions=1 "
                                  f"(got mode={self.mode!r}, balance={self.balance!r}, "
                                  f"partitions={self.partitions!r}); balance='adaptive' is "
                                  f"AllReduce's")
        if self.widths is not None:
            if self.widths == "adaptive":
                raise ConfigError("widths must be 'speed' (measured by a probe stage before "
                                  "the fit) or a list of shares, one per partition")
            check_balance(self.widths)
            if not isinstance(self.partitions, int) or self.partitions < 2 or \
                    (self.widths != "speed" and len(self.widths) != self.partitions):
                raise ConfigError(f"widths gives each of the partitions its share of every "
                                  f"layer's columns: give partitions=F > 1 and F shares, got "
                                  f"partitions={self.partitions!r}, widths={self.widths!r}")
            if self.model_parallel == "master":
                raise ConfigError("model_parallel='master' splits the columns evenly; use "
                                  "model_parallel='collective' with widths")
        check_staleness(self.staleness)
        check_average(self.average)
        if self.average and self.mode != "async":
            raise ConfigError(f"average={self.average} needs mode='async' (got "
                              f"{self.mode!r}): {self.mode} rounds follow one trajectory, "
                              f"nothing to damp")
        check_clip(self.clip, self.mode != "sync")
        if self.overlap and self.mode != "async":
            raise ConfigError(f"overlap=True needs mode='async' (got {self.mode!r}): sync and "
                              f"sequential rounds wait for the server by design")
        if self.model_parallel == "master" and self.partitions == 1:
            raise ConfigError("model_parallel='master' is how partitions > 1 split the model; "
                              "give partitions=F (or leave model_parallel alone)")

    def check_job(self, job: Job) -> None:
        check_server_optimizer(job, "Downpour", self.server_optimizer)
        check_amp(self.amp, job.stage["dtype"])
        if self.model_parallel == "master":
            if self.amp:
                raise ConfigError("model_parallel='master' computes its layers by hand, "
                                  "without autocast: use model_parallel='collective' with amp")
            check_master_backprop(job.model_fn, job.loss_name, self.partitions)

    def barrier(self, job: Job) -> bool:
        return job.plan.get("partitions", self.partitions) != 1

    def tasks(self, job: Job) -> int:
        partitions = self.partitions
        if partitions == "auto":
            partitions, planned = plan_partitions(
                job.spark, job.model_fn, job.stage["shape"], job.stage["batch_size"],
                job.slots, job.stage["dtype"], job.log, job.train["optimizer"],
                job.train["momentum"])
            job.replicas = job.replicas or planned
        job.plan["partitions"] = partitions
        replicas = job.replicas = job.replicas or max(min(job.partitions or job.slots, job.slots)
                                                      // partitions, 1)
        check_int("replicas", replicas, 1)
        momentum = job.train["momentum"]
        if self.overlap and self.overlap_diverges(job, replicas):
            raise ConfigError(
                f"overlap=True with staleness={self.staleness!r} and server momentum "
                f"{momentum} over {replicas} replicas diverges: every push is one step more "
                f"stale, and the server's momentum adds to the momentum the asynchrony makes "
                f"(docs/guides/downpour.md, \"Staleness rule\"); use staleness='dana' (the "
                f"default) or 'halfway', or overlap=False")
        if partitions > 1 and replicas * partitions > job.slots:
            raise ResourceError(
                f"replicas={replicas} x partitions={partitions} = {replicas * partitions} "
                f"tasks, but the cluster runs {job.slots} at once; the tasks of a barrier stage "
                f"start together: lower replicas or partitions, or add executors/cores")
        return replicas * partitions

    def overlap_diverges(self, job: Job, replicas: int) -> bool:
        """Overlap with the plain or lr staleness rule and server momentum: diverges
        (docs/guides/downpour.md, "Staleness rule")."""
        momentum = job.train["momentum"]
        return self.staleness in ("none", "lr") and replicas > 1 and momentum > 0 and \
            (self.server_optimizer or server_optimizer_for(job.train["optimizer"], momentum)) \
            == "momentum"

    @staticmethod
    def on_gpus(job: Job) -> bool:
        """Whether the tasks will run on GPUs, where overlap=None turns overlap on (the task
        decides by its device; guessed here from the fit's device, and for device='auto' from
        this machine's GPUs in local mode or the GPUs Spark assigns to tasks on a cluster)."""
        device = job.stage["device"]
        if device != "auto":
            return device == "cuda"
        from ...compat import master
        where = master(job.spark)
        if where.startswith("local") and not where.startswith("local-cluster"):
            return torch.cuda.is_available()
        return float(job.spark.conf.get("spark.task.resource.gpu.amount", None) or 0) > 0

    def run(self, job: Job) -> FitResult:
        """Downpour SGD: a parameter server here, workers as Spark tasks (see
        spark_dl.transport.ps)."""
        replicas, partitions = job.replicas, job.plan["partitions"]
        check_balance(self.balance, replicas)
        s = settings(self, job)
        run = Run(job, self, {**job.stage, "server_optimizer": s.server_optimizer,
                              "lr": job.train["lr"], "lr_decay": job.train["lr_decay"],
                              "momentum": job.train["momentum"], "partitions": partitions,
                              "average": s.average, "clip": s.clip,
                              "server_momentum": s.plan.server_momentum,
                              "worker_momentum": s.plan.worker_momentum,
                              "look_ahead": s.plan.look_ahead})
        widths, measured = column_widths(self, job, run)
        torch.manual_seed(job.stage["seed"])
        net = job.model_fn().to(job.dtype)
        layout = Layout(net, partitions, widths)
        opts = task_options(self, s, widths)
        plan = worker_plan(opts, s, layout.buffer_spec)       # running statistics reported
        secret = run.secret.encode()
        ps, ps_shards, schedule = make_server(self, job, s, layout, net, secret)
        val = None
        if job.validation is not None:
            val = (model_input(torch.as_tensor(job.validation[0]), "cpu", job.dtype),
                   torch.as_tensor(job.validation[1]))
        resumed = resume_server(run.checkpoint, run.path / "checkpoint.pt", ps, replicas,
                                job.log)
        epochs = ServerEpochs(run, ps, layout, net, val, replicas, partitions,
                              resumed["history"] if resumed is not None else [])
        channel = run.serve(epochs.on_message)
        task = _task.make_task(StageConfig(**job.stage), opts, plan,
                               FitParts(job.model_fn, job.loss_fn, str(run.path)), secret,
                               ps.address, channel.address, partitions)
        described = layout.describe() if partitions > 1 else None
        if job.log is not None and described and described["kept_whole"]:
            job.log(f"partitions={partitions}: layers {', '.join(described['kept_whole'])} "
                    f"are narrower than {partitions} units and kept whole (trained by "
                    f"partition 0)")
        if job.log is not None:
            job.log(f"downpour ({opts.mode}, n_fetch={opts.n_fetch}, n_push={opts.n_push}): "
                    f"{replicas} worker(s), parameter server {ps.address[0]}:{ps.address[1]} "
                    f"({ps_shards} shard(s), {s.server_optimizer}), run directory {run.path}")
        job.tracker.start(run.path, run.config)
        snapshots = ServerSnapshots(ps, job.stage["validate_every"]).start() \
            if val is not None else None
        rows = _train(run, job, task, epochs, ps, snapshots, job.stage["epochs"])
        tasks = sorted((json.loads(r.report) for r in rows),
                       key=lambda r: r.get("task", r["worker"]))
        epochs.fill_lost([r for r in tasks if r.get("partition", 0) == 0],
                          job.stage["epochs"])
        evals = [] if snapshots is None else snapshots.evals(
            layout, net, val, job.loss_fn, job.loss_name == "cross_entropy")
        layout.load(ps.parameters().to(job.dtype), ps.buffers())
        info = _info(self, s, ps, tasks, schedule, job, evals)
        if partitions > 1:
            info["model_parallel"] = {**described, "algorithm": opts.model_parallel,
                                      "probed_speeds": measured}
        info["resumed_from_epoch"] = resumed["epoch"] if resumed is not None else None
        return run.finish(net, epochs.history, info,
                          f"downpour {opts.mode}, {job.replicas} worker(s)")


def _train(run: Run, job: Job, task, epochs: ServerEpochs, ps, snapshots, n_epochs: int):
    """The tasks' Spark stage (a barrier stage with partitions > 1): their result rows, once
    the last epoch messages had time to arrive; the server closed after it."""
    partitions = job.plan["partitions"]
    df = job.frame(job.replicas * partitions, barrier=partitions > 1)
    try:
        try:
            if partitions == 1:
                rows = run.collect(map_in_arrow(df, task, _task.RESULT_SCHEMA, False,
                                                job.profile))
            else:          # a barrier stage (process groups); the shuffle after it lets Spark
                rows = run.collect(map_in_arrow(df, task, _task.RESULT_SCHEMA, True,
                                                job.profile).repartition(1))  # retry it whole
        except BaseException:
            job.tracker.close(failed=True)
            raise
        epochs.wait(n_epochs)
    finally:
        if snapshots is not None:
            snapshots.stop()
        run.close()
        ps.close()
    return rows


def _info(strategy: Downpour, s, ps, tasks: list[dict], schedule, job: Job,
          evals: list[dict]) -> dict:
    """The fit's info: the rule's values, the server's statistics, the workers' reports."""
    reports = [r for r in tasks if r.get("partition", 0) == 0]     # one per replica
    stale: Counter = Counter()
    for r in tasks:
        stale.update({int(k): v for k, v in r["staleness"].items()})
    return {"world": job.replicas, "mode": strategy.mode, "n_fetch": strategy.n_fetch,
            "n_push": 1 if strategy.mode == "sync" else strategy.n_push,
            "staleness": strategy.staleness, "server_momentum": s.plan.server_momentum,
            "worker_momentum": s.plan.worker_momentum, "server_rate": s.plan.rate,
            "average": s.average, "look_ahead": s.plan.look_ahead, "evals": evals,
            "lr_schedule": {**schedule.describe(), "push_scaling": job.train["lr_scaling"]},
            "server": ps.stats(), "staleness_histogram": dict(sorted(stale.items())),
            "served": {"parameter_server": list(ps.address)},
            "rows_per_replica": [sum(t["rows"] for t in tasks if t["worker"] == r["worker"])
                                 for r in reports],
            "devices": [r["device"] for r in reports], "workers": tasks,
            "overlap": [r.get("overlap") for r in reports],
            "partitions": job.plan["partitions"],
            "balance": None if ps.split is None else [ps.split[w] for w in sorted(ps.split)],
            "total_rows": sum(t["rows"] for t in tasks),
            "train_seconds": max((t["task_seconds"] for t in tasks), default=0.0)}
