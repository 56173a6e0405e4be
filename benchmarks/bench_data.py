"""Benchmark of the data foundation, side by side and interleaved (A B A B ...), medians.

(a) extended-MNIST generation on Spark with 2 executors (local-cluster[2,1,1024]) against the
    same generator in this process on one core (calibration);
(b) the partition -> torch mini-batch bridge (ShardData.from_arrow + batches, from the Arrow
    record batches a task receives) against plain in-process loops over the same numpy array
    already in memory: a hand-written shuffled fancy-indexing loop and torch's DataLoader over
    a TensorDataset; for fits of 1 and 5 epochs (the bridge reads the partition once per fit).

    .venv/bin/python benchmarks/bench_data.py [--repeats 5] [--out benchmarks/results/data.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from spark_dl.data import (  # noqa: E402
    ShardData,
    arrays_to_arrow,
    distort_range,
    extended_mnist,
    mnist_split,
)


def _timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def bench_generation(spark, x, y, n, repeats):
    def on_spark():
        df = extended_mnist(spark, x, y, n=n, partitions=4, seed=0)
        rows = df.mapInArrow(_count_task, "rows long").groupBy().sum("rows").first()[0]
        assert rows == n
    def in_process():
        torch.set_num_threads(1)
        for lo in range(0, n // 4, 10000):                 # a quarter of n: a 1-core budget
            distort_range(x, y, lo, min(lo + 10000, n // 4), seed=0)
    on_spark()                                             # warm the executors' Python workers
    spark_s, local_s = [], []
    for _ in range(repeats):
        spark_s.append(_timed(on_spark)[0])
        local_s.append(_timed(in_process)[0])
    spark_rate = n / statistics.median(spark_s)
    local_rate = (n // 4) / statistics.median(local_s)
    return {"samples": n, "spark_2_executors_samples_per_s": round(spark_rate),
            "in_process_1_core_samples_per_s": round(local_rate),
            "ratio_spark_vs_1_core": round(spark_rate / local_rate, 3),
            "spark_seconds": spark_s, "in_process_seconds_for_quarter": local_s}


def _count_task(batches):
    import pyarrow as pa
    yield pa.RecordBatch.from_pydict({"rows": [sum(b.num_rows for b in batches)]},
                                     schema=pa.schema([("rows", pa.int64())]))


def bench_bridge(x, y, batch_size, epochs, repeats):
    """Rate of delivering (x, y) torch batches for a fit of ``epochs`` epochs."""
    n = len(x)
    feats = (x.reshape(n, -1) / 255.0).astype(np.float32)
    # What a Spark task receives: Arrow record batches of 10,000 rows.
    batches = [arrays_to_arrow(feats[i:i + 10000], y[i:i + 10000]) for i in range(0, n, 10000)]
    data, labels = feats.reshape(n, 1, 28, 28), y

    def bridge():                 # read + validate the partition once, then the epochs
        shard = ShardData.from_arrow(batches, shape=(1, 28, 28), num_classes=10)
        s = 0.0
        for e in range(epochs):
            for xb, yb in shard.batches(batch_size, seed=0, epoch=e):
                s += float(xb[:, 0, 0, 0].sum()) + int(yb[0])
        return s

    def plain():                  # hand-written loop over the numpy array already in memory
        s = 0.0
        for e in range(epochs):
            order = np.random.default_rng([0, e]).permutation(n)
            for i in range(0, n, batch_size):
                idx = order[i:i + batch_size]
                xb, yb = torch.from_numpy(data[idx]), torch.from_numpy(labels[idx])
                s += float(xb[:, 0, 0, 0].sum()) + int(yb[0])
        return s

    def dataloader():             # what most PyTorch code writes
        ds = torch.utils.data.TensorDataset(torch.from_numpy(data), torch.from_numpy(labels))
        loader = torch.utils.data.DataLoader(ds, batch_size=batch_size, shuffle=True)
        s = 0.0
        for _ in range(epochs):
            for xb, yb in loader:
                s += float(xb[:, 0, 0, 0].sum()) + int(yb[0])
        return s

    runs = {"bridge": bridge, "plain_numpy_loop": plain, "torch_dataloader": dataloader}
    for fn in runs.values():
        fn()                                               # warm-up
    secs = {k: [] for k in runs}
    for _ in range(repeats):                               # interleaved A B C A B C ...
        for k, fn in runs.items():
            secs[k].append(_timed(fn)[0])
    rate = {k: n * epochs / statistics.median(v) for k, v in secs.items()}
    return {"rows": n, "epochs": epochs, "batch_size": batch_size,
            **{f"{k}_samples_per_s": round(r) for k, r in rate.items()},
            "ratio_bridge_vs_plain_numpy_loop": round(rate["bridge"] / rate["plain_numpy_loop"], 3),
            "ratio_bridge_vs_torch_dataloader": round(rate["bridge"] / rate["torch_dataloader"], 3),
            "seconds": secs}


def bench_bridge_steady(x, y, batch_size, repeats):
    """Per-epoch delivery once the partition is read, and the one-time read, separately."""
    n = len(x)
    feats = (x.reshape(n, -1) / 255.0).astype(np.float32)
    batches = [arrays_to_arrow(feats[i:i + 10000], y[i:i + 10000]) for i in range(0, n, 10000)]
    data = feats.reshape(n, 1, 28, 28)
    shard = ShardData.from_arrow(batches, shape=(1, 28, 28), num_classes=10)

    def read():
        ShardData.from_arrow(batches, shape=(1, 28, 28), num_classes=10)

    def bridge_epoch():
        s = 0.0
        for xb, yb in shard.batches(batch_size, seed=0, epoch=0):
            s += float(xb[:, 0, 0, 0].sum()) + int(yb[0])

    def plain_epoch():
        s = 0.0
        order = np.random.default_rng([0, 0]).permutation(n)
        for i in range(0, n, batch_size):
            idx = order[i:i + batch_size]
            xb, yb = torch.from_numpy(data[idx]), torch.from_numpy(y[idx])
            s += float(xb[:, 0, 0, 0].sum()) + int(yb[0])

    runs = {"bridge_epoch": bridge_epoch, "plain_numpy_epoch": plain_epoch, "read": read}
    for fn in runs.values():
        fn()
    secs = {k: [] for k in runs}
    for _ in range(repeats):
        for k, fn in runs.items():
            secs[k].append(_timed(fn)[0])
    med = {k: statistics.median(v) for k, v in secs.items()}
    return {"rows": n, "batch_size": batch_size,
            "bridge_epoch_samples_per_s": round(n / med["bridge_epoch"]),
            "plain_numpy_epoch_samples_per_s": round(n / med["plain_numpy_epoch"]),
            "ratio_bridge_vs_plain_per_epoch": round(med["plain_numpy_epoch"] /
                                                     med["bridge_epoch"], 3),
            "read_seconds_per_partition": round(med["read"], 4),
            "read_mb_per_s": round(feats.nbytes / 1e6 / med["read"]), "seconds": secs}


def bench_bridge_training(x, y, batch_size, repeats, rows=10000):
    """One epoch of the thesis CNN fed by the bridge vs by the plain numpy loop."""
    from spark_dl.models import build_model
    from spark_dl.train import make_optimizer, train_epoch
    x, y = x[:rows], y[:rows]
    feats = (x.reshape(rows, -1) / 255.0).astype(np.float32)
    batches = [arrays_to_arrow(feats[i:i + 10000], y[i:i + 10000])
               for i in range(0, rows, 10000)]
    data = feats.reshape(rows, 1, 28, 28)

    def plain_batches():
        order = np.random.default_rng([0, 0]).permutation(rows)
        for i in range(0, rows, batch_size):
            idx = order[i:i + batch_size]
            yield torch.from_numpy(data[idx]), torch.from_numpy(y[idx])

    def fit(source):
        torch.manual_seed(0)
        model = build_model("cnn")
        opt = make_optimizer("sgd", model.parameters(), 0.01)
        if source == "bridge":
            shard = ShardData.from_arrow(batches, shape=(1, 28, 28), num_classes=10)
            train_epoch(model, shard.batches(batch_size, seed=0, epoch=0), opt)
        else:
            train_epoch(model, plain_batches(), opt)

    secs = {"bridge": [], "plain_numpy_loop": []}
    fit("bridge"), fit("plain")
    for _ in range(repeats):
        for k in secs:
            secs[k].append(_timed(lambda: fit(k))[0])  # noqa: B023 - called at once
    rate = {k: rows / statistics.median(v) for k, v in secs.items()}
    return {"rows": rows, "model": "thesis CNN, SGD, 1 epoch", "batch_size": batch_size,
            **{f"{k}_samples_per_s": round(r) for k, r in rate.items()},
            "ratio_bridge_vs_plain_numpy_loop": round(rate["bridge"] / rate["plain_numpy_loop"],
                                                      3),
            "seconds": secs}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--samples", type=int, default=40000)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "data.json"))
    args = p.parse_args(argv)
    (x, y), _ = mnist_split(ROOT / "data/mnist/t10k-images-idx3-ubyte.gz",
                            ROOT / "data/mnist/t10k-labels-idx1-ubyte.gz")
    ext, ext_y = distort_range(x, y, 0, 60000, seed=1)     # 60k rows for the bridge
    results = {"date": time.strftime("%Y-%m-%d %H:%M"), "machine": platform.machine(),
               "cpus": os.cpu_count(), "torch": torch.__version__, "repeats": args.repeats}
    results["bridge"] = [bench_bridge((ext * 255).reshape(-1, 28, 28), ext_y, 64, e,
                                      args.repeats) for e in (1, 5)]
    results["bridge_steady_state"] = bench_bridge_steady(
        (ext * 255).reshape(-1, 28, 28), ext_y, 64, args.repeats)
    results["bridge_with_training"] = bench_bridge_training(
        (ext * 255).reshape(-1, 28, 28), ext_y, 64, args.repeats)
    for r in results["bridge"] + [results["bridge_steady_state"],
                                  results["bridge_with_training"]]:
        print(json.dumps({k: v for k, v in r.items() if k != "seconds"}))

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("SPARK_CONF_DIR", str(ROOT / "conf" / "logging"))
    from spark_dl.session import get_session
    spark = get_session("local-cluster")
    results["generation"] = bench_generation(spark, x, y, args.samples, args.repeats)
    results["generation"]["master"] = spark.sparkContext.master
    spark.stop()
    print(json.dumps({k: v for k, v in results["generation"].items() if "seconds" not in k}))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1))
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
