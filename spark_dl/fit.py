"""``spark_dl.fit``: train a torch model on a DataFrame's partitions with a distributed engine.

    from spark_dl import fit
    result = fit(df, "cnn", strategy="allreduce", shape=(1, 28, 28), num_classes=10,
                 optimizer="sgd", lr=0.05, momentum=0.9, epochs=3, batch_size=64)
    result.model, result.history, result.run_dir

The DataFrame holds a feature column (array<float> or fixed-size list, reshaped to ``shape``)
and a label column; each partition is one replica's shard (``replicas`` repartitions). Rows
never reach the driver: each task reads its partition through the Arrow bridge.
"""

from __future__ import annotations

import dataclasses
import io
from collections import Counter
import json
import secrets
import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from torch import nn

from .errors import ConfigError, DataError, ResourceError, SparkDLError
from .optim.factory import OPTIMIZERS
from .parallel import allreduce, downpour
from .parallel.channel import MessageServer
from .progress import ProgressLine
from .runs import new_run_dir, plot_history, write_history, write_json
from .tracking import Tracker

__all__ = ["fit", "FitResult", "STRATEGIES"]

STRATEGIES = ("allreduce", "downpour")


@dataclasses.dataclass
class FitResult:
    model: nn.Module
    history: list[dict]          # one dict per epoch: loss, samples, seconds, samples_per_s, val_*
    info: dict                   # replicas, devices, rows per replica, all-reduce calls and bytes
    run_dir: Path

    @property
    def final(self) -> dict:
        return self.history[-1] if self.history else {}


def _model_factory(model: str | Callable[[], nn.Module]) -> Callable[[], nn.Module]:
    if isinstance(model, str):
        from .models import build_model
        build_model(model)                      # unknown names fail here, on the driver
        return lambda: build_model(model)
    if not callable(model):
        raise TypeError(f"model must be a model name ('fc', 'cnn') or a function returning an "
                        f"nn.Module, got {type(model).__name__}")
    return model


def _server_optimizer(optimizer: str, momentum: float) -> str:
    if optimizer == "sgd":
        return "momentum" if momentum else "sgd"
    return optimizer


