"""The parameter server of Downpour and Boosting, run by the driver for the duration of a fit:
its wire format (wire.py), the blocks of parameters it keeps (shard.py), the server
(server.py) and a worker's client (client.py)."""

from .client import PSClient
from .server import MODES, ParameterServer
from .shard import SERVER_OPTIMIZERS
from .wire import PSError

__all__ = ["MODES", "SERVER_OPTIMIZERS", "PSClient", "PSError", "ParameterServer"]
