"""RD-PSGD's task half: every replica trains its own model on its shard and, every
``sync_every`` steps, averages the coordinates of one shared Bernoulli(α) mask with its ring
neighbours (rounds.py) between computing its gradient and taking its step.

A replica's parameters live in one flat buffer (each parameter a view of it), so a round is
one index_select, the point-to-point exchange and one index_copy_. After every epoch the
replicas agree on their average (one all-reduce), measure how far they are from it (the
consensus distance, mean ‖x_i − x̄‖²), the replicas validate the average (each a part of the
held-out rows), and every replica's model, buffers and optimizer state go into the run's
checkpoint (gathered on replica 0), since they differ. The fit's result is the average, with
the mean of the replicas' floating-point buffers (BatchNorm's running statistics; the others,
e.g. ``num_batches_tracked``, are replica 0's): the model validates as the replicas trained.
"""

from __future__ import annotations

import dataclasses
import io
from collections.abc import Callable

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from spark_dl.runtime.amp import autocast
from spark_dl.runtime.checkpoint import save_atomic
from spark_dl.runtime.stage import (
    LocalStepConfig,
    StepReports,
    Validation,
    barrier_task,
    collective_device,
    mean_buffers,
    most_batches,
    own_statistics,
    read_checkpoint,
    set_lr,
    shared_memory_name,
    stage_info,
    state_bytes,
    sync_buffers,
)

from .rounds import Rounds, average, average_and_distance

__all__ = ["GossipConfig", "make_task"]


@dataclasses.dataclass(frozen=True)
class GossipConfig(LocalStepConfig):
    """Plain values shipped to the tasks (see ``spark_dl.strategies.Gossip``)."""

    alpha: float = 1.0
    sync_every: int = 1
    amp: str | None = None
    topology: str = "exponential"
    average: float = 0.0          # > 0: each replica also keeps its weights' moving average
                                  # over that fraction of an epoch (spark_dl.optim.average);
                                  # the replicas' mean of it is validated and returned


def make_task(cfg: GossipConfig, model_fn: Callable[[], nn.Module], loss_fn: Callable,
              secret: str, channel: tuple[str, int] | None, run_dir: str | None,
              validation: tuple[np.ndarray, np.ndarray] | None):
    """The function ``df.mapInArrow(task, RESULT_SCHEMA, barrier=True)`` runs on every task."""

    def train(shard, device, rank, world, statuses, client, ctx) -> dict:
        return _train(cfg, model_fn, loss_fn, shard, device, rank, world, statuses, client,
                      run_dir, validation, ctx)

    return barrier_task(cfg, train, secret, channel, run_dir)


def flat_parameters(model: nn.Module) -> torch.Tensor:
    """Move ``model``'s trainable parameters into one flat buffer (each a view of it)."""
    params = [p for p in model.parameters() if p.requires_grad]
    flat = torch.cat([p.detach().reshape(-1) for p in params])
    offset = 0
    for p in params:
        p.data = flat[offset:offset + p.numel()].view_as(p)
        offset += p.numel()
    return flat


def gather_bytes(data: bytes, rank: int, world: int, device: torch.device) -> list[bytes]:
    """Every rank's bytes on rank 0 (as uint8 tensors: no pickling); [] elsewhere."""
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


