"""spark_dl: large-scale distributed deep learning on Apache Spark with PyTorch."""

from .config import DataConfig, DemoConfig, TrainConfig, load_toml
from .errors import ConfigError, DataError, ResourceError, SparkDLError, TaskError
from .session import get_session, load_profile
from .fit import FitResult, fit
from .strategies import AllReduce, Boosting, Downpour, Gossip, Strategy

__version__ = "0.1.0"

__all__ = ["DataConfig", "DemoConfig", "TrainConfig", "load_toml", "ConfigError", "DataError",
           "ResourceError", "SparkDLError", "TaskError", "get_session", "load_profile", "fit",
           "FitResult", "Strategy", "AllReduce", "Boosting", "Downpour", "Gossip", "__version__"]
