"""The task half of ``spark_dl.run``: a replica of a barrier stage (runtime.stage's
barrier_task: shard, device, process group, errors to the driver) that runs the user's
function as torchrun would, and sends rank 0's return value back as the stage's row.

The process group is up before the function starts (NCCL on GPUs, gloo on the CPU, made on
the fit's authenticated rendezvous), and torchrun's variables are set: MASTER_ADDR and
MASTER_PORT (the rendezvous store of task 0), RANK, WORLD_SIZE, LOCAL_RANK (the task's GPU
index on CUDA, else its rank among the replicas of its host), LOCAL_WORLD_SIZE. While the
function runs, ``torch.distributed.init_process_group`` is a no-op that checks its backend,
rank and world size against the group that is up (torchrun-style code calls it first; Accelerate
and Lightning Fabric see the group initialised and skip it), and ``destroy_process_group``
of the default group waits for the task's end.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from spark_dl.runtime.stage import StageConfig, barrier_task, most_batches, stage_info

__all__ = ["LaunchConfig", "decode_result", "make_task"]


@dataclasses.dataclass(frozen=True)
class LaunchConfig(StageConfig):
    """Plain values shipped to the tasks (see ``spark_dl.run`` for their meaning); an empty
    ``features`` means a stage without data (run without ``df``)."""

    loss: str = ""                        # the function's own: labels are class ids only
    #                                       with num_classes
    comm_hook: str | None = None          # "shm": every DDP built in the function gets it
    function: str = ""                    # the function's name, for messages


def make_task(cfg: LaunchConfig, fn: Callable, args: tuple, kwargs: dict, secret: str,
              channel: tuple[str, int] | None, run_dir: str | None):
    """The function ``df.mapInArrow(task, RESULT_SCHEMA, barrier=True)`` runs on every task."""

    def train(shard, device, rank, world, statuses, client, ctx) -> dict:
        return _call(cfg, fn, args, kwargs, shard, device, rank, world, statuses, client, ctx)

    return barrier_task(cfg, train, secret, channel, run_dir)


def _call(cfg, fn, args, kwargs, shard, device, rank, world, statuses, client, ctx) -> dict:
    from spark_dl.launch.context import _CURRENT, RunContext
    t0 = time.perf_counter()
    machines = [s["machine"] for s in statuses]
    local = machines[:rank].count(machines[rank])
    steps = most_batches(shard, cfg.batch_size, device) if shard is not None else 0
    hook = cfg.comm_hook == "shm" and world > 1 and device.type == "cpu" and \
        len(set(machines)) == 1
    host = ctx.getTaskInfos()[0].address.rsplit(":", 1)[0]
    env = {"MASTER_ADDR": host, "MASTER_PORT": str(statuses[0]["port"]), "RANK": str(rank),
           "WORLD_SIZE": str(world), "LOCAL_RANK": str(device.index if device.type == "cuda"
                                                       else local),
           "LOCAL_WORLD_SIZE": str(machines.count(machines[rank])),
           "GROUP_RANK": "0", "NODE_RANK": "0", "TORCHELASTIC_RUN_ID": "spark_dl"}
    if device.type == "cuda":
        torch.cuda.set_device(device)
    run_ctx = RunContext(cfg, shard, rank, world, local, device, steps, client,
                         cfg.progress_every_s)
    hooks: list = []
    setup_s = time.perf_counter() - t0
    _CURRENT.append(run_ctx)
    try:
        with _environ(env), _torchrun_group(fn, rank, world, device), \
                _auto_hook(hook, hooks, cfg.timeout_s):
            t_fn = time.perf_counter()
            value = fn(*args, **kwargs)
            fn_s = time.perf_counter() - t_fn
    finally:
        _CURRENT.remove(run_ctx)
        for h in hooks:
            h.close()
    state = encode_result(value, cfg.function) if rank == 0 else b""
    info = {**stage_info(statuses), "function": cfg.function, "steps_per_epoch": steps,
            "comm_hook": "shm" if hooks else None, "comm_hook_calls": sum(h.calls for h in hooks),
            "backend": dist.get_backend(), "threads_per_task": torch.get_num_threads(),
            "attempt": ctx.attemptNumber(),
            "timings": {"setup_s": setup_s, "function_s": fn_s}}
    return {"state": state, "history": run_ctx.history, "info": info}


@contextlib.contextmanager
def _environ(env: dict):
    """torchrun's variables while the function runs (Python workers are reused: restored)."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def _torchrun_group(fn: Callable, my_rank: int, world: int, device: torch.device):
    """``init_process_group`` checks and keeps the group that is up; ``destroy_process_group``
    of the default group is left to the task's end. Also where the function's module bound
    them by name (``from torch.distributed import init_process_group``)."""
    c10d = dist.distributed_c10d
    real_init, real_destroy = c10d.init_process_group, c10d.destroy_process_group
    ours = dist.get_backend()

    def init_process_group(backend=None, init_method=None, timeout=None, world_size=-1,
                           rank=-1, *a, **kw):
        from spark_dl.errors import ConfigError
        if backend is not None and ours not in str(backend).lower():
            raise ConfigError(
                f"the function initialises the process group with backend {backend!r}, but "
                f"this task runs on {device}, where spark_dl.run set up {ours!r}: leave the "
                f"backend out (dist.init_process_group()); 'nccl' needs device='cuda' and a GPU "
                f"of its own for every task (tasks that share a GPU get gloo)")
        for name, got, want in (("rank", rank, my_rank), ("world_size", world_size, world)):
            if got not in (-1, None) and int(got) != want:
                raise ConfigError(f"the function initialises the process group with "
                                  f"{name}={got}, but this task is {name} {want} of "
                                  f"spark_dl.run's group: read it from the environment "
                                  f"(os.environ['RANK'], os.environ['WORLD_SIZE']) or leave "
                                  f"it out")

    def destroy_process_group(group=None):
        if group is not None and group is not dist.group.WORLD:
            real_destroy(group)

    swaps = [(dist, "init_process_group", init_process_group),
             (dist, "destroy_process_group", destroy_process_group),
             (c10d, "init_process_group", init_process_group),
             (c10d, "destroy_process_group", destroy_process_group)]
    g = getattr(fn, "__globals__", {})
    for name, v in list(g.items()):
        if v is real_init:
            swaps.append((g, name, init_process_group))
        elif v is real_destroy:
            swaps.append((g, name, destroy_process_group))
    saved = [(o, k, o[k] if isinstance(o, dict) else getattr(o, k)) for o, k, _ in swaps]
    for o, k, v in swaps:
        o.__setitem__(k, v) if isinstance(o, dict) else setattr(o, k, v)
    try:
        yield
    finally:
        for o, k, v in saved:
            o.__setitem__(k, v) if isinstance(o, dict) else setattr(o, k, v)