def _slots(spark) -> int:
    sc = spark.sparkContext
    task_cpus = int(sc.getConf().get("spark.task.cpus", "1"))
    return max(1, sc.defaultParallelism // task_cpus)


def _gpu_request_error(master: str, task_gpus: str | None, device: str) -> str | None:
    """Why ``device`` cannot be honoured on ``master`` with ``spark.task.resource.gpu.amount``
    = ``task_gpus``, or None. Local mode needs no GPU scheduling (one machine: the tasks take
    the GPUs rank modulo count); a cluster does, or tasks would pile onto the same devices."""
    if device != "cuda" or master.startswith("local") and not master.startswith("local-cluster"):
        return None
    if task_gpus and float(task_gpus) > 0:
        return None
    return (f"device='cuda' but no GPU resources are configured for tasks on {master}: set "
            f"spark.executor.resource.gpu.amount=1, spark.task.resource.gpu.amount=1 and "
            f"spark.executor.resource.gpu.discoveryScript (conf/spark/gpu.conf is a template), "
            f"or use device='auto' (the CPU when no GPU is assigned)")


def _narrow_merges(df) -> bool:
    """Whether the DataFrame's physical plan unions or coalesces partitions."""
    try:
        plan = df._jdf.queryExecution().executedPlan().toString()
    except Exception:                   # Spark Connect has no JVM handle: play safe
        return True
    return any(op in plan for op in ("Union", "Coalesce"))


def fit(df, model: str | Callable[[], nn.Module], *, strategy: str = "allreduce",
        features: str = "features", label: str = "label", shape=(), label_shape=(),
        num_classes: int | None = None, loss: str | Callable = "cross_entropy",
        optimizer: str = "sgd", lr: float = 0.01, lr_decay: float = 1.0,
        momentum: float = 0.0, weight_decay: float = 0.0, max_iter: int = 3,
        epochs: int = 1, batch_size: int = 64,
        accumulate: int = 1, replicas: int | None = None, shuffle: bool = True, seed: int = 0,
        dtype: str = "float32", device: str = "auto", amp: str | None = None,
        threads: int = 0, validation: tuple | None = None, run_dir: str | Path | None = None,
        resume: bool = True, progress: bool = True, log: Callable[[str], None] | None = print,
        timeout_s: float = 300.0, transport: str = "auto", n_fetch: int = 1,
        n_push: int = 1, mode: str = "async", server_optimizer: str | None = None,
        ps_shards: int | None = None, wire_dtype: str = "float32",
        max_staleness: int | None = None, overlap: bool = False, staleness: str = "momentum",
        average: float | None = None, partitions: int | str = 1,
        model_parallel: str = "collective", data: str = "auto",
        shuffle_buffer: int | str = "256MB", transform: Callable | None = None,
        track=None) -> FitResult:
    """Train ``model`` (a name from spark_dl.models or a zero-argument factory) on ``df``.

    strategy: "allreduce" (synchronous data parallelism in a barrier stage, sample-weighted
      ring all-reduce of the gradients every step) or "downpour" (Downpour SGD: the tasks
      train asynchronously against a parameter server on the driver).
    downpour only: n_fetch / n_push (fetch parameters / push accumulated gradients every so
      many steps), mode ("async", "sync": one averaged update per step of all replicas,
      "sequential": every push its own step, fetched right after), server_optimizer ("sgd",
      "momentum", "adagrad", "adam"; default: from ``optimizer``/``momentum``), ps_shards
      (parameter blocks with their own lock and version; default 1, or 4 from a million
      parameters on: transfers of big models pipeline better), wire_dtype ("float32", "bfloat16",
      "float64"), max_staleness (a worker more than this many pushes ahead of the slowest
      waits; None: unbounded), overlap (async: a push and its reply travel while the worker
      computes the next step, on parameters that miss that push: one more step of staleness,
      no waiting for the round trip), staleness (async: how the server allows for stale
      pushes; "momentum" (default): the server's momentum is ``momentum`` lowered by the
      momentum that asynchrony adds of itself, 1 - 1/replicas, so that the single-process
      settings carry over; "lr": a push computed tau >= 2 server versions ago steps lr / tau;
      "lr+momentum": both; "none": every push a plain step), average (async: the model
      validated and returned is the server's moving average of its parameters over this
      fraction of an epoch's pushes, which damps the noise of the last asynchronous steps;
      default 0.1 with several replicas, 0 (the last values) with one, so that one worker is
      plain SGD; the workers always fetch the last values), partitions (F > 1: every
      replica's model is split by columns over F tasks, which train it together on the
      union of their micro-batches and each push and fetch their own slice: Downpour over model-parallel replicas, in a
      barrier stage of replicas x F tasks; modes async and sequential; "auto": the cost
      model's planner picks F and R for any model it splits, with the link measured by a
      probe job and the memory of a task from spark.executor.pyspark.memory), model_parallel
      (with partitions > 1: "collective", each layer's all-gather and all-reduce, any supported
      model; "thesis", the thesis's master algorithm of §3.2 for FC nets with cross-entropy:
      the master holds the batch, hypercube all-to-all of activations, δ contributions
      summed on the master).
    lr_decay: the learning rate is multiplied by it after every epoch.
    batch_size: per replica and micro-batch; ``accumulate`` micro-batches make one step, so the
      global batch is replicas x accumulate x batch_size.
    replicas: number of tasks (default: the DataFrame's partitions, at most the cluster's task
      slots); the data is repartitioned when it differs.
    device: "auto" (the GPU Spark assigned to the task, else the CPU), "cpu" or "cuda";
      amp: None, "bf16" or "fp16" autocast with float32 master weights; dtype: "float32" or
      "float64" (exactness checks).
    data: how a task holds its partition: "memory" (read into one array; a partition larger
      than the task's memory fails with a ResourceError), "stream" (spilled once to Spark's
      local directory in its storage dtype, read back per epoch through a shuffle buffer:
      memory bounded by the buffer, whatever the partition's size) or "auto" (in memory while
      the partition stays under a quarter of the task's memory headroom, else streamed).
      Both serve the same batches when the buffer holds the whole shard.
    shuffle_buffer: rows (int) or a size ("256MB") of a streamed shard's shuffle buffer: each
      epoch reads the shard in a random order of chunks, and serves the rows of each buffer-
      ful in a random order.
    transform: ``transform(x, y) -> (x_tensor, y_tensor)`` on every mini-batch's numpy rows
      (storage dtypes: uint8 for binary pixel columns), instead of the default conversion
      (uint8 -> float32 in [0, 1]); streamed shards run it in a background thread, two
      batches ahead of the step.
    validation: (x, y) numpy arrays evaluated by replica 0 after every epoch.
    transport: "auto" sums gradients through shared memory when all replicas run on one host
      (CPU), else through the process group (gloo on CPU, NCCL on GPU); "process_group"
      always uses the process group.
    run_dir: where config, metrics, history, plot and checkpoints go (default
      runs/<strategy>-<time>-<id>); a run_dir with a checkpoint is resumed when ``resume``.
    track: None, "tensorboard", "mlflow" or both in a list: the run's figures also go there
      (see spark_dl.tracking; the packages are optional: pip install 'spark_dl[tracking]').
    """
    if strategy not in STRATEGIES:
        raise ConfigError(f"unknown strategy {strategy!r}; choose one of {', '.join(STRATEGIES)}")
    if optimizer not in OPTIMIZERS:
        raise ConfigError(f"unknown optimizer {optimizer!r}; choose one of "
                          f"{', '.join(OPTIMIZERS)}")
    for name, value, low in (("epochs", epochs, 1), ("batch_size", batch_size, 1),
                             ("accumulate", accumulate, 1), ("max_iter", max_iter, 1)):
        if not isinstance(value, int) or value < low:
            raise ConfigError(f"{name} must be an integer >= {low}, got {value!r}")
    if not lr > 0:
        raise ConfigError(f"lr must be > 0, got {lr!r}")
    if not 0 < lr_decay <= 1:
        raise ConfigError(f"lr_decay (a per-epoch factor) must be in (0, 1], got {lr_decay!r}")
    if dtype not in ("float32", "float64"):
        raise ConfigError(f"dtype must be 'float32' or 'float64', got {dtype!r}")
    if amp not in (None, "bf16", "fp16"):
        raise ConfigError(f"amp must be None, 'bf16' or 'fp16', got {amp!r}")
    if amp is not None and dtype == "float64":
        raise ConfigError("amp autocasts float32 weights; use dtype='float32' with amp")
    if strategy == "downpour":
        from .parallel.ps import MODES, SERVER_OPTIMIZERS
        if mode not in MODES:
            raise ConfigError(f"unknown mode {mode!r}; choose one of {', '.join(MODES)}")
        if server_optimizer is not None and server_optimizer not in SERVER_OPTIMIZERS:
            raise ConfigError(f"unknown server_optimizer {server_optimizer!r}; choose one of "
                              f"{', '.join(SERVER_OPTIMIZERS)}")
        if server_optimizer is None and optimizer not in ("sgd", "adagrad", "adam", "rmsprop"):
            raise ConfigError(f"optimizer {optimizer!r} has no parameter-server form; use "
                              f"sgd, rmsprop, adagrad or adam (or set server_optimizer)")
        for name, value in (("n_fetch", n_fetch), ("n_push", n_push),
                            ("ps_shards", 1 if ps_shards is None else ps_shards)):
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be an integer >= 1, got {value!r}")
        if max_staleness is not None and (not isinstance(max_staleness, int)
                                          or max_staleness < 0):
            raise ConfigError(f"max_staleness must be None or an integer >= 0, got "
                              f"{max_staleness!r}")
        if wire_dtype not in ("float32", "bfloat16", "float64"):
            raise ConfigError(f"wire_dtype must be 'float32', 'bfloat16' or 'float64', got "
                              f"{wire_dtype!r}")
        if partitions != "auto" and (not isinstance(partitions, int) or partitions < 1):
            raise ConfigError(f"partitions must be an integer >= 1 or 'auto', got "
                              f"{partitions!r}")
        if partitions != 1 and (mode == "sync" or max_staleness is not None):
            raise ConfigError("partitions > 1 runs modes 'async' and 'sequential' without "
                              "max_staleness (each partition is its own parameter-server "
                              "shard, pushed by the replicas' tasks of that partition)")
        if model_parallel not in ("collective", "thesis"):
            raise ConfigError(f"model_parallel must be 'collective' or 'thesis', got "
                              f"{model_parallel!r}")
        if staleness not in STALENESS_RULES:
            raise ConfigError(f"staleness must be one of {', '.join(STALENESS_RULES)}, got "
                              f"{staleness!r}")
        if average is not None and not (isinstance(average, (int, float)) and average >= 0):
            raise ConfigError(f"average must be a number >= 0 (the fraction of an epoch's "
                              f"pushes the returned parameters average over; 0: the last "
                              f"values), got {average!r}")
        if average and mode != "async":
            raise ConfigError(f"average={average} needs mode='async' (got {mode!r}): "
                              f"{mode} rounds follow one trajectory, nothing to damp")
        if overlap and mode != "async":
            raise ConfigError(f"overlap=True needs mode='async' (got {mode!r}): sync and "
                              f"sequential rounds wait for the server by design")
        if amp is not None or accumulate != 1:
            raise ConfigError("amp and accumulate are options of the allreduce strategy; "
                              "downpour accumulates with n_push")
    from .data.stream import DATA_MODES, parse_buffer
    if data not in DATA_MODES:
        raise ConfigError(f"data must be one of {', '.join(DATA_MODES)}, got {data!r}")
    parse_buffer(shuffle_buffer)
    if transform is not None and not callable(transform):
        raise TypeError(f"transform must be a function (x, y) -> (tensor, tensor), got "
                        f"{type(transform).__name__}")
    if transport not in ("auto", "process_group"):
        raise ConfigError(f"transport must be 'auto' or 'process_group', got {transport!r}")
    if device not in ("auto", "cpu", "cuda"):
        raise ConfigError(f"device must be 'auto', 'cpu' or 'cuda', got {device!r}")
    loss_name = loss if isinstance(loss, str) else "custom"
    loss_fn = allreduce.loss_function(loss) if isinstance(loss, str) else loss
    if not callable(loss_fn):
        raise TypeError(f"loss must be a name or a callable, got {type(loss).__name__}")
    for col in (features, label):
        if col and col not in df.columns:
            raise DataError(f"column {col!r} not in the DataFrame (columns: {df.columns}); "
                            f"pass features=/label= with the right names")
    if validation is not None:
        vx, vy = (np.asarray(a) for a in validation)
        if len(vx) != len(vy):
            raise DataError(f"validation x has {len(vx)} rows but y has {len(vy)}")
        if vx.dtype.kind == "f" and not np.isfinite(vx).all():
            raise DataError("validation x holds NaN or inf; clean it before training")
        vx = vx.reshape(len(vx), *shape) if len(shape) else vx
        validation = (vx.astype(np.float64 if dtype == "float64" else np.float32), vy)
    model_fn = _model_factory(model)
    if strategy == "downpour" and model_parallel == "thesis":
        _check_thesis(model_fn, loss_name, partitions)
    tracker = Tracker(track)

    spark = df.sparkSession
    why = _gpu_request_error(spark.sparkContext.master,
                             spark.sparkContext.getConf().get("spark.task.resource.gpu.amount"),
                             device)
    if why:
        raise ConfigError(why)
    slots = _slots(spark)
    parts = df.rdd.getNumPartitions()
    if strategy != "downpour" and partitions != 1:
        raise ConfigError("partitions > 1 (model parallelism) runs with strategy='downpour'")
    if partitions == "auto":
        partitions, planned = _plan_partitions(spark, model_fn, shape, batch_size, slots, dtype,
                                               log)
        replicas = replicas or planned
    barrier = strategy == "allreduce" or partitions > 1
    if barrier and spark.conf.get("spark.dynamicAllocation.enabled", "false") == "true":
        raise ConfigError("this fit runs a barrier stage (strategy='allreduce' or partitions > "
                          "1), which Spark does not run with dynamic allocation: set "
                          "spark.dynamicAllocation.enabled=false for this application, or "
                          "use strategy='downpour' with partitions=1")
    if replicas is None:
        replicas = max(min(parts, slots) // partitions, 1)
    if not isinstance(replicas, int) or replicas < 1:
        raise ConfigError(f"replicas must be an integer >= 1, got {replicas!r}")
    if strategy == "downpour" and overlap and staleness in ("none", "lr") and replicas > 1 \
            and momentum > 0 and (server_optimizer or _server_optimizer(optimizer, momentum)) \
            == "momentum":
        raise ConfigError(f"overlap=True with staleness={staleness!r} and server momentum "
                          f"{momentum} over {replicas} replicas diverges (in 2 of 3 benchmark "
                          f"runs to chance): every push is one step more stale, and the "
                          f"server's momentum adds to the momentum the asynchrony makes; use "
                          f"staleness='momentum' (the default) or 'lr+momentum'")
    if partitions > 1 and replicas * partitions > slots:
        raise ResourceError(
            f"replicas={replicas} x partitions={partitions} = {replicas * partitions} tasks, but "
            f"the cluster runs {slots} at once; the tasks of a barrier stage start together: "
            f"lower replicas or partitions, or add executors/cores")
    if replicas > slots:
        raise ResourceError(
            f"replicas={replicas} but the cluster runs {slots} task(s) at once (default "
            f"parallelism {spark.sparkContext.defaultParallelism} / spark.task.cpus); the "
            f"replicas train together: use replicas <= {slots} or add executors/cores")
    if strategy == "downpour":
        tasks = replicas * partitions
        if parts != tasks or (partitions > 1 and _narrow_merges(df)):
            df = df.repartition(tasks)
        return _fit_downpour(
            df, model, model_fn, loss_fn,
            loss_name, replicas, validation, run_dir, progress, log, tracker,
            downpour.DownpourConfig(
                features=features, label=label, shape=tuple(shape),
                label_shape=tuple(label_shape), num_classes=num_classes, loss=loss_name,
                epochs=epochs, batch_size=batch_size, n_fetch=n_fetch,
                n_push=1 if mode == "sync" else n_push, mode=mode, shuffle=shuffle, seed=seed,
                dtype=dtype, wire_dtype=wire_dtype, device=device, threads=threads,
                timeout_s=timeout_s, overlap=bool(overlap), data=data,
                shuffle_buffer=shuffle_buffer, transform=transform, resume=resume,
                model_parallel=model_parallel),
            server_optimizer or _server_optimizer(optimizer, momentum), lr, momentum,
            ps_shards, max_staleness, lr_decay, partitions, staleness,
            _server_average(average, replicas, mode))
    if parts != replicas or _narrow_merges(df):
        # A barrier stage may not read through union()/coalesce() (Spark refuses the RDD
        # chain), so a shuffle gives it exactly ``replicas`` plain partitions.
        df = df.repartition(replicas)

    cfg = allreduce.AllReduceConfig(
        features=features, label=label, shape=tuple(shape), label_shape=tuple(label_shape),
        num_classes=num_classes, loss=loss_name, optimizer=optimizer, lr=float(lr),
        lr_decay=float(lr_decay), momentum=float(momentum), weight_decay=float(weight_decay),
        max_iter=max_iter,
        epochs=epochs, batch_size=batch_size, accumulate=accumulate, shuffle=shuffle,
        seed=seed, dtype=dtype, device=device, amp=amp, threads=threads, timeout_s=timeout_s,
        resume=resume, transport=transport, data=data, shuffle_buffer=shuffle_buffer,
        transform=transform)
    run_path = Path(run_dir).resolve() if run_dir is not None else \
        new_run_dir("runs", strategy)
    run_path.mkdir(parents=True, exist_ok=True)
    config = {"strategy": strategy, "replicas": replicas,
              "model": model if isinstance(model, str) else
              getattr(model, "__name__", repr(model)), **dataclasses.asdict(cfg)}
    write_json(run_path / "config.json", config)

    secret = secrets.token_hex(16)
    metrics = open(run_path / "metrics.jsonl", "a")
    t_start = time.perf_counter()
    live = ProgressLine(log)

    def on_message(m: dict) -> None:
        metrics.write(json.dumps(m) + "\n")
        metrics.flush()
        if m.get("type") == "step":
            tracker.step(m)
        elif m.get("type") == "epoch":
            tracker.epoch(m)
        if not progress:
            return
        if m.get("type") == "step":
            live.update(f"  epoch {m['epoch']}/{m['epochs']} step {m['step']}/{m['steps']} "
                        f"loss {m['loss']:.4f} {m['samples_per_s']:,.0f} samples/s")
        elif m.get("type") == "epoch":
            extra = "".join(f" {k} {m[k]:.4f}" for k in ("val_loss", "val_accuracy") if k in m)
            live.line(f"epoch {m['epoch']}: loss {m['loss']:.4f}{extra}, {m['samples']} "
                      f"samples, {m['samples_per_s']:,.0f} samples/s")
        elif m.get("type") == "resume":
            live.line(f"resumed from the checkpoint of epoch {m['epoch']}")

    host = spark.conf.get("spark.driver.host", "127.0.0.1")
    server = MessageServer(host, secret.encode(), on_message)
    task = allreduce.make_task(cfg, model_fn, loss_fn, secret, server.address, str(run_path),
                               validation)
    if log is not None:
        log(f"{strategy}: {replicas} replica(s), run directory {run_path}")
    tracker.start(run_path, config)
    try:
        # The shuffle after the barrier stage makes it a ShuffleMapStage, which Spark retries
        # as a whole when a task fails (a failed barrier ResultStage is never retried); the
        # retried tasks resume from the run's last checkpoint.
        rows = df.mapInArrow(task, allreduce.RESULT_SCHEMA, barrier=True) \
            .repartition(1).collect()
    except BaseException:
        tracker.close(failed=True)
        raise
    finally:
        server.close()
        metrics.close()
        live.close()
    if not rows or rows[0].error:
        tracker.close(failed=True)
    if not rows:
        raise RuntimeError("the training stage returned no result (replica 0 produced none)")
    row = rows[0]
    if row.error:
        errors = json.loads(row.error)
        kinds = {e["type"] for e in errors}
        cls = {"DataError": DataError, "ResourceError": ResourceError,
               "ConfigError": ConfigError}.get(kinds.pop(), SparkDLError) if len(kinds) == 1 \
            else SparkDLError
        raise cls("training did not start: " + "; ".join(
            f"task {e['task']}: {e['message']}" for e in errors))
    net = model_fn()
    if dtype == "float64":
        net = net.double()
    net.load_state_dict(torch.load(io.BytesIO(row.state), weights_only=True))
    history = json.loads(row.history)
    info = {**json.loads(row.info), "wall_seconds": time.perf_counter() - t_start,
            "rejected_messages": server.rejected}
    write_history(run_path / "history.csv", history)
    write_json(run_path / "info.json", info)
    plot_history(run_path / "loss.png", history, f"{strategy}, {replicas} replica(s)")
    torch.save(net.state_dict(), run_path / "model.pt")
    for h in history:                      # epochs whose live messages were lost
        tracker.epoch(h)
    tracker.close()
    return FitResult(net, history, info, run_path)


STALENESS_RULES = ("none", "lr", "momentum", "lr+momentum")


def _raise_task_error(e: Exception) -> None:
    """A spark_dl error raised in a task reaches the driver inside Spark's exception text:
    raise it again as itself (with its message), so that callers can catch ConfigError,
    DataError or ResourceError. Returns when there is none."""
    import re
    m = re.search(r"spark_dl\.errors\.(ConfigError|DataError|ResourceError): ([^\n]*)", str(e))
    if m:
        cls = {"ConfigError": ConfigError, "DataError": DataError,
               "ResourceError": ResourceError}[m.group(1)]
        raise cls(m.group(2)) from e


def _plan_partitions(spark, model_fn, shape, batch_size, slots, dtype, log) -> tuple[int, int]:
    """partitions="auto": F and R from cost_model.plan (a step of the model priced on the meta
    device, inputs of ``shape``, or the first layer's width for flat features), with the link
    probed on the cluster."""
    from .parallel import cost_model
    with torch.device("meta"):
        shape = tuple(shape) or cost_model.flat_input_shape(model_fn())
    if not shape:
        raise ConfigError("partitions='auto' prices a step of the model on inputs of its shape, "
                          "which its first layer does not give: pass shape= (one sample's, "
                          "e.g. shape=(1, 28, 28))")
    try:                       # a model it cannot run or split fails here, before the probe
        cost_model.step_cost(model_fn, shape, 1, batch_size, getattr(torch, dtype))
    except (ValueError, RuntimeError) as e:
        raise ConfigError(f"partitions='auto' cannot price this model on inputs of shape "
                          f"{shape}: {e}") from e
    if slots >= 2:
        link, flops = cost_model.probe_cluster(spark, with_flops=True)
    else:
        link, flops = cost_model.Link(0.0, 0.0), cost_model.probe_flops()
    memory = _task_memory(spark)
    plan = cost_model.plan(model_fn, batch_size, cost_model.Cluster(slots, memory, link, flops),
                           itemsize=8 if dtype == "float64" else 4, input_shape=shape)
    if log is not None:
        log(f"partitions='auto': {plan.explanation} (link: {link.t_lat * 1e6:.0f} us per "
            f"message, {link.t_data * 1e9:.2f} ns per byte)")
    return plan.partitions, plan.replicas


def _task_memory(spark) -> int:
    """Bytes a task's Python worker may use: spark.executor.pyspark.memory over the executor's
    cores (unset: no limit)."""
    value = spark.conf.get("spark.executor.pyspark.memory", None)
    if not value:
        return 1 << 62
    import re
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgtp]?)(b?)\s*", value.lower())
    if not m:
        raise ConfigError(f"spark.executor.pyspark.memory={value!r} is not a size such as "
                          f"'2g' or '512m'")
    number, unit, b = m.groups()
    scale = {"": 1 if b else 1 << 20, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30,
             "t": 1 << 40, "p": 1 << 50}[unit]
    size = int(float(number) * scale)
    cores = int(spark.conf.get("spark.executor.cores", "1") or 1)
    return size // max(cores, 1)


