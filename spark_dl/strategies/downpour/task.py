"""Downpour SGD workers: ordinary Spark tasks (``mapInArrow`` over the data) that train on
their own partition and exchange parameters with the driver's parameter server
(spark_dl.transport.ps).

Each worker fetches the parameters every ``n_fetch`` steps and, between fetches, computes
gradients on the parameters it holds (a DistBelief replica does not update itself); it pushes
the accumulated per-sample gradient sum every ``n_push`` steps. Spark schedules the tasks and
retries a failed one, which registers again, fetches, and goes on.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import time
from collections import Counter
from collections.abc import Callable, Iterator

import numpy as np
import torch

from spark_dl.balance import balanced_batches
from spark_dl.runtime.amp import MixedPrecision, autocast
from spark_dl.runtime.failures import at
from spark_dl.runtime.failures import report as report_error
from spark_dl.runtime.seeds import replica_seed
from spark_dl.runtime.stage import (
    LossSum,
    StageConfig,
    peak_memory_mb,
    read_shard,
    write_task_info,
)

from .exchange import (
    CarriedMomentum,
    Exchange,
    carried_report,
    flat_parameters,
    ramp_length,
    reported_momentum,
)

__all__ = ["RESULT_SCHEMA", "DownpourConfig", "make_task"]

RESULT_SCHEMA = "worker int, report string"


@dataclasses.dataclass(frozen=True)
class DownpourConfig(StageConfig):
    n_fetch: int = 1
    n_push: int = 1
    mode: str = "async"
    wire_dtype: str = "float32"        # float32, bfloat16 (half the bytes) or float64
    overlap: bool | None = False       # async: a push travels while the next step computes
                                       # (None: on when the worker is on a GPU)
    model_parallel: str = "collective"  # partitions > 1: all-gather layers, or "master"
    amp: str | None = None             # autocast: "bf16" or "fp16" (float32 master weights)
    widths: tuple | None = None        # partitions' shares of every layer's columns
    balance: str | tuple | None = None  # sync rounds: "speed" or fixed shares per worker
    buffers: tuple = ()                # (name, shape) of the buffers reported (ps/buffers.py)
    worker_momentum: float = 0.0       # async, staleness "dana": SGD's momentum kept here
    look_ahead: bool = False           # staleness "dana": its momentum reported to the server


_TORCH = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}


def make_task(cfg: DownpourConfig, model_fn: Callable, loss_fn: Callable, secret: bytes,
              ps_address, channel, run_dir: str | None, partitions: int = 1):
    """The function ``df.mapInArrow(task, RESULT_SCHEMA)`` runs on every task. With
    ``partitions`` F > 1 the stage is a barrier stage of R x F tasks: task r F + p holds
    partition p of replica r's model (column partitioning), the F tasks of a replica train
    together on the union of their micro-batches, and each pushes and fetches only its own
    slice (parameter-server shard p): Downpour SGD over model-parallel replicas."""

    def task(batches: Iterator) -> Iterator:
        import pyarrow as pa
        from pyspark import BarrierTaskContext, TaskContext

        ctx = TaskContext.get() if partitions == 1 else BarrierTaskContext.get()
        rank = ctx.partitionId()
        t_start = time.perf_counter()
        opened: list = []                 # the task's shard: its spill files go when it ends
        at(None, None)
        try:
            if partitions == 1:
                shard = read_shard(cfg, batches, f"partition {rank}")
                opened.append(shard)
                report = _work(cfg, model_fn, loss_fn, secret, ps_address, channel, run_dir,
                               ctx, shard, None, t_start)
            else:
                report = _work_partitioned(cfg, model_fn, loss_fn, secret, ps_address,
                                           channel, run_dir, ctx, batches, partitions,
                                           t_start, opened)
        except BaseException as e:        # the driver hears of it first, and cancels the fit
            report_error(channel, secret, rank, e)
            raise
        finally:
            for shard in opened:
                shard.close()
        yield pa.RecordBatch.from_pydict({"worker": [rank], "report": [json.dumps(report)]},
                                         schema=pa.schema([("worker", pa.int32()),
                                                           ("report", pa.string())]))

    return task


def _work_partitioned(cfg, model_fn, loss_fn, secret, ps_address, channel, run_dir, ctx,
                      batches, F: int, t_start: float, opened: list) -> dict:
    """A barrier task of a model-parallel replica: rendezvous, sub-groups, then _work."""
    import torch.distributed as dist

    from spark_dl import errors
    from spark_dl.data.bridge import ShardData
    from spark_dl.model_parallel import Comm
    from spark_dl.transport.rendezvous import process_group

    rank = ctx.partitionId()
    status: dict = {"error": None}
    shard = None
    try:
        shard = read_shard(cfg, batches, f"partition {rank}")
        opened.append(shard)
        status["rows"] = len(shard)
        feat, fdtype, lab = shard.spec()
        status["sample"] = [list(feat), str(fdtype),
                            None if lab is None else [list(lab[0]), str(lab[1])]]
    except errors.SparkDLError as e:             # every task stops, with the reason
        status["error"] = {"type": type(e).__name__, "message": str(e)}
    via = None if channel is None else (channel, secret)
    with process_group(ctx, "gloo", secret.hex(), status, cfg.timeout_s, via) as (
            me, world, statuses):
        if me is None:
            bad = [s["error"] for s in statuses if s.get("error")]
            raise getattr(errors, bad[0]["type"], errors.SparkDLError)(
                "; ".join(f"{e['message']}" for e in bad))
        replicas = world // F
        groups = [dist.new_group(list(range(r * F, (r + 1) * F))) for r in range(replicas)]
        r = rank // F
        comm = Comm(list(range(r * F, (r + 1) * F)), groups[r], cfg.widths)
        # the replica trains on the union of its tasks' shards: as many steps as its largest
        replica = [statuses[r * F + q] for q in range(F)]
        steps = max(-(-s["rows"] // cfg.batch_size) for s in replica)
        if len(shard) == 0 and any(s["rows"] for s in replica):
            # an empty partition: its (empty) micro-batches take the shape of a peer's rows
            feat, fdtype, lab = next(s["sample"] for s in replica if s["rows"])
            shard = ShardData.from_spec((tuple(feat), np.dtype(fdtype), None if lab is None
                                         else (tuple(lab[0]), np.dtype(lab[1]))))
        return _work(cfg, model_fn, loss_fn, secret, ps_address, channel, run_dir, ctx, shard,
                     (comm, steps), t_start)


def _is_out_of_memory(e: BaseException) -> bool:
    """MemoryError, or torch's allocator failing (it raises RuntimeError)."""
    return isinstance(e, MemoryError) or "can't allocate memory" in str(e) or \
        "not enough memory" in str(e)


