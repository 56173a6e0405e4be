"""The replica loop: what every task of a barrier-stage fit does, whatever the strategy.

One ``ReplicaLoop`` a task: it seeds, builds the model (rank 0's weights on every replica),
the optimizer, its rate schedule, the gradient clipping and the mixed precision, resumes from
the run's checkpoint, runs the epochs' steps with the held-out validation, the weights'
moving average, the step reports and a checkpoint after every epoch, and returns the model
and the info of the fit. A strategy supplies ``Hooks``: how a step's update is shared, how
many steps an epoch takes, what its checkpoint and info add. Where the replicas hold one
model (``Hooks.agree``: AllReduce) replica 0's model is checkpointed, validated and
returned; where each holds its own (Gossip, LocalSGD) every replica's model goes into the
checkpoint and their mean is validated and returned. Where each holds a shard of the one
model (``Hooks.sharded``: FSDP) the hooks shard it before the optimizer is made
(``wrap``), write and read its shards in the checkpoint (``state``, ``restore``) and gather
the model returned (``full_state``); every forward is then a collective, and every replica
validates on all the rows.

    def make_task(cfg, options, parts, secret, channel):   # options: the strategy object
        return replica_task(cfg, options, MyHooks, parts, secret, channel)
"""

from __future__ import annotations

import dataclasses
import io
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from ..data.device import model_input
from ..runs import sees_driver_dir
from .amp import MixedPrecision
from .buffers import (
    collective_device,
    mean_buffers,
    own_statistics,
    replica_mean,
    sync_buffers,
)
from .checkpoint import save_atomic
from .stage import (
    StepReports,
    barrier_task,
    most_batches,
    read_checkpoint,
    set_lr,
    stage_info,
    state_bytes,
)
from .validation import Validation

__all__ = ["FitParts", "Hooks", "ReplicaLoop", "copy_into", "flatten_parameters",
           "gather_bytes", "replica_task", "save_model_file", "trainable"]


@dataclasses.dataclass(frozen=True)
class FitParts:
    """What the driver ships to every task of a fit besides its config: the model maker, the
    loss, the run directory and the validation rows."""

    model_fn: Callable[[], nn.Module]
    loss_fn: Callable
    run_dir: str | None = None
    validation: tuple[np.ndarray, np.ndarray] | None = None


