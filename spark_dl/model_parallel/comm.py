"""Counted communication for model parallelism: every message and byte goes through ``Comm``.

``Comm`` wraps a torch.distributed process group (or a sub-group of one) and counts, per kind
of operation, the point-to-point messages *this rank sends* and their payload bytes (the
group's totals are the sums over its ranks). Collectives are counted as the algorithms the cost
model assumes, whatever gloo or NCCL does inside:

    broadcast from a root       the root sends the tensor to each of the F - 1 others
    send                        one message
    ring all-gather             every rank forwards F - 1 slices: F (F - 1) messages in all,
                                each slice crossing F - 1 links
    hypercube all-gather        log2 F messages per rank (F a power of two, recursive
                                doubling; the message of round r holds 2^r slices)
    ring all-reduce             every rank sends 2 (F - 1) chunks of about 1/F of the tensor
                                (reduce-scatter, then all-gather)

A group of one member communicates nothing and counts nothing.

GPU tensors: NCCL takes them as they are. Gloo (the group of replicas that share a GPU, or of
tasks on no GPU at all) broadcasts and all-reduces them too, but sends, receives and gathers
host tensors only: those go through a host copy here (``_on_host``), counted the same.
"""

from __future__ import annotations

import math
from collections import defaultdict

import torch
import torch.distributed as dist

__all__ = ["Comm", "CountingComm", "split_sizes"]


