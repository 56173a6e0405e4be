"""What every strategy shares on the driver: its options, the job ``fit`` hands it, and the run
(directory, metrics, progress, tracking, the authenticated message channel, the result).

A strategy is a frozen dataclass of its own options, validated when it is made; its driver
half is ``run(job)`` (plan the stage, start what it serves, handle the tasks' messages,
finish) and its task half is the function its module ships to the executors.
"""

from __future__ import annotations

import dataclasses
import functools
import io
import json
import os
import re
import secrets
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn

from ..compat import is_connect
from ..errors import ConfigError, DataError, ResourceError, SparkDLError
from ..progress import ProgressLine
from ..resources import map_in_arrow
from ..runs import (
    MARK,
    loss_figure,
    new_run_dir,
    plot_history,
    read_metrics,
    shared_mark,
    write_history,
    write_json,
)
from ..runtime.checkpoint import load_checkpoint
from ..runtime.failures import TaskErrors

__all__ = ["FitResult", "Job", "Run", "Strategy", "barrier_row", "options", "run_barrier"]


@dataclasses.dataclass
class FitResult:
    """What ``fit`` returns: the trained model, one history row per epoch, the strategy's
    facts (``info``, also in ``info.json``), the run directory and, with ``track="mlflow"``,
    the MLflow run that holds the model (``runs:/<mlflow_run_id>/model``); ``plot()`` draws
    the run's ``loss.png`` as a matplotlib Figure (in a notebook: ``result.plot()``)."""

    model: nn.Module
    history: list[dict]          # one dict per epoch: loss, samples, seconds, samples_per_s, val_*
    info: dict                   # replicas, devices, rows per replica, the strategy's counters
    run_dir: Path
    title: str = ""              # the plot's title: the strategy and its replicas
    mlflow_run_id: str | None = None

    @property
    def final(self) -> dict:
        return self.history[-1] if self.history else {}

    def plot(self):
        """Training loss per step (the run's ``metrics.jsonl``) and per epoch, validation on
        its own axes: the figure of ``loss.png`` (``spark_dl.runs.loss_figure``)."""
        return loss_figure(self.history, read_metrics(Path(self.run_dir) / "metrics.jsonl"),
                           self.title)


def options(cls):
    """Make ``cls`` a frozen, keyword-only dataclass whose unknown options are a ConfigError
    listing the allowed ones, and whose ``check()`` runs on construction."""
    cls = dataclasses.dataclass(frozen=True, kw_only=True)(cls)
    init = cls.__init__

    @functools.wraps(init)
    def __init__(self, **kw):
        allowed = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(kw) - set(allowed))
        if unknown:
            hints = "".join(f" ({cls.hints[k]})" for k in unknown if k in cls.hints)
            raise ConfigError(f"{cls.__name__} has no option {', '.join(map(repr, unknown))}"
                              f"{hints}; its options: {', '.join(allowed)}")
        init(self, **kw)
        self.check()
    cls.__init__ = __init__
    return cls


class Strategy:
    """The base of every strategy. Subclasses: ``@options``, a ``name``, ``check`` (their own
    options), ``check_job`` (against fit's common arguments), ``barrier`` and ``run``."""

    name: ClassVar[str] = ""
    hints: ClassVar[dict] = {}           # an option of another strategy -> where it belongs
    nesterov: ClassVar[bool] = True      # takes fit's nesterov=True (the parameter-server
                                         # strategies' staleness rule places the momentum)

    def check(self) -> None:
        """Raise ConfigError for a bad option (called on construction)."""

    def check_job(self, job: Job) -> None:
        """Raise ConfigError for options that do not go with fit's arguments."""

    def tasks(self, job: Job) -> int:
        """Sets ``job.replicas`` when fit left it open; returns the stage's task count."""
        job.replicas = job.replicas or max(min(job.partitions or job.slots, job.slots), 1)
        return job.replicas

    def barrier(self, job: Job) -> bool:
        """Whether the stage is a barrier stage (its tasks start together)."""
        return True

    def run(self, job: Job) -> FitResult:
        raise NotImplementedError

    def describe(self) -> dict:
        return {"name": self.name, **dataclasses.asdict(self)}


def nesterov_strategies() -> str:
    """The strategies that take fit's nesterov=True, by class name ("A, B or C")."""
    names = [cls.__name__ for cls in Strategy.__subclasses__() if cls.name and cls.nesterov]
    return f"{', '.join(names[:-1])} or {names[-1]}"