def _out_of_memory(comm, slice_bytes: int | None = None):
    from spark_dl.errors import ResourceError
    limit = os.environ.get("PYSPARK_EXECUTOR_MEMORY_MB")
    F = comm.size if comm is not None else 1
    raise ResourceError(
        "the model does not fit this task's Python worker"
        + (f" (spark.executor.pyspark.memory: {limit} MiB)" if limit else "")
        + (f": its parameters and gradients take {2 * slice_bytes / 2**20:.0f} MiB here"
           if slice_bytes else "")
        + f" with partitions={F}; split it over more tasks (partitions={2 * F}, or 'auto' "
          f"to let the planner choose) or give the Python workers more memory") from None


def _partitioned_model(model_fn: Callable, comm, dtype, algorithm: str = "collective"
                       ) -> torch.nn.Module:
    """This task's slice of the model, without materialising the whole model: built on the
    meta device and cut; flat_parameters allocates the slice (its values come from the
    server).
    ``algorithm`` "master": the FC net as MasterBackpropFC (the thesis's master algorithm)."""
    from spark_dl.model_parallel import MasterBackpropFC, fc_activation, partition_model
    with torch.device("meta"):
        full = model_fn().to(dtype)
    if algorithm == "master":
        return MasterBackpropFC(full, comm, fc_activation(full))
    model = partition_model(full, comm)
    for module in model.modules():    # buffers (kept-whole BatchNorm's): real, at their start
        meta = [k for k, b in module._buffers.items() if b is not None and b.is_meta]
        for k in meta:
            module._buffers[k] = torch.zeros(module._buffers[k].shape,
                                             dtype=module._buffers[k].dtype)
        if meta and hasattr(module, "reset_running_stats"):
            module.reset_running_stats()
    return model


