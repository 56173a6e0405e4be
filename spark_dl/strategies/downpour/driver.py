"""``Downpour``: its options and its driver half (the parameter server on the driver, the
workers as Spark tasks; checkpoints are the server's). The task half is task.py, the server
and its wire protocol are spark_dl.transport.ps, model-parallel replicas
spark_dl.planning.partitions."""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from collections import Counter
from pathlib import Path

import torch

from ...balance import check_balance
from ...errors import ConfigError, ResourceError
from ...losses import val_metrics
from ...optim.average import DEFAULT_AVERAGE, check_average
from ...planning.partitions import (
    Layout,
    check_master_backprop,
    model_parallel_algorithm,
    plan_partitions,
)
from ...runtime.amp import check_amp
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
from . import task as _task

__all__ = ["MODES", "STALENESS_RULES", "Downpour"]

STALENESS_RULES = ("halfway", "step", "momentum", "lr", "lr+momentum", "none", "worker",
                   "worker+short", "dana")


@options
class Downpour(Strategy):
    """Downpour SGD (DistBelief): the tasks train asynchronously against a parameter server on
    the driver.

    n_fetch / n_push: fetch the parameters / push the accumulated gradients every so many
    steps. mode: "async"; "sync" (one averaged update per step of all replicas);
    "sequential" (every push its own step, fetched right after). server_optimizer: "sgd",
    "momentum", "adagrad", "adam" (default: from fit's ``optimizer``/``momentum``).
    ps_shards: parameter blocks with their own lock and version (default 1, or 4 from a million
    parameters on: transfers of big models pipeline better). amp: None, "bf16" or "fp16": the
    workers' forward passes autocast (float32 master weights on the server; fp16 scales the loss
    and drops a push that overflowed). wire_dtype: "float32", "bfloat16" or "float64" (default:
    "bfloat16" with amp, half the bytes, else "float32"). max_staleness: a worker more than this
    many pushes ahead of the slowest waits (None: unbounded). overlap (async): a push and its
    reply travel while the worker computes the next step, on parameters that miss that push: one
    more step of staleness, no waiting for the round trip (default None: on for workers on a
    GPU, where the host is otherwise idle while the GPU computes; off on CPUs, where the round
    trip takes the cores the step needs, with partitions > 1, and where it diverges, below).
    staleness (async): how the replicas allow for stale pushes. "dana" (the default since
    2026-11-29 09:00): each worker keeps fit's momentum over its own pushes, ramped as
    under "worker+short" below, and reports it to the server, which steps the pushes
    without momentum of its own at dana_rate (fit's rate up to 4 replicas, 4 / replicas of
    it from there, not below half) and sends every worker the look-ahead of its values: less
    lr x every worker's last step times its momentum, the steps the workers' next pushes
    will take again before this worker's gradient lands (DANA-Zero, Hakimi et al. 2019;
    spark_dl.transport.ps.shard, "Look-ahead"). The gradient is taken about where it is
    applied, so a push keeps the single process's step. On 2 CPU workers of the thesis CNN
    it reached 98% after the epochs one worker needs, in 0.45x one worker's time (seeds
    0-5; "worker+short" 0.52x in the same run), on local[16] a quarter to half an epoch
    sooner than "worker+short" (seeds 0-2), and it kept the ships U-Net's IoU (docs/guides/
    downpour.md, "Look-ahead"). The server holds a model's worth of values per worker.
    "worker+short" (the default from 2026-11-29 03:30 until then): SGD's momentum moves to
    the workers: each keeps a momentum over its own
    pushes (a buffer of its mean gradients, as torch's SGD keeps one; the momentum grows from
    0 over its first MOMENTUM_RAMP = 50 mini-batches, at most a tenth of its fit: the first
    large gradients would otherwise be carried, late, for ten pushes each) and pushes that,
    which the server steps without momentum of its own. A gradient is stepped
    rate x lr / (1 - momentum) in all, rate = worker_rate: half fit's up to 8 replicas, 4 /
    replicas of it from there (a push lands about replicas - 1 versions late; overlapped
    pushes take the rate of twice the replicas); the workers carry 1 - replicas x (1 -
    momentum) for it, not below 0 (0.8 for 2 replicas at 0.9, 0.6 for 4, 0.2 for 8, none
    from 10), and the server's rate makes up the step (fit's rate at 2 replicas, 2x at 4, 4x
    at 8, 2.5x at 16: shorter_memory): a worker's buffer
    decays once a push of its own, every replicas server steps, and so spans as many of them
    as the single process's momentum does, where the asynchrony adds momentum of its own.
    "worker" (the default from 2026-11-28 night until then) takes the same step with fit's
    ``momentum`` at the workers and rate x fit's rate at the server. Against it, the shorter
    memory reached 98% on 2 CPU workers of the thesis CNN in 0.58 / 0.68x one worker's time
    (two runs of 6 seeds; "worker" 0.57 / 0.78x), ended the ships U-Net higher in 5 seeds of
    6 (IoU 0.948 against 0.941, about one process's; with 4 workers 0.906 against 0.919,
    within the seeds' spread); on local[4] it reached 98% sooner in 3 seeds of 3, on
    local[16] in 3 seeds of 3, at 95-96% after an epoch (a one-process simulation of workers
    pushing in turn, benchmarks/async_turns.py, does not separate the rules at 8 workers:
    docs/guides/downpour.md, "Staleness rule"). A
    worker's buffer starts empty in every task attempt (a retried or resumed task; its ramp
    then a tenth of what the task has left); server optimizers other than SGD keep their
    state on the server (the rule moves nothing there, and their rates stay fit's); the
    server's clip cuts the pushed buffer's step, not the buffer. The rules
    that keep the momentum on the server: "momentum": fit's ``momentum`` lowered by the
    momentum asynchrony adds of itself, 1 - 1/replicas (0.4 for 2 replicas at 0.9); "step":
    its momentum m' makes its effective step lr / (1 - m') the single process's lr / (1 -
    momentum) divided by the replicas R (2R when the pushes overlap), not below momentum 0: R
    workers pushing in turn land each push about R - 1 versions late, and the effective step
    that stays stable falls about as 1 / (tau + 1) with a delay of tau (0.8 for 2 replicas at
    momentum 0.9, 0 from 10); "halfway" (the default until "worker"): the mean of the two
    (0.6 for 2 replicas at 0.9, 0.375 for 4, 0 from 10), the best of them on the ships U-Net
    and the thesis CNN together; "lr": a push computed tau >= 2 versions ago steps lr / tau;
    "lr+momentum": both; "none": every push a plain step.
    average (async): the model validated and returned is the server's moving average over this
    fraction of an epoch (its mini-batch steps, whatever n_push; default 0.1, as AllReduce's
    and Gossip's ``average``);
    the workers always fetch the last values. clip (async, sequential): the server cuts a push's
    step gradient to at most this multiple of the running mean of the steps' gradient norms
    (spark_dl.transport.ps.shard, "Clipped pushes"): a stale push of an oscillation the delay
    has made unstable can no longer run away (docs/quality.md, "Clipped pushes"); default 2 with
    several asynchronous replicas, off otherwise (one worker stays plain SGD); 0: off.
    partitions: F > 1 splits every replica's model by columns over F tasks, which train it
    together on the union of their micro-batches and each push and fetch their own slice (a
    barrier stage of replicas x F tasks; modes async and sequential); "auto": the cost model's
    planner picks F and the replicas, with the link measured by a probe job and a task's memory
    from spark.executor.pyspark.memory. model_parallel (partitions > 1):
    "collective" (each layer's all-gather and all-reduce, any supported model) or "thesis"
    (the thesis's master algorithm of §3.2 for FC nets with cross-entropy). widths
    (collective): each partition's share of every layer's columns, e.g. [2, 1] when partition
    0's tasks run twice as fast as partition 1's (default: even); largest remainders, at least
    one column each. balance (mode="sync"): "speed", every worker's step timed on its own
    rows before training and the rounds' global batch (batch_size x replicas) split so that
    all finish together, or fixed shares per worker (spark_dl.balance; AllReduce
    also re-splits every epoch)."""

    name = "downpour"
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
            if self.model_parallel == "thesis":
                raise ConfigError("model_parallel='thesis' splits the columns evenly; use "
                                  "model_parallel='collective' with widths")
        check_choice("staleness", self.staleness, STALENESS_RULES)
        check_average(self.average)
        if self.average and self.mode != "async":
            raise ConfigError(f"average={self.average} needs mode='async' (got "
                              f"{self.mode!r}): {self.mode} rounds follow one trajectory, "
                              f"nothing to damp")
        check_clip(self.clip, self.mode != "sync")
        if self.overlap and self.mode != "async":
            raise ConfigError(f"overlap=True needs mode='async' (got {self.mode!r}): sync and "
                              f"sequential rounds wait for the server by design")
        if self.model_parallel == "thesis" and self.partitions == 1:
            raise ConfigError("model_parallel='thesis' is how partitions > 1 split the model; "
                              "give partitions=F (or leave model_parallel alone)")

    def check_job(self, job: Job) -> None:
        check_server_optimizer(job, "Downpour", self.server_optimizer)
        check_amp(self.amp, job.stage["dtype"])
        if self.model_parallel == "thesis":
            if self.amp:
                raise ConfigError("model_parallel='thesis' computes its layers by hand, "
                                  "without autocast: use model_parallel='collective' with amp")
            check_master_backprop(job.model_fn, job.loss_name, self.partitions)

    def barrier(self, job: Job) -> bool:
        return job.plan.get("partitions", self.partitions) != 1

    def tasks(self, job: Job) -> int:
        partitions = self.partitions
        if partitions == "auto":
            partitions, planned = plan_partitions(
                job.spark, job.model_fn, job.stage["shape"], job.stage["batch_size"],
                job.slots, job.stage["dtype"], job.log)
            job.replicas = job.replicas or planned
        job.plan["partitions"] = partitions
        replicas = job.replicas = job.replicas or max(min(job.partitions or job.slots, job.slots)
                                                      // partitions, 1)
        check_int("replicas", replicas, 1)
        momentum = job.train["momentum"]
        if self.overlap and self._overlap_diverges(job, replicas):
            raise ConfigError(
                f"overlap=True with staleness={self.staleness!r} and server momentum "
                f"{momentum} over {replicas} replicas diverges (in 2 of 3 benchmark runs to "
                f"chance): every push is one step more stale, and the server's momentum adds "
                f"to the momentum the asynchrony makes; use staleness='dana' (the default), "
                f"'worker+short', 'worker', 'halfway', 'momentum', 'step' or 'lr+momentum'")
        if partitions > 1 and replicas * partitions > job.slots:
            raise ResourceError(
                f"replicas={replicas} x partitions={partitions} = {replicas * partitions} "
                f"tasks, but the cluster runs {job.slots} at once; the tasks of a barrier stage "
                f"start together: lower replicas or partitions, or add executors/cores")
        return replicas * partitions

    def _overlap_diverges(self, job: Job, replicas: int) -> bool:
        """Overlap with the plain or lr staleness rule and server momentum: diverged in the
        benchmark (docs/benchmarks.md)."""
        momentum = job.train["momentum"]
        return self.staleness in ("none", "lr") and replicas > 1 and momentum > 0 and \
            (self.server_optimizer or _server_optimizer(job.train["optimizer"], momentum)) \
            == "momentum"

    @staticmethod
    def _on_gpus(job: Job) -> bool:
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
        from ...transport.ps import ParameterServer
        replicas, partitions = job.replicas, job.plan["partitions"]
        check_balance(self.balance, replicas)
        mode, staleness = self.mode, self.staleness
        lr, lr_decay, momentum = job.train["lr"], job.train["lr_decay"], job.train["momentum"]
        server_optimizer = self.server_optimizer or \
            _server_optimizer(job.train["optimizer"], momentum)
        average = _server_average(self.average, replicas, mode)
        overlap = self.overlap          # None: the task turns it on if it runs on a GPU
        worker_momentum = _worker_momentum(momentum, replicas, mode, staleness,
                                           server_optimizer)
        if overlap is None and (mode != "async" or partitions != 1 or
                                self._overlap_diverges(job, replicas)):
            overlap = False
        overlapped = self._on_gpus(job) if overlap is None else overlap
        if overlap is None and worker_momentum:
            overlap = overlapped      # the tasks overlap as the server's rate assumes
        worker_momentum, rate = _worker_rule(worker_momentum, replicas, overlapped, staleness)
        server_momentum = _server_momentum(momentum, replicas, mode, staleness, overlapped)
        clip = server_clip(self.clip, replicas, mode)
        ahead = looks_ahead(staleness, worker_momentum)
        run = Run(job, self, {**job.stage, "server_optimizer": server_optimizer, "lr": lr,
                              "lr_decay": lr_decay, "momentum": momentum,
                              "partitions": partitions, "average": average, "clip": clip,
                              "server_momentum": server_momentum,
                              "worker_momentum": worker_momentum, "look_ahead": ahead})
        widths, measured = self.widths, None
        kept = run.path / "widths.json"
        if widths == "speed" and kept.exists() and job.stage["resume"]:  # a resumed fit
            widths = json.loads(kept.read_text())                           # keeps its layout
        elif widths == "speed":               # each partition's tasks' matmul rate, measured
            from ...planning.cost_model import partition_speeds, probe_task_speeds
            measured = probe_task_speeds(job.spark, replicas * partitions)
            widths = partition_speeds([m["flops"] for m in measured], partitions)
            kept.write_text(json.dumps(widths))
            job.say(f"downpour: column widths ∝ the partitions' measured speeds "
                    f"{[round(w / 1e9, 2) for w in widths]} GFLOP/s")
        cfg = _task.DownpourConfig(
            **job.stage, n_fetch=self.n_fetch, n_push=1 if mode == "sync" else self.n_push,
            mode=mode, wire_dtype=self.wire_dtype or ("bfloat16" if self.amp else "float32"),
            overlap=overlap, model_parallel=self.model_parallel, amp=self.amp,
            worker_momentum=worker_momentum, look_ahead=ahead,
            widths=None if widths is None else tuple(float(w) for w in widths),
            balance=self.balance if self.balance in (None, "speed") else
            tuple(float(w) for w in self.balance))
        run_path, tracker, log = run.path, job.tracker, job.log
        dtype = job.dtype
        torch.manual_seed(cfg.seed)
        net = job.model_fn().to(dtype)
        params = [p for p in net.parameters() if p.requires_grad]
        numel = sum(p.numel() for p in params)
        ps_shards = self.ps_shards or (4 if numel >= 1_000_000 else 1)
        schedule = _schedule(job, replicas, cfg.mode, rate)
        secret = run.secret.encode()
        layout = Layout(net, partitions, widths)
        cfg = dataclasses.replace(cfg, buffers=layout.buffer_spec)   # running statistics
        if partitions > 1:
            ps_shards = partitions                    # shard p: partition p's slices
        ps = ParameterServer(layout.flatten(), secret, job.host, bounds=layout.bounds,
                             shards=ps_shards, optimizer=server_optimizer, lr=lr * rate,
                             momentum=server_momentum, mode=cfg.mode,
                             workers=replicas * partitions, max_staleness=self.max_staleness,
                             timeout_s=cfg.timeout_s, lr_decay=lr_decay,
                             staleness_lr=cfg.mode == "async" and "lr" in staleness.split("+"),
                             average=average, schedule=schedule,
                             push_scaling=job.train["lr_scaling"],
                             buffers=layout.flatten_buffers(),
                             clip=clip, ahead=ahead)
        val = None
        if job.validation is not None:
            val = (torch.as_tensor(job.validation[0], dtype=dtype),
                   torch.as_tensor(job.validation[1]))
        epochs_done: dict[int, dict[int, dict]] = {}       # epoch -> worker -> its report
        history: list[dict] = []
        ckpt_path = run_path / "checkpoint.pt"
        resumed = _resume_downpour(run.checkpoint, ckpt_path, ps, replicas, log)
        if resumed is not None:
            history = resumed["history"]
        t_start = run.t_start

        def evaluate_server(epoch: int, rows: list[dict]) -> dict:
            """One history row when every worker has finished ``epoch``: the server's model."""
            n = sum(r["samples"] for r in rows)
            row = {"epoch": epoch,
                   "loss": sum(r["loss"] * r["samples"] for r in rows) / max(n, 1),
                   "samples": n, "seconds": max(r["seconds"] for r in rows),
                   "since_start_s": time.perf_counter() - t_start,
                   "samples_per_s": sum(r["samples_per_s"] for r in rows),
                   "server_versions": ps.versions,
                   "grad_mean_abs": ps.take_gradient_mean_abs(),
                   "lr": ps.shards[0].epoch_lr(epoch, ps.epoch_steps)}
            if val is not None:
                layout.load(ps.parameters().to(dtype), ps.buffers())
                row.update(val_metrics(net, val, job.loss_fn, job.loss_name == "cross_entropy"))
            return row

        def on_message(m: dict) -> None:
            run.record(m)
            if m.get("type") == "epoch":
                # a retried task goes on mid-epoch and reports that epoch again (its part of it):
                # the first report of each worker counts
                rows = epochs_done.setdefault(m["epoch"], {})
                if m["worker"] in rows:
                    return
                rows[m["worker"]] = m
                if len(rows) == replicas:
                    ps.settle()        # every shard has the epoch's last pushes: then evaluate
                    row = evaluate_server(m["epoch"], list(rows.values()))
                    history.append(row)
                    tracker.epoch(row)
                    run.record({"type": "server_epoch", **row})
                    _checkpoint_downpour(ckpt_path, ps, history, replicas, partitions)
                    run.epoch_line(row, f", server version {sum(row['server_versions'])}")
            elif m.get("type") == "step" and m["worker"] == 0:
                tracker.step(m)
                run.step_line(m, f", mean staleness {m.get('staleness', 0.0):.2f} (worker 0)")

        channel = run.serve(on_message)
        task = _task.make_task(cfg, job.model_fn, job.loss_fn, secret, ps.address,
                               channel.address, str(run_path), partitions)
        described = layout.describe() if partitions > 1 else None
        if log is not None and described and described["kept_whole"]:
            log(f"partitions={partitions}: layers {', '.join(described['kept_whole'])} are "
                f"narrower than {partitions} units and kept whole (trained by partition 0)")
        if log is not None:
            log(f"downpour ({cfg.mode}, n_fetch={cfg.n_fetch}, n_push={cfg.n_push}): "
                f"{replicas} worker(s), parameter server {ps.address[0]}:{ps.address[1]} "
                f"({ps_shards} shard(s), {server_optimizer}), run directory {run_path}")
        tracker.start(run_path, run.config)
        df = job.frame(replicas * partitions, barrier=partitions > 1)
        snapshots = ServerSnapshots(ps, job.stage["validate_every"]).start() \
            if val is not None else None
        try:
            try:
                if partitions == 1:
                    rows = run.collect(df.mapInArrow(task, _task.RESULT_SCHEMA))
                else:      # a barrier stage (process groups); the shuffle after it lets Spark
                    rows = run.collect(df.mapInArrow(task, _task.RESULT_SCHEMA, barrier=True)
                                       .repartition(1))   # retry it as a whole
            except BaseException:
                tracker.close(failed=True)
                raise

            deadline = time.monotonic() + 2.0        # let the last epoch messages arrive
            while time.monotonic() < deadline and \
                    sum(len(v) for v in epochs_done.values()) < replicas * cfg.epochs:
                time.sleep(0.01)
        finally:
            if snapshots is not None:
                snapshots.stop()
            run.close()
            ps.close()
        tasks = sorted((json.loads(r.report) for r in rows),
                       key=lambda r: r.get("task", r["worker"]))
        reports = [r for r in tasks if r.get("partition", 0) == 0]     # one per replica
        # epochs whose messages were lost (the driver channel is best effort): from the reports,
        # and from the messages that did arrive; a task Spark retried went on past the epochs its
        # earlier attempt finished, so its report has no row for them: they are not waited for
        for e in range(1, cfg.epochs + 1):
            if e not in {h["epoch"] for h in history}:
                got = dict(epochs_done.get(e, {}))
                for r in reports:
                    for h in r["history"]:
                        if h["epoch"] == e:
                            got[r["worker"]] = h
                skipped = {r["worker"] for r in reports
                           if r.get("resumed_at") and r["resumed_at"]["epoch"] > e}
                if got and len(got.keys() | skipped) == replicas:
                    row = evaluate_server(e, list(got.values()))
                    history.append(row)
                    tracker.epoch(row)
                    run.record({"type": "server_epoch", **row})
        evals = [] if snapshots is None else snapshots.evals(
            layout, net, val, job.loss_fn, job.loss_name == "cross_entropy")
        layout.load(ps.parameters().to(dtype), ps.buffers())
        stale: Counter = Counter()
        for r in tasks:
            stale.update({int(k): v for k, v in r["staleness"].items()})
        info = {"world": replicas, "mode": cfg.mode, "n_fetch": cfg.n_fetch,
                "n_push": cfg.n_push,
                "staleness": staleness, "server_momentum": server_momentum,
                "worker_momentum": worker_momentum, "server_rate": rate, "average": average,
                "look_ahead": ahead, "evals": evals,
                "lr_schedule": {**schedule.describe(), "push_scaling": job.train["lr_scaling"]},
                "server": ps.stats(), "staleness_histogram": dict(sorted(stale.items())),
                "served": {"parameter_server": list(ps.address)},
                "rows_per_replica": [sum(t["rows"] for t in tasks if t["worker"] == r["worker"])
                                     for r in reports],
                "devices": [r["device"] for r in reports], "workers": tasks,
                "overlap": [r.get("overlap") for r in reports],
                "partitions": partitions,
                "balance": None if ps.split is None else
                [ps.split[w] for w in sorted(ps.split)],
                "total_rows": sum(t["rows"] for t in tasks),
                "train_seconds": max((t["task_seconds"] for t in tasks), default=0.0)}
        if partitions > 1:
            info["model_parallel"] = {**described, "algorithm": cfg.model_parallel,
                                      "probed_speeds": measured}
        info["resumed_from_epoch"] = resumed["epoch"] if resumed is not None else None
        return run.finish(net, history, info, f"downpour {cfg.mode}, {replicas} worker(s)")


class ServerSnapshots:
    """The server's validated parameters every ``every`` of an epoch, for fit's
    ``validate_every``: the step after which every shard has crossed a mark copies the
    parameters; ``evals()`` validates the copies after training, so that validation neither
    stalls the pushes nor takes the driver's cores from the server. Each eval's
    train_seconds runs from the first step the server applied."""

    def __init__(self, ps, every: float):
        self.ps, self.every = ps, every
        # (epoch, seconds, parameters, buffers)
        self.taken: list[tuple[float, float, torch.Tensor, torch.Tensor]] = []
        self.t0, self.mark = None, every         # the first step's time, the next mark
        self._lock = threading.Lock()

    def start(self) -> ServerSnapshots:
        for shard in self.ps.shards:
            shard.on_step = self._on_step
        return self

    def _on_step(self, shard, epoch_steps: int) -> None:
        """After a step of ``shard`` (under its lock). One step at a time takes a copy; a
        step that finds another taking one leaves it (no lock held while waiting for a
        second shard's: two shards' steps never wait on each other)."""
        if not self._lock.acquire(blocking=False):
            return
        try:
            if self.t0 is None:
                self.t0 = time.perf_counter()
            t = min(s.steps for s in self.ps.shards) / epoch_steps if epoch_steps else 0.0
            if epoch_steps and t >= self.mark - 1e-9:
                self.taken.append((t, time.perf_counter() - self.t0, self.ps.parameters(),
                                   self.ps.buffers()))
                while self.mark <= t + 1e-9:
                    self.mark += self.every
        finally:
            self._lock.release()

    def stop(self) -> None:
        for shard in self.ps.shards:
            shard.on_step = None

    def evals(self, layout, net, val, loss_fn, classify: bool) -> list[dict]:
        out = []
        for t, seconds, values, buffers in self.taken:
            layout.load(values.to(next(net.parameters()).dtype), buffers)
            out.append({"epoch": round(t, 6), "train_seconds": seconds,
                        **val_metrics(net, val, loss_fn, classify)})
        return out


def _schedule(job: Job, replicas: int, mode: str, rate: float = 1.0):
    """The server's rate: in sync mode an update averages a round of every replica's
    mini-batch (k = replicas, the fit's scaling rule and warmup); asynchronous and sequential
    pushes are each applied as they come, a push of n mini-batches stepping f(n) times their
    mean (the server's push_scaling), so k = 1 there; fit's lr times ``rate``."""
    from ...optim.schedule import LRSchedule
    t = job.train
    return LRSchedule(t["lr"] * rate, replicas if mode == "sync" else 1, t["lr_scaling"],
                      t["warmup_epochs"], t["lr_decay"], job.stage["epochs"])


def _server_optimizer(optimizer: str, momentum: float) -> str:
    if optimizer == "sgd":
        return "momentum" if momentum else "sgd"
    return optimizer


def _completed_epochs(history: list[dict]) -> int:
    """The epochs 1..k all in the history (a lost message can leave a gap)."""
    done = {h["epoch"] for h in history}
    k = 0
    while k + 1 in done:
        k += 1
    return k


def _server_average(average: float | None, replicas: int, mode: str) -> float:
    """The server's averaging span in epochs: ``average``, or by default 0.1 in async mode
    (measured best of 0.05 and 0.1 against the last values in bench_downpour), whatever the
    replicas: one replica's average reaches 98% on the thesis CNN a quarter epoch sooner too,
    as AllReduce's does (docs/benchmarks.md, "Averaged weights"; until 2026-11-28 one replica
    returned its last values), and 0 in the other modes (sync, sequential)."""
    if average is not None:
        return float(average)
    return DEFAULT_AVERAGE if mode == "async" else 0.0


CLIP = 2.0        # the default cap: measured on the ships job, docs/quality.md "Clipped pushes"


def check_clip(clip, applies: bool) -> None:
    """``clip``: None (the default), 0 (off) or a number > 0, in a mode whose server steps
    pushes one by one."""
    if clip is None:
        return
    if isinstance(clip, bool) or not isinstance(clip, (int, float)) or not clip >= 0:
        raise ConfigError(f"clip must be None (the default), 0 (off) or a number > 0 (a "
                          f"push's step gradient at most that many times the running mean "
                          f"norm; e.g. 2), got {clip!r}")
    if clip and not applies:
        raise ConfigError("clip cuts single pushes: it needs mode='async' or 'sequential' "
                          "(a sync round averages the replicas' gradients, got mode='sync')")


def server_clip(clip: float | None, replicas: int, mode: str) -> float | None:
    """The server's cap on a push (see check_clip): ``clip``, or by default CLIP with several
    asynchronous replicas (pushes one version old, the delay that makes momentum unstable)
    and off otherwise; 0: off."""
    if clip is None:
        return CLIP if mode == "async" and replicas > 1 else None
    return float(clip) or None


def worker_rate(replicas: int) -> float:
    """Staleness rule "worker": the server's rate as a multiple of fit's, min(1/2, 4 / R) for
    R replicas (docs/guides/downpour.md, "Staleness rule"). A one-process simulation of R
    workers pushing in turn (the thesis CNN, lr 0.02, momentum 0.9 at the workers) found half
    the rate best at 8 and a quarter at 16, where the full rate fell to chance. At 2 the full
    rate was a little faster at lr 0.02 but did not reach 98% at lr 0.05 in 2 seeds of 3
    (half of it: 0.5-0.75 epochs); at 4 it missed 98% in a seed of 3 where half of it did
    not."""
    return min(0.5, 4.0 / replicas)


def _worker_rule_rate(worker_momentum: float, replicas: int, overlapped: bool) -> float:
    """The server's rate as a multiple of fit's: worker_rate where the workers carry the
    momentum (of twice the replicas where the pushes overlap the next step, each a version
    more late), else 1."""
    return worker_rate(replicas * (2 if overlapped else 1)) if worker_momentum else 1.0


def dana_rate(replicas: int) -> float:
    """Staleness rule "dana": the server's rate as a multiple of fit's, 1 up to 4 replicas,
    4 / R from there, not below 1/2 (docs/guides/downpour.md, "Look-ahead"). A one-process
    simulation of R workers pushing in turn (benchmarks/async_turns.py, the thesis CNN, lr
    0.02, seeds 0-5) reached 98% with the full rate at 2 and 4 workers as soon as one worker
    did (2) or sooner than "worker+short" (4), and at 8 in 6 seeds of 6 with half of it, 4
    of 6 with all of it; at 16, 3 of 6 with half of it, 1 of 6 with a quarter."""
    return min(1.0, max(0.5, 4.0 / replicas))


def _worker_rule(worker_momentum: float, replicas: int, overlapped: bool,
                 staleness: str) -> tuple[float, float]:
    """(the momentum each worker carries, the server's rate as a multiple of fit's) under
    ``staleness``, from the momentum _worker_momentum moves to the workers: its rate
    (_worker_rule_rate), under "worker+short" the same step with the single process's
    memory counted in the server's steps (shorter_memory), under "dana" fit's momentum at
    dana_rate."""
    if looks_ahead(staleness, worker_momentum):
        return worker_momentum, dana_rate(replicas * (2 if overlapped else 1))
    rate = _worker_rule_rate(worker_momentum, replicas, overlapped)
    if staleness == "worker+short":
        return shorter_memory(worker_momentum, rate, replicas)
    return worker_momentum, rate


def looks_ahead(staleness: str, worker_momentum: float) -> bool:
    """Whether the workers report their momentum and the server returns the look-ahead of
    their steps to come: rule "dana" with momentum at the workers."""
    return staleness == "dana" and worker_momentum > 0


def shorter_memory(momentum: float, rate: float, replicas: int) -> tuple[float, float]:
    """Staleness rule "worker+short": (the momentum a worker carries, the server's rate) that
    step a gradient as far as ``momentum`` carried at ``rate`` does, rate / (1 - momentum)
    times fit's lr, with the single process's memory counted in the server's steps. A
    worker's buffer decays once a push of its own, every ``replicas`` server steps, so it
    spans replicas / (1 - carried) of them where the single process's spans 1 / (1 -
    momentum): it carries 1 - replicas x (1 - momentum), not below 0 (0.8 for 2 replicas at
    0.9, 0.6 for 4, 0.2 for 8, none from 10; overlapped pushes land later, not more often:
    their lateness is in ``rate``), and the server's rate rate x (1 - carried) / (1 -
    momentum) makes up the step: above fit's rate from 3 replicas on (2x at 4, 4x at 8, 2.5x
    at 16 at 0.9). Nothing carried: unchanged."""
    if not momentum:
        return momentum, rate
    carried = max(0.0, round(1.0 - replicas * (1.0 - momentum), 12))
    return carried, round(rate * (1.0 - carried) / (1.0 - momentum), 12)


def _worker_momentum(momentum: float, replicas: int, mode: str, staleness: str,
                     server_optimizer: str) -> float:
    """The momentum each worker carries over its pushes: fit's under rules "worker" and
    "dana" with several asynchronous replicas and a momentum SGD server, else 0 (nothing to
    move)."""
    carried = mode == "async" and replicas > 1 and \
        staleness.split("+")[0] in ("worker", "dana") and server_optimizer == "momentum"
    return momentum if carried else 0.0


def _server_momentum(momentum: float, replicas: int, mode: str, staleness: str,
                     overlap: bool = False) -> float:
    """The server's momentum (async; other modes and one worker keep ``momentum``):
    rule "step": m' with lr / (1 - m') = lr / (1 - momentum) / D, D = replicas (2 x replicas
    when the pushes overlap the next step: a version more late each), not below 0. A push
    lands about R - 1 versions after the values it was computed on; with a delay of one the
    effective step heavy-ball SGD tolerates no longer grows with the momentum (1 / curvature,
    38 / curvature without delay at 0.9: benchmarks/delay_stability.py), and for plain SGD it
    falls as 2 sin(pi / (4 tau + 2)) with tau, about pi / (2 tau + 1); so the step a single
    process was tuned with is divided by tau + 1. Rule "momentum": lowered by the
    momentum that asynchrony adds of itself, 1 - 1/replicas (Mitliagkas et al., 2016:
    asynchronous SGD on R workers behaves in expectation as momentum SGD with mu = 1 - 1/R),
    not below 0. Rule "halfway": the mean of the two, which measured better than either on
    the thesis CNN and the ships U-Net together (docs/guides/downpour.md). Rule "worker":
    0, the workers keep the momentum."""
    rules = staleness.split("+")
    if mode != "async" or replicas <= 1:
        return momentum
    if "worker" in rules or "dana" in rules:    # the workers keep it (over their own pushes)
        return 0.0
    if "halfway" in rules:
        return (_server_momentum(momentum, replicas, mode, "step", overlap)
                + _server_momentum(momentum, replicas, mode, "momentum")) / 2
    if "step" in rules:
        return max(0.0, 1.0 - replicas * (2 if overlap else 1) * (1.0 - momentum))
    if "momentum" in rules:
        return max(0.0, momentum - (1.0 - 1.0 / replicas))
    return momentum


def _checkpoint_downpour(path: Path, ps, history: list[dict], replicas: int,
                         partitions: int) -> None:
    """The server after an epoch every replica finished, written atomically (the previous
    checkpoint stays until the new one is complete): its values, optimizer states, versions
    and steps, and the history so far. The driver writes it; fit(run_dir=...) resumes it."""
    from ...runtime.checkpoint import save_atomic
    epoch = _completed_epochs(history)
    save_atomic(path, {"strategy": "downpour", "epoch": epoch, "replicas": replicas,
                 "partitions": partitions, "server": ps.state_dict(),
                 "history": [h for h in history if h["epoch"] <= epoch]})


def _resume_downpour(ckpt: dict | None, path: Path, ps, replicas: int, log) -> dict | None:
    """The run's Downpour checkpoint (``Run.checkpoint``, read from ``path`` and checked to be
    Downpour's) loaded into the fresh server; None without one."""
    if ckpt is None:
        return None
    try:
        ps.load_state_dict(ckpt["server"], start_epoch=ckpt["epoch"])
    except ValueError as e:
        raise ConfigError(f"{path} does not fit this fit's model: {e}; give a new run_dir, or "
                          f"resume=False to start over in this one") from None
    if ckpt["replicas"] != replicas and log is not None:
        log(f"resuming a fit of {ckpt['replicas']} replicas with {replicas}")
    if log is not None:
        log(f"resumed from the checkpoint of epoch {ckpt['epoch']} ({path})")
    return ckpt
