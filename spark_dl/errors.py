"""Exception family of spark_dl.

``ValueError``/``TypeError`` stay the errors for bad arguments; these cover what a user fixes
outside the call: configuration files, input data and the cluster.
"""

__all__ = ["SparkDLError", "ConfigError", "DataError", "ResourceError"]


class SparkDLError(Exception):
    """Base class of every spark_dl error."""


class ConfigError(SparkDLError, ValueError):
    """A configuration file, profile or key is wrong (names the key, the value and the fix)."""


class DataError(SparkDLError, ValueError):
    """Input data is malformed: bad file format, NaN, ragged rows, labels out of range."""


class ResourceError(SparkDLError):
    """The cluster cannot give what was asked for (executors, GPUs, memory)."""
