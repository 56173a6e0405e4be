"""A training stage's own resources: ``fit(..., resources={"cpus": C, "gpus": G})``.

The training stage (fit's, ``spark_dl.run``'s, TorchEstimator's) runs with a stage-level task
resource profile (``pyspark.resource``: task requests only, so the tasks run on the executors the
application has): each of its tasks gets C cores and G GPUs, while every other stage of the
application keeps its ``spark.task.cpus`` and ``spark.task.resource.gpu.amount``. An application
sized for its ETL (one core and no GPU, or a fraction of one, per task) trains at one GPU and
several cores per task. A key left out keeps the application's amount; ``"gpus": 0`` gives the
stage's tasks no GPU.

Spark schedules such a profile on standalone (and ``local-cluster``), YARN and Kubernetes
clusters with dynamic allocation off, from Spark 3.5; elsewhere (local mode, dynamic
allocation, an older Spark) ``resources=`` is a ConfigError that says what to do instead.
"""

from __future__ import annotations

import inspect
import math
import re

from .compat import default_parallelism, is_connect, master
from .errors import ConfigError, ResourceError

__all__ = ["KEYS", "check_resources", "map_in_arrow", "profile_slots", "stage_profile"]

KEYS = ("cpus", "gpus")
_SPARK = (3, 5)          # the first Spark with task profiles on standalone, YARN and Kubernetes


def check_resources(value) -> None:
    """None, or a dict of ``cpus`` (an integer >= 1) and/or ``gpus`` (a number >= 0: a
    fraction below 1, or a whole number); else a ConfigError naming what is wrong."""
    if value is None:
        return
    if not isinstance(value, dict) or not value:
        raise ConfigError(f"resources must be None or a dict such as {{'cpus': 4, 'gpus': 1}} "
                          f"(the training stage's cores and GPUs per task), got {value!r}")
    unknown = sorted(set(value) - set(KEYS))
    if unknown:
        raise ConfigError(f"resources has no key {', '.join(map(repr, unknown))}; its keys: "
                          f"'cpus' (cores per task) and 'gpus' (GPUs per task), got {value!r}")
    cpus, gpus = value.get("cpus", 1), value.get("gpus", 0)
    if not isinstance(cpus, int) or isinstance(cpus, bool) or cpus < 1:
        raise ConfigError(f"resources['cpus'] must be an integer >= 1 (cores per task), got "
                          f"{cpus!r}")
    if not isinstance(gpus, (int, float)) or isinstance(gpus, bool) or not math.isfinite(gpus) \
            or gpus < 0 or (gpus > 1 and gpus != int(gpus)):
        raise ConfigError(f"resources['gpus'] must be a number >= 0 (GPUs per task: a fraction "
                          f"below 1 shares a GPU, above 1 a whole number), got {gpus!r}")


def _version(spark) -> tuple[int, int]:
    m = re.match(r"(\d+)\.(\d+)", spark.version)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


def task_amounts(spark, resources: dict) -> tuple[int, float]:
    """(cores, GPUs) per task of the training stage: ``resources``' or the application's."""
    cpus = resources.get("cpus", int(spark.conf.get("spark.task.cpus", "1") or 1))
    gpus = resources.get("gpus", float(spark.conf.get("spark.task.resource.gpu.amount", None)
                                       or 0))
    return cpus, float(gpus)