class _Layout:
    """How the parameter server lays out a model's parameters: the flat parameter vector, or
    with F partitions, partition 0's slices, then partition 1's, ... (shard p = partition p)."""

    def __init__(self, net: torch.nn.Module, partitions: int):
        from .parallel.model_parallel import Comm, partition_model
        self.net, self.F = net, partitions
        self.parts = [partition_model(net, Comm.layout(p, partitions))
                      for p in range(partitions)] if partitions > 1 else [net]
        sizes = [sum(q.numel() for q in part.parameters() if q.requires_grad)
                 for part in self.parts]
        self.bounds = [sum(sizes[:i]) for i in range(len(sizes) + 1)] if partitions > 1 \
            else None

    def describe(self) -> dict:
        """For info.json: the partitions' sizes and the layers kept whole (too narrow to split:
        partition 0 trains them, the others receive its values every forward pass)."""
        from .parallel.model_parallel import kept_whole
        return {"partitions": self.F, "parameters_per_partition":
                [b - a for a, b in zip(self.bounds[:-1], self.bounds[1:])],
                "kept_whole": kept_whole(self.parts[0])}

    def flatten(self) -> torch.Tensor:
        return torch.cat([torch.nn.utils.parameters_to_vector(
            [q for q in part.parameters() if q.requires_grad]).detach() for part in self.parts])

    def load(self, flat: torch.Tensor) -> None:
        """The server's flat vector into ``net`` (merging the partitions' slices)."""
        if self.F == 1:
            torch.nn.utils.vector_to_parameters(
                flat, [q for q in self.net.parameters() if q.requires_grad])
            return
        from .parallel.model_parallel import merge_partitions
        for part, a, b in zip(self.parts, self.bounds[:-1], self.bounds[1:]):
            torch.nn.utils.vector_to_parameters(
                flat[a:b], [q for q in part.parameters() if q.requires_grad])
        self.net.load_state_dict(merge_partitions(self.net, self.parts))


