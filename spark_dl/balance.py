"""Heterogeneous replicas in a synchronous step: the global batch split in proportion to each
replica's measured speed (seed 001, §E of the seed notes), so that all finish their share of a
step together instead of waiting for the slowest.

The split. Each replica's speed s_p(b) (samples/s at batch b) is measured, before training,
by timing forward + backward at two batch sizes on its own rows (``profile``), which fits
t_p(b) = a_p + c_p b; the global batch |B| is then split with |B_p| ∝ s_p(|B_p|) (a fixed
point: the batch sizes at which every replica's step takes as long), rounded by largest
remainders and capped by what each task's memory holds (``split``). ``balance="adaptive"``
re-splits after every epoch from the epoch's own step times (LB-BSP): a replica that slows
down mid-fit is followed. The gradients are summed weighted by samples, so every step's
gradient is the mean over the whole global batch, whatever the split.

One pass over the data. A faster replica consumes its shard faster, so an epoch is fixed by
the global batch: ceil(total rows / |B|) steps, each replica drawing |B_p| rows per step from
its own shard in a fresh random order per pass, wrapping around into the next pass when its
shard runs out (``balanced_batches``). With ``rows="move"`` (the default) the shards are first
made proportional to the split: a replica with more rows than its share lends the tail of its
shard to one with fewer, over the stage's process group (``move_plan``, ``move_rows``), so an
epoch is one pass over every row (the wrap-around then only fills the last step). Only the
difference moves, again after an adaptive re-split; the rows lent stay with their new holder
for the rest of the fit. With ``rows="wrap"`` nothing moves: a fast replica's rows come round
more often than a slow one's (unbiased for random partitions, but each epoch sees fewer
distinct rows).
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Iterable, Iterator, Sequence

import numpy as np
import torch

from .data.bridge import spec_row_bytes
from .data.memory import memory_headroom
from .errors import ConfigError, DataError, ResourceError

__all__ = [
    "BALANCE_MODES",
    "activation_bytes",
    "balanced_batches",
    "check_balance",
    "equal_time_split",
    "measure",
    "memory_cap",
    "move_plan",
    "move_rows",
    "profile",
    "rebatch",
    "row_targets",
    "split",
]

BALANCE_MODES = (None, "speed", "adaptive")
ROW_MODES = ("move", "wrap")


def check_balance(balance, replicas: int | None = None) -> None:
    """ConfigError unless ``balance`` is None, "speed", "adaptive" or a sequence of positive
    finite shares (one per replica when ``replicas`` is known)."""
    if balance in BALANCE_MODES:
        return
    if isinstance(balance, str) or not isinstance(balance, Sequence):
        raise ConfigError(f"balance must be None, 'speed', 'adaptive' or a list of each "
                          f"replica's share of the global batch (e.g. [2, 1]), got {balance!r}")
    bad = [w for w in balance if isinstance(w, bool) or not isinstance(w, (int, float))
           or not math.isfinite(w) or w <= 0]
    if bad or not balance:
        raise ConfigError(f"balance shares must be positive finite numbers, got "
                          f"{list(balance)!r}")
    if replicas is not None and len(balance) != replicas:
        raise ConfigError(f"balance gives {len(balance)} shares but the fit has {replicas} "
                          f"replicas: give one share per replica")


def _check_speeds(speeds: Sequence[float]) -> None:
    for p, s in enumerate(speeds):
        if not (isinstance(s, (int, float)) and math.isfinite(s) and s > 0):
            raise ResourceError(
                f"replica {p}'s measured speed is {s!r} samples/s: it cannot be given a share "
                f"of the batch (a stalled or broken task, or a profile of zero steps); check "
                f"that task's executor, or use balance=None")


def split(total: int, speeds: Sequence[float], caps: Sequence[int] | None = None) -> list[int]:
    """``total`` rows split ∝ ``speeds`` by largest remainders, no share above its cap.

    A share whose proportional quota exceeds its cap is set to the cap and the rest is split
    over the others ∝ their speeds (water filling). Every replica gets at least one row when
    ``total`` allows, so its speed can still be measured. ResourceError when a cap is below one
    sample or the caps together hold less than ``total``."""
    n = len(speeds)
    _check_speeds(speeds)
    caps = [int(c) for c in caps] if caps is not None else [total] * n
    if len(caps) != n:
        raise ValueError(f"{n} speeds but {len(caps)} caps")
    for p, c in enumerate(caps):
        if c < 1:
            raise ResourceError(f"replica {p}'s memory holds {c} samples per step, less than "
                                f"one: give its executor more memory, or use a smaller model")
    if sum(caps) < total:
        raise ResourceError(f"the global batch of {total} rows does not fit the replicas' "
                            f"memory (at most {caps} rows per step each, {sum(caps)} in all): "
                            f"lower batch_size or give the executors more memory")
    fixed: dict[int, int] = {}
    while True:                               # water filling: shares over their cap are capped
        free = [p for p in range(n) if p not in fixed]
        left = total - sum(fixed.values())
        weight = sum(speeds[p] for p in free)
        quota = {p: left * speeds[p] / weight for p in free}
        over = [p for p in free if quota[p] > caps[p]]
        if not over:
            break
        for p in over:
            fixed[p] = caps[p]
    shares = {**fixed, **{p: math.floor(quota[p]) for p in free}}
    order = sorted(free, key=lambda p: (-(quota[p] - math.floor(quota[p])), p))
    rest = total - sum(shares.values())
    for p in order:                           # largest remainders first, within the caps
        if rest == 0:
            break
        if shares[p] < caps[p]:
            shares[p] += 1
            rest -= 1
    out = [shares[p] for p in range(n)]
    if total >= n:                            # nobody starves: its speed stays measurable
        for p in range(n):
            if out[p] == 0:
                donor = max(range(n), key=lambda q: (out[q], -q))
                out[donor] -= 1
                out[p] = 1
    return out


def equal_time_split(total: int, step_time: Sequence[Callable[[float], float]],
                     caps: Sequence[int] | None = None, rounds: int = 9) -> list[int]:
    """Shares ∝ each replica's speed at its own share, s_p(b_p) = b_p / t_p(b_p): the fixed
    point of ``split`` where every replica's step takes as long (starting from equal shares;
    a share of 0 is timed as 1 row)."""
    n = len(step_time)
    shares = [total / n] * n
    for _ in range(rounds):
        sizes = [max(b, 1) for b in shares]
        shares = split(total, [b / max(t(b), 1e-12) for b, t in zip(sizes, step_time)], caps)
    return shares


def activation_bytes(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor,
                     loss_fn: Callable) -> int:
    """Bytes that one forward of the batch ``x`` keeps for backward (the tensors autograd
    saves, the parameters themselves not counted), plus the batch itself."""
    params = {p.data_ptr() for p in model.parameters()}
    seen: dict[tuple, int] = {}

    def pack(t):
        if t.data_ptr() not in params:
            seen[(t.data_ptr(), t.numel(), t.dtype)] = t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss_fn(model(x), y)
    return sum(seen.values()) + x.numel() * x.element_size()


def memory_cap(bytes_per_sample: float, device: torch.device, fraction: float = 0.5) -> int:
    """Rows per step that fit ``fraction`` of what this task may still allocate (the GPU's
    free memory, or the process's headroom on the CPU: its address-space limit under
    spark.executor.pyspark.memory, else its share of the machine's available memory)."""
    room = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else memory_headroom()
    return int(room * fraction // max(bytes_per_sample, 1.0))


def profile(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor], loss_fn: Callable,
            sizes: tuple[int, int], repeats: int = 3, autocast=None,
            sync: Callable[[], None] = lambda: None, min_seconds: float = 0.3) -> dict:
    """Time forward + backward of this replica's own rows at two batch sizes, alternately,
    after one warm-up each, at least ``repeats`` times each and for at least ``min_seconds`` in
    all (a core shared with another process is shared by time slices of a few ms: a short
    window would see a whole slice or none) -> {"sizes", "seconds" (mean per step), "a",
    "c", "bytes_per_sample"}: t(b) = a + c·b. The gradients are zeroed after: nothing is
    trained."""
    import contextlib
    x, y = batch
    parts = [(x[:b], y[:b]) for b in sizes]
    spent, counts = [0.0] * len(parts), [0] * len(parts)

    def step(xb, yb) -> float:
        sync()
        t0 = time.perf_counter()
        with autocast() if autocast else contextlib.nullcontext():
            loss = loss_fn(model(xb), yb)
        loss.backward()
        sync()
        return time.perf_counter() - t0

    for xb, yb in parts:
        step(xb, yb)                                     # warm-up
    t_start = time.perf_counter()
    while min(counts) < repeats or time.perf_counter() - t_start < min_seconds:
        for i, (xb, yb) in enumerate(parts):
            spent[i] += step(xb, yb)
            counts[i] += 1
    model.zero_grad(set_to_none=False)
    out = {"sizes": [len(xb) for xb, _ in parts],
           "seconds": [t / n for t, n in zip(spent, counts)], "steps": counts}
    (b1, b2), (t1, t2) = out["sizes"], out["seconds"]
    c = (t2 - t1) / (b2 - b1) if b2 != b1 else t2 / max(b2, 1)
    c = max(c, 1e-3 * t2 / max(b2, 1))       # noise must not make rows free
    xb, yb = parts[-1]
    out.update(a=max(t2 - c * b2, 0.0), c=c,
               bytes_per_sample=activation_bytes(model, xb, yb, loss_fn) / max(len(xb), 1))
    model.zero_grad(set_to_none=False)
    return out


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


def measure(mode, *, model, loss_fn, shard, batch_size: int, device, dtype,
            max_batch: int | None = None, profile_steps: int = 3, transform=None,
            autocast=None) -> list[float]:
    """This replica's [a, c, bytes per sample, cap] for a split: its step time t(b) = a + c b
    profiled on its own first rows ("speed", "adaptive"; NaN for fixed shares), the bytes a
    row keeps for backward and the rows per step its memory holds (at most ``max_batch``).
    An empty shard gives [NaN, NaN, NaN, 0]. Draws no random numbers of the fit."""
    if not len(shard):
        return [math.nan, math.nan, math.nan, 0.0]
    rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    buffers = [b.detach().clone() for b in model.buffers()]     # BatchNorm's running stats
    b2 = max(1, min(2 * batch_size, len(shard)))
    x, y = next(iter(shard.batches(b2, shuffle=False, transform=transform)))
    x = x.to(device=device, dtype=dtype)
    y = y.to(device=device, dtype=dtype if y.is_floating_point() else y.dtype)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    if mode in ("speed", "adaptive"):
        prof = profile(model, (x, y), loss_fn, (max(1, b2 // 4), b2), profile_steps, autocast,
                       sync)
    else:
        prof = {"a": math.nan, "c": math.nan,
                "bytes_per_sample": activation_bytes(model, x[:batch_size], y[:batch_size],
                                                     loss_fn) / len(x[:batch_size])}
        model.zero_grad(set_to_none=False)
    cap = memory_cap(prof["bytes_per_sample"], device)
    if max_batch is not None:
        cap = min(cap, max_batch)
    torch.set_rng_state(rng)
    if cuda_rng is not None:
        torch.cuda.set_rng_state(cuda_rng, device)
    with torch.no_grad():
        for b, saved in zip(model.buffers(), buffers):
            b.copy_(saved)
    return [prof["a"], prof["c"], prof["bytes_per_sample"], float(cap)]


class Balancer:
    """A replica's side of a balanced synchronous stage (all-reduce): its share of the global
    batch per epoch, the steps of an epoch, and the re-split after each epoch.

    ``mode``: "speed" (profiled once, before training), "adaptive" (profiled, then re-split
    from every epoch's step times) or a sequence of fixed shares. Every rank computes the same
    split from the same all-gathered measurements. ``rows``: "move" (shards made proportional
    to the split before an epoch that needs it, ``move_rows``) or "wrap" (see the module)."""

    def __init__(self, mode, *, model, loss_fn, shard, batch_size: int, accumulate: int,
                 device, dtype, rank: int, world: int, max_batch: int | None,
                 profile_steps: int = 3, transform=None, autocast=None, rows: str = "move"):
        self.mode, self.rank, self.world, self.device = mode, rank, world, device
        self.row_mode, self.moved = rows, 0
        self.total = batch_size * world
        self.compute_s, self.samples, self.mark = 0.0, 0, time.perf_counter()
        table = self._gather([len(shard), *spec_row_bytes(shard.spec())])
        self.rows = [int(r) for r in table[:, 0]]
        self.have = list(self.rows)
        kinds = {(int(a), int(b)) for n, a, b in table.tolist() if n > 0}
        if rows == "move" and len(kinds) > 1:
            raise DataError(f"the partitions hold rows of different sizes (bytes of features "
                            f"and label per row: {sorted(kinds)}): rows cannot move between "
                            f"replicas; give every partition the same schema and shapes, or "
                            f"use balance_rows='wrap'")
        self.steps = max(1, math.ceil(sum(self.rows) / (self.total * accumulate)))
        stats = measure(mode, model=model, loss_fn=loss_fn, shard=shard, batch_size=batch_size,
                        device=device, dtype=dtype, max_batch=max_batch,
                        profile_steps=profile_steps, transform=transform, autocast=autocast)
        table = self._gather(stats)
        self.caps = [int(c) for c in table[:, 3]]
        self.active = [p for p in range(world) if self.rows[p] > 0]
        self.profile = [{"rows": self.rows[p], "a_s": float(table[p, 0]),
                         "c_s_per_sample": float(table[p, 1]),
                         "bytes_per_sample": float(table[p, 2]), "cap": self.caps[p]}
                        for p in range(world)]
        self.model = {p: (float(table[p, 0]), float(table[p, 1])) for p in self.active}
        if mode in ("speed", "adaptive"):
            fns = [lambda b, a=a, c=c: a + c * b for a, c in self.model.values()]
            for p in self.active:
                a, c = float(table[p, 0]), float(table[p, 1])
                self.profile[p]["samples_per_s_at_batch"] = batch_size / (a + c * batch_size)
            shares = equal_time_split(self.total, fns, [self.caps[p] for p in self.active])
        else:
            shares = split(self.total, [float(mode[p]) for p in self.active],
                           [self.caps[p] for p in self.active])
        self.batches = [0] * world
        for p, s in zip(self.active, shares):
            self.batches[p] = s
        self.first = list(self.batches)

    def _gather(self, values) -> torch.Tensor:
        import torch.distributed as dist
        mine = torch.tensor([float(v) for v in values], dtype=torch.float64,
                            device=self.device)
        parts = [torch.empty_like(mine) for _ in range(self.world)]
        dist.all_gather(parts, mine)
        return torch.stack(parts).cpu()

    @property
    def batch(self) -> int:
        """This replica's rows per micro-batch this epoch."""
        return self.batches[self.rank]

    def epoch(self, shard, *, shuffle: bool, seed: int, epoch: int, accumulate: int,
              transform=None) -> Iterator[tuple]:
        """This epoch's batches of this replica (steps × accumulate of them)."""
        if self.row_mode == "move":
            want = row_targets(sum(self.rows), self.batches)
            if want != self.have:
                self.moved += move_rows(shard, move_plan(self.have, want), self.rank,
                                        self.device)
                self.have = want
        self.compute_s, self.samples, self.mark = 0.0, 0, time.perf_counter()
        return balanced_batches(shard, self.batch, self.steps * accumulate, shuffle=shuffle,
                                seed=seed, epoch=epoch, transform=transform)

    def syncing(self, samples: int) -> None:
        """Called as the step's gradients go out: this replica's own work since the last
        all-reduce came back (its batch read, forward, backward, the optimizer step), not
        the wait for the others, counts towards its step time."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)       # the step's kernels, not their launch
        self.compute_s += time.perf_counter() - self.mark
        self.samples += samples

    def synced(self) -> None:
        self.mark = time.perf_counter()

    def end_epoch(self) -> dict:
        """Every replica's batch and compute seconds per step this epoch (for the history);
        in adaptive mode, the next epoch's split from them."""
        table = self._gather([self.batch, self.compute_s / self.steps, self.samples,
                              self.compute_s])
        row = {"batches": list(self.batches), "rows": list(self.have),
               "step_s": [round(float(t), 6) for t in table[:, 1]]}
        if self.mode == "adaptive":
            # each replica's step-time model t(b) = a + c b, scaled by how much longer (or
            # shorter) its steps took this epoch than the model says: a slowdown factor
            fns = []
            for p in self.active:
                a, c = self.model[p]
                measured, b = float(table[p, 1]), self.batches[p]
                k = measured / (a + c * b) if measured > 0 and a + c * b > 0 else math.nan
                if not math.isfinite(k) or k <= 0:
                    raise ResourceError(
                        f"replica {p}'s measured step time this epoch is {measured!r} s: it "
                        f"cannot be given a share of the batch; check that task's executor, "
                        f"or use balance='speed'")
                self.model[p] = (a * k, c * k)
                fns.append(lambda b, a=a * k, c=c * k: a + c * b)
            shares = equal_time_split(self.total, fns, [self.caps[p] for p in self.active])
            for p, s in zip(self.active, shares):
                self.batches[p] = s
        return row

    def info(self) -> dict:
        return {"mode": self.mode if isinstance(self.mode, str) else list(self.mode),
                "global_batch": self.total, "steps_per_epoch": self.steps,
                "rows": self.row_mode, "rows_moved_here": self.moved,
                "first_split": self.first, "last_split": list(self.batches),
                "replicas": self.profile}

    def state(self) -> list[int]:
        return list(self.batches)

    def restore(self, batches) -> None:
        """The checkpoint's split for the next epoch, when it still fits: the same global
        batch, rows for the same replicas, within their caps (else the fresh split stays)."""
        if batches is None or len(batches) != self.world:
            return
        batches = [int(b) for b in batches]
        if sum(batches) == self.total and all(
                (b > 0) == (p in self.active) and b <= self.caps[p]
                for p, b in enumerate(batches)):
            self.batches = batches
