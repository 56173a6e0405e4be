"""What a function run by ``spark_dl.run`` reads inside its task: its rank, device and shard, and
a way to report progress and metrics to the driver.

    def train(lr):
        ctx = spark_dl.context()
        for epoch in range(3):
            for x, y in ctx.batches(epoch):          # this replica's shard, as fit draws it
                ...
            ctx.log(epoch=epoch + 1, loss=float(loss))
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import torch

__all__ = ["RunContext", "context"]

_CURRENT: list[RunContext] = []


def context() -> RunContext:
    """The running task's RunContext: only inside a function that ``spark_dl.run`` runs."""
    if not _CURRENT:
        raise RuntimeError("spark_dl.context() is only available inside a function run by "
                           "spark_dl.run(train_fn, ...), in its Spark task; outside it there "
                           "is no shard or rank: call it from train_fn")
    return _CURRENT[-1]


class RunContext:
    """One replica of ``spark_dl.run``: ``rank``, ``world_size``, ``local_rank`` (its rank
    among the replicas of its host), ``device`` (the task's: the GPU Spark assigned, else the
    CPU), ``rows`` of its shard, ``steps`` (the most mini-batches of ``batch_size`` any
    replica's shard holds: a DDP loop needs the same number of steps on every rank), and
    ``batches(epoch)``, its mini-batches of an epoch in fit's order."""

    def __init__(self, cfg, shard, rank: int, world: int, local_rank: int,
                 device: torch.device, steps: int, client, report_every_s: float):
        self.cfg, self.shard, self.client = cfg, shard, client
        self.rank, self.world_size, self.local_rank = rank, world, local_rank
        self.device, self.steps = device, steps
        self.rows = len(shard) if shard is not None else 0
        self.history: list[dict] = []          # what log() got with an "epoch": info.json
        self._every, self._last = report_every_s, 0.0

    def batches(self, epoch: int = 0, batch_size: int | None = None) -> Iterator:
        """This replica's mini-batches ``(x, y)`` of ``epoch`` as tensors on ``device`` (on a
        GPU the shard went there once, before the function started): the order fit's
        AllReduce draws them (run's ``shuffle`` and ``seed``, the same each time an epoch is
        drawn again), ``batch_size`` rows (default: run's ``batch_size``), the last one
        shorter; ``x`` as the DataFrame stores it (uint8 pixels stay uint8) or as run's
        ``transform`` makes it."""
        if self.shard is None:
            raise RuntimeError("ctx.batches(): spark_dl.run was called without df=, so this "
                               "replica has no shard: pass run(train_fn, df=your_dataframe)")
        from spark_dl.runtime.failures import at
        from spark_dl.runtime.seeds import replica_seed
        at(epoch, 0)
        size = self.cfg.batch_size if batch_size is None else batch_size
        return iter(self.shard.batches(size, shuffle=self.cfg.shuffle,
                                       seed=replica_seed(self.cfg.seed, self.rank),
                                       epoch=epoch,
                                       transform=self.cfg.transform))

    def num_batches(self, batch_size: int | None = None) -> int:
        """Mini-batches in this replica's own shard."""
        if self.shard is None:
            return 0
        return self.shard.num_batches(self.cfg.batch_size if batch_size is None else batch_size)

    def log(self, metrics: dict | None = None, /, **values) -> None:
        """Report ``metrics`` (numbers, strings) to the driver: its progress line and the run's
        metrics.jsonl; rank 0's reports only (the others' are dropped), at most one every
        ``progress_every_s`` unless they carry an ``epoch`` (those always go, and make
        info.json's history)."""
        m = {**(metrics or {}), **values}
        m = {k: v.item() if isinstance(v, torch.Tensor) and v.numel() == 1 else v
             for k, v in m.items()}
        if self.rank != 0:
            return
        final = "epoch" in m and "step" not in m
        if final:
            self.history.append(m)
        now = time.perf_counter()
        if final or now - self._last >= self._every:
            self._last = now
            self.client.send({"type": "log", **m})