def _check_thesis(model_fn, loss_name: str, partitions) -> None:
    """model_parallel='thesis' runs FC nets with softmax cross-entropy, every layer split."""
    if partitions == 1:
        raise ConfigError("model_parallel='thesis' is how partitions > 1 split the model; "
                          "give partitions=F (or leave model_parallel alone)")
    from .parallel import cost_model
    from .parallel.model_parallel import fc_activation
    with torch.device("meta"):
        net = model_fn()
    sizes = cost_model.fc_sizes(net)
    if sizes is None:
        raise ConfigError("model_parallel='thesis' runs FC nets (a chain of Linear layers); "
                          "use model_parallel='collective' for this model")
    try:
        fc_activation(net)
    except ValueError as e:
        raise ConfigError(f"model_parallel='thesis': {e}") from None
    if loss_name != "cross_entropy":
        raise ConfigError(f"model_parallel='thesis' trains with softmax cross-entropy, not "
                          f"{loss_name!r}")
    if isinstance(partitions, int) and min(sizes[1:]) < partitions:
        raise ConfigError(f"model_parallel='thesis' splits every layer: a layer of "
                          f"{min(sizes[1:])} units cannot go over partitions={partitions}")


def _completed_epochs(history: list[dict]) -> int:
    """The epochs 1..k all in the history (a lost message can leave a gap)."""
    done = {h["epoch"] for h in history}
    k = 0
    while k + 1 in done:
        k += 1
    return k


