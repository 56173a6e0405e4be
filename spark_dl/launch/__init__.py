"""Bring your own training loop: ``spark_dl.run`` runs an existing torch.distributed (DDP)
function once per replica in a Spark barrier stage (driver.py, task.py), and the function
reads its rank, device and shard from ``spark_dl.context()`` (context.py)."""

from .context import RunContext, context
from .driver import run

__all__ = ["RunContext", "context", "run"]