def _train(cfg, model_fn, loss_fn, shard, device, rank, world, statuses, client, run_dir,
           validation, ctx) -> dict:
    import time

    from spark_dl.optim.factory import load_optimizer_state, make_optimizer

    t_setup = time.perf_counter()
    dtype = torch.float64 if cfg.dtype == "float64" else torch.float32
    torch.manual_seed(cfg.seed)
    model = model_fn().to(device=device, dtype=dtype)
    for t in list(model.parameters()) + list(model.buffers()):
        dist.broadcast(t.data, 0)                       # x_0 the same on every replica
    flat = flat_parameters(model)
    opt = make_optimizer(cfg.optimizer, model.parameters(), cfg.lr, cfg.momentum,
                         weight_decay=cfg.weight_decay, max_iter=cfg.max_iter,
                         nesterov=cfg.nesterov)
    schedule = cfg.schedule(world)      # the replicas' average moves by their mean gradient
    clip = cfg.clip(schedule, device)   # each replica cuts its own gradient
    shm, name = None, shared_memory_name(statuses, rank, world, device)
    if name is not None:                 # one host: the rounds go through shared memory
        from spark_dl.transport.shm import ShmAllReduce
        shm = ShmAllReduce(flat.numel(), flat.dtype, name, cfg.timeout_s)
    rounds = Rounds(flat, cfg.alpha, cfg.seed, rank, world, shm=shm, topology=cfg.topology)
    scaler = torch.amp.GradScaler(device.type) if cfg.amp == "fp16" else None

    # Resume: replica 0 reads the checkpoint, every replica takes its own model from it.
    ckpt_path, ckpt = read_checkpoint(cfg, run_dir, rank, device)
    start, history, resumed = 0, [], None
    if ckpt is not None:
        if ckpt.get("strategy") != "gossip":
            raise ValueError(f"{ckpt_path} is not a checkpoint of a gossip fit")
        mine = ckpt["replicas"][rank % len(ckpt["replicas"])]
        flat.copy_(mine["flat"])
        for name, b in model.named_buffers():
            if name in mine.get("buffers", {}):
                b.copy_(mine["buffers"][name])
        load_optimizer_state(opt, mine["optimizer"])
        torch.set_rng_state(mine["rng"].cpu())
        rounds.bytes_sent, rounds.rounds = mine["bytes_sent"], mine["rounds"]
        clip.load(mine.get("clip"))
        start, history, resumed = ckpt["epoch"], ckpt["history"], ckpt["epoch"]
        client.send({"type": "resume", "epoch": start})

    steps = most_batches(shard, cfg.batch_size, device)   # every replica, every round
    # every replica gets the average: each validates its part of the rows (Validation)
    val = Validation(cfg, validation, rank, dtype, device, client, steps, loss_fn, world,
                     shared=True)
    # the averages' own BatchNorm statistics
    restat = own_statistics(cfg, model, shard, rank, world, device, dtype)
    probe = None
    if val.on or val.shared or restat is not None:
        from spark_dl.optim.average import remake
        probe = remake(model, model_fn)      # (its frozen parameters, which validation
                                             # leaves, are the model's)
    avg = None
    if cfg.average > 0:
        from spark_dl.optim.average import WeightAverage
        avg = WeightAverage([flat], cfg.average, max(steps, 1), start * steps)
        if ckpt is not None:
            avg.load_state_dict(mine.get("average"))

    def shown() -> tuple[torch.Tensor, float]:
        """(the model validated and returned: the replicas' mean of their weights, or of
        their weights' averages; the consensus distance of the weights)"""
        mean, distance = average_and_distance(flat)
        if avg is not None:
            mean = average(avg.current()[0])
        return mean, distance

    def validate(t: float) -> dict:
        """The replicas' average, validated (a collective: every rank calls it)."""
        mean, distance = shown()

        def made():
            buffers = mean_buffers(model, world, device)
            if probe is not None:
                torch.nn.utils.vector_to_parameters(
                    mean, [p for p in probe.parameters() if p.requires_grad])
                for name, b in probe.named_buffers():
                    b.copy_(buffers[name])
                if restat is not None:
                    restat(probe)
            return probe
        return {**val.run(made, t, reports), "consensus_distance": distance}
    t_fit = time.perf_counter()
    round_s = 0.0
    reports = StepReports(cfg, client, rank)
    model.train()                        # (the average is validated on a probe copy)
    for epoch in range(start, cfg.epochs):
        it = reports.epoch(shard, epoch)
        loss_sum = samples = 0.0
        for step in range(steps):
            k = epoch * steps + step
            set_lr(opt, schedule.at(epoch + step / steps))
            batch = next(it, None)
            opt.zero_grad()
            if batch is not None:                    # g_i at x_k,i
                x = batch[0].to(device=device, dtype=dtype, non_blocking=True)
                y = batch[1].to(device=device, non_blocking=True)
                y = y.to(dtype) if y.is_floating_point() else y
                with autocast(device, cfg.amp):
                    loss = loss_fn(model(x), y)
                (scaler.scale(loss) if scaler is not None else loss).backward()
                loss_sum += float(loss.detach()) * len(x)
                samples += len(x)
            if (k + 1) % cfg.sync_every == 0:         # x_k+1/2: the masked average
                t_round = time.perf_counter()
                with torch.no_grad():
                    rounds.round(k // cfg.sync_every)
                round_s += time.perf_counter() - t_round
            if batch is not None and clip.on:
                if scaler is not None:
                    scaler.unscale_(opt)
                clip([p.grad for p in model.parameters() if p.grad is not None])
            if batch is not None and scaler is not None:
                scaler.step(opt)                     # (skipped when fp16 overflowed)
                scaler.update()
            elif batch is not None:
                opt.step()                           # x_k+1 = x_k+1/2 - lr g_i(x_k,i)
            if avg is not None:
                avg.update()
            reports.step(epoch, step, steps, loss_sum, samples)
            if val.due(step):
                validate(epoch + (step + 1) / steps)
        seconds = reports.seconds()
        totals = torch.tensor([loss_sum, samples], dtype=torch.float64, device=device)
        dist.all_reduce(totals)
        sent = torch.tensor([float(rounds.bytes_sent)], dtype=torch.float64, device=device)
        dist.all_reduce(sent)
        row = {"epoch": epoch + 1, "loss": float(totals[0]) / max(float(totals[1]), 1.0),
               "samples": int(totals[1]), "seconds": seconds,
               "samples_per_s": float(totals[1]) / seconds, "steps": steps,
               "lr": opt.param_groups[0]["lr"],
               "bytes_sent_per_replica": float(sent) / world, **validate(epoch + 1)}
        history.append(row)
        state = state_bytes({"flat": flat.cpu(), "optimizer": opt.state_dict(),
                             "buffers": {k: b.cpu() for k, b in model.named_buffers()},
                             "rng": torch.get_rng_state(), "bytes_sent": rounds.bytes_sent,
                             "rounds": rounds.rounds, "clip": clip.state(),
                             "average": avg.state_dict() if avg else None})
        replicas = gather_bytes(state, rank, world, device)
        if rank == 0:
            client.send({"type": "epoch", **row})
            if ckpt_path is not None:
                save_atomic(ckpt_path, {
                    "strategy": "gossip", "epoch": epoch + 1, "history": history,
                    "replicas": [torch.load(io.BytesIO(b), weights_only=True)
                                 for b in replicas]})
    mean, distance = shown()
    flat.copy_(mean)                                     # the result: the replicas' average
    if restat is not None:                               # ... with its own statistics
        restat(model)
    else:                                                # ... with the mean of their buffers
        sync_buffers(model, world, device)
    where = collective_device(device)
    sent = [torch.zeros(1, dtype=torch.float64, device=where) for _ in range(world)]
    dist.all_gather(sent, torch.tensor([float(rounds.bytes_sent)], dtype=torch.float64,
                                       device=where))
    numel, item = flat.numel(), flat.element_size()
    info = {**stage_info(statuses), "steps_per_epoch": steps, "resumed_from_epoch": resumed,
            "alpha": cfg.alpha, "sync_every": cfg.sync_every, "rounds": rounds.rounds,
            "topology": cfg.topology,
            "transport": rounds.transport,
            "neighbours": rounds.neighbours, "parameters": numel,
            "bytes_sent": [int(s) for s in sent],
            "bytes_per_round_expected": cfg.alpha * numel * item * rounds.neighbours,
            "final_consensus_distance": distance,
            "lr_schedule": schedule.describe(), "grad_clip": clip.describe(),
            "average": cfg.average, "evals": val.evals,
            "validated_by": val.by if validation is not None else None,
            "train_seconds": time.perf_counter() - t_fit,
            "threads_per_task": torch.get_num_threads(), "attempt": ctx.attemptNumber(),
            "timings": {"setup_s": t_fit - t_setup, "train_s": time.perf_counter() - t_fit,
                        "gossip_s": round_s, "validation_s": val.seconds}}
    if shm is not None:
        shm.close()
    state = state_bytes({k: v.cpu() for k, v in model.state_dict().items()}) if rank == 0 else b""
    return {"state": state, "history": history, "info": info}
