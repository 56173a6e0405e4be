"""Process groups inside a Spark barrier stage, and the device a task trains on.

Task 0 starts torch's TCPStore on a free port of its own host; the port travels to the other
tasks together with every task's status, so that one bad partition stops all tasks cleanly
instead of leaving them waiting. The statuses are gathered by the driver over the fit's
authenticated channel (milliseconds) when the tasks can reach it, else through
``BarrierTaskContext.allGather`` (Spark's channel, a second or more: transport/channel.py).
Keys live under a per-fit random prefix, so a peer that does not know the fit's secret cannot
take part in the rendezvous.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os

import torch
import torch.distributed as dist

from ..errors import ResourceError

__all__ = ["choose_backend", "gather", "process_group", "task_device"]


def task_device(requested: str, gpu_addresses: list[str], rank: int) -> tuple[torch.device, str]:
    """The device for this task and a note on why.

    ``auto``: the GPU Spark assigned to the task (``TaskContext.resources()["gpu"]``) when torch
    has CUDA, else any CUDA device (rank modulo count: local mode without GPU scheduling), else
    the CPU. ``cuda``: as ``auto`` but without CUDA it is an error. ``cpu``: the CPU.
    """
    if requested not in ("auto", "cpu", "cuda"):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {requested!r}")
    has_cuda = torch.cuda.is_available()
    if requested == "cuda" and not has_cuda:
        raise ResourceError(
            f"device='cuda' but torch in this executor ({os.uname().nodename}) sees no CUDA "
            f"device (Spark assigned GPU addresses {gpu_addresses or 'none'}); install a CUDA "
            f"build of torch on the executors, or use device='auto' or 'cpu'")
    if requested == "cpu" or not has_cuda:
        note = "cpu" if not gpu_addresses else \
            f"cpu: Spark assigned GPU {','.join(gpu_addresses)} but torch has no CUDA"
        return torch.device("cpu"), note
    if gpu_addresses:
        index = int(gpu_addresses[0])
        if index >= torch.cuda.device_count():
            raise ResourceError(
                f"Spark assigned GPU address {index} but torch sees {torch.cuda.device_count()} "
                f"device(s); check the discovery script and CUDA_VISIBLE_DEVICES")
        return torch.device("cuda", index), f"cuda:{index} assigned by Spark"
    index = rank % torch.cuda.device_count()
    return torch.device("cuda", index), f"cuda:{index} (no GPU scheduling: rank modulo count)"


def task_devices(statuses: list[dict]) -> dict[tuple, list[int]]:
    """The ranks on each (machine, device) the tasks reported ("device" and "machine" of each
    status), in the order first seen."""
    groups: dict[tuple, list[int]] = {}
    for rank, s in enumerate(statuses):
        groups.setdefault((s.get("machine"), s.get("device", "cpu")), []).append(rank)
    return groups


def choose_backend(statuses: list[dict]) -> tuple[str, str]:
    """(backend, why) for the tasks whose reports these are (each with "device" and "machine").

    NCCL takes one rank per GPU: two ranks on the same CUDA device of one machine (more tasks
    than GPUs, or a fractional ``spark.task.resource.gpu.amount``) stop it with "Duplicate GPU
    detected". Such ranks get gloo, whose broadcast and all-reduce take CUDA tensors, and the
    strategies move their per-step traffic through host shared memory (one machine) instead.
    NCCL only when every task holds a CUDA device of its own; gloo for CPU tasks."""
    groups = task_devices(statuses)
    gpu = [d.startswith("cuda") for _, d in groups]
    if not all(gpu):
        if any(gpu):
            return "gloo", "gloo: some tasks run on the CPU, others on a GPU"
        return "gloo", "gloo: CPU tasks"
    (_machine, device), ranks = max(groups.items(), key=lambda group: len(group[1]))
    if len(ranks) == 1:
        return "nccl", "nccl: one GPU per task"
    return "gloo", (f"gloo: {len(ranks)} tasks share {device} on one machine (NCCL needs a GPU "
                    f"per rank); their tensors stay on the GPU, exchanged through host memory")


@contextlib.contextmanager
def process_group(ctx, backend, secret: str, status: dict, timeout_s: float,
                  via: tuple[tuple[str, int], bytes] | None = None):
    """Yield (rank, world, statuses) with the default process group up; always torn down.

    ``status`` is this task's report (e.g. {"error": None, "rows": 123}); every task gets all
    reports. When any report carries an error no process group is made and ``None`` is
    yielded as the rank, so that callers can stop together. ``backend``: a name, or a function
    of the reports that returns (name, why) (choose_backend); the choice and its reason go
    into every report as "backend" and "backend_why". ``via``: the driver's channel (its
    address, the fit's channel key) that gathers the reports; None: Spark's allGather.
    """
    rank = ctx.partitionId()
    infos = ctx.getTaskInfos()
    world = len(infos)
    host = infos[0].address.rsplit(":", 1)[0]
    timeout = datetime.timedelta(seconds=timeout_s)
    store = None
    if rank == 0 and not status.get("error"):
        store = dist.TCPStore(host, 0, world, is_master=True, timeout=timeout,
                              wait_for_workers=False)
        status = {**status, "port": store.port}
    statuses = gather(ctx, status, via)
    if any(s.get("error") for s in statuses):
        yield None, world, statuses
        return
    if callable(backend):
        backend, why = backend(statuses)
        for s in statuses:
            s.update(backend=backend, backend_why=why)
    if store is None:
        store = dist.TCPStore(host, statuses[0]["port"], world, is_master=False,
                              timeout=timeout)
    dist.init_process_group(backend, store=dist.PrefixStore(f"spark_dl/{secret}/", store),
                            rank=rank, world_size=world, timeout=timeout)
    try:
        yield rank, world, statuses
    finally:
        # Python workers are reused by Spark: leave no group (or port) behind.
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
        del store


def gather(ctx, status: dict, via: tuple[tuple[str, int], bytes] | None) -> list[dict]:
    """Every task's ``status`` (JSON values), in rank order: through the driver when ``via``
    names its channel and it answers, else (every task of the stage alike) through Spark's
    allGather; each status then says which ("rendezvous": "driver" or "spark")."""
    if via is not None:
        from .channel import gather_statuses
        address, key = via
        statuses = gather_statuses(address, key, f"stage {ctx.stageId()}", ctx.partitionId(),
                                   len(ctx.getTaskInfos()), status)
        if statuses is not None:
            return [{**s, "rendezvous": "driver"} for s in statuses]
    return [{**json.loads(m), "rendezvous": "spark"} for m in ctx.allGather(json.dumps(status))]