def _profile(cfg, model, loss_fn, shard, device, dtype, worker: int):
    """Balanced sync rounds: this worker's (a, c, cap) for the server's split (step time
    t(b) = a + c b, profiled; fixed shares as c = 1 / share), or None."""
    if cfg.balance is None:
        return None
    from spark_dl.balance import measure
    a, c, _, cap = measure(cfg.balance, model=model, loss_fn=loss_fn, shard=shard,
                           batch_size=cfg.batch_size, device=device, dtype=dtype,
                           transform=cfg.transform,
                           autocast=(lambda: autocast(device, cfg.amp)) if cfg.amp else None)
    model.zero_grad(set_to_none=True)
    if cfg.balance != "speed":                       # fixed shares
        a, c = 0.0, 1.0 / float(cfg.balance[worker])
    return (a, c, int(cap)) if len(shard) else (0.0, 1.0, 1)


def _buffers(model, spec, out: torch.Tensor | None) -> torch.Tensor | None:
    """The model's buffers of ``spec`` in ``out`` for the server (None: none reported)."""
    from spark_dl.transport.ps.buffers import read_buffers
    return None if out is None else read_buffers(model, spec, out)


def _gather_batch(comm, x: torch.Tensor, y: torch.Tensor | None):
    """The replica's mini-batch: every task's micro-batch, on every task (uneven sizes)."""
    n = torch.tensor([len(x)], dtype=torch.int64)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(comm.size)]
    comm.all_gather(sizes, n, "batch")
    sizes = [int(v) for v in sizes]
    xs = [x.new_empty((k, *x.shape[1:])) for k in sizes]
    comm.all_gather(xs, x, "batch")
    ys = None
    if y is not None:
        ys = [y.new_empty((k, *y.shape[1:])) for k in sizes]
        comm.all_gather(ys, y, "batch")
        ys = torch.cat(ys)
    return torch.cat(xs), ys


