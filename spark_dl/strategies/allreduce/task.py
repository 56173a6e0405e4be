"""Synchronous data parallelism in one Spark barrier stage: every step, ring all-reduce of the
gradients (bucketed), weighted by samples.

Each of R tasks reads its own partition through the Arrow bridge, builds the model from the
same seed (and takes rank 0's weights to be sure), and per step runs ``accumulate``
micro-batches, sums ``n_i * grad(mean loss_i)`` locally, all-reduces the sums together with the
sample count, and divides: every replica then holds the gradient of the mean loss over the
global batch, however unevenly the data is split. All replicas run the same number of steps
per epoch (that of the largest shard); a replica whose shard is used up contributes zero
samples (join semantics). Checkpoints go to the run directory after every epoch; a retried
stage resumes from the last one.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch import nn

from spark_dl.runtime.amp import autocast
from spark_dl.runtime.loop import FitParts, Hooks, ReplicaLoop, replica_task
from spark_dl.runtime.seeds import replica_seed
from spark_dl.runtime.stage import LocalStepConfig, shared_memory_name

__all__ = ["AllReduceHooks", "GradientSync", "make_task"]


class GradientSync:
    """Bucketed all-reduce of summed gradients plus (loss sum, sample count); sample-weighted.

    Buckets are flat buffers of about ``bucket_mb`` MB, reduced asynchronously in parallel;
    the last one carries two extra values, the local loss sum and sample count. Every
    ``p.grad`` is a view into its bucket (as DDP's ``gradient_as_bucket_view``), so backward
    accumulates straight into the buffers that are reduced: no copies in or out. The messages,
    bytes and seconds spent are counted.
    """

    def __init__(self, params: list[nn.Parameter], bucket_mb: float = 25.0, shm_name=None,
                 timeout_s: float = 300.0):
        self.params = [p for p in params if p.requires_grad]
        limit = max(1, int(bucket_mb * 2**20 / self.params[0].element_size()))
        if shm_name is not None:
            limit = float("inf")              # one segment, one barrier per step
        self.buckets: list[list[nn.Parameter]] = [[]]
        size = 0
        for p in self.params:
            if size and size + p.numel() > limit:
                self.buckets.append([])
                size = 0
            self.buckets[-1].append(p)
            size += p.numel()
        ref = self.params[0]
        self.flats, self.views = [], []
        for i, bucket in enumerate(self.buckets):
            n = sum(p.numel() for p in bucket)
            flat = torch.zeros(n + (2 if i == len(self.buckets) - 1 else 0), dtype=ref.dtype,
                               device=ref.device)
            off = 0
            for p in bucket:
                view = flat[off:off + p.numel()].view_as(p)
                if p.grad is not None:
                    view.copy_(p.grad)
                p.grad = view
                self.views.append((p, view))
                off += p.numel()
            self.flats.append(flat)
        self.grad_numels = [sum(p.numel() for p in b) for b in self.buckets]
        self.calls = self.bytes = 0
        self.seconds = 0.0                # wall time inside the all-reduce (incl. waiting)
        self.shm = None
        if shm_name is not None:
            from spark_dl.transport.shm import ShmAllReduce
            self.shm = ShmAllReduce(self.flats[0].numel(), ref.dtype, shm_name, timeout_s)
        self.world = dist.get_world_size()
        self.transport = "shm" if self.shm is not None else dist.get_backend() \
            if self.world > 1 else "none"

    def __call__(self, loss_sum: float, count: int) -> tuple[float, float]:
        """Make every .grad the global sample-weighted mean gradient; returns the global
        (mean loss, sample count)."""
        t0 = time.perf_counter()
        for p, view in self.views:            # someone replaced a .grad: bring it back
            if p.grad is None:
                view.zero_()
                p.grad = view
            elif p.grad.data_ptr() != view.data_ptr():
                view.copy_(p.grad)
                p.grad = view
        self.flats[-1][-2] = loss_sum          # a tensor: no host synchronisation
        self.flats[-1][-1] = count
        works = []
        for flat in self.flats if self.world > 1 else ():     # one replica: nothing to reduce
            if self.shm is not None:
                self.shm(flat)
            else:
                works.append(dist.all_reduce(flat, async_op=True))
            self.bytes += flat.numel() * flat.element_size()
        for w in works:
            w.wait()
        self.seconds += time.perf_counter() - t0
        self.calls += 1
        total = self.flats[-1][-1].clamp(min=1.0)            # tensors: no host sync
        loss = self.flats[-1][-2] / total
        for flat, n in zip(self.flats, self.grad_numels):
            flat[:n].div_(total)
        return loss, self.flats[-1][-1]

    def zero_grad(self) -> None:
        for flat in self.flats:
            flat.zero_()


def make_task(cfg: LocalStepConfig, options, parts: FitParts, secret: str,
              channel: tuple[str, int] | None):
    """The function ``df.mapInArrow(task, RESULT_SCHEMA, barrier=True)`` runs on every task;
    ``options``: the ``AllReduce`` with its resolved ``average`` and ``balance``."""
    return replica_task(cfg, options, AllReduceHooks, parts, secret, channel)


class AllReduceHooks(Hooks):
    """AllReduce's part of the replica loop: every step the sample-weighted sum of the
    replicas' gradients (GradientSync), or with a balancer their shares of the global batch;
    one replica without a balancer steps as a plain loop does."""

    name = "allreduce"
    agree = True
    totals_global = True

    def __init__(self, cfg: LocalStepConfig, options):
        super().__init__(cfg, options)
        self.accumulate = options.accumulate
        self.sync = self.balancer = None

    def build(self, loop: ReplicaLoop) -> None:
        opts = self.options
        # One replica without a balancer has nothing to reduce: its step is the plain loop's
        # (gradients set to None and made afresh by backward, no buckets, no copies)
        self.local = loop.world == 1 and opts.balance is None
        if not self.local:
            shm_name = shared_memory_name(loop.statuses, loop.rank, loop.world, loop.device) \
                if opts.transport == "auto" else None
            self.sync = GradientSync(list(loop.model.parameters()), opts.bucket_mb, shm_name,
                                     self.cfg.timeout_s)

    def steps(self, loop: ReplicaLoop) -> int:
        cfg, opts = self.cfg, self.options
        if opts.balance is None:
            return super().steps(loop)
        from spark_dl.balance import Balancer
        self.balancer = Balancer(
            opts.balance, model=loop.model, loss_fn=loop.loss_fn, shard=loop.shard,
            batch_size=cfg.batch_size, accumulate=opts.accumulate, device=loop.device,
            dtype=loop.dtype, rank=loop.rank, world=loop.world, max_batch=opts.max_batch,
            profile_steps=opts.profile_steps, transform=cfg.transform,
            autocast=(lambda: autocast(loop.device, opts.amp)) if opts.amp else None,
            rows=opts.balance_rows)
        return self.balancer.steps

    def restore(self, loop: ReplicaLoop, state: dict) -> None:
        if self.balancer is not None:
            self.balancer.restore(state.get("balance"))

    def batches(self, loop: ReplicaLoop, epoch: int):
        if self.balancer is None:
            return None
        return self.balancer.epoch(loop.shard, shuffle=self.cfg.shuffle,
                                   seed=replica_seed(self.cfg.seed, loop.rank), epoch=epoch,
                                   accumulate=self.options.accumulate,
                                   transform=self.cfg.transform)

    def step(self, loop: ReplicaLoop, micro: list, totals: torch.Tensor) -> None:
        if self.local:
            self._local_step(loop, micro, totals)
        else:
            self._synced_step(loop, micro, totals)

    def _local_step(self, loop: ReplicaLoop, micro: list, totals: torch.Tensor) -> None:
        """One replica's step: the mean loss over its micro-batches, as a plain loop does."""
        opt, precision = loop.opt, loop.precision
        count = sum(len(x) for x, _ in micro)
        losses = []                                  # (mean loss, rows) of each micro-batch

        def closure():
            opt.zero_grad(set_to_none=True)
            losses.clear()
            for x, y in micro:
                loss = loop.forward_loss(x, y)
                scaled = loss if len(x) == count else loss * (len(x) / count)
                (scaled if loop.closure_opt else precision.scale_loss(scaled)).backward()
                losses.append((loss.detach(), len(x)))
            if not loop.closure_opt:                 # SGD & co. read no loss: no extra kernels
                return None
            if not losses:                           # no rows left this step
                return torch.zeros((), dtype=loop.dtype, device=loop.device)
            return sum(loss * n for loss, n in losses) / count
        if loop.closure_opt:
            opt.step(closure)
        else:
            closure()
            grads = [p.grad for p in loop.model.parameters() if p.grad is not None]
            if count and precision.unscale(grads):
                if loop.clip.on:
                    loop.clip(grads)
                opt.step()
        for loss, n in losses:                       # on the device: no host synchronisation
            totals[0].add_(loss, alpha=n)
        totals[1] += count

    def _synced_step(self, loop: ReplicaLoop, micro: list, totals: torch.Tensor) -> None:
        """The global batch's step: every replica's summed gradients all-reduced."""
        opt, precision, sync, balancer = loop.opt, loop.precision, self.sync, self.balancer

        def closure():
            sync.zero_grad()
            loss_sum, count = torch.zeros((), dtype=loop.dtype, device=loop.device), 0
            for x, y in micro:
                loss = loop.forward_loss(x, y)
                scaled = loss * len(x)
                (scaled if loop.closure_opt else precision.scale_loss(scaled)).backward()
                loss_sum += loss.detach().to(loop.dtype) * len(x)   # no host sync per step
                count += len(x)
            if balancer is not None:
                balancer.syncing(count)
            mean, _total = sync(loss_sum, count)
            if balancer is not None:
                balancer.synced()
            return mean
        if loop.closure_opt:
            opt.step(closure)
        else:
            closure()
            grads = [flat[:n] for flat, n in zip(sync.flats, sync.grad_numels)]
            if precision.unscale(grads):             # the global mean gradient: every
                if loop.clip.on:                     # replica cuts and steps it alike
                    loop.clip(grads)
                opt.step()
        totals += sync.flats[-1][-2:].to(torch.float64)  # (global loss sum, samples)

    def row(self, loop: ReplicaLoop) -> dict:
        return {"balance": self.balancer.end_epoch()} if self.balancer is not None else {}

    def state(self, loop: ReplicaLoop) -> dict:
        return {"balance": self.balancer.state()} if self.balancer is not None else {}

    def info(self, loop: ReplicaLoop) -> dict:
        sync = self.sync
        return {"allreduce_calls": sync.calls if sync else 0,
                "allreduce_bytes": sync.bytes if sync else 0,
                "buckets": len(sync.buckets) if sync else 0,
                "transport": sync.transport if sync else "none",
                "balance": self.balancer.info() if self.balancer is not None else None,
                "timings": {"allreduce_s": sync.seconds if sync else 0.0}}

    def close(self) -> None:
        if self.sync is not None and self.sync.shm is not None:
            self.sync.shm.close()
