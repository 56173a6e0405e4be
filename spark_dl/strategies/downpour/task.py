"""Downpour SGD workers: ordinary Spark tasks (``mapInArrow`` over the data) that train on
their own partition and exchange parameters with the driver's parameter server
(spark_dl.transport.ps).

Each worker fetches the parameters every ``n_fetch`` steps and, between fetches, computes
gradients on the parameters it holds (a DistBelief replica does not update itself); it pushes
the accumulated per-sample gradient sum every ``n_push`` steps. Spark schedules the tasks and
retries a failed one, which registers again, fetches, and goes on.
"""

from __future__ import annotations

import itertools
import json
import os
import time
from collections import Counter
from collections.abc import Callable, Iterator

import numpy as np
import torch

from spark_dl.balance import balanced_batches
from spark_dl.runtime.amp import autocast
from spark_dl.runtime.failures import at
from spark_dl.runtime.failures import report as report_error
from spark_dl.runtime.loop import FitParts
from spark_dl.runtime.seeds import replica_seed
from spark_dl.runtime.stage import LossSum, StageConfig, StepLosses, read_shard, write_task_info
from spark_dl.strategies.ps_worker import PSTask, PSWorker, WorkerPlan, ramp_length

from .exchange import Exchange

__all__ = ["RESULT_SCHEMA", "make_task"]

RESULT_SCHEMA = "worker int, report string"


def make_task(cfg: StageConfig, options, plan: WorkerPlan, parts: FitParts, secret: bytes,
              ps_address, channel, partitions: int = 1):
    """The function ``df.mapInArrow(task, RESULT_SCHEMA)`` runs on every task: ``cfg``, fit's
    stage settings; ``options``, the Downpour object with the values its driver resolved
    (n_push, wire_dtype, overlap, widths, balance); ``plan``, the workers' WorkerPlan. With
    ``partitions`` F > 1 the stage is a barrier stage of R x F tasks: task r F + p holds
    partition p of replica r's model (column partitioning), the F tasks of a replica train
    together on the union of their micro-batches, and each pushes and fetches only its own
    slice (parameter-server shard p): Downpour SGD over model-parallel replicas."""

    task_of = PSTask(cfg, options, plan, parts, secret, ps_address, channel)

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
                report = DownpourWorker(task_of, ctx, shard, None, t_start).run()
            else:
                report = _work_partitioned(task_of, ctx, batches, partitions, t_start,
                                           opened)
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


