"""What the benchmarks share, in one module (no benchmark imports another):

- ``write_results``: the JSON results file every benchmark writes (date, host, command,
  settings, the summary the performance page reads, the raw runs);
- the data: the shipped MNIST digits (``IMAGES``, ``LABELS``), as arrays, as a DataFrame,
  the 2,000 held-out digits, and the extended (distorted) digits written as Parquet;
- the calibrations: plain single-process PyTorch loops over the same rows;
- the peers' side: ``run_torchdistributor`` (PySpark's TorchDistributor with a deadline) and
  ``ddp_train``, the DDP function bench_run.py runs under every launcher.

Only the standard library is imported at module level: ray_peer.py imports ``ddp_train``
inside .venv-ray, and bench_run.py ships this module by value to TorchDistributor's processes.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
IMAGES = str(ROOT / "data/mnist/t10k-images-idx3-ubyte.gz")
LABELS = str(ROOT / "data/mnist/t10k-labels-idx1-ubyte.gz")
SOURCES = 8000                 # the extended digits are distortions of the first 8,000


def write_results(out: str | Path, script: str, argv, settings: dict, summary: dict,
                  raw: dict) -> None:
    """One JSON results file: the run's date, host and command, its settings, the summary
    (printed too) and the raw runs."""
    doc = {"date": time.strftime("%Y-%m-%d %H:%M"), "host": platform.node(),
           "cpus": os.cpu_count(), **settings,
           "command": f"benchmarks/{script} " + " ".join(argv or sys.argv[1:]),
           "summary": summary, "raw": raw}
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1))
    print(json.dumps(summary, indent=1))


# --- data --------------------------------------------------------------------------------

def mnist_arrays(rows: int):
    """The first ``rows`` shipped digits: float32 pixels in [0, 1] (rows x 784), int64 labels."""
    import numpy as np

    from spark_dl.data import load_mnist
    x, y = load_mnist(IMAGES, LABELS)
    return (x[:rows].reshape(rows, -1).astype(np.float32) / 255), y[:rows].astype(np.int64)


def validation_digits():
    """The last 2,000 shipped digits (never among the training rows): (x, y) as above."""
    import numpy as np

    from spark_dl.data import load_mnist
    x, y = load_mnist(IMAGES, LABELS)
    return x[-2000:].reshape(2000, -1).astype(np.float32) / 255, y[-2000:].astype(np.int64)


def mnist_frame(spark, rows: int, shards: int = 2):
    """The first ``rows`` shipped digits as a DataFrame of ``shards`` partitions."""
    from spark_dl.data import mnist_file_dataframe
    return mnist_file_dataframe(spark, IMAGES, LABELS, 0, rows, shards)


def extended_shards(spark, rows: int, shards: int, where: Path) -> tuple[str, tuple]:
    """``rows`` distorted digits of the first 8,000 shipped ones, made on the executors once
    and written as ``shards`` Parquet shards at ``where``; also the same rows on the driver
    (float32 pixels, int64 labels) for the calibration."""
    import numpy as np

    from spark_dl.data import extended_mnist, load_mnist, write_shards
    x, y = load_mnist(IMAGES, LABELS)
    write_shards(extended_mnist(spark, x[:SOURCES], y[:SOURCES], rows, shards, seed=0),
                 str(where), mode="overwrite")
    local = spark.read.parquet(str(where)).toPandas()
    px = np.stack([np.frombuffer(b, np.uint8) for b in local["features"]]).astype(np.float32)
    return str(where), (px / 255, local["label"].to_numpy().astype(np.int64))


def scaling_data(spark, samples: int, out: Path):
    """The demo's extended set (``samples`` distorted digits of the first 8,000, 4
    partitions) as Parquet (uint8 pixels) at ``out``; returns the held-out 2,000 real digits
    as float32 pixels and int64 labels."""
    import numpy as np

    from spark_dl.data import extended_mnist
    from spark_dl.data.mnist import mnist_split
    (src_x, src_y), (test_x, test_y) = mnist_split(IMAGES, LABELS, SOURCES, 2000)
    extended_mnist(spark, src_x, src_y, samples, 4, seed=0).write.mode("overwrite") \
        .parquet(out.as_uri())
    return test_x.reshape(len(test_x), -1).astype(np.float32) / 255, test_y.astype(np.int64)


# --- calibrations ------------------------------------------------------------------------

def plain_rate(model_name: str, rows: int, batch: int, threads: int, *, epochs: int,
               lr: float, momentum: float):
    """Single-process PyTorch over an in-memory tensor of the first ``rows`` digits (SGD with
    momentum, ``threads`` torch threads): (steady samples/s, the median over epochs 2 on;
    wall seconds)."""
    import torch

    from spark_dl.models import build_model
    t_wall = time.perf_counter()
    torch.set_num_threads(threads)
    x, y = mnist_arrays(rows)
    x = torch.from_numpy(x).reshape(rows, 1, 28, 28) if model_name == "cnn" else \
        torch.from_numpy(x)
    y = torch.from_numpy(y)
    torch.manual_seed(0)
    model = build_model(model_name)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    secs = []
    for e in range(epochs):
        perm = torch.randperm(rows, generator=torch.Generator().manual_seed(e))
        t0 = time.perf_counter()
        for i in range(0, rows, batch):
            idx = perm[i:i + batch]
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
            opt.step()
        secs.append(time.perf_counter() - t0)
    return rows / statistics.median(secs[1:]), time.perf_counter() - t_wall


def plain_curve(rows: int, epochs: int, data=None, seed: int = 0, batch: int = 16, *,
                lr: float, momentum: float) -> list[dict]:
    """Single-process PyTorch, 1 thread, the thesis CNN on the first ``rows`` digits (or
    ``data``: (x, y)), validated on the held-out digits after every epoch: one dict an epoch
    (epoch, seconds, samples_per_s, val_accuracy)."""
    import torch

    from spark_dl.models import build_model
    from spark_dl.train import evaluate
    torch.set_num_threads(1)
    x, y = data if data is not None else mnist_arrays(rows)
    x, y = torch.from_numpy(x).reshape(rows, 1, 28, 28), torch.from_numpy(y)
    vx, vy = validation_digits()
    vx = torch.from_numpy(vx).reshape(-1, 1, 28, 28)
    torch.manual_seed(seed)
    model = build_model("cnn")
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    hist = []
    for e in range(epochs):
        perm = torch.randperm(rows, generator=torch.Generator().manual_seed(seed * 1000 + e))
        t0 = time.perf_counter()
        model.train()
        for i in range(0, rows, batch):
            idx = perm[i:i + batch]
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
            opt.step()
        secs = time.perf_counter() - t0
        hist.append({"epoch": e + 1, "seconds": secs, "samples_per_s": rows / secs,
                     "val_accuracy": evaluate(model, vx, vy)["accuracy"]})
    return hist


# --- the peers ---------------------------------------------------------------------------

def run_torchdistributor(spark, fn, *args, timeout_s: float, processes: int = 2):
    """``TorchDistributor(num_processes=processes, local_mode=False).run(fn, *args)``: (its
    result or None, wall seconds, the error or None). A run past ``timeout_s`` has its jobs
    cancelled: its torchrun agents sometimes abort, or wait out their 300 s exit barrier."""
    from pyspark.ml.torch.distributor import TorchDistributor
    out, t0 = {}, time.perf_counter()

    def go():
        try:
            out["r"] = TorchDistributor(num_processes=processes, local_mode=False,
                                        use_gpu=False).run(fn, *args)
        except Exception as e:
            out["error"] = f"{type(e).__name__}: {str(e)[:300]}"
    t = threading.Thread(target=go, daemon=True)
    t.start()
    t.join(timeout_s)
    wall = time.perf_counter() - t0
    if t.is_alive() or "r" not in out:
        spark.sparkContext.cancelAllJobs()
        t.join(30)
        return None, wall, out.get("error", f"hung > {timeout_s} s")
    return out["r"], wall, None


def ddp_train(images: str, labels: str, rows: int, epochs: int, batch: int, lr: float,
              momentum: float) -> dict:
    """The DDP function bench_run.py runs under every launcher: the thesis CNN wrapped in
    DistributedDataParallel, SGD with momentum, its own loop, 1 torch thread a process.

    Its rows: under ``spark_dl.run``, the context's shard (the DataFrame's partition); under
    TorchDistributor and Ray Train (no DataFrame reaches their functions), the rank's slice of
    the same digits read from the IDX files, as the DataFrame's partitions hold them. The
    epoch's own loop time is measured; rank 0 returns the trained weights."""
    import os
    import time

    import numpy as np
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    from spark_dl.models import build_model

    torch.set_num_threads(1)
    if not dist.is_initialized():                      # Ray Train has made it already
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        import spark_dl
        ctx = spark_dl.context()
        batches = ctx.batches
    except RuntimeError:                               # not under spark_dl.run: the files
        from spark_dl.data import load_mnist
        lo, hi = rank * rows // world, (rank + 1) * rows // world
        x, y = load_mnist(images, labels)
        x = torch.from_numpy(x[lo:hi].reshape(hi - lo, 1, 28, 28).astype(np.float32) / 255)
        y = torch.from_numpy(y[lo:hi].astype(np.int64))

        def batches(epoch):
            perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(epoch))
            for i in range(0, len(x), batch):
                idx = perm[i:i + batch]
                yield x[idx], y[idx]
    torch.manual_seed(0)
    model = DDP(build_model("cnn"))
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    secs, samples = [], 0
    for epoch in range(epochs):
        t0, n = time.perf_counter(), 0
        for xb, yb in batches(epoch):
            opt.zero_grad()
            F.cross_entropy(model(xb), yb).backward()
            opt.step()
            n += len(xb)
        secs.append(time.perf_counter() - t0)
        samples = n
    out = {"epoch_seconds": secs, "samples_per_rank": samples, "world": world,
           "pid": os.getpid()}
    if rank == 0:
        out["state"] = {k: v.detach().clone() for k, v in model.module.state_dict().items()}
    return out
