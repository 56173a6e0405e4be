"""Classic sessions and Spark Connect sessions alike, on pyspark 3.5 and 4.x.

A Spark Connect client (``SparkSession.builder.remote(...)``, the ``pyspark-client`` package)
has no JVM and no SparkContext: ``spark.sparkContext``, ``df.rdd`` and ``_jdf`` raise
``JVM_ATTRIBUTE_NOT_SUPPORTED``. What spark_dl asks of a session goes through here, with an
answer for both kinds.

pyspark 3.5 lacks a few APIs that 4.0 added: ``DataFrame.toArrow``, ``createDataFrame`` from
a ``pyarrow.Table`` and Spark ML persistence given a session instead of a SparkContext.
``to_arrow``, ``create_from_arrow`` and ``ml_context`` answer on both lines (4.x calls the
public API); ``require_spark`` refuses what needs a newer Spark, naming it.
"""

from __future__ import annotations

import re

import pyspark

from .errors import SparkDLError

__all__ = ["SPARK_VERSION", "broadcast", "create_from_arrow", "default_parallelism",
           "gpu_request_error", "is_connect", "master", "ml_context", "num_partitions",
           "require_spark", "task_slots", "to_arrow"]


def _version(text: str) -> tuple[int, int, int]:
    m = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", text)
    if m is None:
        raise SparkDLError(f"cannot read the pyspark version {text!r}")
    return int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)


SPARK_VERSION: tuple[int, int, int] = _version(pyspark.__version__)
"""The installed pyspark's (major, minor, patch), e.g. (3, 5, 7) or (4, 0, 1)."""


def require_spark(what: str, version: tuple[int, int] = (4, 0)) -> None:
    """Raise SparkDLError unless the installed pyspark is at least ``version``: ``what``
    (e.g. "saving a TorchModel from a Spark Connect session") needs it."""
    if SPARK_VERSION[:2] < tuple(version):
        raise SparkDLError(f"{what} needs Spark {version[0]}.{version[1]} or newer; this is "
                           f"pyspark {pyspark.__version__}")


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


def to_arrow(df):
    """``df`` collected to the driver as one ``pyarrow.Table`` (``df.toArrow()`` on 4.x)."""
    if SPARK_VERSION >= (4, 0, 0):
        return df.toArrow()
    import pyarrow as pa
    if is_connect(df.sparkSession):                 # pyspark 3.5's Connect client
        client = df.sparkSession.client
        table, _ = client.to_table(df._plan.to_proto(client))
        return table
    from pyspark.sql.pandas.types import to_arrow_schema
    schema = to_arrow_schema(df.schema)
    batches = df._collect_as_arrow()
    if not batches:
        return schema.empty_table()
    return pa.Table.from_batches(batches).cast(schema)


def create_from_arrow(spark, table):
    """A DataFrame of the ``pyarrow.Table`` ``table``, its schema read from the table's
    (``spark.createDataFrame(table)`` on 4.x)."""
    if SPARK_VERSION >= (4, 0, 0):
        return spark.createDataFrame(table)
    from pyspark.sql.pandas.types import from_arrow_schema
    schema = from_arrow_schema(table.schema)
    if is_connect(spark):                           # pyspark 3.5's Connect client
        return spark.createDataFrame(table.to_pandas(), schema=schema)
    # pyspark 3.5's classic session: what 4.x's createDataFrame(pyarrow.Table) does, one
    # Arrow batch per partition handed to the JVM, no pandas in between
    from pyspark.sql import DataFrame
    from pyspark.sql.pandas.serializers import ArrowStreamSerializer
    from pyspark.sql.pandas.types import to_arrow_schema
    table = table.cast(to_arrow_schema(schema))
    step = spark._jconf.arrowMaxRecordsPerBatch()
    batches = table.to_batches(max_chunksize=step if step > 0 else None)
    jvm = spark._jvm
    jiter = spark._sc._serialize_to_jvm(
        batches, ArrowStreamSerializer(), jvm.PythonSQLUtils.readArrowStreamFromFile,
        jvm.ArrowIteratorServer)
    df = DataFrame(jvm.PythonSQLUtils.toDataFrame(jiter, schema.json(), spark._jsparkSession),
                   spark)
    df._schema = schema
    return df


def ml_context(spark):
    """What Spark ML's ``DefaultParamsWriter.saveMetadata``/``DefaultParamsReader.
    loadMetadata`` take: the session on 4.x (a Connect session too), its SparkContext on
    3.5, which has no Connect path for them."""
    if SPARK_VERSION >= (4, 0, 0):
        return spark
    if is_connect(spark):
        require_spark("saving or loading a spark_dl.ml model from a Spark Connect session")
    return spark.sparkContext
