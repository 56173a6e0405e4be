"""Classic sessions and Spark Connect sessions alike.

A Spark Connect client (``SparkSession.builder.remote(...)``, the ``pyspark-client`` package)
has no JVM and no SparkContext: ``spark.sparkContext``, ``df.rdd`` and ``_jdf`` raise
``JVM_ATTRIBUTE_NOT_SUPPORTED``. What spark_dl asks of a session goes through here, with an
answer for both kinds.
"""

from __future__ import annotations

import re

__all__ = ["broadcast", "default_parallelism", "gpu_request_error", "is_connect", "master",
           "num_partitions", "task_slots"]


def is_connect(spark) -> bool:
    """Whether ``spark`` is a Spark Connect session."""
    return type(spark).__module__.startswith("pyspark.sql.connect")


def master(spark) -> str:
    """The cluster's master URL ("local[2]", "spark://...", "yarn", ...; "" if unknown)."""
    if not is_connect(spark):
        return spark.sparkContext.master
    return spark.conf.get("spark.master", "") or ""


def default_parallelism(spark) -> int:
    """The cluster's default parallelism (task slots when one task takes one core)."""
    if not is_connect(spark):
        return spark.sparkContext.defaultParallelism
    given = spark.conf.get("spark.default.parallelism", None)
    if given:
        return int(given)
    m = re.fullmatch(r"local\[(\d+|\*)(?:,\d+)?\]", master(spark))
    if m and m.group(1) != "*":
        return int(m.group(1))
    m = re.fullmatch(r"local-cluster\[(\d+),\s*(\d+),\s*\d+\]", master(spark))
    if m:
        return int(m.group(1)) * int(m.group(2))
    # Elsewhere: a range without numPartitions gets the default parallelism (a tiny job)
    from pyspark.sql import functions as F
    return spark.range(0, 1 << 16).select(F.spark_partition_id().alias("p")).distinct().count()


def task_slots(spark) -> int:
    """Tasks the application runs at once: its default parallelism over spark.task.cpus."""
    task_cpus = int(spark.conf.get("spark.task.cpus", "1") or 1)
    return max(1, default_parallelism(spark) // task_cpus)


def gpu_request_error(where: str, task_gpus: str | None, device: str) -> str | None:
    """Why ``device`` cannot be honoured on master ``where`` with
    ``spark.task.resource.gpu.amount`` = ``task_gpus``, or None. Local mode needs no GPU
    scheduling (one machine: the tasks take the GPUs rank modulo count); a cluster does, or
    tasks would pile onto the same devices."""
    if device != "cuda" or (where.startswith("local") and not where.startswith("local-cluster")):
        return None
    if task_gpus and float(task_gpus) > 0:
        return None
    return (f"device='cuda' but no GPU resources are configured for tasks on {where}: set "
            f"spark.executor.resource.gpu.amount=1, spark.task.resource.gpu.amount=1 and "
            f"spark.executor.resource.gpu.discoveryScript (conf/spark/gpu.conf is a template), "
            f"or use device='auto' (the CPU when no GPU is assigned)")


def num_partitions(df) -> int | None:
    """The DataFrame's partition count; None under Spark Connect (knowing it would compute
    the DataFrame): the caller repartitions."""
    if is_connect(df.sparkSession):
        return None
    return df.rdd.getNumPartitions()


class _Held:
    """A value the tasks' closure carries itself (Spark Connect has no broadcast variables)."""

    def __init__(self, value):
        self.value = value


def broadcast(spark, value):
    """``value`` for the tasks, read as ``.value``: a broadcast variable (once per executor)
    on a classic session; under Spark Connect, carried in the function that reads it."""
    if is_connect(spark):
        return _Held(value)
    return spark.sparkContext.broadcast(value)
