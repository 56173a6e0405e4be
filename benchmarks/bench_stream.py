"""Benchmark of streamed shards (data larger than memory), side by side, interleaved, medians.

(a) training throughput on data that fits: the thesis CNN, one epoch over extended-MNIST
    pixels (uint8), fed by a StreamShard (spilled to local disk, 16 MB shuffle buffer), by the
    in-memory ShardData, and by plain PyTorch (one float32 tensor, randperm batches) as the
    calibration; interleaved A B C A B C ..., medians;
(b) scaling: a fresh process per run spills 1x, 3x and 10x the rows and trains one epoch of an
    FC net from them with a fixed buffer; time per epoch against the data, and the process's
    peak RSS (which must stay flat: memory is the model + the buffer, not the shard);
(c) accuracy after equal epochs: the thesis CNN trained from the streamed shard (a buffer of a
    tenth of the data) and with a full in-memory shuffle, same seeds, on the last 2,000 MNIST
    digits.

    .venv/bin/python benchmarks/bench_stream.py [--repeats 5] [--out benchmarks/results/stream.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from spark_dl.data import distort_range, mnist_split, open_shard, pixels_to_arrow  # noqa: E402
from spark_dl.data.mnist import to_pixels  # noqa: E402
from spark_dl.models.cnn import ThesisCNN  # noqa: E402
from spark_dl.train import evaluate, train_epoch  # noqa: E402

IMAGES = ROOT / "data" / "mnist" / "t10k-images-idx3-ubyte.gz"
LABELS = ROOT / "data" / "mnist" / "t10k-labels-idx1-ubyte.gz"


def _arrow(px, y, rows=10_000):
    """The record batches a Spark task would receive (Spark's maxRecordsPerBatch)."""
    return [pixels_to_arrow(px[a:a + rows], y[a:a + rows]) for a in range(0, len(px), rows)]


def _extended(n, seed=0):
    (x, y), _ = mnist_split(IMAGES, LABELS)
    fx, fy = distort_range(x, y, 0, n, seed=seed)
    return to_pixels(fx).reshape(n, 784), fy


def _sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def bench_throughput(n, repeats, batch_size=128):
    px, y = _extended(n)
    tmp = tempfile.mkdtemp(prefix="bench-stream-")
    stream = open_shard(_arrow(px, y), shape=(1, 28, 28), data="stream",
                        shuffle_buffer="16MB", directory=tmp)
    memory = open_shard(_arrow(px, y), shape=(1, 28, 28), data="memory")
    xt = torch.from_numpy(px.reshape(n, 1, 28, 28).astype(np.float32) / 255)
    yt = torch.from_numpy(y)

    def plain(model, opt, epoch):
        g = torch.Generator().manual_seed(epoch)
        perm = torch.randperm(n, generator=g)
        batches = ((xt[idx], yt[idx]) for idx in perm.split(batch_size))
        return train_epoch(model, batches, opt)

    runs = {
        "stream": lambda m, o, e: train_epoch(m, stream.batches(batch_size, seed=0, epoch=e), o),
        "memory": lambda m, o, e: train_epoch(m, memory.batches(batch_size, seed=0, epoch=e), o),
        "plain_pytorch": plain,
    }
    times = {k: [] for k in runs}
    for rep in range(repeats + 1):                   # the first round warms up
        for name, run in runs.items():
            torch.manual_seed(0)
            model = ThesisCNN()
            out = run(model, _sgd(model), rep)
            if rep:
                times[name].append(out["seconds"])
    stream.close()
    rate = {k: n / statistics.median(v) for k, v in times.items()}
    return {"rows": n, "batch_size": batch_size, "model": "ThesisCNN", "buffer": "16MB",
            "samples_per_s": {k: round(v) for k, v in rate.items()},
            "ratio_stream_vs_memory": round(rate["stream"] / rate["memory"], 3),
            "ratio_stream_vs_plain": round(rate["stream"] / rate["plain_pytorch"], 3),
            "ratio_memory_vs_plain": round(rate["memory"] / rate["plain_pytorch"], 3),
            "seconds": times}


_SCALING_CHILD = """
import json, resource, sys, tempfile, time
import numpy as np, torch
sys.path.insert(0, sys.argv[1])
from spark_dl.data import open_shard, pixels_to_arrow
from spark_dl.models.fc import FCNet
from spark_dl.train import train_epoch
rows, buffer = int(sys.argv[2]), sys.argv[3]
torch.set_num_threads(2)

def arrow():                      # made batch by batch, as a task receives them from Spark
    g = np.random.default_rng(0)
    for a in range(0, rows, 10_000):
        k = min(10_000, rows - a)
        px = g.integers(0, 256, (k, 784), dtype=np.uint8)
        yield pixels_to_arrow(px, px[:, 0] % 10)

t0 = time.perf_counter()
shard = open_shard(arrow(), shape=(784,), data="stream", shuffle_buffer=buffer,
                   directory=tempfile.gettempdir())
spill_s = time.perf_counter() - t0
torch.manual_seed(0)
model = FCNet((784, 128, 10), act="relu")
opt = torch.optim.SGD(model.parameters(), lr=0.01)
out = train_epoch(model, shard.batches(256, seed=0, epoch=0), opt)
print(json.dumps({"rows": rows, "spill_s": spill_s, "epoch_s": out["seconds"],
                  "samples": out["samples"], "spilled_bytes": shard.spilled_bytes,
                  "peak_buffer_rows": shard.peak_buffer_rows,
                  "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def bench_scaling(base, factors, repeats, buffer="32MB"):
    runs = {f: [] for f in factors}
    for _ in range(repeats):
        for f in factors:                             # interleaved: 1x 3x 10x 1x 3x 10x ...
            runs[f].append(_child(base * f, buffer))
    med = {f: {k: statistics.median(r[k] for r in rs)
               for k in ("epoch_s", "spill_s", "peak_rss_mb")} for f, rs in runs.items()}
    lo = factors[0]
    return {"base_rows": base, "row_bytes": 784 + 8, "buffer": buffer, "model": "FC 784-128-10",
            "batch_size": 256,
            "median": {f"{f}x": m for f, m in med.items()},
            "epoch_time_ratio": {f"{f}x": round(med[f]["epoch_s"] / med[lo]["epoch_s"], 3)
                                 for f in factors},
            "peak_rss_ratio": {f"{f}x": round(med[f]["peak_rss_mb"] / med[lo]["peak_rss_mb"], 3)
                               for f in factors},
            "disk_bytes_at_largest": runs[factors[-1]][0]["spilled_bytes"],
            "runs": {f"{f}x": rs for f, rs in runs.items()}}


def _child(rows, buffer="32MB"):
    out = subprocess.run([sys.executable, "-c", _SCALING_CHILD, str(ROOT), str(rows), buffer],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def bench_one(rows, scaling=None):
    """One streamed epoch at a large size (once: it takes minutes), against the 1x median."""
    t0 = time.perf_counter()
    run = _child(rows)
    run["wall_s"] = time.perf_counter() - t0
    if scaling:
        one = scaling["median"]["1x"]
        f = rows / scaling["base_rows"]
        run["factor"] = f
        run["epoch_time_ratio"] = round(run["epoch_s"] / one["epoch_s"], 3)
        run["epoch_time_ratio_per_factor"] = round(run["epoch_s"] / one["epoch_s"] / f, 3)
        run["peak_rss_ratio"] = round(run["peak_rss_mb"] / one["peak_rss_mb"], 3)
    return run


def bench_accuracy(n, epochs, seeds, batch_size=64):
    px, y = _extended(n)
    (_, _), (tx, ty) = mnist_split(IMAGES, LABELS)
    tx = tx.reshape(len(tx), 1, 28, 28).astype(np.float32) / 255
    buffer = n // 10
    tmp = tempfile.mkdtemp(prefix="bench-stream-")
    stream = open_shard(_arrow(px, y), shape=(1, 28, 28), data="stream", shuffle_buffer=buffer,
                        directory=tmp)
    memory = open_shard(_arrow(px, y), shape=(1, 28, 28), data="memory")
    acc = {"stream": [], "memory": []}
    for seed in seeds:
        for name, shard in (("stream", stream), ("memory", memory)):
            torch.manual_seed(seed)
            model = ThesisCNN()
            opt = _sgd(model)
            for e in range(epochs):
                train_epoch(model, shard.batches(batch_size, seed=seed, epoch=e), opt)
            acc[name].append(evaluate(model, tx, ty)["accuracy"])
    stream.close()
    mean = {k: float(np.mean(v)) for k, v in acc.items()}
    return {"rows": n, "epochs": epochs, "seeds": list(seeds), "buffer_rows": buffer,
            "batch_size": batch_size, "model": "ThesisCNN", "accuracy": acc,
            "mean_accuracy": mean,
            "difference_points": round(100 * (mean["stream"] - mean["memory"]), 3)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--rows", type=int, default=20_000)
    ap.add_argument("--base", type=int, default=50_000)
    ap.add_argument("--acc-rows", type=int, default=24_000)
    ap.add_argument("--acc-epochs", type=int, default=2)
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--only", default="throughput,scaling,accuracy")
    ap.add_argument("--thesis-rows", type=int, default=0,
                    help="also one streamed epoch over this many rows (8100000: the thesis's "
                         "extended MNIST), after the scaling runs")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "stream.json"))
    args = ap.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    out_path = Path(args.out)
    result = json.loads(out_path.read_text()) if out_path.exists() else {}
    result["machine"] = {"cpus": os.cpu_count(), "python": platform.python_version(),
                         "torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M")}
    only = args.only.split(",")
    if "throughput" in only:
        result["throughput"] = bench_throughput(args.rows, args.repeats)
        print(json.dumps(result["throughput"]["samples_per_s"]),
              result["throughput"]["ratio_stream_vs_memory"], flush=True)
    if "scaling" in only:
        result["scaling"] = bench_scaling(args.base, [1, 3, 10], args.repeats)
        print(json.dumps(result["scaling"]["median"]), flush=True)
    if args.thesis_rows:
        result["thesis_scale"] = bench_one(args.thesis_rows, result.get("scaling"))
        print(json.dumps(result["thesis_scale"]), flush=True)
    if "accuracy" in only:
        result["accuracy"] = bench_accuracy(args.acc_rows, args.acc_epochs, range(args.seeds))
        print(json.dumps(result["accuracy"]["mean_accuracy"]), flush=True)
    out_path.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