def _server_average(average: float | None, replicas: int, mode: str) -> float:
    """The server's averaging span in epochs: ``average``, or by default 0.1 for asynchronous
    replicas (measured best of 0.05 and 0.1 against the last values in bench_downpour) and 0
    otherwise."""
    if average is not None:
        return float(average)
    return 0.1 if mode == "async" and replicas > 1 else 0.0


def _server_momentum(momentum: float, replicas: int, mode: str, staleness: str) -> float:
    """The server's momentum: ``momentum``, or (rule "momentum", async) lowered by the
    momentum that asynchrony adds of itself, 1 - 1/replicas (Mitliagkas et al., 2016:
    asynchronous SGD on R workers behaves in expectation as momentum SGD with
    mu = 1 - 1/R), not below 0."""
    if mode != "async" or "momentum" not in staleness.split("+"):
        return momentum
    return max(0.0, momentum - (1.0 - 1.0 / max(replicas, 1)))


def _checkpoint_downpour(path: Path, ps, history: list[dict], replicas: int,
                         partitions: int) -> None:
    """The server after an epoch every replica finished, written atomically (the previous
    checkpoint stays until the new one is complete): its values, optimizer states, versions
    and steps, and the history so far. The driver writes it; fit(run_dir=...) resumes it."""
    from .parallel.allreduce import _save
    epoch = _completed_epochs(history)
    _save(path, {"strategy": "downpour", "epoch": epoch, "replicas": replicas,
                 "partitions": partitions, "server": ps.state_dict(),
                 "history": [h for h in history if h["epoch"] <= epoch]})