def split_sizes(n: int, parts: int, shares=None) -> list[int]:
    """``n`` columns over ``parts`` partitions, uniformly, the remainder spread over the first
    ones: split_sizes(10, 4) == [3, 3, 2, 2]; or ∝ ``shares`` (one per partition, e.g. the
    tasks' relative speeds) by largest remainders, at least one column each:
    split_sizes(10, 2, (2, 1)) == [7, 3]."""
    if parts < 1:
        raise ValueError(f"partitions must be at least 1, got {parts}")
    if n < parts:
        raise ValueError(f"cannot split {n} columns over {parts} partitions: every partition "
                         f"needs at least one; use partitions <= {n}")
    if shares is not None:
        from ..balance import split
        if len(shares) != parts:
            raise ValueError(f"{len(shares)} shares for {parts} partitions")
        return split(n, [float(s) for s in shares])
    return [n // parts + (1 if p < n % parts else 0) for p in range(parts)]


class Comm:
    """Collectives and point-to-point messages over ``ranks`` (global ranks of the default
    group; ``None``: all of them), with counters. ``rank`` / ``size`` are within the group.
    ``group``: the torch group of those ranks when the caller made it (torch wants every
    rank of the default group to create every sub-group, in the same order)."""

    def __init__(self, ranks: list[int] | None = None, group=None, shares=None):
        self.shares = None if shares is None else tuple(shares)
        self.initialized = dist.is_available() and dist.is_initialized()
        world = dist.get_world_size() if self.initialized else 1
        me = dist.get_rank() if self.initialized else 0
        self.ranks = list(range(world)) if ranks is None else list(ranks)
        if me not in self.ranks:
            raise ValueError(f"rank {me} is not in the group {self.ranks}")
        self.size = len(self.ranks)
        self.rank = self.ranks.index(me)
        self.group = group
        if group is None and self.initialized and self.size < world:
            self.group = dist.new_group(self.ranks)
        self._init_counters()

    @classmethod
    def layout(cls, rank: int, size: int, shares=None) -> Comm:
        """A Comm that only describes rank ``rank`` of ``size`` (to cut a model into the
        slices of each partition, e.g. on the driver); it cannot communicate."""
        c = cls.__new__(cls)
        c.initialized, c.ranks, c.size, c.rank, c.group = False, list(range(size)), size, \
            rank, None
        c.shares = None if shares is None else tuple(shares)
        c._init_counters()
        return c

    def split(self, n: int) -> list[int]:
        """Each rank's columns of a layer ``n`` wide (∝ ``shares`` when the group has them)."""
        return split_sizes(n, self.size, self.shares)

    def _init_counters(self) -> None:
        self.messages: dict[str, int] = defaultdict(int)
        self.bytes: dict[str, int] = defaultdict(int)

    # -- counting ------------------------------------------------------------------------
    def _count(self, kind: str, messages: int, nbytes: int) -> None:
        self.messages[kind] += messages
        self.bytes[kind] += nbytes

    @property
    def total_messages(self) -> int:
        return sum(self.messages.values())

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes.values())

    def reset(self) -> None:
        self.messages.clear()
        self.bytes.clear()

    def counts(self) -> dict:
        return {"messages": dict(self.messages), "bytes": dict(self.bytes),
                "total_messages": self.total_messages, "total_bytes": self.total_bytes}

    # -- operations (every rank of the group must call them) -----------------------------
    def _global(self, r: int) -> int:
        return self.ranks[r]

    def broadcast(self, t: torch.Tensor, root: int = 0, kind: str = "broadcast") -> torch.Tensor:
        """Collective: the root's ``t`` to every rank, in place. F - 1 messages of ``t``."""
        if self.size == 1:
            return t
        dist.broadcast(t, self._global(root), group=self.group)
        if self.rank == root:
            self._count(kind, self.size - 1, (self.size - 1) * _nbytes(t))
        return t

    def _on_host(self, t: torch.Tensor) -> bool:
        """Whether ``t`` must travel through host memory (a GPU tensor over gloo)."""
        return t.device.type != "cpu" and dist.get_backend(self.group) != "nccl"

    def send(self, t: torch.Tensor, dst: int, kind: str) -> None:
        """Point-to-point: one message to group rank ``dst`` (counted by the sender only)."""
        out = t.cpu() if self._on_host(t) else t
        dist.send(out.contiguous(), self._global(dst), group=self.group)
        self._count(kind, 1, _nbytes(t))

    def recv(self, t: torch.Tensor, src: int) -> torch.Tensor:
        """Point-to-point: receive into ``t`` from group rank ``src``."""
        if self._on_host(t):
            buf = torch.empty(t.shape, dtype=t.dtype)
            dist.recv(buf, self._global(src), group=self.group)
            return t.copy_(buf)
        dist.recv(t, self._global(src), group=self.group)
        return t

    def all_gather(self, chunks: list[torch.Tensor], mine: torch.Tensor,
                   kind: str = "all_gather") -> list[torch.Tensor]:
        """Collective: rank p's ``mine`` lands in ``chunks[p]`` on every rank (chunks may differ
        in size: uneven partitions). Counted as a ring: at step s rank p forwards the slice of
        rank p - s."""
        if self.size == 1:
            chunks[0].copy_(mine)
            return chunks
        same = len({c.shape for c in chunks}) == 1
        if same and self._on_host(mine):
            host = [torch.empty(c.shape, dtype=c.dtype) for c in chunks]
            dist.all_gather(host, mine.cpu().contiguous(), group=self.group)
            for c, h in zip(chunks, host):
                c.copy_(h)
        elif same:
            dist.all_gather(chunks, mine.contiguous(), group=self.group)
        else:                   # gloo's all_gather wants equal sizes: broadcast each slice
            for p, c in enumerate(chunks):
                if p == self.rank:
                    c.copy_(mine)
                dist.broadcast(c, self._global(p), group=self.group)
        self._count(kind, *_ring_all_gather_cost(chunks, self.size, self.rank))
        return chunks

    def all_reduce(self, t: torch.Tensor, kind: str = "all_reduce") -> torch.Tensor:
        """Collective: sum of ``t`` over the group, in place. Counted as a ring all-reduce:
        the tensor in F chunks; at step s of the reduce-scatter rank p sends chunk p - s, at
        step s of the all-gather chunk p + 1 - s."""
        if self.size == 1:
            return t
        dist.all_reduce(t, group=self.group)
        self._count(kind, *_ring_all_reduce_cost(t, self.size, self.rank))
        return t

    def hypercube_all_gather(self, chunks: list[torch.Tensor], mine: torch.Tensor,
                             kind: str = "hypercube_all_gather") -> list[torch.Tensor]:
        """Collective: all-gather by recursive doubling (the thesis's hypercube all-to-all
        broadcast): log2 F rounds; in round r rank p exchanges the 2^r slices it holds with
        rank p XOR 2^r. F log2 F messages in all. F must be a power of two."""
        F = self.size
        if F & (F - 1):
            raise ValueError(f"the hypercube all-gather needs a power-of-two group, got {F}")
        chunks[self.rank].copy_(mine)
        for r in range(int(math.log2(F)) if F > 1 else 0):
            step = 1 << r
            peer = self.rank ^ step
            mine_block = range(self.rank & ~(step - 1), (self.rank & ~(step - 1)) + step)
            peer_block = range(peer & ~(step - 1), (peer & ~(step - 1)) + step)
            out = torch.cat([chunks[q].reshape(-1) for q in mine_block])
            into = torch.empty(sum(chunks[q].numel() for q in peer_block), dtype=out.dtype,
                               device=out.device)
            # the lower rank sends first: no two peers both block in send
            if self.rank < peer:
                self.send(out, peer, kind)
                self.recv(into, peer)
            else:
                self.recv(into, peer)
                self.send(out, peer, kind)
            off = 0
            for q in peer_block:
                n = chunks[q].numel()
                chunks[q].copy_(into[off:off + n].view_as(chunks[q]))
                off += n
        return chunks