class Hooks:
    """What a strategy adds to the loop; each hook gets the loop (``loop.model``,
    ``loop.opt``, ``loop.precision``, ``loop.rank`` ...). Only ``step`` must be written.
    ``cfg``: fit's stage and optimizer settings (LocalStepConfig); ``options``: the strategy
    object itself, with the values its driver resolved (its ``amp`` and ``average``, when it
    has them, are the loop's)."""

    name = ""             # the checkpoint's strategy (a resume checks it)
    agree = True          # the replicas hold one model; False: each its own, whose trainable
                          # parameters the loop moves into one flat buffer (``loop.flat``)
    totals_global = False  # step() adds the global (loss sum, samples), not this replica's
    accumulate = 1        # micro-batches a step takes
    sharded = False       # the parameters are this replica's shards of one model (FSDP):
                          # checkpoint.pt holds no model or optimizer (the hooks' files do)

    def __init__(self, cfg, options):
        self.cfg, self.options = cfg, options
        self.amp = getattr(options, "amp", None)
        self.average = float(getattr(options, "average", 0.0) or 0.0)
        self.model_path: Path | None = None    # rank 0's: the driver's run directory's
        #                                        model.pt, where this task sees that directory

    def wrap(self, loop: ReplicaLoop) -> None:
        """After the model is built with rank 0's weights, before the optimizer is made over
        its parameters: a strategy that replaces them (FSDP's shards) does it here."""

    def build(self, loop: ReplicaLoop) -> None:
        """After the optimizer and the precision: the strategy's transports."""

    def steps(self, loop: ReplicaLoop) -> int:
        """Steps an epoch: every replica the most its shard holds."""
        return -(-most_batches(loop.shard, loop.cfg.batch_size, loop.device)
                 // self.accumulate)

    def restore(self, loop: ReplicaLoop, state: dict) -> None:
        """A resumed fit: this replica's ``state()`` from the checkpoint (after ``steps``)."""

    def batches(self, loop: ReplicaLoop, epoch: int) -> Iterator | None:
        """The epoch's mini-batches when the strategy draws them; None: the shard's own."""
        return None

    def step(self, loop: ReplicaLoop, micro: list, totals: torch.Tensor) -> None:
        """One update from the micro-batches ``micro`` (possibly none); adds the (loss sum,
        samples) to ``totals``."""
        raise NotImplementedError

    def row(self, loop: ReplicaLoop) -> dict:
        """What the epoch's history row adds (a collective where it says so)."""
        return {}

    def state(self, loop: ReplicaLoop) -> dict:
        """What this replica's part of the checkpoint adds."""
        return {}

    def finish(self, loop: ReplicaLoop) -> None:
        """After the last epoch (LocalSGD: the last average)."""

    def info(self, loop: ReplicaLoop) -> dict:
        """What info.json adds; a "timings" dict is merged into the loop's."""
        return {}

    def full_state(self, loop: ReplicaLoop, model: nn.Module) -> dict | None:
        """The fit's model (``model``) as rank 0 returns it: its state dict on the CPU, {}
        elsewhere; None where the hook wrote it to ``model_path`` itself (its info's
        ``model_file`` then says so). Every rank calls it (FSDP gathers its shards here)."""
        if loop.rank != 0:
            return {}
        return {k: v.cpu() for k, v in model.state_dict().items()}

    def close(self) -> None:
        """Release the transports."""


def replica_task(cfg, options, make_hooks: Callable[..., Hooks], parts: FitParts, secret: str,
                 channel: tuple[str, int] | None):
    """The function ``df.mapInArrow(task, RESULT_SCHEMA, barrier=True)`` runs on every task:
    the replica loop with ``make_hooks(cfg, options)``'s hooks."""

    def train(shard, device, rank, world, statuses, client, ctx) -> dict:
        place = dict(shard=shard, device=device, rank=rank, world=world, statuses=statuses,
                     client=client, ctx=ctx)
        hooks = make_hooks(cfg, options)
        if rank == 0 and parts.run_dir is not None and sees_driver_dir(parts.run_dir, secret):
            hooks.model_path = Path(parts.run_dir) / "model.pt"
        out = ReplicaLoop(cfg, hooks, parts, **place).run()
        if hooks.model_path is not None and out["state"]:
            saved = save_model_file(out["state"], parts.run_dir, secret)
            if saved is not None:
                out["info"]["model_file"], out["state"] = saved, b""
        return out

    return barrier_task(cfg, train, secret, channel, parts.run_dir)


def save_model_file(state: bytes, run_dir: str, secret: str) -> dict | None:
    """Task 0's model (``state``: its serialised state dict) written as the run
    directory's model.pt when this task sees the directory the driver reads
    (spark_dl.runs.sees_driver_dir): the driver loads it from there rather than from the
    stage's result row (whose bytes would pass through Arrow, Spark's shuffle and the
    collect). Returns what the row says of it (the file's name and size), or None: the
    bytes go in the row."""
    if not state or not sees_driver_dir(run_dir, secret):
        return None
    path = Path(run_dir) / "model.pt"
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_bytes(state)
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)
        return None
    return {"name": path.name, "bytes": len(state)}