def stage_profile(spark, resources: dict | None):
    """The task ResourceProfile for ``resources`` (None for None), or a ConfigError where
    Spark cannot schedule one for this session."""
    if resources is None:
        return None
    check_resources(resources)
    where = master(spark)
    asked = f"resources={resources!r}"
    if where.startswith("local") and not where.startswith("local-cluster"):
        raise ConfigError(
            f"{asked} asks for a stage-level resource profile, which Spark does not schedule "
            f"in local mode (master {where!r}: one executor whose slots are the master's "
            f"threads): leave resources=None and size the session instead (threads= sets a "
            f"task's torch threads; spark.task.cpus its cores), or run on a standalone "
            f"(local-cluster[N,C,M] on one machine), YARN or Kubernetes cluster")
    if where and not where.startswith(("local-cluster", "spark://", "yarn", "k8s://")):
        raise ConfigError(f"{asked}: Spark schedules stage-level task profiles on standalone, "
                          f"YARN and Kubernetes clusters, not on master {where!r}: leave "
                          f"resources=None and size the application's spark.task.cpus and "
                          f"spark.task.resource.gpu.amount for training")
    if _version(spark) < _SPARK:
        raise ConfigError(f"{asked} needs Spark {_SPARK[0]}.{_SPARK[1]} or later (task "
                          f"profiles on standalone, YARN and Kubernetes); this session runs "
                          f"Spark {spark.version}: leave resources=None and size the "
                          f"application's spark.task.cpus and spark.task.resource.gpu.amount "
                          f"for training, or upgrade Spark")
    if spark.conf.get("spark.dynamicAllocation.enabled", "false") == "true":
        raise ConfigError(f"{asked} runs the training stage on the executors the application "
                          f"has (a task profile), which Spark allows with dynamic allocation "
                          f"off: set spark.dynamicAllocation.enabled=false, or leave "
                          f"resources=None")
    if is_connect(spark) and not _takes_profile(type(spark.range(0))):
        raise ConfigError(f"{asked} under Spark Connect needs pyspark 4.0 or later (a "
                          f"profile for mapInArrow); leave resources=None, or use a classic "
                          f"session")
    from pyspark.resource import ResourceProfileBuilder, TaskResourceRequests
    cpus, gpus = task_amounts(spark, resources)
    requests = TaskResourceRequests().cpus(cpus)
    if gpus > 0:
        requests = requests.resource("gpu", gpus)
    return ResourceProfileBuilder().require(requests).build


def profile_slots(spark, profile, resources: dict) -> int:
    """Tasks of ``profile`` the executors run at once (Spark's own count on a classic
    session; under Spark Connect the default parallelism over the cores per task); a
    ResourceError when no executor can run one."""
    cpus, gpus = task_amounts(spark, resources)
    if not is_connect(spark):
        sc, jrp = spark.sparkContext._jsc.sc(), profile._java_resource_profile
        try:        # registered as the stage will register it (Spark's own checks with it)
            sc.resourceProfileManager().addResourceProfile(jrp)
        except Exception as e:
            raise ConfigError(f"resources={resources!r}: Spark refuses the stage's task "
                              f"profile: {str(e).splitlines()[0][:400]}") from None
        slots = int(sc.maxNumConcurrentTasks(jrp))
    else:
        slots = default_parallelism(spark) // cpus
    if slots < 1:
        has = spark.conf.get("spark.executor.cores", None) or "the default number of"
        gpu = f" and {gpus:g} GPU(s)" if gpus else ""
        has_gpu = f", {spark.conf.get('spark.executor.resource.gpu.amount', '0')} GPU(s)" \
            if gpus else ""
        raise ResourceError(
            f"resources={resources!r}: no executor of this application can run a training "
            f"task of {cpus} core(s){gpu} (executors of {has} cores{has_gpu}): ask for what "
            f"an executor has, or start the application with larger executors")
    return slots


def _takes_profile(frame_class) -> bool:
    """Whether this pyspark's DataFrame.mapInArrow takes a ResourceProfile (4.0+)."""
    return "profile" in inspect.signature(frame_class.mapInArrow).parameters


def map_in_arrow(df, task, schema: str, barrier: bool, profile):
    """``df.mapInArrow(task, schema, barrier=barrier)`` run with ``profile`` (None: the
    application's): through mapInArrow's ``profile=`` where pyspark has it (4.0+), else
    through the RDD (``.rdd.withResources``: rows, which the callers repartition and collect
    alike)."""
    if profile is None:
        return df.mapInArrow(task, schema, barrier=barrier)
    if _takes_profile(type(df)):
        return df.mapInArrow(task, schema, barrier=barrier, profile=profile)
    return df.mapInArrow(task, schema, barrier=barrier).rdd.withResources(profile)
