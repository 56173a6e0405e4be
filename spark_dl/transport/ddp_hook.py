"""The shared-memory all-reduce (shm.py) as a DistributedDataParallel communication hook: a
user's own DDP loop averages its gradient buckets through shared memory when every replica
shares a host, at the speed AllReduce gets there.

    from spark_dl import ShmCommHook
    ddp = DistributedDataParallel(model)
    ShmCommHook.register(ddp)            # or: ddp.register_comm_hook(ShmCommHook(ddp), hook)

DDP calls the hook once per bucket, in bucket order on every rank (its reducer launches them
in order), with ``bucket.buffer()`` the bucket's flat gradients (B,); the hook returns a
completed future holding their mean over the ranks, as DDP's default all-reduce does.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

__all__ = ["ShmCommHook", "shm_allreduce_hook"]


class ShmCommHook:
    """The hook's state: one shared-memory segment holding the largest bucket DDP can form
    (all the gradients of ``ddp``'s module), made when the hook is made.

    Collective: every rank makes it, with a model of the same parameters, all on one host;
    the segment's name is rank 0's, broadcast over the default process group."""

    def __init__(self, ddp: torch.nn.Module, timeout_s: float = 300.0):
        from .shm import ShmAllReduce
        params = [p for p in ddp.parameters() if p.requires_grad]
        dtypes = {p.dtype for p in params}
        devices = {p.device.type for p in params}
        if len(dtypes) != 1 or devices != {"cpu"}:
            raise ValueError(f"the shared-memory hook takes CPU parameters of one dtype, got "
                             f"dtypes {sorted(map(str, dtypes))} on {sorted(devices)}: keep "
                             f"DDP's default all-reduce (NCCL on GPUs) for this model")
        self.world = dist.get_world_size()
        token = torch.frombuffer(bytearray(os.urandom(8)), dtype=torch.uint8)
        dist.broadcast(token, 0)                           # rank 0's 8 random bytes: no pickle
        self.shm = ShmAllReduce(sum(p.numel() for p in params), dtypes.pop(),
                                f"sdl-hook-{bytes(token.tolist()).hex()}", timeout_s)
        self.calls = 0

    @classmethod
    def register(cls, ddp, timeout_s: float = 300.0) -> ShmCommHook:
        """Make the state and register ``shm_allreduce_hook`` on ``ddp``; returns the state.
        Collective: every rank must call it."""
        state = cls(ddp, timeout_s)
        ddp.register_comm_hook(state, shm_allreduce_hook)
        return state

    def close(self) -> None:
        self.shm.close()


def shm_allreduce_hook(state: ShmCommHook, bucket: dist.GradBucket) -> torch.futures.Future:
    """DDP communication hook: the bucket's gradients (B,) summed over the ranks through
    shared memory, then divided by the world size (DDP's mean). Collective: every rank."""
    buf = bucket.buffer()                                  # (B,) this rank's gradients
    state.shm(buf)                                         # (B,) their sum over the ranks
    buf.div_(state.world)
    state.calls += 1
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(buf)
    return fut


# DDP checks the hook's annotations as objects (this module's are strings, see __future__)
shm_allreduce_hook.__annotations__.update(bucket=dist.GradBucket,
                                          **{"return": torch.futures.Future[torch.Tensor]})
