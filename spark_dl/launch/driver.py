"""``spark_dl.run``: the driver half. Check what can be checked before any Spark job (the
function pickles, the replicas fit the slots, the data's columns), open the run (directory,
metrics, progress line, authenticated channel, fast task errors: strategies/base.py's Run),
run one barrier stage of ``replicas`` tasks and return rank 0's return value."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from typing import ClassVar

from ..compat import default_parallelism, gpu_request_error, master, num_partitions, task_slots
from ..errors import ConfigError, DataError, ResourceError
from ..preflight import check_label_column, check_not_empty, check_picklable, named
from ..runs import write_history, write_json
from ..runtime.stage import RESULT_SCHEMA
from ..strategies.base import Job, Run, Strategy, barrier_row
from ..tracking import Tracker
from . import task as _task

__all__ = ["run"]


@dataclasses.dataclass(frozen=True)
class _Function(Strategy):
    """What config.json says of a run: the function, and the communication hook asked for."""

    name: ClassVar[str] = "run"
    nesterov: ClassVar[bool] = False     # not a strategy of fit: its function picks
    function: str = ""
    comm_hook: str | None = None


def run(train_fn: Callable, *args, df=None, replicas: int | None = None, device: str = "auto",
        features: str = "features", label: str = "label", shape=(), label_shape=(),
        num_classes: int | None = None, batch_size: int = 64, shuffle: bool = True,
        seed: int = 0, data: str = "auto", shuffle_buffer: int | str = "256MB",
        transform: Callable | None = None, comm_hook: str | None = None, run_dir=None,
        progress: bool = True, log: Callable[[str], None] | None = print,
        timeout_s: float = 300.0, threads: int = 0, **kwargs):
    """Run ``train_fn(*args, **kwargs)`` once per replica in a Spark barrier stage, as torchrun
    would run it, and return rank 0's return value (TorchDistributor.run's contract).

    Each replica starts with the default process group up (NCCL on GPUs, gloo on the CPU) and
    torchrun's variables set (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE, LOCAL_RANK), so a
    DDP script's function runs unchanged; its own ``dist.init_process_group(...)`` keeps that
    group. ``spark_dl.context()`` inside it gives the replica's rank, device and shard.

    df: a DataFrame whose partitions are the replicas' shards, read as ``fit`` reads them
      (features/label columns, ``shape``, ``label_shape``, ``num_classes``, ``data``: "memory",
      "stream" or "auto", ``shuffle_buffer``, ``transform``); ``ctx.batches(epoch)`` yields
      mini-batches of ``batch_size`` in fit's order (``shuffle``, ``seed``). None: no data.
      Features may be Spark ML vectors (dense or sparse); with ``num_classes`` the labels are
      class ids, int64 (doubles holding whole numbers accepted).
    replicas: the number of tasks (default: the DataFrame's partitions, at most the task
      slots; without df, the slots); device: "auto", "cpu" or "cuda".
    comm_hook: None, or "shm": every DistributedDataParallel the function builds averages its
      gradients through shared memory when all replicas share a host (CPU), else keeps DDP's
      own all-reduce (see ShmCommHook to register it yourself).
    run_dir, progress, log: the run directory (config.json, metrics.jsonl with what the
      function reports through ``ctx.log``, info.json), the progress line and where it goes.
    timeout_s: how long a replica waits for the others; threads: torch threads per task
      (0: the task's cores). Every other keyword argument goes to ``train_fn``.
    """
    if not callable(train_fn):
        raise TypeError(f"train_fn must be a function, got {type(train_fn).__name__}: pass "
                        f"the training function itself, spark_dl.run(train, ...)")
    name = named(train_fn)
    _check_picklable(name, train_fn, args, kwargs, transform)
    _check_choice("device", device, ("auto", "cpu", "cuda"))
    _check_choice("comm_hook", comm_hook, (None, "shm"))
    for key, value in (("batch_size", batch_size), ("threads", threads)):
        if not isinstance(value, int) or isinstance(value, bool) or value < (key != "threads"):
            raise ConfigError(f"{key} must be an integer >= {int(key != 'threads')}, "
                              f"got {value!r}")
    if replicas is not None and (not isinstance(replicas, int) or isinstance(replicas, bool)
                                 or replicas < 1):
        raise ConfigError(f"replicas must be an integer >= 1, got {replicas!r}")
    from ..data.stream import DATA_MODES, parse_buffer
    _check_choice("data", data, DATA_MODES)
    parse_buffer(shuffle_buffer)
    spark = _session(df)
    slots = task_slots(spark)
    if df is not None:
        for col in (features, label):
            if col and col not in df.columns:
                raise DataError(f"column {col!r} not in the DataFrame (columns: {df.columns}); "
                                f"pass features=/label= with the right names")
        check_label_column(df, label)
        partitions = num_partitions(df)
        replicas = replicas or max(min(partitions or slots, slots), 1)
    else:
        replicas = replicas or slots
        partitions = replicas
        df = spark.range(replicas, numPartitions=replicas)
        features = label = ""
    _check_resources(spark, replicas, slots, device)
    if features:
        check_not_empty(df)
    cfg = _task.LaunchConfig(features=features, label=label, shape=tuple(shape),
                             label_shape=tuple(label_shape), num_classes=num_classes,
                             batch_size=batch_size, shuffle=shuffle, seed=seed, device=device,
                             threads=threads, timeout_s=timeout_s, data=data,
                             shuffle_buffer=shuffle_buffer, transform=transform, resume=False,
                             comm_hook=comm_hook, function=name)
    stage = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
    job = Job(df=df, model=name, model_fn=None, loss_fn=None, loss_name="", stage=stage,
              train={}, replicas=replicas, validation=None, run_dir=run_dir, progress=progress,
              log=log, tracker=Tracker(None), slots=slots, partitions=partitions)
    the_run = Run(job, _Function(function=name, comm_hook=comm_hook), stage)
    try:
        task = _task.make_task(cfg, train_fn, args, kwargs, the_run.secret,
                               the_run.serve(_reports(the_run, progress)).address,
                               str(the_run.path))
        job.say(f"run: {name} on {replicas} replica(s), run directory {the_run.path}")
        row = barrier_row(job, the_run, task, RESULT_SCHEMA)
        value = _task.decode_result(row.state)
        history = json.loads(row.history)
        if history:
            write_history(the_run.path / "history.csv", history)
        write_json(the_run.path / "info.json", {**json.loads(row.info), "history": history,
                                                "served": {"channel": list(
                                                    the_run.channel.address)}})
    finally:
        the_run.metrics.close()
    return value


def _reports(the_run: Run, progress: bool) -> Callable[[dict], None]:
    """Rank 0's ``ctx.log`` reports: metrics.jsonl, and the progress line (a report with an
    ``epoch`` and no ``step`` as a lasting line)."""

    def on_message(m: dict) -> None:
        the_run.record(m)
        if not progress or m.get("type") != "log":
            return
        text = "  ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                         for k, v in m.items() if k not in ("type", "time"))
        if "epoch" in m and "step" not in m:
            the_run.live.line(text)
        else:
            the_run.live.update("  " + text)
    return on_message


def _check_choice(name: str, value, choices) -> None:
    if value not in choices:
        raise ConfigError(f"{name} must be one of {', '.join(map(repr, choices))}, "
                          f"got {value!r}")


def _check_picklable(name: str, fn: Callable, args: tuple, kwargs: dict,
                     transform: Callable | None = None) -> None:
    """Spark ships the function, its arguments and the transform pickled: say which one
    cannot be, here."""
    check_picklable((("the function " + name, fn),
                     *((f"argument {i} ({type(a).__name__})", a) for i, a in enumerate(args)),
                     *((f"keyword argument {k!r} ({type(v).__name__})", v)
                       for k, v in kwargs.items()),
                     *((("the transform " + named(transform), transform),) if transform
                       else ())))


def _session(df):
    if df is not None:
        return df.sparkSession
    from pyspark.sql import SparkSession
    spark = SparkSession.getActiveSession()
    if spark is None:
        try:
            from pyspark.sql.connect.session import SparkSession as ConnectSession
            spark = ConnectSession.getActiveSession()
        except ImportError:                      # pyspark without the Connect client
            spark = None
    if spark is None:
        raise ConfigError("spark_dl.run without df= needs an active SparkSession: create one "
                          "first (spark_dl.get_session('local')), or pass df=")
    return spark


def _check_resources(spark, replicas: int, slots: int, device: str) -> None:
    if replicas > slots:
        raise ResourceError(
            f"replicas={replicas} but the cluster runs {slots} task(s) at once (default "
            f"parallelism {default_parallelism(spark)} / spark.task.cpus), and the replicas of "
            f"spark_dl.run start together (a barrier stage): use replicas <= {slots} or add "
            f"executors/cores")
    if spark.conf.get("spark.dynamicAllocation.enabled", "false") == "true":
        raise ConfigError("spark_dl.run runs a barrier stage, which Spark does not run with "
                          "dynamic allocation: set spark.dynamicAllocation.enabled=false for "
                          "this application")
    why = gpu_request_error(master(spark),
                            spark.conf.get("spark.task.resource.gpu.amount", None), device)
    if why:
        raise ConfigError(why)