def check_choice(name: str, value, choices) -> None:
    if value not in choices:
        raise ConfigError(f"{name} must be one of {', '.join(map(repr, choices))}, got {value!r}")


def check_int(name: str, value, low: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ConfigError(f"{name} must be an integer >= {low}, got {value!r}")


def check_server_optimizer(job: Job, strategy: str, server_optimizer: str | None) -> None:
    """ConfigErrors for fit's optimizer under a parameter-server ``strategy`` (Downpour,
    Boosting): it needs a server form, and Nesterov's momentum has none there (the staleness
    rule places the momentum; "dana" already looks ahead by the steps to come)."""
    if server_optimizer is None and \
            job.train["optimizer"] not in ("sgd", "adagrad", "adam", "rmsprop"):
        raise ConfigError(f"optimizer {job.train['optimizer']!r} has no parameter-server "
                          f"form; use sgd, rmsprop, adagrad or adam (or set "
                          f"server_optimizer)")
    if job.train.get("nesterov"):
        raise ConfigError(f"nesterov=True with {strategy}: its staleness rule decides where "
                          f"the momentum runs (the workers or the server), and its 'dana' "
                          f"rule already looks ahead by the momentum steps to come; use "
                          f"nesterov=False with {strategy}, or "
                          f"{nesterov_strategies()} for Nesterov's momentum")


@dataclasses.dataclass
class Job:
    """What fit hands a strategy: the data, the model, the settings every strategy shares."""

    df: Any
    model: Any                       # as given: a name or a factory (for config.json)
    model_fn: Callable[[], nn.Module]
    loss_fn: Callable
    loss_name: str
    stage: dict                      # StageConfig's fields (data, loop, task resources)
    train: dict                      # optimizer, lr, lr_decay, momentum, weight_decay, max_iter
    replicas: int | None
    validation: tuple | None
    run_dir: str | Path | None
    progress: bool
    log: Callable[[str], None] | None
    tracker: Any
    slots: int
    partitions: int | None           # the DataFrame's (None: not known, Spark Connect)
    plan: dict = dataclasses.field(default_factory=dict)   # what the strategy decided
    signature: dict = dataclasses.field(default_factory=dict)  # the model's parameter shapes
    profile: Any = None              # the training stage's ResourceProfile (None: the app's)
    example: Any = None              # a few training rows as the model takes them (numpy), for
                                     # the signature of the model a tracker logs (MLflow)
    started_at: float | None = None  # time.time() when fit was called (info's "phases")

    @property
    def spark(self):
        return self.df.sparkSession

    @property
    def dtype(self) -> torch.dtype:
        return torch.float64 if self.stage["dtype"] == "float64" else torch.float32

    @property
    def host(self) -> str:
        return self.spark.conf.get("spark.driver.host", "127.0.0.1")

    def say(self, text: str) -> None:
        if self.log is not None:
            self.log(text)

    def frame(self, tasks: int, barrier: bool):
        """The DataFrame in ``tasks`` partitions. A barrier stage may not read through
        union()/coalesce() (Spark refuses the RDD chain): a shuffle gives it plain ones."""
        if self.partitions != tasks or (barrier and _narrow_merges(self.df)):
            return self.df.repartition(tasks)
        return self.df


def _narrow_merges(df) -> bool:
    """Whether the DataFrame's physical plan unions or coalesces partitions, or the RDD a
    DataFrame was made of (spark.createDataFrame(rdd), rdd.toDF()) does."""
    if is_connect(df.sparkSession):     # no JVM handle to ask: play safe
        return True
    execution = df._jdf.queryExecution()
    plan = execution.executedPlan().toString()
    if any(op in plan for op in ("Union", "Coalesce")):
        return True
    return "ExistingRDD" in plan and any(
        rdd in execution.toRdd().toDebugString() for rdd in ("UnionRDD", "CoalescedRDD"))


def _writable(path: Path) -> None:
    """The run directory exists and takes files, or a ConfigError says why."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".write-test-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise ConfigError(f"the run directory {path} cannot be written ({e.strerror or e}): "
                          f"pass run_dir= a directory this user can write (on a cluster, one "
                          f"every executor can reach)") from None


# what must match for a run directory's checkpoint to be resumed
_SAME = ("model", "parameters", "shape", "label_shape", "num_classes", "loss", "dtype",
         "features", "label")


def _same_model(path: Path, config: dict) -> None:
    """A run directory with a checkpoint resumes only the model and data it was made for
    (its config.json): else a ConfigError names what differs."""
    if not (path / "checkpoint.pt").exists() or not (path / "config.json").exists():
        return
    try:
        old = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return
    new = json.loads(json.dumps(config, default=str))
    diff = []
    for key in _SAME:
        a, b = old.get(key), new.get(key)
        if a is None or b is None or a == b:
            continue
        if key == "model" and old.get("parameters") and new.get("parameters"):
            continue                 # factories' names differ freely; their parameters tell
        if key == "parameters":
            names = [k for k in dict.fromkeys([*a, *b]) if a.get(k) != b.get(k)]
            diff.append("parameters " + ", ".join(
                f"{k} {tuple(a[k]) if k in a else 'absent'} there, "
                f"{tuple(b[k]) if k in b else 'absent'} here" for k in names[:3])
                + (f" (and {len(names) - 3} more)" if len(names) > 3 else ""))
        else:
            diff.append(f"{key} {a!r} there, {b!r} here")
    if diff:
        raise ConfigError(f"the run directory {path} holds the checkpoint of a different fit "
                          f"({'; '.join(diff)}): give a new run_dir, or resume=False to start "
                          f"over in this one (its checkpoint is then replaced)")


def _same_strategy(path: Path, name: str, say) -> dict | None:
    """The run directory's checkpoint (``path``; None without one): readable, or its previous
    one (set in its place, with a message), and of this strategy; else a ConfigError."""
    ckpt = load_checkpoint(path, say)
    found = None if ckpt is None else ckpt.get("strategy", "allreduce")
    if found is not None and found != name:
        raise ConfigError(f"{path} is a checkpoint of strategy {found!r}, not of this {name} "
                          f"fit: give a new run_dir, or resume=False to start over in this one")
    return ckpt


class Run:
    """One fit's run directory, metrics, progress line, tracking and message channel."""

    def __init__(self, job: Job, strategy: Strategy, config: dict):
        self.job, self.strategy = job, strategy
        self.path = Path(job.run_dir).resolve() if job.run_dir is not None else \
            new_run_dir("runs", strategy.name)
        _writable(self.path)
        self.config = {"strategy": strategy.name, "replicas": job.replicas,
                       "model": job.model if isinstance(job.model, str) else
                       getattr(job.model, "__name__", repr(job.model)),
                       "options": strategy.describe(), **config,
                       "parameters": job.signature.get("parameters")}
        notes: list[str] = []
        # the checkpoint to resume (None without one, or with resume=False), read once here:
        # refused before config.json is rewritten, so that a refused run directory is kept
        self.checkpoint: dict | None = None
        if job.stage["resume"]:
            _same_model(self.path, self.config)
            self.checkpoint = _same_strategy(self.path / "checkpoint.pt", strategy.name,
                                             notes.append)
        write_json(self.path / "config.json", self.config)
        self.metrics = open(self.path / "metrics.jsonl", "a")  # noqa: SIM115 - open for the run
        self.live = ProgressLine(job.log)
        for note in notes:
            self.say(note)
        self.t_start = time.perf_counter()
        self.stamps: dict = {}          # time.time() of the stage's submission, its row, ...
        self.secret = secrets.token_hex(16)
        (self.path / MARK).write_text(shared_mark(self.path, self.secret))  # close() drops it
        self.channel = None
        self.errors = TaskErrors(job.spark, f"spark_dl-{self.path.name}-{self.secret[:8]}")

    def say(self, text: str) -> None:
        """A line for the user (through the progress line, which may be drawing)."""
        if self.job.log is not None:
            self.live.line(text)

    def record(self, m: dict) -> None:
        self.metrics.write(json.dumps(m) + "\n")
        self.metrics.flush()

    def serve(self, on_message: Callable[[dict], None] | None = None):
        """The authenticated channel the tasks report to (default: replica 0's reports)."""
        from ..transport.channel import MessageServer
        handler = on_message or self.on_message

        def dispatch(m: dict) -> None:
            if not self.errors.on_message(m):       # a task's error cancels the fit's jobs
                handler(m)
        self.channel = MessageServer(self.job.host, self.secret.encode(), dispatch)
        return self.channel

    def collect(self, frame):
        """``frame.collect()`` under the fit's job tag: a task's reported error cancels it and
        is raised here (a TaskError carrying the task's exception), in seconds."""
        try:
            with self.errors:
                return frame.collect()
        except Exception as e:
            self.errors.wait(1.0)
            self.errors.raise_reported()
            raise_task_error(e)
            raise

    def step_line(self, m: dict, extra: str = "") -> None:
        if self.job.progress:
            self.live.update(f"  epoch {m['epoch']}/{m['epochs']} step {m['step']}/{m['steps']}"
                             f" loss {m['loss']:.4f} {m['samples_per_s']:,.0f} samples/s{extra}")

    def epoch_line(self, row: dict, extra: str = "") -> None:
        if self.job.progress:
            vals = "".join(f" {k} {row[k]:.4f}" for k in ("val_loss", "val_accuracy")
                           if k in row)
            self.live.line(f"epoch {row['epoch']}: loss {row['loss']:.4f}{vals}, "
                           f"{row['samples']} samples, {row['samples_per_s']:,.0f} "
                           f"samples/s{extra}")

    def on_message(self, m: dict) -> None:
        """Replica 0's reports: steps, epochs (with its validation) and resumes."""
        self.record(m)
        if m.get("type") == "step":
            self.job.tracker.step(m)
            self.step_line(m)
        elif m.get("type") == "epoch":
            self.job.tracker.epoch(m)
            self.epoch_line(m)
        elif m.get("type") == "resume" and self.job.progress:
            self.live.line(f"resumed from the checkpoint of epoch {m['epoch']}")

    def close(self) -> None:
        """After the stage: no more messages (the metrics stay open for what finish adds)."""
        if self.channel is not None:
            self.channel.close()
        (self.path / MARK).unlink(missing_ok=True)
        self.live.close()

    def finish(self, net: nn.Module, history: list[dict], info: dict, title: str,
               model_saved: bool = False) -> FitResult:
        """The run directory's files (``model_saved``: model.pt, of ``net``, is there
        already) and the FitResult."""
        self.metrics.close()
        history.sort(key=lambda h: h["epoch"])
        info = {**info, "wall_seconds": time.perf_counter() - self.t_start,
                "rejected_messages": self.channel.rejected if self.channel else 0,
                "served": {**info.get("served", {}), **(
                    {"channel": list(self.channel.address)} if self.channel else {})}}
        write_history(self.path / "history.csv", history)
        plot_history(self.path / "loss.png", history, title,
                     read_metrics(self.path / "metrics.jsonl"))
        if not model_saved:
            torch.save(net.state_dict(), self.path / "model.pt")
        phases = fit_phases(self.job.started_at, self.stamps, info.get("timings_rank0"))
        if phases:
            info["phases"] = phases
        write_json(self.path / "info.json", info)
        tracker = self.job.tracker
        try:
            tracker.log_model(net, self.job.example)
        except BaseException:
            tracker.close(failed=True)
            raise
        tracker.close()
        return FitResult(net, history, info, self.path, title,
                         mlflow_run_id=tracker.mlflow_run_id)


def fit_phases(started_at: float | None, stamps: dict, task: dict | None) -> dict | None:
    """Where a barrier-stage fit's wall time went, in seconds (info's "phases"), from the
    driver's ``stamps`` (time.time() of the stage's submission, ``submitted``, and of task
    0's row on the driver, ``received``) and task 0's timings (``task``, with its start and
    end on its executor's clock): the driver's checks before the stage (``checks_s``), the
    stage's start until task 0 runs (``launch_s``: scheduling, the Python workers, the task
    unpickled; a retried stage's earlier attempts too), the task's reading of its shard,
    rendezvous, setup (model, optimizer, resume), epochs, validation, checkpoints and the
    result (the final model made ready and serialised), the rest of the task (``task_other_s``),
    the row's way to the driver (``return_s``) and the driver's finish (the model loaded, the
    run directory written: ``finish_s``); ``total_s`` and ``outside_epochs_s`` (all but the
    epochs). None when a stamp is missing (a strategy of its own loop)."""
    if started_at is None or not task or "started_at" not in task or \
            not {"submitted", "received"} <= set(stamps):
        return None
    finished = time.time()
    inside = {"read_s": task.get("read_partition_s", 0.0),
              **{k: task.get(k, 0.0) for k in ("rendezvous_s", "setup_s", "epochs_s",
                                               "validation_s", "checkpoints_s", "result_s")}}
    phases = {"checks_s": stamps["submitted"] - started_at,
              "launch_s": task["started_at"] - stamps["submitted"], **inside,
              "task_other_s": task["task_total_s"] - sum(inside.values()),
              "return_s": stamps["received"] - task["ended_at"],
              "finish_s": finished - stamps["received"]}
    phases = {k: round(max(v, 0.0), 3) for k, v in phases.items()}   # clocks of two machines
    phases["total_s"] = round(finished - started_at, 3)
    phases["outside_epochs_s"] = round(phases["total_s"] - phases["epochs_s"], 3)
    return phases


def run_barrier(job: Job, run: Run, task, schema: str, title: str,
                info: dict | None = None) -> FitResult:
    """Run a replica-per-task barrier stage whose task 0 returns the model (runtime.stage's
    barrier_task; ``run.serve()`` gave the tasks their channel) and finish the fit with it:
    the model.pt task 0 wrote in the run directory (its info's ``model_file``), or the row's
    bytes where task 0 does not see the directory; ``info``: the driver's own entries for
    info.json, beside the tasks'."""
    row = barrier_row(job, run, task, schema)
    stage_info = json.loads(row.info)
    saved = stage_info.pop("model_file", None)
    net = job.model_fn()
    net = net.double() if job.stage["dtype"] == "float64" else net
    net.load_state_dict(torch.load(io.BytesIO(row.state), weights_only=True) if saved is None
                        else torch.load(_model_file(run.path, saved), weights_only=True,
                                        mmap=True))
    history = json.loads(row.history)
    for h in history:                      # epochs whose live messages were lost
        job.tracker.epoch(h)
    stage_info["model_via"] = "result row" if saved is None else "run directory"
    return run.finish(net, history, {**stage_info, **(info or {})}, title,
                      model_saved=saved is not None)


def _model_file(path: Path, saved: dict) -> Path:
    """The model file task 0 wrote in the run directory ``path`` (``saved``: its name and
    size), or a SparkDLError when it is not there whole."""
    file = path / saved["name"]
    size = file.stat().st_size if file.exists() else None
    if size != saved["bytes"]:
        raise SparkDLError(f"task 0 wrote the fit's model to {file} ({saved['bytes']} bytes) "
                           f"but the driver finds {'no file' if size is None else f'{size} bytes'}"
                           f" there: was the run directory changed during the fit?")
    return file


def barrier_row(job: Job, run: Run, task, schema: str):
    """Run a replica-per-task barrier stage (runtime.stage's barrier_task) and return the row
    its task 0 yields; a stage whose tasks did not start (a bad shard) raises their errors."""
    df = job.frame(job.replicas, barrier=True)
    job.tracker.start(run.path, run.config)
    try:
        # The shuffle after the barrier stage makes it a ShuffleMapStage, which Spark retries
        # as a whole when a task fails (a failed barrier ResultStage is never retried); the
        # retried tasks resume from the run's last checkpoint.
        run.stamps["submitted"] = time.time()
        rows = run.collect(map_in_arrow(df, task, schema, True, job.profile).repartition(1))
        run.stamps["received"] = time.time()
    except BaseException:
        job.tracker.close(failed=True)
        raise
    finally:
        run.close()
    if not rows or rows[0].error:
        job.tracker.close(failed=True)
    if not rows:
        raise RuntimeError("the training stage returned no result (replica 0 produced none)")
    row = rows[0]
    if row.error:
        errors = json.loads(row.error)
        kinds = {e["type"] for e in errors}
        cls = _ERRORS.get(kinds.pop(), SparkDLError) if len(kinds) == 1 else SparkDLError
        raise cls("training did not start: " + "; ".join(
            f"task {e['task']}: {e['message']}" for e in errors))
    return row


_ERRORS = {"DataError": DataError, "ResourceError": ResourceError, "ConfigError": ConfigError}


def raise_task_error(e: Exception) -> None:
    """A spark_dl error raised in a task reaches the driver inside Spark's exception text:
    raise it again as itself (with its message), so that callers can catch ConfigError,
    DataError or ResourceError. Returns when there is none."""
    m = re.search(r"spark_dl\.errors\.(ConfigError|DataError|ResourceError): ([^\n]*)", str(e))
    if m:
        raise _ERRORS[m.group(1)](m.group(2)) from e
