"""The boosting parameter server's workers: Spark tasks (one per worker, over a range of
worker ids) that ask the server for their next data key, read its rows from Parquet, sum the
gradients of its ``n_push`` mini-batches, push once and fetch the result (the request for
the next key goes out behind the push: one wait a key), until the server says the fit is
finished. A key's rows are a view of its row group, decoded once (``_Files``). With
``local`` (SGD servers), each mini-batch's gradient is taken after the key's earlier ones
stepped the worker's copy (x <- x - lr g, plain SGD at the server's rate): the push sums
the gradients k sequential steps would take, not k gradients of one point; the server
steps their sum once, with its momentum, and the worker fetches. With ``fresh``, before
each mini-batch a worker asks the server for values newer than its own (another worker
pushed meanwhile) and takes them, less the key's local steps so far: the key's later
gradients are taken on values that include the pushes landed since its fetch (a worker on
the driver's machine reads the server's version from a memory-mapped file first and asks
only when it has moved: transport/ps/board.py). A task Spark retries asks again and gets
back the key its last attempt held (keys.py)."""

from __future__ import annotations

import dataclasses
import json
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator

import torch

from spark_dl.runtime.failures import at
from spark_dl.runtime.failures import report as report_error
from spark_dl.runtime.loop import FitParts
from spark_dl.runtime.seeds import replica_seed
from spark_dl.runtime.stage import (
    LossSum,
    StageConfig,
    read_shard,
    write_task_info,
)
from spark_dl.strategies.ps_worker import PSTask, PSWorker, WorkerPlan

__all__ = ["RESULT_SCHEMA", "make_task", "read_key", "rebase"]

RESULT_SCHEMA = "worker int, report string"


@dataclasses.dataclass(frozen=True)
class _Task(PSTask):
    """A Boosting task's PSTask, with the keys, the local steps' rate and the board."""

    keys: list = ()
    rate: object = None
    board: tuple | None = None


def make_task(cfg: StageConfig, options, plan: WorkerPlan, parts: FitParts, secret: bytes,
              ps_address, channel, keys: list[tuple[str, int, int]], rate=None,
              board: tuple | None = None):
    """The function ``spark.range(workers).mapInArrow(task, RESULT_SCHEMA)`` runs: worker id =
    the task's partition. ``cfg``: fit's stage settings; ``options``: the Boosting object with
    the values its driver resolved (local, fresh); ``plan``: the workers' WorkerPlan;
    ``keys``: (Parquet file URI, first row, end row) per key; ``rate``: with ``local``, the
    server's LRSchedule (a key's mini-batches step the worker's copy one after another at
    its rate, see _work); ``board``: with ``fresh``, where the server's versions are mapped
    from on its machine (transport/ps/board.py: ticket)."""
    task_of = _Task(cfg, options, plan, parts, secret, ps_address, channel, keys, rate, board)

    def task(batches: Iterator) -> Iterator:
        import pyarrow as pa
        from pyspark import TaskContext

        for _ in batches:                   # the worker ids' range: nothing to read
            pass
        ctx = TaskContext.get()
        rank = ctx.partitionId()
        at(None, None)
        try:
            report = _work(task_of, ctx)
        except BaseException as e:          # the driver hears of it first, and cancels the fit
            report_error(channel, secret, rank, e)
            raise
        yield pa.RecordBatch.from_pydict({"worker": [rank], "report": [json.dumps(report)]},
                                         schema=pa.schema([("worker", pa.int32()),
                                                           ("report", pa.string())]))

    return task


def rebase(client, wire: torch.Tensor, flat: torch.Tensor, moved: torch.Tensor | None) -> int:
    """Fresh values mid-key: when another worker has pushed since this one's fetch, its copy
    ``flat`` becomes the server's new values less ``moved``, this key's local steps so far
    (None: none taken), shard by shard (``wire``: the wire-dtype buffer the values arrive
    in, ``flat`` itself when the two are one tensor). Returns 1 when the server had moved."""
    ranges = client.pull_newer(wire)
    for off, size in ranges:
        part = flat[off:off + size]
        if wire is not flat:
            part.copy_(wire[off:off + size])
        if moved is not None:
            part.sub_(moved[off:off + size])
    return int(bool(ranges))


