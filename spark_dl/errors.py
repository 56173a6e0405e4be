"""Exception family of spark_dl.

``ValueError``/``TypeError`` stay the errors for bad arguments; these cover what a user fixes
outside the call: configuration files, input data and the cluster.
"""

__all__ = ["ConfigError", "DataError", "ResourceError", "SparkDLError", "TaskError"]


class SparkDLError(Exception):
    """Base class of every spark_dl error."""


class ConfigError(SparkDLError, ValueError):
    """A configuration file, profile or key is wrong (names the key, the value and the fix)."""


class DataError(SparkDLError, ValueError):
    """Input data is malformed: bad file format, NaN, ragged rows, labels out of range."""


class ResourceError(SparkDLError):
    """The cluster cannot give what was asked for (executors, GPUs, memory)."""


class TaskError(SparkDLError):
    """An exception raised in a task: ``remote_type`` (its class name), ``task`` (the Spark
    partition), ``epoch``/``step`` (1-based, or None before training started) and
    ``remote_traceback`` (the task's frames, innermost last)."""

    def __init__(self, message: str, *, remote_type: str = "", task: int | None = None,
                 epoch: int | None = None, step: int | None = None,
                 remote_traceback: str = ""):
        super().__init__(message)
        self.remote_type, self.task, self.epoch, self.step = remote_type, task, epoch, step
        self.remote_traceback = remote_traceback