def _resume_downpour(path: Path, ps, replicas: int, partitions: int, log) -> dict | None:
    """Load a Downpour checkpoint of ``run_dir`` into the fresh server; None without one."""
    if not path.exists():
        return None
    ckpt = torch.load(path, map_location="cpu", weights_only=True)
    if ckpt.get("strategy") != "downpour":
        raise ConfigError(f"{path} is a checkpoint of strategy {ckpt.get('strategy', 'allreduce')!r}"
                          f", not of this downpour fit: give a new run_dir, or resume=False to "
                          f"start over in this one")
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


def _fit_downpour(df, model, model_fn, loss_fn, loss_name, replicas, validation, run_dir,
                  progress, log, tracker, cfg, server_optimizer, lr, momentum, ps_shards,
                  max_staleness, lr_decay, partitions=1, staleness="none",
                  average=0.0) -> FitResult:
    """Downpour SGD: a parameter server here, workers as Spark tasks (see parallel/ps.py)."""
    from .parallel.ps import ParameterServer
    spark = df.sparkSession
    run_path = Path(run_dir).resolve() if run_dir is not None else \
        new_run_dir("runs", "downpour")
    run_path.mkdir(parents=True, exist_ok=True)
    server_momentum = _server_momentum(momentum, replicas, cfg.mode, staleness)
    config = {"strategy": "downpour", "replicas": replicas,
              "server_optimizer": server_optimizer, "lr": lr, "lr_decay": lr_decay,
              "partitions": partitions, "momentum": momentum, "staleness": staleness,
              "average": average,
              "server_momentum": server_momentum, "ps_shards": ps_shards or "auto",
              "model": model if isinstance(model, str) else
              getattr(model, "__name__", repr(model)), **dataclasses.asdict(cfg)}
    write_json(run_path / "config.json", config)
    dtype = torch.float64 if cfg.dtype == "float64" else torch.float32
    torch.manual_seed(cfg.seed)
    net = model_fn().to(dtype)
    params = [p for p in net.parameters() if p.requires_grad]
    numel = sum(p.numel() for p in params)
    ps_shards = ps_shards or (4 if numel >= 1_000_000 else 1)
    secret = secrets.token_bytes(32)
    host = spark.conf.get("spark.driver.host", "127.0.0.1")
    layout = _Layout(net, partitions)
    if partitions > 1:
        ps_shards = partitions                    # shard p: partition p's slices
    ps = ParameterServer(layout.flatten(), secret, host, bounds=layout.bounds,
                         shards=ps_shards, optimizer=server_optimizer, lr=lr,
                         momentum=server_momentum, mode=cfg.mode,
                         workers=replicas * partitions, max_staleness=max_staleness,
                         timeout_s=cfg.timeout_s, lr_decay=lr_decay,
                         staleness_lr=cfg.mode == "async" and "lr" in staleness.split("+"),
                         average=average)
    val = None
    if validation is not None:
        val = (torch.as_tensor(validation[0], dtype=dtype), torch.as_tensor(validation[1]))
    epochs_done: dict[int, dict[int, dict]] = {}       # epoch -> worker -> its report
    history: list[dict] = []
    ckpt_path = run_path / "checkpoint.pt"
    resumed = _resume_downpour(ckpt_path, ps, replicas, partitions, log) if cfg.resume else None
    if resumed is not None:
        history = resumed["history"]
    metrics = open(run_path / "metrics.jsonl", "a")
    t_start = time.perf_counter()
    live = ProgressLine(log)

    def evaluate_server(epoch: int, rows: list[dict]) -> dict:
        """One history row when every worker has finished ``epoch``: the server's model."""
        n = sum(r["samples"] for r in rows)
        row = {"epoch": epoch, "loss": sum(r["loss"] * r["samples"] for r in rows) / max(n, 1),
               "samples": n, "seconds": max(r["seconds"] for r in rows),
               "since_start_s": time.perf_counter() - t_start,
               "samples_per_s": sum(r["samples_per_s"] for r in rows),
               "server_versions": ps.versions,
               "grad_mean_abs": ps.take_gradient_mean_abs()}
        if val is not None:
            layout.load(ps.parameters().to(dtype))
            row.update(allreduce._evaluate(net, val, loss_fn, loss_name == "cross_entropy"))
        return row

    def on_message(m: dict) -> None:
        metrics.write(json.dumps(m) + "\n")
        metrics.flush()
        if m.get("type") == "epoch":
            # a retried task goes on mid-epoch and reports that epoch again (its part of it):
            # the first report of each worker counts
            rows = epochs_done.setdefault(m["epoch"], {})
            if m["worker"] in rows:
                return
            rows[m["worker"]] = m
            if len(rows) == replicas:
                row = evaluate_server(m["epoch"], list(rows.values()))
                history.append(row)
                tracker.epoch(row)
                metrics.write(json.dumps({"type": "server_epoch", **row}) + "\n")
                _checkpoint_downpour(ckpt_path, ps, history, replicas, partitions)
                if progress:
                    extra = "".join(f" {k} {row[k]:.4f}" for k in ("val_loss", "val_accuracy")
                                    if k in row)
                    live.line(f"epoch {row['epoch']}: loss {row['loss']:.4f}{extra}, "
                              f"{row['samples']} samples, {row['samples_per_s']:,.0f} "
                              f"samples/s, server version {sum(row['server_versions'])}")
        elif m.get("type") == "step" and m["worker"] == 0:
            tracker.step(m)
            if progress:
                live.update(f"  epoch {m['epoch']}/{m['epochs']} step {m['step']}/{m['steps']} "
                            f"loss {m['loss']:.4f} {m['samples_per_s']:,.0f} samples/s, mean "
                            f"staleness {m.get('staleness', 0.0):.2f} (worker 0)")

    channel = MessageServer(host, secret, on_message)
    task = downpour.make_task(cfg, model_fn, loss_fn, secret, ps.address, channel.address,
                              str(run_path), partitions)
    described = layout.describe() if partitions > 1 else None
    if log is not None and described and described["kept_whole"]:
        log(f"partitions={partitions}: layers {', '.join(described['kept_whole'])} are "
            f"narrower than {partitions} units and kept whole (trained by partition 0)")
    if log is not None:
        log(f"downpour ({cfg.mode}, n_fetch={cfg.n_fetch}, n_push={cfg.n_push}): {replicas} "
            f"worker(s), parameter server {ps.address[0]}:{ps.address[1]} "
            f"({ps_shards} shard(s), {server_optimizer}), run directory {run_path}")
    tracker.start(run_path, config)
    try:
        try:
            if partitions == 1:
                rows = df.mapInArrow(task, downpour.RESULT_SCHEMA).collect()
            else:          # a barrier stage (process groups); the shuffle after it lets Spark
                rows = df.mapInArrow(task, downpour.RESULT_SCHEMA, barrier=True) \
                    .repartition(1).collect()   # retry it as a whole
        except BaseException as e:
            tracker.close(failed=True)
            if isinstance(e, Exception):
                _raise_task_error(e)
            raise

        deadline = time.monotonic() + 2.0        # let the last epoch messages arrive
        while time.monotonic() < deadline and \
                sum(len(v) for v in epochs_done.values()) < replicas * cfg.epochs:
            time.sleep(0.01)
    finally:
        channel.close()
        ps.close()
        live.close()
    tasks = sorted((json.loads(r.report) for r in rows), key=lambda r: r.get("task", r["worker"]))
    reports = [r for r in tasks if r.get("partition", 0) == 0]     # one per replica
    # epochs whose messages were lost (the driver channel is best effort): from the reports,
    # and from the messages that did arrive; a task Spark retried went on past the epochs its
    # earlier attempt finished, so its report has no row for them: they are not waited for
    for e in range(1, cfg.epochs + 1):
        if e not in {h["epoch"] for h in history}:
            got = dict(epochs_done.get(e, {}))
            for r in reports:
                got.update({r["worker"]: h for h in r["history"] if h["epoch"] == e})
            skipped = {r["worker"] for r in reports
                       if r.get("resumed_at") and r["resumed_at"]["epoch"] > e}
            if got and len(got.keys() | skipped) == replicas:
                row = evaluate_server(e, list(got.values()))
                history.append(row)
                tracker.epoch(row)
                metrics.write(json.dumps({"type": "server_epoch", **row}) + "\n")
    metrics.close()
    layout.load(ps.parameters().to(dtype))
    stale: Counter = Counter()
    for r in tasks:
        stale.update({int(k): v for k, v in r["staleness"].items()})
    info = {"world": replicas, "mode": cfg.mode, "n_fetch": cfg.n_fetch, "n_push": cfg.n_push,
            "staleness": staleness, "server_momentum": server_momentum, "average": average,
            "server": ps.stats(), "staleness_histogram": dict(sorted(stale.items())),
            "rows_per_replica": [sum(t["rows"] for t in tasks if t["worker"] == r["worker"])
                                 for r in reports],
            "devices": [r["device"] for r in reports], "workers": tasks,
            "partitions": partitions,
            "total_rows": sum(t["rows"] for t in tasks),
            "train_seconds": max((t["task_seconds"] for t in tasks), default=0.0),
            "wall_seconds": time.perf_counter() - t_start,
            "rejected_messages": channel.rejected}
    if partitions > 1:
        info["model_parallel"] = {**described, "algorithm": cfg.model_parallel}
    info["resumed_from_epoch"] = resumed["epoch"] if resumed is not None else None
    history.sort(key=lambda h: h["epoch"])
    write_history(run_path / "history.csv", history)
    write_json(run_path / "info.json", info)
    plot_history(run_path / "loss.png", history, f"downpour {cfg.mode}, {replicas} worker(s)")
    torch.save(net.state_dict(), run_path / "model.pt")
    tracker.close()
    return FitResult(net, history, info, run_path)
