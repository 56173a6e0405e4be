"""What every training task of a fit needs to know, whatever the engine (plain values only:
the configs travel to the executors in the task closure)."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import Callable

__all__ = ["StageConfig", "peak_memory_mb", "read_shard", "write_task_info"]


@dataclasses.dataclass(frozen=True)
class StageConfig:
    """The data, the loop and the task's resources (see ``spark_dl.fit`` for their meaning)."""

    features: str = "features"
    label: str = "label"
    shape: tuple = ()
    label_shape: tuple = ()
    num_classes: int | None = None
    loss: str = "cross_entropy"
    epochs: int = 1
    batch_size: int = 64
    shuffle: bool = True
    seed: int = 0
    dtype: str = "float32"
    device: str = "auto"
    threads: int = 0
    timeout_s: float = 300.0
    progress_every_s: float = 2.0
    data: str = "auto"                 # "memory", "stream" (spilled to local disk) or "auto"
    shuffle_buffer: int | str = "256MB"  # a streamed shard's shuffle buffer: rows or a size
    transform: Callable | None = None  # (x, y) numpy rows of a batch -> tensors


def read_shard(cfg: StageConfig, batches, where: str):
    """Runs in a task: its partition's record batches -> a ShardData or StreamShard (see
    spark_dl.data.stream.open_shard); the caller closes it when the task ends."""
    from spark_dl.data.stream import open_shard
    return open_shard(batches, cfg.features, cfg.label, cfg.shape, cfg.label_shape,
                      cfg.num_classes, where, cfg.data, cfg.shuffle_buffer)


def peak_memory_mb() -> dict:
    """This Python worker's peak resident memory and peak address space (what
    spark.executor.pyspark.memory caps) so far, in MiB: over its whole life, as Spark reuses
    workers across tasks."""
    import resource

    from ..data.stream import proc_status_kib
    out = {"peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    vm_peak = proc_status_kib("VmPeak")
    if vm_peak is not None:
        out["peak_vm_mb"] = vm_peak / 1024
    return out


def write_task_info(run_dir: str, name: str, info: dict) -> None:
    """run_dir/workers/<name>.json: where this task runs, for operators: ``info`` plus the host,
    the process, the Python interpreter and where spark_dl was imported from (the shipped
    environment and --py-files archive on a cluster). Best effort: the run directory is the
    driver's and may not be reachable from this executor."""
    import torch

    import spark_dl
    facts = {"host": os.uname().nodename, "pid": os.getpid(), "python": sys.executable,
             "spark_dl": os.path.abspath(os.path.dirname(spark_dl.__file__)),
             "torch": os.path.abspath(os.path.dirname(torch.__file__)), **info}
    try:
        d = Path(run_dir) / "workers"
        d.mkdir(parents=True, exist_ok=True)
        tmp = d / f".{name}.json.tmp-{os.getpid()}"
        tmp.write_text(json.dumps(facts))
        os.replace(tmp, d / f"{name}.json")
    except OSError:
        pass