def _work(cfg, model_fn, loss_fn, secret, ps_address, channel, run_dir, ctx, shard, partitioned,
          t_start: float) -> dict:
    """One worker's training loop; ``partitioned``: None, or (replica Comm, steps per epoch)."""
    from spark_dl.transport.channel import MessageClient
    from spark_dl.transport.ps import PSClient
    from spark_dl.transport.ps.buffers import spec_numel
    from spark_dl.transport.rendezvous import task_device

    rank = ctx.partitionId()
    comm, replica_steps = partitioned if partitioned is not None else (None, 0)
    part = comm.rank if comm is not None else 0
    worker = rank // comm.size if comm is not None else rank        # the replica
    gpus = list(ctx.resources()["gpu"].addresses) if "gpu" in ctx.resources() else []
    device, note = task_device(cfg.device, gpus, rank)
    torch.set_num_threads(cfg.threads or int(ctx.cpus() or 1))
    if comm is None:                      # on a GPU: the rows go there once, batched there
        from spark_dl.data.device import on_device
        shard = on_device(shard, device, cfg.transform)
    if run_dir is not None:
        write_task_info(run_dir, f"worker-{rank}",
                        {"worker": rank, "device": str(device), "attempt": ctx.attemptNumber(),
                         "rows": len(shard), "data": shard.kind, "replica": worker,
                         "partition": part})
    dtype = _TORCH[cfg.dtype]
    torch.manual_seed(cfg.seed)
    try:
        if comm is None:
            model = model_fn().to(device=device, dtype=dtype)
        else:
            model = _partitioned_model(model_fn, comm, dtype, cfg.model_parallel)
    except (MemoryError, RuntimeError) as e:
        if not _is_out_of_memory(e):
            raise
        _out_of_memory(comm)
    # profiled before connecting: the server gives a connection 30 s to say its hello
    prof = _profile(cfg, model, loss_fn, shard, device, dtype, worker) if comm is None else None
    client = PSClient(ps_address, secret, rank, _TORCH[cfg.wire_dtype], cfg.timeout_s)
    # progress and epoch reports come from one task per replica
    progress = MessageClient(channel if part == 0 else None, secret)
    resume_epoch = resume_step = 0
    batch_size = cfg.batch_size
    if comm is None:
        steps = client.hello(len(shard), cfg.batch_size, profile=prof)
        if prof is not None:                      # balanced sync rounds: this worker's share
            batch_size = client.batch
        shards = None
        if client.done_steps and steps:   # a retried task: go on where the server is
            resume_epoch, resume_step = divmod(client.done_steps, steps)
    else:             # the server counts an epoch's steps once per replica (lr_decay)
        client.hello(replica_steps * cfg.batch_size if part == 0 else 0, cfg.batch_size,
                     shards=[part])
        steps, shards = replica_steps, [part]
        # a retried stage or a resumed fit: the replica goes on at the first epoch its
        # partition 0 has not finished (shard 0 counts that task's steps); its tasks agree
        done = torch.tensor([client.done_steps // max(steps, 1) if part == 0 else 0])
        comm.broadcast(done, 0, "resume")
        resume_epoch = int(done)
    expected = client.numel if shards is None else \
        client.bounds[part + 1] - client.bounds[part]
    # parameters and gradients live in two flat vectors (p and p.grad are views): a pull
    # lands in the model, backward accumulates the pushed sum in place, nothing is copied
    # when the wire carries the model's dtype on the CPU
    try:
        flat, grad = flat_parameters(model, expected, device, dtype)
    except (MemoryError, RuntimeError) as e:
        if not _is_out_of_memory(e):
            raise
        _out_of_memory(comm, expected * torch.empty((), dtype=dtype).element_size())
    numel = flat.numel()
    direct = flat.dtype == client.dtype and flat.device.type == "cpu"
    wire = flat if direct else torch.empty(numel, dtype=client.dtype)

    def landed():                                 # the pulled values into the model
        if not direct:
            flat.copy_(wire)

    client.pull(wire, shards)
    landed()
    overlap = cfg.overlap if cfg.overlap is not None else device.type == "cuda"
    exchange = Exchange(client, numel, client.dtype, shards, device) if overlap else None
    # the running statistics the server averages: partition 0 of a replica reports them
    # (a split model's normalisation layers are kept whole: partition 0's are the trained)
    buffers = None
    if cfg.buffers and part == 0:
        buffers = torch.empty(spec_numel(cfg.buffers), dtype=torch.float64
                              if dtype == torch.float64 else torch.float32)
    held = list(client.versions)                  # versions of the parameters in the model
    acc_samples = acc_steps = 0
    scaler = MixedPrecision(cfg.amp, device)
    staleness: Counter = Counter()
    history, pushes = [], 0
    n_fetch = cfg.n_push if cfg.mode == "sequential" else cfg.n_fetch
    # staleness "dana": this worker's momentum buffer over its pushes' mean gradients
    carrier = CarriedMomentum(grad, cfg.worker_momentum,     # ramped over what is left
                              ramp_length(steps * (cfg.epochs - resume_epoch) - resume_step)) \
        if cfg.worker_momentum else None

    def reported():               # staleness "dana": the next push's momentum, to the server
        return reported_momentum(carrier, cfg.look_ahead)

    thesis = comm is not None and cfg.model_parallel == "master"
    master = part == 0                            # the thesis algorithm's master
    rows_total = len(shard) if comm is None else None
    for epoch in range(resume_epoch, cfg.epochs):
        first = resume_step if epoch == resume_epoch else 0
        if cfg.balance is None:
            it = iter(shard.batches(cfg.batch_size, shuffle=cfg.shuffle,
                                    transform=cfg.transform, seed=replica_seed(cfg.seed, rank),
                                    epoch=epoch, skip=first))
        else:
            it = itertools.islice(balanced_batches(
                shard, batch_size, steps, shuffle=cfg.shuffle, seed=replica_seed(cfg.seed, rank),
                epoch=epoch, transform=cfg.transform), first, None)
        t0 = last = time.perf_counter()
        loss_sum, samples = LossSum(), 0.0
        for step in range(first, steps):
            at(epoch, step)
            batch = next(it, None)
            if comm is not None:                  # every task of the replica, every step
                if batch is None:
                    batch = shard.empty_batch()
                batch = _gather_batch(comm, *batch)
                if len(batch[0]) == 0:
                    batch = None
            elif batch is None and cfg.mode != "sync":
                break                             # only sync rounds need everyone
            if batch is not None:
                x, y = batch
                x = x.to(device=device, dtype=dtype)
                y = y.to(device=device)
                if y.is_floating_point():
                    y = y.to(dtype)
                if thesis:                        # the master holds the batch (§3.2)
                    loss = model.step(x if master else None, y if master else None, len(x),
                                      grad_scale=len(x))
                    loss = torch.tensor(loss if master else 0.0)
                else:
                    with autocast(device, cfg.amp):
                        loss = loss_fn(model(x), y)
                    scaler.scale_loss(loss * len(x)).backward()  # grad += the per-sample gradient sum
                acc_samples += len(x)
                loss_sum.add(loss, len(x))                # read once a report goes
                samples += len(x)
            acc_steps += 1
            last_step = step == steps - 1 or (rows_total is not None and cfg.mode != "sync"
                                              and samples >= rows_total)
            fetch = (step + 1) % n_fetch == 0 or cfg.mode == "sync"
            due = acc_steps >= cfg.n_push or last_step
            if due and not scaler.unscale(grad):  # fp16 overflow: this gradient is dropped
                grad.zero_()
                acc_samples = 0                   # (a sync round still gets its empty push)
                if cfg.mode != "sync":
                    acc_steps, due = 0, False
            if due and carrier is not None and acc_samples:
                carrier.carry(grad, acc_samples, acc_steps)
            if exchange is not None and due:
                for s in exchange.wait():         # the previous push's reply: the
                    staleness[s] += 1             # parameters after it, into the model
                computed_on = held
                if exchange.pushed:
                    exchange.land(flat)
                    held = list(client.versions)
                exchange.start(grad, acc_samples, acc_steps, computed_on,
                               _buffers(model, cfg.buffers, buffers), reported())
                pushes += 1
                grad.zero_()
                acc_samples = acc_steps = 0
            elif due:
                out = grad if grad.device.type == "cpu" else grad.cpu()
                for s in client.push(out, acc_samples, acc_steps,
                                     pull_into=wire if fetch else None, shards=shards,
                                     buffers=_buffers(model, cfg.buffers, buffers),
                                     momentum=reported()):
                    staleness[s] += 1
                pushes += 1
                grad.zero_()
                acc_samples = acc_steps = 0
                if fetch:
                    landed()
            elif fetch and exchange is None:      # with overlap every push also fetches
                client.pull(wire, shards)
                landed()
            now = time.perf_counter()
            if now - last >= cfg.progress_every_s:
                last = now
                n_stale = sum(staleness.values())
                progress.send({"type": "step", "worker": worker, "epoch": epoch + 1,
                               "epochs": cfg.epochs, "step": step + 1, "steps": steps,
                               "loss": loss_sum.value() / max(samples, 1),
                               "samples_per_s": samples / (now - t0),
                               "staleness": sum(k * v for k, v in staleness.items())
                               / max(n_stale, 1)})
        seconds = time.perf_counter() - t0
        row = {"epoch": epoch + 1, "worker": worker, "loss": loss_sum.value() / max(samples, 1),
               "samples": int(samples), "seconds": seconds,
               "samples_per_s": samples / max(seconds, 1e-9)}
        if first:                                 # a retry's part of the epoch only
            row["resumed_at_step"] = first + 1
        history.append(row)
        progress.send({"type": "epoch", **row})
    if exchange is not None:
        for s in exchange.close():
            staleness[s] += 1
    client.close()
    progress.close()
    report = {"worker": worker, "task": rank, "partition": part, "rows": len(shard),
              "amp_skipped_pushes": scaler.skipped,
              "data": shard.kind, "spill_dir": getattr(shard, "directory", None),
              "device": str(device), "note": note, "history": history, "pushes": pushes,
              "overlap": overlap,
              **carried_report(carrier),        # staleness "dana": the buffer it carried
              "resumed_at": {"epoch": resume_epoch + 1, "step": resume_step + 1}
              if resume_epoch or resume_step else None,
              "staleness": {str(k): v for k, v in sorted(staleness.items())},
              "push_seconds": client.push_seconds, "pull_seconds": client.pull_seconds,
              "bytes_sent": client.conn.bytes_sent,
              "bytes_received": client.conn.bytes_received,
              "task_seconds": time.perf_counter() - t_start, "attempt": ctx.attemptNumber(),
              **peak_memory_mb()}
    if comm is not None:
        report["model_parallel"] = {"partitions": comm.size, "parameter_bytes": numel *
                                    flat.element_size(), "communication": comm.counts()}
    return report
