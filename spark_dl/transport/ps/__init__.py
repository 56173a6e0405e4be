"""The parameter server of Downpour and Boosting, run by the driver for the duration of a fit:
its wire format (wire.py), the blocks of parameters it keeps (shard.py), the server
(server.py) with its parts (rule.py: how a push becomes a step; rounds.py: sync rounds;
leases.py: data keys; bound.py: the staleness bound; serving.py: its connections) and a
worker's client (client.py)."""

from .client import PSClient
from .leases import KeyLeases
from .rule import StepRule
from .server import MODES, ParameterServer
from .shard import SERVER_OPTIMIZERS
from .wire import PSError

__all__ = ["MODES", "SERVER_OPTIMIZERS", "KeyLeases", "PSClient", "PSError", "ParameterServer",
           "StepRule"]
