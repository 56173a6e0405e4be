"""What every training task of a fit needs, whatever the strategy: its configuration (plain
values only: the configs travel to the executors in the task closure), its shard, and the
scaffold of a barrier stage whose replica 0 returns the trained model. The replica loop that
runs in it is loop.py; the losses and evaluation are spark_dl.losses, the checkpoint files
checkpoint.py."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.distributed as dist

from .failures import at, report
from .seeds import replica_seed

__all__ = ["RESULT_SCHEMA", "LocalStepConfig", "LossSum", "StageConfig", "StepLosses",
           "barrier_task", "broadcast_bytes", "most_batches", "peak_memory_mb",
           "read_checkpoint", "read_shard", "set_lr", "shared_memory_name", "stage_info",
           "state_bytes", "write_task_info"]


@dataclasses.dataclass(frozen=True)
class StageConfig:
    """The data, the loop and the task's resources (see ``spark_dl.fit`` for their meaning)."""

    features: str = "features"
    label: str = "label"
    shape: tuple = ()
    label_shape: tuple = ()
    num_classes: int | None = None
    loss: str = "cross_entropy"
    epochs: int = 1
    batch_size: int = 64
    shuffle: bool = True
    seed: int = 0
    dtype: str = "float32"
    device: str = "auto"
    threads: int = 0
    timeout_s: float = 300.0
    progress_every_s: float = 2.0
    data: str = "auto"                 # "memory", "stream" (spilled to local disk) or "auto"
    shuffle_buffer: int | str = "256MB"  # a streamed shard's shuffle buffer: rows or a size
    transform: Callable | None = None  # (x, y) numpy rows of a batch -> tensors
    resume: bool = True                # a run_dir with a checkpoint goes on from it
    validate_every: float = 1.0        # validation every this fraction of an epoch (and at
                                       # every epoch's end)


@dataclasses.dataclass(frozen=True)
class LocalStepConfig(StageConfig):
    """... and the optimizer each replica steps with itself (all-reduce, gossip)."""

    optimizer: str = "sgd"
    lr: float = 0.01
    lr_decay: float = 1.0
    momentum: float = 0.0
    nesterov: bool = False             # SGD's Nesterov momentum
    weight_decay: float = 0.0
    max_iter: int = 3
    lr_scaling: str = "none"           # the rule for the global batch: "linear", "sqrt", "none"
    warmup_epochs: float | str = "auto"
    grad_clip: float | str | None = "auto"   # see spark_dl.optim.clip

    def schedule(self, k: float):
        """The rate per fractional epoch when an update averages ``k`` mini-batches."""
        from ..optim.schedule import LRSchedule
        return LRSchedule(self.lr, k, self.lr_scaling, self.warmup_epochs, self.lr_decay,
                          self.epochs)

    def clip(self, schedule, device, line_search: bool = False):
        """The gradient clipping of a fit whose rate follows ``schedule`` (none for an
        optimizer with a ``line_search``)."""
        from ..optim.clip import GradClip
        return GradClip(self.grad_clip, schedule.k > 1 and schedule.scaled != schedule.lr,
                        device, line_search=line_search)


def read_shard(cfg: StageConfig, batches, where: str):
    """Runs in a task: its partition's record batches -> a ShardData or StreamShard (see
    spark_dl.data.stream.open_shard); the caller closes it when the task ends. The labels are
    class ids (int64) with num_classes or a cross-entropy loss."""
    from spark_dl.data.stream import open_shard
    return open_shard(batches, cfg.features, cfg.label, cfg.shape, cfg.label_shape,
                      cfg.num_classes, where, cfg.data, cfg.shuffle_buffer,
                      class_ids=cfg.loss == "cross_entropy")


