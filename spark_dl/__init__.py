"""spark_dl: large-scale distributed deep learning on Apache Spark with PyTorch."""

from .config import DataConfig, DemoConfig, TrainConfig, load_toml
from .errors import ConfigError, DataError, ResourceError, SparkDLError, TaskError
from .fit import FitResult, fit
from .launch import RunContext, context, run
from .session import get_session, load_profile
from .strategies import FSDP, AllReduce, Boosting, Downpour, Gossip, LocalSGD, Strategy
from .transport.ddp_hook import ShmCommHook, shm_allreduce_hook

__version__ = "0.1.0"

__all__ = ["FSDP", "AllReduce", "Boosting", "ConfigError", "DataConfig", "DataError", "DemoConfig",
           "Downpour", "FitResult", "Gossip", "LocalSGD", "ResourceError", "RunContext",
           "ShmCommHook", "SparkDLError", "Strategy", "TaskError", "TrainConfig", "__version__",
           "context", "fit", "get_session", "load_profile", "load_toml", "run", "shm_allreduce_hook"]
