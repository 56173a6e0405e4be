"""Downpour SGD workers: ordinary Spark tasks (``mapInArrow`` over the data) that train on
their own partition and exchange parameters with the driver's parameter server (ps.py).

Each worker fetches the parameters every ``n_fetch`` steps and, between fetches, computes
gradients on the parameters it holds (a DistBelief replica does not update itself); it pushes
the accumulated per-sample gradient sum every ``n_push`` steps. Spark schedules the tasks and
retries a failed one, which registers again, fetches, and goes on.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections import Counter
from typing import Callable, Iterator

import torch

__all__ = ["DownpourConfig", "make_task", "RESULT_SCHEMA"]

RESULT_SCHEMA = "worker int, report string"


@dataclasses.dataclass(frozen=True)
class DownpourConfig:
    features: str = "features"
    label: str = "label"
    shape: tuple = ()
    label_shape: tuple = ()
    num_classes: int | None = None
    loss: str = "cross_entropy"
    epochs: int = 1
    batch_size: int = 64
    n_fetch: int = 1
    n_push: int = 1
    mode: str = "async"
    shuffle: bool = True
    seed: int = 0
    dtype: str = "float32"
    wire_dtype: str = "float32"        # float32, bfloat16 (half the bytes) or float64
    device: str = "auto"
    threads: int = 0
    timeout_s: float = 300.0
    progress_every_s: float = 2.0


_TORCH = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}


def make_task(cfg: DownpourConfig, model_fn: Callable, loss_fn: Callable, secret: bytes,
              ps_address, channel, run_dir: str | None):

    def task(batches: Iterator) -> Iterator:
        import pyarrow as pa
        from pyspark import TaskContext

        from spark_dl.data.bridge import ShardData
        from spark_dl.parallel.channel import MessageClient
        from spark_dl.parallel.ps import PSClient
        from spark_dl.parallel.rendezvous import task_device

        ctx = TaskContext.get()
        worker = ctx.partitionId()
        t_start = time.perf_counter()
        shard = ShardData.from_arrow(batches, cfg.features, cfg.label, cfg.shape,
                                     cfg.label_shape, cfg.num_classes,
                                     where=f"partition {worker}")
        gpus = list(ctx.resources()["gpu"].addresses) if "gpu" in ctx.resources() else []
        device, note = task_device(cfg.device, gpus, worker)
        torch.set_num_threads(cfg.threads or int(ctx.cpus() or 1))
        if run_dir is not None:
            _write_worker_info(run_dir, worker, {"pid": os.getpid(), "host": os.uname().nodename,
                                                 "device": str(device), "attempt":
                                                 ctx.attemptNumber(), "rows": len(shard)})
        dtype = _TORCH[cfg.dtype]
        torch.manual_seed(cfg.seed)
        model = model_fn().to(device=device, dtype=dtype)
        params = [p for p in model.parameters() if p.requires_grad]
        client = PSClient(ps_address, secret, worker, _TORCH[cfg.wire_dtype], cfg.timeout_s)
        progress = MessageClient(channel, secret)
        steps = client.hello(len(shard), cfg.batch_size)
        # parameters and gradients live in two flat vectors (p and p.grad are views): a pull
        # lands in the model, backward accumulates the pushed sum in place, nothing is copied
        # when the wire carries the model's dtype on the CPU
        flat, grad = _flatten(params, client.numel)
        direct = flat.dtype == client.dtype and flat.device.type == "cpu"
        wire = flat if direct else torch.empty(client.numel, dtype=client.dtype)

        def landed():                                 # the pulled values into the model
            if not direct:
                flat.copy_(wire)

        client.pull(wire)
        landed()
        acc_samples = acc_steps = 0
        staleness: Counter = Counter()
        history, pushes = [], 0
        n_fetch = cfg.n_push if cfg.mode == "sequential" else cfg.n_fetch
        for epoch in range(cfg.epochs):
            it = iter(shard.batches(cfg.batch_size, shuffle=cfg.shuffle,
                                    seed=cfg.seed * 1000003 + worker, epoch=epoch))
            t0 = last = time.perf_counter()
            loss_sum = samples = 0.0
            for step in range(steps):
                batch = next(it, None)
                if batch is None and cfg.mode != "sync":
                    break                             # only sync rounds need everyone
                if batch is not None:
                    x, y = batch
                    x = x.to(device=device, dtype=dtype)
                    y = y.to(device=device)
                    if y.is_floating_point():
                        y = y.to(dtype)
                    loss = loss_fn(model(x), y)
                    (loss * len(x)).backward()        # grad += the per-sample gradient sum
                    acc_samples += len(x)
                    loss_sum += float(loss.detach()) * len(x)
                    samples += len(x)
                acc_steps += 1
                last_step = step == steps - 1 or (cfg.mode != "sync" and
                                                  samples >= len(shard))
                fetch = (step + 1) % n_fetch == 0 or cfg.mode == "sync"
                if acc_steps >= cfg.n_push or last_step:
                    out = grad if grad.device.type == "cpu" else grad.cpu()
                    for s in client.push(out, acc_samples, acc_steps,
                                         pull_into=wire if fetch else None):
                        staleness[s] += 1
                    pushes += 1
                    grad.zero_()
                    acc_samples = acc_steps = 0
                    if fetch:
                        landed()
                elif fetch:
                    client.pull(wire)
                    landed()
            seconds = time.perf_counter() - t0
            row = {"epoch": epoch + 1, "worker": worker, "loss": loss_sum / max(samples, 1),
                   "samples": int(samples), "seconds": seconds,
                   "samples_per_s": samples / max(seconds, 1e-9)}
            history.append(row)
            progress.send({"type": "epoch", **row})
        client.close()
        progress.close()
        report = {"worker": worker, "rows": len(shard), "device": str(device), "note": note,
                  "history": history, "pushes": pushes,
                  "staleness": {str(k): v for k, v in sorted(staleness.items())},
                  "push_seconds": client.push_seconds, "pull_seconds": client.pull_seconds,
                  "bytes_sent": client.conn.bytes_sent,
                  "bytes_received": client.conn.bytes_received,
                  "task_seconds": time.perf_counter() - t_start, "attempt": ctx.attemptNumber()}
        yield pa.RecordBatch.from_pydict({"worker": [worker], "report": [json.dumps(report)]},
                                         schema=pa.schema([("worker", pa.int32()),
                                                           ("report", pa.string())]))

    return task


def _flatten(params: list, numel: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Make every parameter and its gradient a view into one flat vector each."""
    if sum(p.numel() for p in params) != numel:
        raise RuntimeError(f"the model has {sum(p.numel() for p in params)} trainable "
                           f"parameters, the parameter server {numel}: model_fn must build "
                           f"the same model in every task")
    ref = params[0]
    flat = torch.empty(numel, dtype=ref.dtype, device=ref.device)
    grad = torch.zeros_like(flat)
    off = 0
    for p in params:
        n = p.numel()
        flat[off:off + n].copy_(p.detach().reshape(-1))
        p.data = flat[off:off + n].view_as(p)
        p.grad = grad[off:off + n].view_as(p)
        off += n
    return flat, grad


def _write_worker_info(run_dir: str, worker: int, info: dict) -> None:
    from pathlib import Path
    try:
        d = Path(run_dir) / "workers"
        d.mkdir(parents=True, exist_ok=True)
        tmp = d / f".worker-{worker}.json.tmp"
        tmp.write_text(json.dumps({"worker": worker, **info}))
        os.replace(tmp, d / f"worker-{worker}.json")
    except OSError:
        pass