def peak_memory_mb() -> dict:
    """This Python worker's peak resident memory and peak address space (what
    spark.executor.pyspark.memory caps) so far, in MiB: over its whole life, as Spark reuses
    workers across tasks."""
    import resource

    from ..data.memory import proc_status_kib
    out = {"peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    vm_peak = proc_status_kib("VmPeak")
    if vm_peak is not None:
        out["peak_vm_mb"] = vm_peak / 1024
    return out


def write_task_info(run_dir: str, name: str, info: dict) -> None:
    """run_dir/workers/<name>.json: where this task runs, for operators: ``info`` plus the host,
    the process, the Python interpreter and where spark_dl was imported from (the shipped
    environment and --py-files archive on a cluster). Best effort: the run directory is the
    driver's and may not be reachable from this executor."""
    import torch

    import spark_dl
    facts = {"host": os.uname().nodename, "pid": os.getpid(), "python": sys.executable,
             "spark_dl": os.path.abspath(os.path.dirname(spark_dl.__file__)),
             "torch": os.path.abspath(os.path.dirname(torch.__file__)), **info}
    try:
        d = Path(run_dir) / "workers"
        d.mkdir(parents=True, exist_ok=True)
        tmp = d / f".{name}.json.tmp-{os.getpid()}"
        tmp.write_text(json.dumps(facts))
        os.replace(tmp, d / f"{name}.json")
    except OSError:
        pass


def state_bytes(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def broadcast_bytes(data: bytes | None, rank: int, device: torch.device) -> bytes:
    """Rank 0's bytes to every rank (length first), as uint8 tensors: no pickling."""
    n = torch.tensor([len(data) if rank == 0 and data is not None else 0], dtype=torch.int64,
                     device=device)
    dist.broadcast(n, 0)
    if int(n) == 0:
        return b""
    buf = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device) if rank == 0 else \
        torch.empty(int(n), dtype=torch.uint8, device=device)
    dist.broadcast(buf, 0)
    return buf.cpu().numpy().tobytes()


def _schema():
    import pyarrow as pa
    return pa.schema([("state", pa.binary()), ("history", pa.string()), ("info", pa.string()),
                      ("error", pa.string())])


RESULT_SCHEMA = "state binary, history string, info string, error string"


def barrier_task(cfg: StageConfig, train: Callable, secret: str,
                 channel: tuple[str, int] | None, run_dir: str | None):
    """The function ``df.mapInArrow(task, RESULT_SCHEMA, barrier=True)`` runs on every task of
    a replica-per-task barrier stage: read the shard, pick the device, join the process group
    (every task learns every other's status, and a bad shard stops them all with its reason,
    reported once by task 0), then ``train(shard, device, rank, world, statuses, client, ctx)``
    -> {"state": bytes, "history": [...], "info": {...}}; task 0 returns that as the row."""

    def task(batches: Iterator) -> Iterator:
        from pyspark import TaskContext
        opened: list = []                 # the task's shard: its spill files go when it ends
        at(None, None)
        try:
            yield from _task(batches, opened)
        except BaseException as e:        # the driver hears of it first, and cancels the fit
            report(channel, secret.encode(), TaskContext.get().partitionId(), e)
            raise
        finally:
            for shard in opened:
                shard.close()

    def _task(batches: Iterator, opened: list) -> Iterator:
        import pyarrow as pa
        from pyspark import BarrierTaskContext

        from spark_dl.errors import SparkDLError
        from spark_dl.transport.channel import MessageClient
        from spark_dl.transport.ps.board import host_id
        from spark_dl.transport.rendezvous import choose_backend, process_group, task_device

        ctx = BarrierTaskContext.get()
        rank = ctx.partitionId()
        status: dict = {"error": None}
        t_start, started_at = time.perf_counter(), time.time()
        shard = device = None
        try:
            if cfg.features:              # no feature column: a stage without data (run())
                shard = read_shard(cfg, batches, f"partition {rank}")
                opened.append(shard)
            gpus = list(ctx.resources()["gpu"].addresses) if "gpu" in ctx.resources() else []
            device, note = task_device(cfg.device, gpus, rank)
            if shard is not None:         # on a GPU: the rows go there once, batched there
                from spark_dl.data.device import DeviceShard, on_device
                shard = on_device(shard, device, cfg.transform)
                if isinstance(shard, DeviceShard):
                    note += "; rows held on the GPU"
            status.update(rows=len(shard) if shard is not None else 0, device=str(device),
                          note=note, gpus=gpus, data=shard.kind if shard is not None else None,
                          host=os.uname().nodename, machine=host_id(), pid=os.getpid(),
                          read_s=time.perf_counter() - t_start)
        except SparkDLError as e:        # reported to all tasks and the driver; not retried
            status["error"] = {"type": type(e).__name__, "message": str(e)}
        status["cpus"] = int(ctx.cpus() or 1)  # the stage's profile's, else spark.task.cpus
        threads = cfg.threads or status["cpus"]
        torch.set_num_threads(threads)
        if run_dir is not None and not status["error"]:
            write_task_info(run_dir, f"rank-{rank}",
                            {"rank": rank, "attempt": ctx.attemptNumber(),
                             "stage": ctx.stageId(), **status, "threads": threads})
        t_rdv = time.perf_counter()
        via = None if channel is None else (channel, secret.encode())
        with process_group(ctx, choose_backend, secret, status, cfg.timeout_s, via) as (
                rank_, world, statuses):
            status["rendezvous_s"] = time.perf_counter() - t_rdv
            if rank_ is None:
                if rank == 0:
                    errors = [{"task": i, **s["error"]} for i, s in enumerate(statuses)
                              if s.get("error")]
                    yield pa.RecordBatch.from_pydict(
                        {"state": [b""], "history": ["[]"], "info": ["{}"],
                         "error": [json.dumps(errors)]}, schema=_schema())
                return
            out = train(shard, device, rank, world, statuses,
                        MessageClient(channel if rank == 0 else None, secret.encode()), ctx)
            out["info"]["timings_rank0"] = {
                "read_partition_s": status["read_s"], "rendezvous_s": status["rendezvous_s"],
                **out["info"].pop("timings"), "task_total_s": time.perf_counter() - t_start,
                "started_at": started_at, "ended_at": time.time()}   # the executor's clock
        if rank == 0:
            yield pa.RecordBatch.from_pydict(
                {"state": [out["state"]], "history": [json.dumps(out["history"])],
                 "info": [json.dumps(out["info"])], "error": [""]}, schema=_schema())

    return task


def stage_info(statuses: list[dict]) -> dict:
    """What info.json says of a barrier stage's tasks, whatever the strategy."""
    return {"world": len(statuses), "rows_per_replica": [s["rows"] for s in statuses],
            "devices": [s["device"] for s in statuses], "data": [s["data"] for s in statuses],
            "notes": [s["note"] for s in statuses], "gpus": [s["gpus"] for s in statuses],
            "hosts": [s["host"] for s in statuses], "cpus": [s.get("cpus") for s in statuses],
            "total_rows": sum(s["rows"] for s in statuses),
            "backend": statuses[0].get("backend"), "backend_why": statuses[0].get("backend_why"),
            "rendezvous": statuses[0].get("rendezvous")}


def epoch_batches(cfg: StageConfig, shard, rank: int, epoch: int) -> Iterator:
    """Replica ``rank``'s mini-batches of ``epoch`` (its own shuffle, the same on a resume)."""
    return iter(shard.batches(cfg.batch_size, shuffle=cfg.shuffle, transform=cfg.transform,
                              seed=replica_seed(cfg.seed, rank), epoch=epoch))


def most_batches(shard, batch_size: int, device) -> int:
    """The most mini-batches any replica's shard holds (every replica runs that many steps)."""
    n = torch.tensor([shard.num_batches(batch_size)], device=device)
    dist.all_reduce(n, op=dist.ReduceOp.MAX)
    return int(n)


def read_checkpoint(cfg: StageConfig, run_dir: str | None, rank: int, device):
    """(path, checkpoint or None): replica 0 reads the run's checkpoint (when ``cfg.resume``),
    every replica gets its bytes (no pickling: weights_only)."""
    path = Path(run_dir) / "checkpoint.pt" if run_dir else None
    data = path.read_bytes() if rank == 0 and cfg.resume and path and path.exists() else None
    blob = broadcast_bytes(data, rank, device)
    if not blob:
        return path, None
    return path, torch.load(io.BytesIO(blob), map_location=device, weights_only=True)


class StepLosses:
    """Each step's loss, from the epoch's running sums (loss x rows, rows) marked after every
    step: device tensors are copied where they are and read at ``read`` (one host
    synchronisation per report, not per step)."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        """A new epoch: its sums start from zero."""
        self.marks: list = []
        self.prev = (0.0, 0.0)

    def mark(self, loss_sum, samples) -> None:
        """The epoch's sums after a step: numbers, or 0-d tensors (copied, as they grow in
        place)."""
        self.marks.append(tuple(x.detach().to(torch.float64, copy=True) if torch.is_tensor(x)
                                else float(x) for x in (loss_sum, samples)))

    def read(self) -> tuple[list, float, float]:
        """(the loss of each step marked since the last read, None for a step without rows;
        the epoch's loss sum; its rows), and forgets the marks."""
        flat = [x for m in self.marks for x in m]
        by_device: dict = {}
        for i, x in enumerate(flat):
            if torch.is_tensor(x):
                by_device.setdefault(x.device, []).append(i)
        for idx in by_device.values():
            for i, v in zip(idx, torch.stack([flat[i] for i in idx]).tolist()):
                flat[i] = v
        losses, (s0, n0) = [], self.prev
        for s, n in zip(flat[::2], flat[1::2]):
            losses.append(float(f"{(s - s0) / (n - n0):.6g}") if n > n0 else None)
            s0, n0 = s, n
        self.marks, self.prev = [], (s0, n0)
        return losses, s0, n0


class StepReports:
    """Replica 0's step reports to the driver, at most every ``cfg.progress_every_s`` and at
    the end of every epoch; each carries the loss of every step since the previous one
    (``losses``: the run's plot draws them) and the epoch's mean so far (``loss``)."""

    def __init__(self, cfg: StageConfig, client, rank: int):
        self.cfg, self.client, self.rank, self.on = cfg, client, rank, rank == 0
        self.t0 = self.last = time.perf_counter()
        self.losses = StepLosses()

    def epoch(self, shard, epoch: int, batches: Iterator | None = None) -> Iterator:
        """Start timing ``epoch``; returns its mini-batches: ``batches`` when the strategy
        draws them itself, else epoch_batches."""
        self.t0 = self.last = time.perf_counter()
        self.losses.reset()
        at(epoch, 0)
        return batches if batches is not None else epoch_batches(self.cfg, shard, self.rank,
                                                                 epoch)

    def seconds(self) -> float:
        """Since the epoch started."""
        return time.perf_counter() - self.t0

    def step(self, epoch: int, step: int, steps: int, loss_sum, samples) -> None:
        """``loss_sum`` and ``samples`` so far this epoch: numbers, or 0-d tensors read only
        when a report goes (no host synchronisation on the other steps)."""
        at(epoch, min(step + 1, steps - 1))          # what runs next (for an error report)
        if not self.on:
            return
        self.losses.mark(loss_sum, samples)
        now = time.perf_counter()
        if now - self.last >= self.cfg.progress_every_s or step == steps - 1:
            self.last = now
            losses, loss_sum, samples = self.losses.read()
            self.client.send({"type": "step", "epoch": epoch + 1, "epochs": self.cfg.epochs,
                              "step": step + 1, "steps": steps,
                              "loss": loss_sum / max(samples, 1),
                              "samples_per_s": samples / max(now - self.t0, 1e-9),
                              "losses": losses})

    def pause(self, seconds: float) -> None:
        """Leave ``seconds`` (a validation's) out of the epoch's clock."""
        self.t0 += seconds
        self.last += seconds


def shared_memory_name(statuses: list[dict], rank: int, world: int, device) -> str | None:
    """A fresh shared-memory segment's name, the same on every rank, when the replicas all
    share this host and talk over gloo (transport/shm.py: CPU tensors, or GPU tensors of
    replicas that share a GPU, staged through host memory), else None (NCCL, or several
    hosts). Collective when it names one."""
    if world < 2 or dist.get_backend() != "gloo" or len({s["machine"] for s in statuses}) != 1:
        return None
    return broadcast_bytes(f"sdl-{os.urandom(8).hex()}".encode(), rank, device).decode()


class LossSum:
    """A running sum of mini-batch losses x rows, kept on the loss's device: read (a host
    synchronisation) only when a report goes, not every step."""

    def __init__(self):
        self.total = None

    def add(self, loss: torch.Tensor, rows: int) -> None:
        """Add a mini-batch's mean ``loss`` over ``rows`` rows."""
        lost = loss.detach().to(torch.float64)
        self.total = lost * rows if self.total is None else self.total.add_(lost, alpha=rows)

    def value(self) -> float:
        return 0.0 if self.total is None else float(self.total)


def set_lr(opt: torch.optim.Optimizer, lr: float) -> None:
    for group in opt.param_groups:
        group["lr"] = lr
