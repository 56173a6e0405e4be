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

import json
import threading
import time
from pathlib import Path

import torch

from ...errors import ConfigError, DataError
from ...losses import val_metrics
from ...optim.average import check_average
from ...runtime.amp import check_amp
from ...transport.ps import SERVER_OPTIMIZERS
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

__all__ = ["Boosting", "cut_keys", "parquet_files", "staleness_rule"]


@options
class Boosting(Strategy):
    """Seed 000's boosting parameter server with a data-key scheduler.

    n_push: mini-batches per key; a worker sums their gradients and pushes once per key, the
    server applies each push as one step in arrival order and the worker fetches the result
    (default 2 since 2026-11-29 evening, with "dana"; 4 before, the seed's: the seed found
    8-16 worse than 4, and with "dana" 2 reached the targets below where 4 did not).
    server_optimizer: "sgd", "momentum", "adagrad", "adam",
    "rmsprop" (default: from fit's ``optimizer``/``momentum``). lease_s: a key leased to a
    worker that has not pushed it after this long goes to the next worker that asks (its late
    push is then dropped). data_dir: where the DataFrame's Parquet copy goes when it is not
    a plain Parquet scan (default: the run directory; on a cluster a URI every executor
    reads). amp: None, "bf16" or "fp16" (autocast forward passes, float32 on the server,
    bfloat16 on the wire). staleness: how the server allows for the pushes computed on values
    the other workers' pushes have moved since (with W equally fast workers every push is
    W - 1 versions old), Downpour's rules: "dana" (the default since 2026-11-29 evening, as
    Downpour's: fit's momentum at the workers over their pushes, fit's rate up to 4
    workers, and every fetch the look-ahead of the workers' momentum steps to come; with
    keys of 2 mini-batches, 2 workers reached 98% on the thesis CNN as soon in epochs as
    one worker, and the ships U-Net's mean IoU at 2 and 4 workers above the rule before's
    (lower in 2 and 4 seeds of 6); with keys of 4 it had ended the ships U-Net lower in 4
    seeds of 4 and was less steady at 4 workers: docs/guides/boosting.md, "The default
    since 2026-11-29 evening");
    "worker+short" (the default from 2026-11-29 morning until then): each
    worker carries 1 - W (1 - m) of fit's momentum m over its own pushes
    (0.8 at 2 workers, 0.6 at 4, 0.2 at 8, none from 10 at 0.9), ramped up over its first
    mini-batches, and the server steps them plainly at the rate that keeps Downpour's step
    per gradient (fit's at 2 workers, 2x at 4, 4x at 8; a key's local steps too): on the
    thesis CNN 2 workers reach 98% in 6 seeds of 6 where "momentum" did in 4, and at 4 and 8
    workers more often; on the ships U-Net at its lr 0.004 the IoU of "momentum" within
    noise (docs/guides/boosting.md, "The default of 2026-11-29"); "momentum" (the
    default until 2026-11-29 morning): the server's momentum is
    fit's ``momentum`` lowered by the momentum asynchrony adds of itself, 1 - 1/W; "step":
    the server's effective step lr / (1 - m) that of fit's momentum divided by W (faster on
    the thesis CNN, not on the ships U-Net: docs/guides/boosting.md); "lr": a push tau >= 2
    versions old steps lr / tau; "lr+momentum"; "none"; "halfway" (the mean of "step" and
    "momentum": faster on the thesis CNN, a little lower on the ships U-Net,
    docs/guides/boosting.md); "worker": each worker keeps fit's momentum over its own
    pushes, ramped up over its first mini-batches, and the server steps them plainly
    (Downpour's rule, its rate included; faster on the thesis CNN, IoU 0.92 against 0.96 on
    the ships U-Net at lr 0.01). local (SGD servers, default True): a
    worker steps its copy by each mini-batch of a key (plain SGD at the server's
    rate) before taking the next one's gradient, so that a push sums the gradients of k
    sequential steps; False: k gradients of the values the worker holds (docs/quality.md,
    ships). fresh (default: True with several workers): before each mini-batch of a key, a
    worker whose server has moved since its fetch (another worker pushed) takes the new
    values less its own local steps of the key so far, so that a push is no longer a whole
    key behind; the staleness the server counts (and the "lr" rules divide by) is then the
    versions since that worker's last fresh values.
    average: the model validated, checkpointed and returned is the server's moving average
    over its last average x E mini-batch steps, E an epoch's (Downpour's ``average``: that
    fraction of an epoch whatever n_push; default 0.1, with one worker too); the
    workers fetch the last values. clip: a push's step gradient at
    most this multiple of the running mean norm (Downpour's ``clip``; default 2 with several
    workers, off with one; 0: off). With ``fresh`` the fit moves faster and, as Downpour's,
    needs the cap late in the fit (docs/quality.md, "Fresh values mid-key")."""

    name = "boosting"
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
        from ..downpour.driver import STALENESS_RULES, check_clip
        check_int("n_push", self.n_push, 1)
        check_clip(self.clip, True)
        check_choice("staleness", self.staleness, STALENESS_RULES)
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
        from ...planning.partitions import Layout
        from ...transport.ps import ParameterServer
        from ..downpour.driver import (
            ServerSnapshots,
            _schedule,
            _server_average,
            _server_optimizer,
            looks_ahead,
            server_clip,
        )
        from ..downpour.exchange import ramp_length
        from .keys import KeyScheduler
        workers = job.replicas
        momentum, lr = job.train["momentum"], job.train["lr"]
        server_optimizer = self.server_optimizer or \
            _server_optimizer(job.train["optimizer"], momentum)
        server_momentum, worker_momentum, rate = staleness_rule(
            self.staleness, momentum, workers, server_optimizer)
        average = _server_average(self.average, workers, "async")
        ahead = looks_ahead(self.staleness, worker_momentum)
        run = Run(job, self, {**job.stage, "server_optimizer": server_optimizer, "lr": lr,
                              "lr_decay": job.train["lr_decay"], "momentum": momentum,
                              "server_momentum": server_momentum,
                              "worker_momentum": worker_momentum, "look_ahead": ahead})
        stage = job.stage
        key_rows = self.n_push * stage["batch_size"]
        files = parquet_files(job, Path(self.data_dir) if self.data_dir else run.path / "data",
                              run.say)
        keys = cut_keys(files, key_rows)
        if not keys:
            raise DataError("the DataFrame's Parquet files hold no rows: nothing to train on")
        ckpt_path = run.path / "checkpoint.pt"
        ckpt = run.checkpoint                 # read and checked to be Boosting's by Run
        start_epoch = int(ckpt["epoch"]) if ckpt is not None else 0
        history = list(ckpt["history"]) if ckpt is not None else []
        torch.manual_seed(stage["seed"])
        dtype = job.dtype
        net = job.model_fn().to(dtype)
        layout = Layout(net, 1, None)
        scheduler = KeyScheduler(len(keys), stage["epochs"], workers, seed=stage["seed"],
                                 lease_s=self.lease_s, start_epoch=start_epoch)
        schedule = _schedule(job, 1, "sequential", rate)   # each push its own step, as it comes
        fresh = workers > 1 if self.fresh is None else self.fresh
        # fresh values: the workers beside the driver read the server's version from a
        # memory-mapped file and ask only when it has moved (transport/ps/board.py)
        board = run.path / "ps-versions" if fresh else None
        ps = ParameterServer(layout.flatten(), run.secret.encode(), job.host,
                             optimizer=server_optimizer, lr=lr * rate,
                             momentum=server_momentum,
                             staleness_lr="lr" in self.staleness.split("+"),
                             mode="sequential", workers=workers, timeout_s=stage["timeout_s"],
                             lr_decay=job.train["lr_decay"], keys=scheduler,
                             schedule=schedule, push_scaling=job.train["lr_scaling"],
                             average=average, clip=server_clip(self.clip, workers, "async"),
                             buffers=layout.flatten_buffers(), board=board, ahead=ahead)
        ps.epoch_steps = len(keys) * self.n_push   # mini-batch steps of an epoch (lr_decay)
        if ckpt is not None:
            try:
                ps.load_state_dict(ckpt["server"])
            except ValueError as e:
                ps.close()                     # its thread, socket and board with it
                raise ConfigError(f"{ckpt_path} does not fit this fit's model: {e}; give a new "
                                  f"run_dir, or resume=False to start over in this one") from None
            run.say(f"resumed from the checkpoint of epoch {start_epoch} ({ckpt_path})")
        val = None
        if job.validation is not None:
            val = (torch.as_tensor(job.validation[0], dtype=dtype),
                   torch.as_tensor(job.validation[1]))
        losses: dict[int, list[float]] = {}     # epoch -> [loss sum, samples, keys reported]
        lock = threading.Condition()

        def on_message(m: dict) -> None:
            run.record(m)
            if m.get("type") == "key":
                with lock:
                    acc = losses.setdefault(m["epoch"], [0.0, 0, 0])
                    acc[0] += m["loss"] * m["samples"]
                    acc[1] += m["samples"]
                    acc[2] += 1
                    lock.notify_all()
                if job.progress:
                    run.live.update(f"  epoch {m['epoch']}/{stage['epochs']} key "
                                    f"{min(acc[2], len(keys))}/{len(keys)} loss "
                                    f"{m['loss']:.4f} (worker {m['worker']})")

        def epochs_thread() -> None:
            """Validate and checkpoint each epoch's server state as the scheduler ends it."""
            t_epoch = time.perf_counter()
            for epoch in range(start_epoch + 1, stage["epochs"] + 1):
                state = None
                while state is None and not stopped.is_set():
                    state = ps.next_epoch_state(epoch, 0.5)
                if state is None:
                    return
                with lock:                     # the epoch's last key reports (best effort)
                    lock.wait_for(lambda e=epoch: losses.get(e, [0, 0, 0])[2] >= len(keys), 2.0)
                    loss, n, _ = losses.pop(epoch, [0.0, 0, 0])
                now = time.perf_counter()
                served = scheduler.state()["keys_per_worker"][epoch - 1 - start_epoch]
                row = {"epoch": epoch, "loss": loss / max(n, 1), "samples": n,
                       "seconds": now - t_epoch, "since_start_s": now - run.t_start,
                       "samples_per_s": n / max(now - t_epoch, 1e-9),
                       "server_versions": list(state["versions"]),
                       "keys_per_worker": served,
                       "lr": ps.shards[0].epoch_lr(epoch, ps.epoch_steps)}
                t_epoch = now
                if val is not None:
                    kept = state["averages"][0]          # the averaged server's, if any
                    layout.load((state["values"][0] if kept is None else kept).to(dtype),
                                state["buffers"])
                    row.update(val_metrics(net, val, job.loss_fn, job.loss_name == "cross_entropy"))
                history.append(row)
                job.tracker.epoch(row)
                run.record({"type": "server_epoch", **row})
                _checkpoint(ckpt_path, state, history, epoch)
                run.epoch_line(row, f", keys per worker {served}")

        stopped = threading.Event()
        watcher = threading.Thread(target=epochs_thread, name="spark_dl-boosting-epochs",
                                   daemon=True)
        channel = run.serve(on_message)
        # local steps: plain SGD on the worker, for the servers whose step is lr x gradient
        local = self.local and server_optimizer in ("sgd", "momentum") and \
            self.amp != "fp16" and job.train["lr_scaling"] == "linear"
        cfg = _task.BoostingConfig(**stage, n_push=self.n_push, amp=self.amp,
                                   buffers=layout.buffer_spec,
                                   local=schedule if local else None, fresh=fresh,
                                   worker_momentum=worker_momentum, look_ahead=ahead,
                                   board=None if ps.board is None else ps.board.ticket(),
                                   momentum_ramp=ramp_length(       # the epochs to go
                                       sum(hi - lo for _, lo, hi in keys)
                                       * (stage["epochs"] - start_epoch)
                                       / stage["batch_size"] / workers),
                                   wire_dtype="float64" if stage["dtype"] == "float64" else
                                   "bfloat16" if self.amp else "float32")
        task = _task.make_task(cfg, job.model_fn, job.loss_fn, run.secret.encode(), ps.address,
                               channel.address, str(run.path), keys)
        job.say(f"boosting: {len(keys)} keys of {key_rows} rows ({self.n_push} mini-batches) "
                f"from {len(files)} Parquet file(s), {workers} worker(s), parameter server "
                f"{ps.address[0]}:{ps.address[1]} ({server_optimizer}), run directory "
                f"{run.path}")
        job.tracker.start(run.path, run.config)
        frame = job.spark.range(0, workers, numPartitions=workers)
        watcher.start()
        snapshots = ServerSnapshots(ps, stage["validate_every"]).start() \
            if val is not None else None
        try:
            try:
                rows = run.collect(frame.mapInArrow(task, _task.RESULT_SCHEMA))
            except BaseException:
                job.tracker.close(failed=True)
                raise
            watcher.join(timeout=30)           # the last epoch's validation
        finally:
            stopped.set()
            watcher.join(timeout=5)
            if snapshots is not None:
                snapshots.stop()
            run.close()
            ps.close()
        evals = [] if snapshots is None else snapshots.evals(
            layout, net, val, job.loss_fn, job.loss_name == "cross_entropy")
        layout.load(ps.parameters().to(dtype), ps.buffers())
        reports = sorted((json.loads(r.report) for r in rows), key=lambda r: r["worker"])
        state = scheduler.state()
        info = {"world": workers, "mode": "sequential", "n_push": self.n_push,
                "staleness": self.staleness, "server_momentum": server_momentum,
                "worker_momentum": worker_momentum, "server_rate": rate, "look_ahead": ahead,
                "local_steps": local, "fresh": fresh, "average": average,
                "keys": {"count": len(keys), "rows_per_key": key_rows, "files": len(files),
                         "served": [[list(p) for p in ep] for ep in scheduler.served],
                         "keys_per_worker": state["keys_per_worker"],
                         "reissued": state["reissued"]},
                "server": ps.stats(), "served": {"parameter_server": list(ps.address)},
                "workers": reports, "devices": [r["device"] for r in reports],
                "rows_per_replica": [r["rows"] for r in reports],
                "total_rows": sum(r["rows"] for r in reports),
                "train_seconds": max((r["task_seconds"] for r in reports), default=0.0),
                "resumed_from_epoch": start_epoch or None, "evals": evals,
                "lr_schedule": {**schedule.describe(), "push_scaling": job.train["lr_scaling"]}}
        return run.finish(net, history, info, f"boosting PS, {workers} worker(s)")