class _Files:
    """The Parquet files a task has opened (kept open: keys come from the same few files), and
    the row groups it has decoded (``decode(record batches, where)``: the rows as a
    ShardData, checked and converted once), kept while they fit ``budget`` bytes (least
    recently used dropped first). A key is a few mini-batches, a row group holds many keys
    (Spark writes one per 128 MB), so without them every key decoded its whole row group
    again: the worker's time went to Parquet, not to training; a key's rows are then a view
    of its row group's arrays (``rows``)."""

    def __init__(self, budget: int, decode: Callable):
        self.open: dict = {}
        self.groups: OrderedDict = OrderedDict()      # (uri, group, columns) -> ShardData
        self.budget, self.held = budget, 0
        self.decode = decode
        self.decoded = 0                              # row groups read from the files

    def get(self, uri: str):
        import pyarrow.fs as pafs
        import pyarrow.parquet as pq
        if uri not in self.open:
            fs, path = pafs.FileSystem.from_uri(uri)
            self.open[uri] = pq.ParquetFile(fs.open_input_file(path))
        return self.open[uri]

    def rows(self, uri: str, g: int, lo: int, hi: int, columns: list[str]):
        """Rows [lo, hi) of row group ``g`` of ``uri`` (``columns``): (features, labels or
        None), views of the group decoded once while the budget holds it. A group larger
        than the whole budget is read again for each key, as Parquet reads whole groups, but
        only the key's rows are checked and converted."""
        name = (uri, g, tuple(columns))
        rows = self.groups.get(name)
        if rows is not None:
            self.groups.move_to_end(name)
        else:
            table = self.get(uri).read_row_groups([g], columns=columns)
            self.decoded += 1
            if table.nbytes > self.budget:       # never kept: convert the key's rows only
                rows = self.decode(table.slice(lo, hi - lo).to_batches(),
                                   f"rows {lo}-{hi} of row group {g} of {uri}")
                return rows.features, rows.labels
            rows = self.decode(table.to_batches(), f"row group {g} of {uri}")
            size = _nbytes(rows)
            if size <= self.budget:
                self.groups[name] = rows
                self.held += size
                while self.held > self.budget:
                    self.held -= _nbytes(self.groups.popitem(last=False)[1])
        return rows.features[lo:hi], None if rows.labels is None else rows.labels[lo:hi]

    def close(self) -> None:
        for f in self.open.values():
            f.close()
        self.open.clear()
        self.groups.clear()
        self.held = 0


def _nbytes(rows) -> int:
    return rows.features.nbytes + (0 if rows.labels is None else rows.labels.nbytes)


def read_key(files: _Files, key: tuple[str, int, int], columns: list[str]):
    """The rows [first, end) of a Parquet file as a ShardData: views of the decoded row group
    that holds them (decoded once, see _Files), joined when they span two (rows of another
    length there: the DataError of a ragged column); no rows: an empty one."""
    import numpy as np

    from spark_dl.data.bridge import ShardData, ragged_rows
    uri, first, end = key
    meta = files.get(uri).metadata
    parts, start = [], 0
    for g in range(meta.num_row_groups):
        n = meta.row_group(g).num_rows
        lo, hi = max(first, start), min(end, start + n)
        if lo < hi:
            parts.append(files.rows(uri, g, lo - start, hi - start, columns))
        start += n
    if not parts:
        return files.decode(iter(()), f"rows {first}-{end} of {uri}")
    if len(parts) == 1:
        return ShardData(*parts[0])
    where = f"key of rows {first}-{end} of {uri}"
    for name, arrays in zip(columns, ([x for x, _ in parts], [y for _, y in parts])):
        if arrays[0] is not None and len({a.shape[1:] for a in arrays}) > 1:
            raise ragged_rows(name, where, {int(np.prod(a.shape[1:])) for a in arrays})
    return ShardData([x for x, _ in parts],
                     None if parts[0][1] is None else np.concatenate([y for _, y in parts]))


