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

import dataclasses
import time
from collections.abc import Callable

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from spark_dl.optim.factory import load_optimizer_state
from spark_dl.runtime.amp import autocast
from spark_dl.runtime.checkpoint import save_atomic
from spark_dl.runtime.seeds import replica_seed
from spark_dl.runtime.stage import (
    LocalStepConfig,
    StepReports,
    Validation,
    barrier_task,
    most_batches,
    own_statistics,
    read_checkpoint,
    set_lr,
    shared_memory_name,
    stage_info,
    state_bytes,
    sync_buffers,
)

__all__ = ["AllReduceConfig", "GradientSync", "make_task"]


@dataclasses.dataclass(frozen=True)
class AllReduceConfig(LocalStepConfig):
    """Plain values shipped to the tasks (see ``spark_dl.fit`` for their meaning)."""

    accumulate: int = 1
    amp: str | None = None
    bucket_mb: float = 25.0
    transport: str = "auto"       # "auto": shared memory when all replicas share a host, else
                                  # the process group (gloo/NCCL); "process_group": always that
    balance: str | tuple | None = None   # None, "speed", "adaptive" or fixed shares
    max_batch: int | None = None  # a replica's rows per micro-batch at most (balance)
    profile_steps: int = 3        # timed steps per batch size when balance profiles
    balance_rows: str = "move"    # "move": shards made ∝ the split; "wrap": rows stay put
    average: float = 0.0          # > 0: validate and return the weights' moving average over
                                  # that fraction of an epoch (spark_dl.optim.average)


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


def make_task(cfg: AllReduceConfig, model_fn: Callable[[], nn.Module], loss_fn: Callable,
              secret: str, channel: tuple[str, int] | None, run_dir: str | None,
              validation: tuple[np.ndarray, np.ndarray] | None, optimizer_fn=None):
    """The function ``df.mapInArrow(task, RESULT_SCHEMA, barrier=True)`` runs on every task."""

    def train(shard, device, rank, world, statuses, client, ctx) -> dict:
        from spark_dl.optim.factory import make_optimizer, needs_closure
        return _train(cfg, model_fn, loss_fn, optimizer_fn or make_optimizer, needs_closure,
                      shard, device, rank, world, statuses, client, run_dir, validation, ctx)

    return barrier_task(cfg, train, secret, channel, run_dir)