class CountingComm(Comm):
    """Rank ``rank`` of an F-way group run alone, to count a step in one process (on the meta
    device, or on small real tensors): its collectives move nothing (a gathered tensor holds
    this rank's slice and uninitialised peers' slices; a reduced one this rank's values) and
    count, for every rank p of the group, what ``Comm`` counts on rank p. Every rank runs the
    same collectives on tensors of the same shapes, so one rank's run gives all ranks' counts:
    ``per_rank[p]`` holds rank p's counters, the inherited counters this rank's.
    Point-to-point messages, whose pattern depends on the peers' programme (MasterBackpropFC),
    are not simulated: ``cost_model.master_counts`` counts those."""

    def __init__(self, size: int, rank: int = 0):
        if not 0 <= rank < size:
            raise ValueError(f"rank must be in [0, {size}), got {rank}")
        self.ranks, self.size, self.rank, self.group = list(range(size)), size, rank, None
        self.shares = None
        self.initialized = True           # "communicates": kept-whole layers broadcast
        self.per_rank = [Comm.layout(p, size) for p in range(size)]
        self._init_counters()

    def reset(self) -> None:
        super().reset()
        for c in self.per_rank:
            c.reset()

    def group_counts(self) -> dict:
        """``counts()`` of the whole group: every kind's messages and bytes summed over the
        ranks."""
        kinds = {k for c in self.per_rank for k in c.messages}
        return {"messages": {k: sum(c.messages[k] for c in self.per_rank) for k in kinds},
                "bytes": {k: sum(c.bytes[k] for c in self.per_rank) for k in kinds},
                "total_messages": sum(c.total_messages for c in self.per_rank),
                "total_bytes": sum(c.total_bytes for c in self.per_rank)}

    def _count_all(self, kind: str, cost, ranks=None) -> None:
        """``cost(p)``: (messages, bytes) rank p of ``ranks`` (default: all) sends."""
        for c in self.per_rank if ranks is None else [self.per_rank[p] for p in ranks]:
            c._count(kind, *cost(c.rank))
            if c.rank == self.rank:
                self._count(kind, *cost(c.rank))

    def broadcast(self, t: torch.Tensor, root: int = 0, kind: str = "broadcast") -> torch.Tensor:
        if self.size > 1:
            n = self.size - 1
            self._count_all(kind, lambda p: (n, n * _nbytes(t)), [root])
        return t

    def all_gather(self, chunks: list[torch.Tensor], mine: torch.Tensor,
                   kind: str = "all_gather") -> list[torch.Tensor]:
        chunks[self.rank].copy_(mine)
        if self.size > 1:
            self._count_all(kind, lambda p: _ring_all_gather_cost(chunks, self.size, p))
        return chunks

    def all_reduce(self, t: torch.Tensor, kind: str = "all_reduce") -> torch.Tensor:
        if self.size > 1:
            self._count_all(kind, lambda p: _ring_all_reduce_cost(t, self.size, p))
        return t

    def _point_to_point(self, *args, **kwargs):
        raise NotImplementedError("CountingComm counts collectives; point-to-point messages "
                                  "(the master algorithm) are counted by "
                                  "cost_model.master_counts")

    send = recv = hypercube_all_gather = _point_to_point


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _ring_all_gather_cost(chunks: list[torch.Tensor], F: int, p: int) -> tuple[int, int]:
    """Messages and bytes rank p sends in a ring all-gather: at step s the slice of p - s."""
    return F - 1, sum(_nbytes(chunks[(p - s) % F]) for s in range(F - 1))


def _ring_all_reduce_cost(t: torch.Tensor, F: int, p: int) -> tuple[int, int]:
    """Messages and bytes rank p sends in a ring all-reduce of ``t`` cut into F chunks: at
    step s of the reduce-scatter chunk p - s, at step s of the all-gather chunk p + 1 - s."""
    n = t.numel()
    chunk = [(n // F + (1 if q < n % F else 0)) * t.element_size() for q in range(F)]
    return 2 * (F - 1), sum(chunk[(p - s) % F] + chunk[(p + 1 - s) % F] for s in range(F - 1))