def _work(task_of: _Task, ctx) -> dict:
    """One worker: it leases a data key from the server, trains on the key's rows (from the
    parameters it pulled, or stepping a local copy), pushes their gradient sum and asks for
    the next key, until the server says the fit is finished."""
    from spark_dl.data.memory import memory_headroom
    from spark_dl.transport.channel import MessageClient
    from spark_dl.transport.ps.board import BoardReader

    cfg, fresh, keys = task_of.cfg, task_of.options.fresh, task_of.keys
    run_dir, loss_fn = task_of.parts.run_dir, task_of.parts.loss_fn
    rank = ctx.partitionId()
    worker = PSWorker(cfg, task_of.plan, ctx, rank)
    if run_dir is not None:
        write_task_info(run_dir, f"worker-{rank}", {"worker": rank,
                                                    "device": str(worker.device),
                                                    "attempt": ctx.attemptNumber()})
    torch.manual_seed(cfg.seed)
    model = task_of.parts.model_fn().to(device=worker.device, dtype=worker.dtype)
    client = worker.connect(task_of.ps_address, task_of.secret)
    progress = MessageClient(task_of.channel, task_of.secret)
    client.hello(0, cfg.batch_size)
    if fresh:
        client.watch(BoardReader.open(task_of.board, len(client.versions)))
    worker.hold(model, client.numel, task_of.plan.momentum_ramp)
    worker.pull()
    mine = dataclasses.replace(cfg, data="memory")
    files = _Files(memory_headroom() // 4,       # decoded row groups kept in a quarter of it
                   lambda batches, where: read_shard(mine, iter(batches), where))
    columns = [c for c in (cfg.features, cfg.label) if c]
    local = _LocalSteps(worker, task_of.rate, fresh) if task_of.rate is not None else None
    trained, rows, waited, done, rebased = [], 0, 0.0, 0, 0
    try:
        while True:
            what, key, epoch = client.next_key()
            if what == "finished":
                break
            if what == "wait":              # the epoch's last keys are being trained
                time.sleep(key / 1000)
                waited += key / 1000
                continue
            at(epoch, key)
            shard = read_key(files, keys[key], columns)
            loss_sum, samples, steps, moved = LossSum(), 0, 0, None
            if local is not None:
                moved = local.start(epoch)
            for x, y in shard.batches(cfg.batch_size, shuffle=cfg.shuffle,
                                      seed=replica_seed(cfg.seed, key), epoch=epoch):
                if fresh:
                    rebased += rebase(client, worker.wire, worker.flat, moved)
                loss, n = worker.backward(x, y, loss_fn)
                loss_sum.add(loss, n)                   # read once a report goes
                samples += n
                steps += 1
                if local is not None:
                    local.step(n)
            shard.close()
            if worker.unscaled():                       # fp16 overflow: an empty push
                worker.carry(samples, steps)
            client.push(worker.outgoing(), samples, max(steps, 1), pull_into=worker.wire,
                        buffers=worker.reported_buffers(), momentum=worker.momentum(),
                        ask_key=True)
            worker.landed()
            worker.grad.zero_()
            done += 1
            rows += samples
            trained.append([epoch, key])
            progress.send({"type": "key", "worker": rank, "epoch": epoch + 1, "key": key,
                           "done": done, "loss": loss_sum.value() / max(samples, 1),
                           "samples": samples})
    finally:
        files.close()
    client.close()
    progress.close()
    return {"worker": rank, "keys": trained, "rows": rows, "pushes": done,
            "rebased": rebased, "fresh_asks": client.newer_asks, "waited_s": waited,
            "board": client.board is not None,
            "asks_sent": client.newer_asks - client.board_skips,
            "row_groups_decoded": files.decoded, **worker.report()}


class _LocalSteps:
    """``local``: the worker steps its copy by every mini-batch's mean gradient at the
    server's rate of the epoch (``rate``, an LRSchedule; ``grad`` holds the key's sum so
    far); with ``fresh`` the
    key's local steps so far, summed (``moved``), for ``rebase``."""

    def __init__(self, worker: PSWorker, rate, fresh: bool):
        self.worker, self.rates = worker, rate
        self.local, self.seen = torch.empty_like(worker.grad), torch.empty_like(worker.grad)
        self.moved = torch.empty_like(worker.grad) if fresh else None

    def start(self, epoch: int) -> torch.Tensor | None:
        """A new key in ``epoch``; returns ``moved``."""
        self.seen.zero_()
        self.rate = self.rates.at(epoch)         # the server's rate in this epoch
        if self.moved is not None:
            self.moved.zero_()
        return self.moved

    @torch.no_grad()
    def step(self, rows: int) -> None:
        grad, flat = self.worker.grad, self.worker.flat
        torch.sub(grad, self.seen, out=self.local)
        flat.sub_(self.local, alpha=self.rate / rows)
        self.seen.copy_(grad)
        if self.moved is not None:
            self.moved.add_(self.local, alpha=self.rate / rows)