def gather_bytes(data: bytes, rank: int, world: int, device: torch.device) -> list[bytes]:
    """Every rank's bytes on rank 0 (as uint8 tensors: no pickling); [] elsewhere.
    Collective: every rank calls it."""
    device = collective_device(device)
    n = torch.tensor([len(data)], dtype=torch.int64, device=device)
    sizes = [torch.zeros_like(n) for _ in range(world)]
    dist.all_gather(sizes, n)
    longest = max(int(s) for s in sizes)
    buf = torch.zeros(longest, dtype=torch.uint8, device=device)
    buf[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
    out = [torch.empty_like(buf) for _ in range(world)] if rank == 0 else None
    dist.gather(buf, out, dst=0)
    if rank != 0:
        return []
    return [o[:int(s)].cpu().numpy().tobytes() for o, s in zip(out, sizes)]


def trainable(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def flatten_parameters(model: nn.Module) -> torch.Tensor:
    """Move ``model``'s trainable parameters into one flat buffer (each a view of it)."""
    params = trainable(model)
    flat = torch.cat([p.detach().reshape(-1) for p in params])
    offset = 0
    for p in params:
        p.data = flat[offset:offset + p.numel()].view_as(p)
        offset += p.numel()
    return flat


@torch.no_grad()
def copy_into(flat: torch.Tensor, params: list[nn.Parameter]) -> None:
    """Copy the values of ``flat`` into ``params`` in place (torch's vector_to_parameters
    would make them views of ``flat``)."""
    chunks = torch.split(flat, [p.numel() for p in params])
    torch._foreach_copy_(params, [c.view_as(p) for c, p in zip(chunks, params)])


class ReplicaLoop:
    """One replica's fit (the module doc); ``run()`` -> {"state", "history", "info"}."""

    def __init__(self, cfg, hooks: Hooks, parts: FitParts, *, shard, device, rank: int,
                 world: int, statuses: list[dict], client, ctx):
        self.cfg, self.hooks, self.parts = cfg, hooks, parts
        self.shard, self.device, self.rank, self.world = shard, device, rank, world
        self.statuses, self.client, self.ctx = statuses, client, ctx
        self.dtype = torch.float64 if cfg.dtype == "float64" else torch.float32
        self.loss_fn, self.model_fn = parts.loss_fn, parts.model_fn
        self.history: list[dict] = []
        self.avg = self.restat = self.probe = self.restated_at = None

    # -- setup ---------------------------------------------------------------------------
    def _build(self) -> None:
        from spark_dl.optim.factory import make_optimizer, needs_closure
        cfg, hooks = self.cfg, self.hooks
        torch.manual_seed(cfg.seed)
        self.model = self.model_fn().to(device=self.device, dtype=self.dtype)
        for t in list(self.model.parameters()) + list(self.model.buffers()):
            dist.broadcast(t.data, 0)                   # identical start on every replica
        hooks.wrap(self)
        if not hooks.agree:
            self.flat = flatten_parameters(self.model)
        self.opt = make_optimizer(
            cfg.optimizer, self.model.parameters(), cfg.lr, cfg.momentum,
            weight_decay=cfg.weight_decay, max_iter=cfg.max_iter, nesterov=cfg.nesterov)
        self.schedule = cfg.schedule(self.world * hooks.accumulate)  # k mini-batches an update
        self.closure_opt = needs_closure(self.opt)
        self.clip = cfg.clip(self.schedule, self.device, line_search=self.closure_opt)
        self.precision = MixedPrecision(hooks.amp, self.device)
        hooks.build(self)

    def _resume(self) -> tuple[int, dict | None]:
        """(the epoch to start from, this replica's part of the checkpoint or None)."""
        self.ckpt_path, ckpt = read_checkpoint(self.cfg, self.parts.run_dir, self.rank,
                                               self.device)
        if ckpt is None:
            return 0, None
        name = self.hooks.name
        if ckpt.get("strategy") != name:
            raise ValueError(f"{self.ckpt_path} is not a checkpoint of a {name} fit: give "
                             f"this fit a run directory of its own")
        replicas = ckpt["replicas"]
        mine = replicas[self.rank % len(replicas)]
        held = mine if not self.hooks.agree else ckpt
        if not self.hooks.sharded:                      # (FSDP: its restore reads them)
            self.model.load_state_dict(held["model"])
            from spark_dl.optim.factory import load_optimizer_state
            load_optimizer_state(self.opt, held["optimizer"])
        self.precision.load_state_dict(held.get("precision"))
        self.clip.load(held.get("clip"))
        if len(replicas) == self.world or not self.hooks.agree:
            torch.set_rng_state(mine["rng"].cpu())
        self.history = ckpt["history"]
        self.client.send({"type": "resume", "epoch": ckpt["epoch"]})
        return ckpt["epoch"], {**mine, "average": held.get("average")}

    def _extras(self, start: int, mine: dict | None) -> None:
        """Validation, the moving average, the averages' own BatchNorm statistics."""
        cfg, hooks = self.cfg, self.hooks
        if mine is not None:
            hooks.restore(self, mine)
        self.val = Validation(cfg, self.parts.validation, self.rank, self.dtype, self.device,
                              self.client, self.steps, self.loss_fn, self.world, shared=True,
                              lockstep=hooks.sharded)
        if hooks.average > 0:
            from spark_dl.optim.average import AveragedModel, WeightAverage
            span, steps = hooks.average, max(self.steps, 1)
            self.avg = AveragedModel(self.model, span, steps, start * self.steps,
                                     make=self.model_fn) if hooks.agree else \
                WeightAverage([self.flat], span, steps, start * self.steps)
            if mine is not None:
                self.avg.load_state_dict(mine.get("average"))
        self.restat = own_statistics(cfg, self.model, self.shard, self.rank, self.world,
                                     self.device, self.dtype, hooks.average, hooks.amp)
        if not hooks.agree and (self.val.on or self.val.shared or self.restat is not None):
            from spark_dl.optim.average import remake
            self.probe = remake(self.model, self.model_fn)   # holds the replicas' mean

    # -- the model shown -------------------------------------------------------------------
    def forward_loss(self, x, y) -> torch.Tensor:
        """The mean loss of one micro-batch (moved to the device, floating-point features in
        the fit's dtype, autocast when amp)."""
        x = model_input(x, self.device, self.dtype, non_blocking=True)
        y = y.to(device=self.device, non_blocking=True)
        if y.is_floating_point():
            y = y.to(self.dtype)
        with self.precision.autocast():
            return self.loss_fn(self.model(x), y)

    def own(self) -> torch.Tensor:
        """This replica's trainable parameters as shown, flat (each its own): their moving
        average, or the live ones."""
        return self.avg.current()[0] if self.avg is not None else self.flat

    def shown(self) -> nn.Module:
        """The model validated (a collective: every rank calls it when a validation is due).
        Replicas that agree: the live model, or its average with BatchNorm statistics of its
        own or the replicas' mean buffers. Each its own: their mean, in a probe copy."""
        if self.hooks.agree:
            if self.avg is None:
                return self.model
            if self.restat is not None:
                return self._restated()
            if self.val.shared:
                sync_buffers(self.model, self.world, self.device)
            return self.avg.read()
        mean = replica_mean(self.own())
        buffers = mean_buffers(self.model, self.world, self.device)
        copy_into(mean, trainable(self.probe))
        with torch.no_grad():
            for name, b in self.probe.named_buffers():
                b.copy_(buffers[name])
        return self.restat(self.probe) if self.restat is not None else self.probe

    def _restated(self) -> nn.Module:
        """The average with BatchNorm statistics of its own: one pass over the statistics
        rows for each step count (the result after a validation at the same step is that
        validation's model, not a second pass; the same on every replica)."""
        steps = self.avg.average.steps
        if self.restated_at != steps:
            self.restat(self.avg.read())
            self.restated_at = steps
        return self.avg.model.train(self.model.training)

    def _result(self) -> nn.Module:
        """The fit's model (a collective): the replicas' mean running statistics on the live
        model or its average; each replica its own: their mean in the live model."""
        if self.hooks.agree:
            sync_buffers(self.model, self.world, self.device)
            return self.shown() if self.avg is not None else self.model
        mean = replica_mean(self.own())
        self.flat.copy_(mean)
        if self.restat is not None:
            self.restat(self.model)
        else:
            sync_buffers(self.model, self.world, self.device)
        return self.model

    # -- the epochs ------------------------------------------------------------------------
    def _epoch(self, epoch: int) -> dict:
        hooks, steps = self.hooks, self.steps
        self.model.train()
        it = self.reports.epoch(self.shard, epoch, hooks.batches(self, epoch))
        totals = torch.zeros(2, dtype=torch.float64, device=self.device)  # loss sum, samples
        for step in range(steps):
            set_lr(self.opt, self.schedule.at(epoch + step / steps))
            micro = [b for b in (next(it, None) for _ in range(hooks.accumulate))
                     if b is not None]
            self.step_index = epoch * steps + step      # steps taken before this one
            hooks.step(self, micro, totals)
            if self.avg is not None:
                self.avg.update()
            self.reports.step(epoch, step, steps, totals[0], totals[1])
            self.val.maybe(self.shown, epoch, step, self.reports)
        seconds = self.reports.seconds()
        if not hooks.totals_global and self.world > 1:
            dist.all_reduce(totals)
        loss_sum, samples = totals.tolist()          # the epoch's one host synchronisation
        row = {"epoch": epoch + 1, "loss": loss_sum / max(samples, 1), "samples": int(samples),
               "seconds": seconds, "samples_per_s": samples / seconds, "steps": steps,
               "lr": self.opt.param_groups[0]["lr"], **hooks.row(self)}
        row.update(self.val.epoch_end(self.shown, epoch, self.reports))
        if self.avg is not None:         # read or not, every replica folds its pending steps
            (self.avg.average if hooks.agree else self.avg).current()   # in here (where a
                                                                         # checkpoint is written)
        return row

    def _model_state(self) -> dict:
        held = {} if self.hooks.sharded else {"model": self.model.state_dict(),
                                              "optimizer": self.opt.state_dict()}
        return {**held, "precision": self.precision.state_dict(), "clip": self.clip.state(),
                "average": self.avg.state_dict() if self.avg else None}

    def _checkpoint(self, row: dict) -> None:
        """Every replica's RNG state and its ``Hooks.state()`` (and its model, where each holds
        its own) gathered into the run's checkpoint on replica 0. A collective."""
        mine = {"rng": torch.get_rng_state(), **self.hooks.state(self)}
        if not self.hooks.agree:
            mine.update(self._model_state())
        parts = gather_bytes(state_bytes(mine), self.rank, self.world, self.device)
        if self.rank != 0:
            return
        self.client.send({"type": "epoch", **row})
        if self.ckpt_path is not None:
            shared = self._model_state() if self.hooks.agree else {}
            save_atomic(self.ckpt_path, {
                "strategy": self.hooks.name, "epoch": row["epoch"], "history": self.history,
                **shared, "replicas": [torch.load(io.BytesIO(b), weights_only=True)
                                       for b in parts]})

    def run(self) -> dict:
        t_setup = time.perf_counter()
        self._build()
        start, mine = self._resume()
        self.steps = self.hooks.steps(self)
        self._extras(start, mine)
        t_fit = time.perf_counter()
        self.reports = StepReports(self.cfg, self.client, self.rank)
        epochs_s = checkpoints_s = 0.0             # this task's (not a resumed fit's before)
        for epoch in range(start, self.cfg.epochs):
            row = self._epoch(epoch)
            self.history.append(row)
            t = time.perf_counter()
            self._checkpoint(row)
            epochs_s += row["seconds"]
            checkpoints_s += time.perf_counter() - t
        t_result = time.perf_counter()
        self.hooks.finish(self)
        result = self._result()
        full = self.hooks.full_state(self, result)
        state = state_bytes(full) if self.rank == 0 and full is not None else b""
        del full                          # (info's peak memory includes the model's bytes)
        info = self._info(start if mine is not None else None, t_setup, t_fit)
        self.hooks.close()
        info["timings"].update(epochs_s=epochs_s, checkpoints_s=checkpoints_s,
                               result_s=time.perf_counter() - t_result)
        return {"state": state, "history": self.history, "info": info}

    def _info(self, resumed: int | None, t_setup: float, t_fit: float) -> dict:
        extra = self.hooks.info(self)
        train_s = time.perf_counter() - t_fit
        timings = {"setup_s": t_fit - t_setup, "train_s": train_s,
                   **extra.pop("timings", {}), "validation_s": self.val.seconds}
        return {**stage_info(self.statuses), "steps_per_epoch": self.steps,
                "resumed_from_epoch": resumed, **extra,
                "lr_schedule": self.schedule.describe(), "grad_clip": self.clip.describe(),
                "average": self.hooks.average, "evals": self.val.evals,
                "statistics_passes": self.restat.passes if self.restat is not None else 0,
                "validated_by": self.val.by if self.parts.validation is not None else None,
                "train_seconds": train_s, "threads_per_task": torch.get_num_threads(),
                "attempt": self.ctx.attemptNumber(), "timings": timings}