def staleness_rule(staleness: str, momentum: float, workers: int, server_optimizer: str
                   ) -> tuple[float, float, float]:
    """(the server's momentum, the momentum each worker carries, the server's rate as a
    multiple of fit's) under Downpour's ``staleness`` rule for ``workers`` pushing in turn,
    each push W - 1 versions old as Downpour's asynchronous pushes, never overlapping the
    next step: Boosting(staleness=...) with fit's ``momentum``."""
    from ..downpour.driver import _server_momentum, _worker_momentum, _worker_rule
    server_momentum = _server_momentum(momentum, workers, "async", staleness)
    worker_momentum = _worker_momentum(momentum, workers, "async", staleness,
                                       server_optimizer)
    worker_momentum, rate = _worker_rule(worker_momentum, workers, False, staleness)
    return server_momentum, worker_momentum, rate


def parquet_files(job: Job, data_dir: Path | str, say) -> list[str]:
    """The Parquet files the keys come from: the DataFrame's own when it is a plain Parquet
    scan (spark.read.parquet(...), nothing on top), else those of a copy of its feature and
    label columns written once to ``data_dir`` (reused when complete)."""
    df, stage = job.df, job.stage
    cols = [c for c in (stage["features"], stage["label"]) if c]
    if _plain_parquet(df):
        return sorted(df.inputFiles())
    path = str(data_dir)
    uri = path if "://" in path else Path(path).resolve().as_uri()
    done = Path(path) / "_SUCCESS" if "://" not in path else None
    if done is None or not done.exists():
        say(f"boosting: writing the DataFrame's {', '.join(cols)} columns as Parquet to "
            f"{path} (the workers read their keys from there)")
        df.select(*cols).write.mode("overwrite").parquet(uri)
    return sorted(job.spark.read.parquet(uri).inputFiles())


def _plain_parquet(df) -> bool:
    try:
        plan = df._jdf.queryExecution().optimizedPlan().toString().strip()
    except Exception:                     # Spark Connect: no JVM handle, write a copy
        return False
    return "\n" not in plan and plan.startswith("Relation") and "parquet" in plan


def cut_keys(files: list[str], key_rows: int) -> list[tuple[str, int, int]]:
    """Every file's rows in chunks of ``key_rows`` (the last of a file may be shorter):
    (file URI, first row, end row)."""
    import pyarrow.fs as pafs
    import pyarrow.parquet as pq
    keys = []
    for uri in files:
        fs, path = pafs.FileSystem.from_uri(uri)
        with fs.open_input_file(path) as f:
            n = pq.ParquetFile(f).metadata.num_rows
        keys += [(uri, a, min(a + key_rows, n)) for a in range(0, n, key_rows)]
    return keys


def _checkpoint(path: Path, state: dict, history: list[dict], epoch: int) -> None:
    from ...runtime.checkpoint import save_atomic
    save_atomic(path, {"strategy": "boosting", "epoch": epoch, "server": state,
                       "history": [h for h in history if h["epoch"] <= epoch]})


