"""The task's memory: what a Python worker may still allocate under its cap
(spark.executor.pyspark.memory), what it used at its peak, and the error that names the fix
when a partition does not fit."""

from __future__ import annotations

import os
import resource

import pyarrow as pa

from ..errors import ResourceError

__all__ = ["address_headroom", "is_memory_error", "memory_error", "memory_headroom",
           "proc_status_kib"]


def address_headroom() -> int | None:
    """Bytes this process may still map under its address-space limit (Spark sets it from
    spark.executor.pyspark.memory), or None without a limit."""
    limit = resource.getrlimit(resource.RLIMIT_AS)[0]
    if limit in (resource.RLIM_INFINITY, -1):
        return None
    return max(limit - (proc_status_kib("VmSize") or 0) * 1024, 0)


def proc_status_kib(field: str) -> int | None:
    """A kB field of /proc/self/status (VmSize, VmPeak, ...), or None where there is none."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))
    except (OSError, StopIteration):
        return None


def memory_headroom() -> int:
    """Bytes this process may still allocate: its address-space headroom under the limit, or
    the machine's available memory over its cores (the tasks running beside this one)."""
    room = address_headroom()
    if room is not None:
        return room
    try:
        with open("/proc/meminfo") as f:
            avail = next(int(line.split()[1]) << 10 for line in f
                         if line.startswith("MemAvailable"))
    except (OSError, StopIteration):
        return 1 << 62
    return avail // max(os.cpu_count() or 1, 1)


def memory_error(where: str, nbytes: int, e: BaseException) -> ResourceError:
    limit = os.environ.get("PYSPARK_EXECUTOR_MEMORY_MB")
    return ResourceError(
        f"the {where} does not fit this task's memory with data='memory' "
        f"({nbytes / 2**20:.0f} MiB of rows read when it ran out"
        + (f"; spark.executor.pyspark.memory: {limit} MiB" if limit else "")
        + f": {type(e).__name__}: {e}); use data='stream' (or 'auto') to stream it from local "
          f"disk, or split the data into more partitions")


def is_memory_error(e: BaseException) -> bool:
    return isinstance(e, (MemoryError, pa.ArrowMemoryError)) or \
        "can't allocate memory" in str(e) or "Cannot allocate memory" in str(e)
