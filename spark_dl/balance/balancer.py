"""A replica's side of a balanced synchronous stage (all-reduce): the split made from every
replica's measurements, its rows moved, its batches drawn, and the re-split after an epoch."""

from __future__ import annotations

import math
import time
from collections.abc import Iterator

import torch

from ..data.bridge import spec_row_bytes
from ..errors import DataError, ResourceError
from .rows import balanced_batches, move_plan, move_rows, row_targets
from .speed import measure
from .split import equal_time_split, split

__all__ = ["Balancer"]


class Balancer:
    """A replica's side of a balanced synchronous stage (all-reduce): its share of the global
    batch per epoch, the steps of an epoch, and the re-split after each epoch.

    ``mode``: "speed" (profiled once, before training), "adaptive" (profiled, then re-split
    from every epoch's step times) or a sequence of fixed shares. Every rank computes the same
    split from the same all-gathered measurements. ``rows``: "move" (shards made proportional
    to the split before an epoch that needs it, ``move_rows``) or "wrap" (see rows.py)."""

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