def _train(cfg, model_fn, loss_fn, make_optimizer, needs_closure, shard, device, rank, world,
           statuses, client, run_dir, validation, ctx) -> dict:
    t_setup = time.perf_counter()
    dtype = torch.float64 if cfg.dtype == "float64" else torch.float32
    torch.manual_seed(cfg.seed)
    model = model_fn().to(device=device, dtype=dtype)
    for t in list(model.parameters()) + list(model.buffers()):
        dist.broadcast(t.data, 0)                       # identical start on every replica
    opt = make_optimizer(cfg.optimizer, model.parameters(), cfg.lr, cfg.momentum,
                         weight_decay=cfg.weight_decay, max_iter=cfg.max_iter,
                         nesterov=cfg.nesterov)
    schedule = cfg.schedule(world * cfg.accumulate)   # an update averages world x accumulate
    closure_opt = needs_closure(opt)
    clip = cfg.clip(schedule, device, line_search=closure_opt)
    scaler = torch.amp.GradScaler(device.type) if cfg.amp == "fp16" else None
    if scaler is not None:              # a rank whose first steps have no rows can step too
        scaler.scale(torch.zeros((), device=device))
    # One replica without a balancer has nothing to reduce: its step is the plain loop's
    # (gradients set to None and made afresh by backward, no buckets, no copies, no divisions)
    local = world == 1 and cfg.balance is None
    shm_name = shared_memory_name(statuses, rank, world, device) \
        if cfg.transport == "auto" and not local else None
    sync = None if local else \
        GradientSync(list(model.parameters()), cfg.bucket_mb, shm_name, cfg.timeout_s)

    # Resume from the run's checkpoint (rank 0 reads it, every rank gets its bytes).
    ckpt_path, ckpt = read_checkpoint(cfg, run_dir, rank, device)
    start, history, resumed = 0, [], None
    if ckpt is not None:
        model.load_state_dict(ckpt["model"])
        load_optimizer_state(opt, ckpt["optimizer"])
        if scaler is not None and ckpt.get("scaler"):
            scaler.load_state_dict(ckpt["scaler"])
        if len(ckpt["rng"]) == world:
            torch.set_rng_state(ckpt["rng"][rank].cpu())
        start, history, resumed = ckpt["epoch"], ckpt["history"], ckpt["epoch"]
        clip.load(ckpt.get("clip"))
        client.send({"type": "resume", "epoch": start})

    balancer = None
    if cfg.balance is not None:
        from spark_dl.balance import Balancer
        balancer = Balancer(cfg.balance, model=model, loss_fn=loss_fn, shard=shard,
                            batch_size=cfg.batch_size, accumulate=cfg.accumulate, device=device,
                            dtype=dtype, rank=rank, world=world, max_batch=cfg.max_batch,
                            profile_steps=cfg.profile_steps, transform=cfg.transform,
                            autocast=(lambda: autocast(device, cfg.amp)) if cfg.amp else None,
                            rows=cfg.balance_rows)
        if ckpt is not None:
            balancer.restore(ckpt.get("balance"))
        steps = balancer.steps
    else:
        steps = -(-most_batches(shard, cfg.batch_size, device) // cfg.accumulate)
    val = Validation(cfg, validation, rank, dtype, device, client, steps, loss_fn, world,
                     shared=True)                     # every replica holds the same model
    avg = None
    if cfg.average > 0:                  # every replica keeps it (they validate a part each)
        from spark_dl.optim.average import AveragedModel
        avg = AveragedModel(model, cfg.average, max(steps, 1), start * steps, make=model_fn)
        if ckpt is not None:
            avg.load_state_dict(ckpt.get("average"))
    restat = own_statistics(cfg, model, shard, rank, world, device, dtype)

    def shown():
        """The model validated and returned: the live one; or its average, with BatchNorm
        statistics recomputed for the averaged weights (spark_dl.optim.average), or without
        BatchNorm the live buffers, which a shared validation first makes the replicas' mean
        as it does the live model's without the average (a collective: every rank calls it
        when a validation is due, and at the end)."""
        if avg is None:
            return model
        if restat is not None:
            return restat(avg.read())
        if val.shared:
            sync_buffers(model, world, device)
        return avg.read()

    def forward_loss(x, y):
        """The mean loss of one micro-batch (moved to the device, autocast when amp)."""
        x = x.to(device=device, dtype=dtype, non_blocking=True)
        y = y.to(device=device, non_blocking=True)
        if y.is_floating_point():
            y = y.to(dtype)
        with autocast(device, cfg.amp):
            return loss_fn(model(x), y)

    def local_step(micro, totals) -> int:
        """One replica's step: the mean loss over its micro-batches, as a plain loop does."""
        count = sum(len(x) for x, _ in micro)
        losses = []                                  # (mean loss, rows) of each micro-batch

        def closure():
            opt.zero_grad(set_to_none=True)
            losses.clear()
            for x, y in micro:
                loss = forward_loss(x, y)
                scaled = loss if len(x) == count else loss * (len(x) / count)
                (scaler.scale(scaled) if scaler is not None else scaled).backward()
                losses.append((loss.detach(), len(x)))
            if not closure_opt:                      # SGD & co. read no loss: no extra kernels
                return None
            if not losses:                           # no rows left this step
                return torch.zeros((), dtype=dtype, device=device)
            return sum(loss * n for loss, n in losses) / count
        if closure_opt:
            opt.step(closure)
        else:
            closure()
            if count and clip.on:
                if scaler is not None:
                    scaler.unscale_(opt)
                clip([p.grad for p in model.parameters() if p.grad is not None])
            if count:
                if scaler is not None:
                    scaler.step(opt)
                    scaler.update()
                else:
                    opt.step()
        for loss, n in losses:                       # on the device: no host synchronisation
            totals[0].add_(loss, alpha=n)
        return count

    def run_step(micro, totals) -> int:
        if local:
            return local_step(micro, totals)

        def closure():
            sync.zero_grad()
            loss_sum, count = torch.zeros((), dtype=dtype, device=device), 0
            for x, y in micro:
                loss = forward_loss(x, y)
                scaled = loss * len(x)
                (scaler.scale(scaled) if scaler is not None else scaled).backward()
                loss_sum += loss.detach().to(dtype) * len(x)    # no host sync per step
                count += len(x)
            if balancer is not None:
                balancer.syncing(count)
            mean, _total = sync(loss_sum, count)
            if balancer is not None:
                balancer.synced()
            return mean
        if closure_opt:
            opt.step(closure)
        else:
            closure()
            if clip.on:                              # the global mean gradient: every
                if scaler is not None:               # replica cuts it alike
                    scaler.unscale_(opt)
                clip([flat[:n] for flat, n in zip(sync.flats, sync.grad_numels)])
            if scaler is not None:
                scaler.step(opt)
                scaler.update()
            else:
                opt.step()
        totals += sync.flats[-1][-2:].to(torch.float64)  # (global loss sum, samples)
        return 0

    t_fit = time.perf_counter()
    setup_s = t_fit - t_setup
    reports = StepReports(cfg, client, rank)
    for epoch in range(start, cfg.epochs):
        model.train()
        it = reports.epoch(shard, epoch, None if balancer is None else balancer.epoch(
            shard, shuffle=cfg.shuffle, seed=replica_seed(cfg.seed, rank), epoch=epoch,
            accumulate=cfg.accumulate, transform=cfg.transform))
        totals = torch.zeros(2, dtype=torch.float64, device=device)   # loss sum, samples
        seen = 0                                     # samples (one replica: counted here)
        for step in range(steps):
            set_lr(opt, schedule.at(epoch + step / steps))
            micro = [b for b in (next(it, None) for _ in range(cfg.accumulate)) if b is not None]
            seen += run_step(micro, totals)
            if avg is not None:
                avg.update()
            reports.step(epoch, step, steps, totals[0], seen if local else totals[1])
            val.maybe(shown, epoch, step, reports)
        loss_sum, samples = totals.tolist()          # the epoch's one host synchronisation
        if local:
            samples = seen
        seconds = reports.seconds()
        row = {"epoch": epoch + 1, "loss": loss_sum / max(samples, 1), "samples": int(samples),
               "seconds": seconds, "samples_per_s": samples / seconds, "steps": steps,
               "lr": opt.param_groups[0]["lr"]}
        if balancer is not None:
            row["balance"] = balancer.end_epoch()
        row.update(val.epoch_end(shown, epoch, reports))
        if avg is not None:              # read or not, every replica folds its pending steps
            avg.average.current()        # in here (where a checkpoint is written)
        history.append(row)
        # Every rank's RNG state goes into the checkpoint (dropout continues as it would).
        states = []
        if device.type == "cpu":
            states = [torch.empty_like(torch.get_rng_state()) for _ in range(world)]
            dist.all_gather(states, torch.get_rng_state())
        if rank == 0:
            client.send({"type": "epoch", **row})
            if ckpt_path is not None:
                save_atomic(ckpt_path, {"model": model.state_dict(), "optimizer": opt.state_dict(),
                                  "scaler": scaler.state_dict() if scaler else None,
                                  "epoch": epoch + 1, "history": history,
                                  "rng": states, "clip": clip.state(),
                                  "average": avg.state_dict() if avg else None,
                                  "balance": balancer.state() if balancer else None})
    sync_buffers(model, world, device)    # the result: the replicas' mean running statistics
    info = {**stage_info(statuses), "steps_per_epoch": steps, "resumed_from_epoch": resumed,
            "allreduce_calls": sync.calls if sync else 0,
            "allreduce_bytes": sync.bytes if sync else 0,
            "buckets": len(sync.buckets) if sync else 0,
            "transport": sync.transport if sync else "none",
            "balance": balancer.info() if balancer is not None else None,
            "lr_schedule": schedule.describe(), "grad_clip": clip.describe(),
            "average": cfg.average, "evals": val.evals,
            "validated_by": val.by if validation is not None else None,
            "train_seconds": time.perf_counter() - t_fit,
            "threads_per_task": torch.get_num_threads(), "attempt": ctx.attemptNumber(),
            "timings": {"setup_s": setup_s, "train_s": time.perf_counter() - t_fit,
                        "allreduce_s": sync.seconds if sync else 0.0,
                        "validation_s": val.seconds}}
    if sync is not None and sync.shm is not None:
        sync.shm.close()
    result = shown()              # (without an average, the buffers synced just above)
    state = state_bytes({k: v.cpu() for k, v in result.state_dict().items()}) \
        if rank == 0 else b""
    return {"state": state, "history": history, "info": info}


