"""The rows a replica trains on in a balanced epoch, and the rows moved between replicas.

A faster replica consumes its shard faster, so an epoch is fixed by the global batch:
ceil(total rows / |B|) steps, each replica drawing |B_p| rows per step from its own shard in a
fresh random order per pass, wrapping around into the next pass when its shard runs out
(``balanced_batches``). With ``rows="move"`` (the default) the shards are first made
proportional to the split: a replica with more rows than its share lends the tail of its shard
to one with fewer, over the stage's process group (``move_plan``, ``move_rows``), so an epoch
is one pass over every row (the wrap-around then only fills the last step). Only the
difference moves, again after an adaptive re-split; the rows lent stay with their new holder
for the rest of the fit. With ``rows="wrap"`` nothing moves: a fast replica's rows come round
more often than a slow one's (unbiased for random partitions, but each epoch sees fewer
distinct rows).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Iterator, Sequence

import numpy as np
import torch

from ..data.bridge import spec_row_bytes
from ..data.memory import memory_headroom
from ..errors import ResourceError

__all__ = ["ROW_MODES", "balanced_batches", "move_plan", "move_rows", "rebatch", "row_targets"]

ROW_MODES = ("move", "wrap")


def rebatch(batches: Iterable[tuple], size: int) -> Iterator[tuple]:
    """Batches of exactly ``size`` rows cut from a stream of (x, y) batches of any sizes."""
    xs, ys, have = [], [], 0
    for x, y in batches:
        while len(x):
            take = min(size - have, len(x))
            xs.append(x[:take])
            ys.append(None if y is None else y[:take])
            have += take
            x, y = x[take:], (None if y is None else y[take:])
            if have == size:
                yield (xs[0] if len(xs) == 1 else torch.cat(xs),
                       None if ys[0] is None else ys[0] if len(ys) == 1 else torch.cat(ys))
                xs, ys, have = [], [], 0


def balanced_batches(shard, size: int, steps: int, *, shuffle: bool, seed: int, epoch: int,
                     transform=None) -> Iterator[tuple]:
    """``steps`` batches of exactly ``size`` rows of ``shard`` for ``epoch``: its rows in a
    random order per pass (the first pass of an epoch in the order of the unbalanced epoch),
    wrapping into the next pass when the shard runs out. An empty shard or a size of 0 gives
    no rows."""
    if size <= 0 or len(shard) == 0 or steps <= 0:
        return iter(())

    def passes():
        k = 0
        while True:
            yield from shard.batches(size, shuffle=shuffle, transform=transform, seed=seed,
                                     epoch=epoch if k == 0 else (epoch + 1) * 1_000_003 + k)
            k += 1

    out = rebatch(passes(), size)
    return (next(out) for _ in range(steps))


def row_targets(rows: int, batches: Sequence[int]) -> list[int]:
    """``rows`` split ∝ each replica's batch by largest remainders (0 rows for a batch of 0):
    the shard sizes at which every replica's pass over its rows takes as many steps."""
    total = sum(batches)
    quota = [rows * b / total for b in batches]
    out = [math.floor(q) for q in quota]
    for p in sorted(range(len(out)), key=lambda p: (-(quota[p] - out[p]), p))[:rows - sum(out)]:
        out[p] += 1
    return out


def move_plan(have: Sequence[int], want: Sequence[int]) -> list[tuple[int, int, int]]:
    """Transfers [(src, dst, rows)] that turn holdings ``have`` into ``want`` (equal sums):
    every replica over its target lends the tail of its rows, in rank order, to those under
    theirs, in rank order. A replica only sends or only receives, and the transfers come in
    the same order on both sides, so blocking sends cannot deadlock."""
    if sum(have) != sum(want) or len(have) != len(want):
        raise ValueError(f"cannot move rows {list(have)} into {list(want)}")
    give = [[p, h - w] for p, (h, w) in enumerate(zip(have, want)) if h > w]
    take = [[p, w - h] for p, (h, w) in enumerate(zip(have, want)) if w > h]
    plan, i, j = [], 0, 0
    while i < len(give) and j < len(take):
        k = min(give[i][1], take[j][1])
        plan.append((give[i][0], take[j][0], k))
        give[i][1] -= k
        take[j][1] -= k
        i += give[i][1] == 0
        j += take[j][1] == 0
    return plan


def move_rows(shard, plan: Sequence[tuple[int, int, int]], rank: int, device) -> int:
    """Carry out ``move_plan``'s transfers that concern this rank over the default process
    group (raw bytes: any storage dtype; a CUDA tensor under NCCL). A lender sends the tail of
    its shard and drops it; a borrower appends what it receives. Returns the rows moved here.

    Every rank calls it with the same plan. The borrowers' memory is checked first, by all
    ranks together (an in-memory shard is copied once to grow): when one cannot hold its rows,
    every rank raises the same ResourceError and nothing has moved."""
    import torch.distributed as dist
    if not plan:
        return 0
    lent = sum(k for src, _, k in plan if src == rank)
    borrowed = sum(k for _, dst, k in plan if dst == rank)
    shape, dtype, lab = shard.spec()
    x_row, y_row = spec_row_bytes(shard.spec())
    wire = device if device.type == "cuda" else torch.device("cpu")
    need, room = 0, 1
    if borrowed and getattr(shard, "kind", "memory") == "memory":
        need, room = (len(shard) + borrowed) * (x_row + y_row), memory_headroom()
    mine = torch.tensor([need, room], dtype=torch.float64, device=wire)
    table = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(table, mine)
    short = [(p, int(t[0]), int(t[1])) for p, t in enumerate(table) if t[0] > t[1]]
    if short:
        p, need, room = short[0]
        raise ResourceError(
            f"replica {p} cannot take its share of rows for the balanced split: its shard "
            f"would need {need / 2**20:.0f} MiB in memory, and {room / 2**20:.0f} MiB are "
            f"left; stream the data (fit(data='stream')), give the executors more memory, "
            f"or use balance_rows='wrap' (no rows move)")
    if not lent and not borrowed:
        return 0

    def send(a: np.ndarray, dst: int) -> None:
        dist.send(torch.from_numpy(np.ascontiguousarray(a).reshape(-1).view(np.uint8))
                  .to(wire), dst)

    def recv(n: int, row: int, src: int, dt, shp) -> np.ndarray:
        buf = torch.empty(n * row, dtype=torch.uint8, device=wire)
        dist.recv(buf, src)
        return buf.cpu().numpy().view(dt).reshape(n, *shp)

    if lent:
        n = len(shard)
        chunks = shard.tail(lent)
        for src, dst, k in plan:
            if src != rank:
                continue
            left = k
            while left:
                x, y = next(chunks)
                if len(x) > left:        # a chunk straddles two borrowers: cut it
                    chunks = itertools.chain([(x[left:], None if y is None else y[left:])],
                                             chunks)
                    x, y = x[:left], None if y is None else y[:left]
                dist.send(torch.tensor([len(x)], dtype=torch.int64, device=wire), dst)
                send(x, dst)
                if y is not None:
                    send(y, dst)
                left -= len(x)
        shard.truncate(n - lent)
        return lent

    def incoming():
        for src, dst, k in plan:
            if dst != rank:
                continue
            left = k
            while left:
                count = torch.empty(1, dtype=torch.int64, device=wire)
                dist.recv(count, src)
                m = int(count.item())
                x = recv(m, x_row, src, dtype, shape)
                y = None if lab is None else recv(m, y_row, src, lab[1], lab[0])
                yield x, y
                left -= m

    shard.extend(incoming())
    return borrowed