@contextlib.contextmanager
def _auto_hook(on: bool, hooks: list, timeout_s: float):
    """When ``on``: every DistributedDataParallel the function builds gets the shared-memory
    communication hook (transport/ddp_hook.py), its state appended to ``hooks``."""
    if not on:
        yield
        return
    from torch.nn.parallel import DistributedDataParallel as DDP

    from spark_dl.transport.ddp_hook import ShmCommHook
    real = DDP.__init__

    def __init__(self, *a, **kw):
        real(self, *a, **kw)
        hooks.append(ShmCommHook.register(self, timeout_s))

    DDP.__init__ = __init__
    try:
        yield
    finally:
        DDP.__init__ = real


def encode_result(value, function: str) -> bytes:
    """Rank 0's return value as bytes for the driver: tensors, numbers, strings and their
    containers (a state_dict) as ``torch.save`` (read back with weights_only: no code runs),
    anything else pickled (read back as Spark reads a collected Python row)."""
    buf = io.BytesIO()
    try:
        torch.save(value, buf)
        torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
        return b"T" + buf.getvalue()
    except Exception:
        pass
    from pyspark import cloudpickle
    try:
        return b"P" + cloudpickle.dumps(value)
    except Exception as e:
        raise TypeError(f"{function or 'the function'} returned a {type(value).__name__} on "
                        f"rank 0, which cannot be sent to the driver ({type(e).__name__}: "
                        f"{e}): return plain values, tensors or a state_dict (of a DDP "
                        f"model: ddp.module.state_dict())") from e


def decode_result(data: bytes):
    """The driver's side of encode_result (the bytes came in the stage's collected row)."""
    if not data:
        return None
    if data[:1] == b"T":
        return torch.load(io.BytesIO(data[1:]), weights_only=True)
    import pickle
    return pickle.loads(data[1:])     # our own task's row, as Spark's collect() reads rows