def _work_partitioned(task_of: PSTask, ctx, batches, F: int, t_start: float, opened: list
                      ) -> dict:
    """A barrier task of a model-parallel replica: rendezvous, sub-groups, then its
    DownpourWorker."""
    import torch.distributed as dist

    from spark_dl import errors
    from spark_dl.data.bridge import ShardData
    from spark_dl.model_parallel import Comm
    from spark_dl.transport.rendezvous import process_group

    cfg, secret, channel = task_of.cfg, task_of.secret, task_of.channel
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
        comm = Comm(list(range(r * F, (r + 1) * F)), groups[r], task_of.options.widths)
        # the replica trains on the union of its tasks' shards: as many steps as its largest
        replica = [statuses[r * F + q] for q in range(F)]
        steps = max(-(-s["rows"] // cfg.batch_size) for s in replica)
        if len(shard) == 0 and any(s["rows"] for s in replica):
            # an empty partition: its (empty) micro-batches take the shape of a peer's rows
            feat, fdtype, lab = next(s["sample"] for s in replica if s["rows"])
            shard = ShardData.from_spec((tuple(feat), np.dtype(fdtype), None if lab is None
                                         else (tuple(lab[0]), np.dtype(lab[1]))))
        return DownpourWorker(task_of, ctx, shard, (comm, steps), t_start).run()


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


def _profile(cfg, balance, amp, model, loss_fn, shard, device, dtype, worker: int):
    """Balanced sync rounds (``balance``): this worker's (a, c, cap) for the server's split
    (step time t(b) = a + c b, profiled; fixed shares as c = 1 / share), or None."""
    if balance is None:
        return None
    from spark_dl.balance import measure
    a, c, _, cap = measure(balance, model=model, loss_fn=loss_fn, shard=shard,
                           batch_size=cfg.batch_size, device=device, dtype=dtype,
                           transform=cfg.transform,
                           autocast=(lambda: autocast(device, amp)) if amp else None)
    model.zero_grad(set_to_none=True)
    if balance != "speed":                           # fixed shares
        a, c = 0.0, 1.0 / float(balance[worker])
    return (a, c, int(cap)) if len(shard) else (0.0, 1.0, 1)


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


class DownpourWorker(PSWorker):
    """A Downpour worker: every ``n_fetch`` steps it pulls the parameters, every ``n_push``
    (and at its epoch's end) it pushes the summed gradient of the steps since; a push may
    travel while the next step computes (``overlap``). Its replica's partition 0 reports
    progress; a retried task goes on where the server is."""

    def __init__(self, task_of: PSTask, ctx, shard, partitioned, t_start: float):
        """``partitioned``: None, or (the replica's Comm, steps an epoch)."""
        cfg, run_dir, rank = task_of.cfg, task_of.parts.run_dir, ctx.partitionId()
        super().__init__(cfg, task_of.plan, ctx, rank)
        self.options = opts = task_of.options
        self.t_start, self.loss_fn = t_start, task_of.parts.loss_fn
        comm, self.replica_steps = partitioned if partitioned is not None else (None, 0)
        self.comm = comm
        self.part = comm.rank if comm is not None else 0
        self.worker = rank // comm.size if comm is not None else rank      # the replica
        if comm is None:                  # on a GPU: the rows go there once, batched there
            from spark_dl.data.device import on_device
            shard = on_device(shard, self.device, cfg.transform)
        self.shard = shard
        if run_dir is not None:
            write_task_info(run_dir, f"worker-{rank}",
                            {"worker": rank, "device": str(self.device),
                             "attempt": ctx.attemptNumber(), "rows": len(shard),
                             "data": shard.kind, "replica": self.worker, "partition": self.part})
        torch.manual_seed(cfg.seed)
        model = self._model(task_of.parts.model_fn)
        # profiled before connecting: the server gives a connection 30 s to say its hello
        prof = _profile(cfg, opts.balance, self.plan.amp, model, self.loss_fn, shard,
                        self.device, self.dtype, self.worker) if comm is None else None
        self.connect(task_of.ps_address, task_of.secret)
        # progress and epoch reports come from one task per replica
        from spark_dl.transport.channel import MessageClient
        self.progress = MessageClient(task_of.channel if self.part == 0 else None,
                                      task_of.secret)
        self._hello(prof)
        self._hold(model)

    def _model(self, model_fn) -> torch.nn.Module:
        try:
            if self.comm is None:
                return model_fn().to(device=self.device, dtype=self.dtype)
            return _partitioned_model(model_fn, self.comm, self.dtype,
                                      self.options.model_parallel)
        except (MemoryError, RuntimeError) as e:
            if not _is_out_of_memory(e):
                raise
            _out_of_memory(self.comm)

    def _hello(self, prof) -> None:
        """Register with the server: the steps of an epoch, this worker's share of a balanced
        sync round, where a retried task or a resumed fit goes on."""
        cfg, client, comm = self.cfg, self.client, self.comm
        self.resume_epoch = self.resume_step = 0
        self.batch_size, self.shards = cfg.batch_size, None
        if comm is None:
            self.steps = client.hello(len(self.shard), cfg.batch_size, profile=prof)
            if prof is not None:                  # balanced sync rounds: this worker's share
                self.batch_size = client.batch
            if client.done_steps and self.steps:  # a retried task: go on where the server is
                self.resume_epoch, self.resume_step = divmod(client.done_steps, self.steps)
            return
        # the server counts an epoch's steps once per replica (lr_decay)
        client.hello(self.replica_steps * cfg.batch_size if self.part == 0 else 0,
                     cfg.batch_size, shards=[self.part])
        self.steps, self.shards = self.replica_steps, [self.part]
        # a retried stage or a resumed fit: the replica goes on at the first epoch its
        # partition 0 has not finished (shard 0 counts that task's steps); its tasks agree
        done = torch.tensor([client.done_steps // max(self.steps, 1) if self.part == 0 else 0])
        comm.broadcast(done, 0, "resume")
        self.resume_epoch = int(done)

    def _hold(self, model) -> None:
        """The flat parameters (pulled), the overlapped exchange, the counters."""
        cfg, client, part = self.cfg, self.client, self.part
        expected = client.numel if self.shards is None else \
            client.bounds[part + 1] - client.bounds[part]
        ramp = ramp_length(self.steps * (cfg.epochs - self.resume_epoch) - self.resume_step)
        try:              # the running statistics the server averages: partition 0 reports
            self.hold(model, expected, ramp, reports_buffers=part == 0)
        except (MemoryError, RuntimeError) as e:
            if not _is_out_of_memory(e):
                raise
            _out_of_memory(self.comm, expected * torch.empty((), dtype=self.dtype).element_size())
        self.pull(self.shards)
        opts = self.options
        self.overlap = opts.overlap if opts.overlap is not None else self.device.type == "cuda"
        self.exchange = Exchange(client, self.flat.numel(), client.dtype, self.shards,
                                 self.device) if self.overlap else None
        self.held = list(client.versions)         # versions of the parameters in the model
        self.acc_samples = self.acc_steps = self.pushes = 0
        self.staleness: Counter = Counter()
        self.n_fetch = opts.n_push if opts.mode == "sequential" else opts.n_fetch
        self.master_backprop = self.comm is not None and opts.model_parallel == "master"

    def run(self) -> dict:
        history = []
        for epoch in range(self.resume_epoch, self.cfg.epochs):
            history.append(self._epoch(epoch))
            self.progress.send({"type": "epoch", **history[-1]})
        if self.exchange is not None:
            for s in self.exchange.close():
                self.staleness[s] += 1
        self.client.close()
        self.progress.close()
        return self._report(history)

    def _batches(self, epoch: int, first: int) -> Iterator:
        cfg, seed = self.cfg, replica_seed(self.cfg.seed, self.rank)
        if self.options.balance is None:
            return iter(self.shard.batches(cfg.batch_size, shuffle=cfg.shuffle,
                                           transform=cfg.transform, seed=seed, epoch=epoch,
                                           skip=first))
        return itertools.islice(balanced_batches(
            self.shard, self.batch_size, self.steps, shuffle=cfg.shuffle, seed=seed,
            epoch=epoch, transform=cfg.transform), first, None)

    def _epoch(self, epoch: int) -> dict:
        cfg, comm, steps, mode = self.cfg, self.comm, self.steps, self.options.mode
        first = self.resume_step if epoch == self.resume_epoch else 0
        it = self._batches(epoch, first)
        t0 = last = time.perf_counter()
        loss_sum, samples, curve = LossSum(), 0.0, StepLosses()
        rows_total = len(self.shard) if comm is None else None
        for step in range(first, steps):
            at(epoch, step)
            batch = next(it, None)
            if comm is not None:                  # every task of the replica, every step
                if batch is None:
                    batch = self.shard.empty_batch()
                batch = _gather_batch(comm, *batch)
                if len(batch[0]) == 0:
                    batch = None
            elif batch is None and mode != "sync":
                break                             # only sync rounds need everyone
            if batch is not None:
                loss, n = self._backward(*batch)
                self.acc_samples += n
                loss_sum.add(loss, n)             # read once a report goes
                samples += n
            self.acc_steps += 1
            last_step = step == steps - 1 or (rows_total is not None and mode != "sync"
                                              and samples >= rows_total)
            self._exchange((step + 1) % self.n_fetch == 0 or mode == "sync",
                           self.acc_steps >= self.options.n_push or last_step)
            curve.mark(0.0 if loss_sum.total is None else loss_sum.total, samples)
            now = time.perf_counter()
            if now - last >= cfg.progress_every_s or last_step:
                last = now
                losses, total, _ = curve.read()
                self._progress(epoch, step, total / max(samples, 1),
                               samples / max(now - t0, 1e-9), losses)
        seconds = time.perf_counter() - t0
        row = {"epoch": epoch + 1, "worker": self.worker,
               "loss": loss_sum.value() / max(samples, 1), "samples": int(samples),
               "seconds": seconds, "samples_per_s": samples / max(seconds, 1e-9)}
        if first:                                 # a retry's part of the epoch only
            row["resumed_at_step"] = first + 1
        return row

    def _backward(self, x, y) -> tuple[torch.Tensor, int]:
        if not self.master_backprop:
            return self.backward(x, y, self.loss_fn)
        x, y = self.on_device(x, y)
        master = self.part == 0                   # the master holds the batch (§3.2)
        loss = self.model.step(x if master else None, y if master else None, len(x),
                               grad_scale=len(x))
        return torch.tensor(loss if master else 0.0), len(x)

    def _exchange(self, fetch: bool, due: bool) -> None:
        """Push the summed gradient when ``due``, pull the parameters when ``fetch``."""
        client, staleness = self.client, self.staleness
        if due and not self.unscaled():           # fp16 overflow: this gradient is dropped
            self.acc_samples = 0                  # (a sync round still gets its empty push)
            if self.options.mode != "sync":
                self.acc_steps, due = 0, False
        if due:
            self.carry(self.acc_samples, self.acc_steps)
        if self.exchange is not None and due:
            for s in self.exchange.wait():        # the previous push's reply: the
                staleness[s] += 1                 # parameters after it, into the model
            computed_on = self.held
            if self.exchange.pushed:
                self.exchange.land(self.flat)
                self.held = list(client.versions)
            self.exchange.start(self.grad, self.acc_samples, self.acc_steps, computed_on,
                                self.reported_buffers(), self.momentum())
        elif due:
            for s in client.push(self.outgoing(), self.acc_samples, self.acc_steps,
                                 pull_into=self.wire if fetch else None, shards=self.shards,
                                 buffers=self.reported_buffers(), momentum=self.momentum()):
                staleness[s] += 1
            if fetch:
                self.landed()
        elif fetch and self.exchange is None:     # with overlap every push also fetches
            self.pull(self.shards)
        if due:
            self.pushes += 1
            self.grad.zero_()
            self.acc_samples = self.acc_steps = 0

    def _progress(self, epoch: int, step: int, loss: float, samples_per_s: float,
                  losses: list) -> None:
        n_stale = sum(self.staleness.values())
        self.progress.send({"type": "step", "worker": self.worker, "epoch": epoch + 1,
                            "epochs": self.cfg.epochs, "step": step + 1, "steps": self.steps,
                            "loss": loss, "losses": losses, "samples_per_s": samples_per_s,
                            "staleness": sum(k * v for k, v in self.staleness.items())
                            / max(n_stale, 1)})

    def _report(self, history: list[dict]) -> dict:
        shard, comm = self.shard, self.comm
        resumed = self.resume_epoch or self.resume_step
        report = {"worker": self.worker, "task": self.rank, "partition": self.part,
                  "rows": len(shard), "data": shard.kind,
                  "spill_dir": getattr(shard, "directory", None), "history": history,
                  "pushes": self.pushes, "overlap": self.overlap,
                  "resumed_at": {"epoch": self.resume_epoch + 1, "step": self.resume_step + 1}
                  if resumed else None,
                  "staleness": {str(k): v for k, v in sorted(self.staleness.items())},
                  **self.report()}
        if comm is not None:
            report["model_parallel"] = {"partitions": comm.size, "parameter_bytes":
                                        self.flat.numel() * self.flat.element_size(),
                                        "communication": comm.counts()}
        return report
