"""All-reduce through shared memory for replicas on one host (CPU tensors, or the GPU
tensors of replicas that share one GPU: copied to the segment and back).

Gloo over loopback TCP costs about as long per all-reduce as a small model's step:
synchronous training of small models is latency-bound. When all replicas share a host, a
shared-memory segment does the same in microseconds (docs/performance.md has the timings):

    segment = [counters, one line of 64 bytes per rank: arrived, summed]
              [2 x world slots of n values] [2 results of n values]

Step k: rank r copies its buffer into slot (k % 2, r), publishes k in its counter, waits until
every counter is >= k, and sums slots (k % 2, 0..world-1) in rank order, so every replica gets
bit-identical sums. Double-buffering makes one barrier per step enough: a rank can only write
slot parity k % 2 again at step k + 2, after all ranks have arrived at step k + 1, i.e. after
they finished reading step k. From 3 ranks and SPLIT_MIN values on, the sum is split instead
(reduce-scatter, then all-gather): rank r sums only its 1/world of the columns of every slot
into result k % 2, publishes k in a second counter, waits for every rank's, and copies the
whole result. Each rank then reads about 2n values a step instead of world x n, for one more
barrier (below SPLIT_MIN values the second barrier costs more than it saves); every column is still summed once, in rank order, so the replicas stay bit-identical.
The segment's name carries the fit's secret; rank 0 unlinks it once all ranks have attached,
so nothing is left in /dev/shm even if a task is killed.
"""

from __future__ import annotations

import threading
import time
from multiprocessing import shared_memory

import numpy as np
import torch
import torch.distributed as dist

__all__ = ["ShmAllReduce"]

_TRACKER_PATCH = threading.Lock()
_LINE = 64                       # bytes between counters (one cache line each)
SPLIT_MIN = 65536                # values from which 3+ ranks reduce-scatter and all-gather


def _untracked(name: str, create: bool = False, size: int = 0) -> shared_memory.SharedMemory:
    """The segment, created or attached, kept out of Python's resource tracker: the tracker
    would unlink it (or warn) when a process exits, and ranks spawned from one parent share one
    tracker, whose set holds the name once, so each rank unregistering it made the tracker
    print a KeyError traceback. Its lifetime is ours: rank 0 unlinks it once every rank has it
    mapped. (Python 3.13 has ``track=False``; before, ``register`` is skipped while it opens.)"""
    try:
        return shared_memory.SharedMemory(name=name, create=create, size=size, track=False)
    except TypeError:                               # Python < 3.13: no track argument
        pass
    from multiprocessing import resource_tracker
    with _TRACKER_PATCH:                           # one thread at a time swaps it
        register = resource_tracker.register

        def skip_segments(rname, rtype):
            if rtype != "shared_memory":
                register(rname, rtype)
        resource_tracker.register = skip_segments
        try:
            return shared_memory.SharedMemory(name=name, create=create, size=size)
        finally:
            resource_tracker.register = register


def _unlink(shm: shared_memory.SharedMemory) -> None:
    """Remove the segment's name (the mappings stay), bypassing the tracker, which never had
    it; once only."""
    try:
        shared_memory._posixshmem.shm_unlink(shm._name)
    except AttributeError:                          # not POSIX shared memory
        shm.unlink()
    except FileNotFoundError:
        pass


class ShmAllReduce:
    """Sum-all-reduce of one flat CPU tensor of fixed size among the ranks of the default
    process group (used for the rendezvous only), all on this host."""

    def __init__(self, numel: int, dtype: torch.dtype, name: str, timeout_s: float = 300.0):
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.numel, self.dtype, self.timeout_s = numel, dtype, timeout_s
        item = torch.empty((), dtype=dtype).element_size()
        head = _LINE * self.world
        size = head + 2 * (self.world + 1) * numel * item
        if self.rank == 0:
            self.shm = _untracked(name, create=True, size=size)
            self.shm.buf[:head] = bytes(head)
        try:
            dist.barrier()
            if self.rank != 0:
                self.shm = _untracked(name)
            dist.barrier()
        finally:                # mapped segments live on; nothing left, even when a rank fails
            if self.rank == 0:
                _unlink(self.shm)
        self._counters = np.ndarray((self.world, _LINE // 8), np.int64, self.shm.buf)
        slots = torch.frombuffer(self.shm.buf, dtype=dtype, offset=head,
                                 count=2 * (self.world + 1) * numel)
        self._slots = slots[:2 * self.world * numel].view(2, self.world, numel)
        self._results = slots[2 * self.world * numel:].view(2, numel)
        self.step = 0

    def __call__(self, flat: torch.Tensor) -> torch.Tensor:
        """In place: ``flat`` becomes the sum over ranks. Collective: every rank calls it with a
        buffer of the same size, at most the ``numel`` the segment was made for (a smaller one
        uses the first values of every slot: DDP's buckets, see ddp_hook.py). A GPU tensor is
        summed on the host and copied back (replicas sharing a GPU, where NCCL cannot go)."""
        n = flat.numel()
        if self.world > 2 and n >= SPLIT_MIN:         # reduce-scatter, then all-gather
            rows = self.gather(flat)
            lo, hi = self.rank * n // self.world, (self.rank + 1) * n // self.world
            out = self._results[self.step % 2, :n]
            torch.sum(rows[:, lo:hi], dim=0, out=out[lo:hi])
            self._counters[self.rank, 1] = self.step
            self._wait(1)
            flat.view(-1).copy_(out)
        elif flat.device.type == "cpu":
            torch.sum(self.gather(flat), dim=0, out=flat.view(-1))
        else:
            flat.view(-1).copy_(self.gather(flat).sum(dim=0))
        return flat

    def gather(self, flat: torch.Tensor) -> torch.Tensor:
        """Every rank's ``flat`` as rows of a (world, n) view of the segment (a gossip round
        reads its neighbours' rows). Collective, as ``__call__``; the view holds until this
        rank's next call (double-buffering: nobody rewrites it before then)."""
        if flat.numel() > self.numel:
            raise ValueError(f"shared-memory all-reduce of {flat.numel()} values, but the "
                             f"segment holds {self.numel} per rank: make it for the largest")
        self.step += 1
        slots = self._slots[self.step % 2, :, :flat.numel()]
        slots[self.rank].copy_(flat.reshape(-1))
        self._counters[self.rank, 0] = self.step
        self._wait(0)
        return slots

    def _wait(self, counter: int) -> None:
        """Until every rank's ``counter`` (0: arrived, 1: its part summed) reaches this step."""
        spins, t0 = 0, None
        col = self._counters[:, counter]
        while col.min() < self.step:
            spins += 1
            if spins > 2000:                         # long waits: give the core away
                t0 = t0 or time.monotonic()
                if time.monotonic() - t0 > self.timeout_s:
                    raise TimeoutError(f"shared-memory all-reduce: a replica did not arrive at "
                                       f"step {self.step} within {self.timeout_s} s")
                time.sleep(0.0001 if spins < 20000 else 0.001)

    def close(self):
        self._slots = self._counters = None
        try:
            self.shm.close()
        except BufferError:                          # a view still alive: freed with the process
            pass
