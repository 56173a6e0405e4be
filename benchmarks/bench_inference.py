"""Batch inference: TorchModel.transform (predict_udf's pandas UDF) vs a plain loop over numpy.

The thesis CNN (weights from a short fit) predicts ROWS digits (the 10,000 shipped MNIST test
digits, repeated), batch 1024:
  plain-1t      model(x) over the numpy array in one process, 1 thread (the calibration)
  plain-2t      the same with 2 threads
  spark_dl      TorchModel.transform on Spark --master (default local[2]: 2 task slots, 1
                thread each; local-cluster[2,1,1024]: 2 executors of 1 core) over a cached
                DataFrame of the same rows, forced by summing the predictions
Interleaved, medians of --repeats; samples/s and ratios to plain-1t.

    .venv/bin/python benchmarks/bench_inference.py [--rows 100000] [--repeats 5]
    .venv/bin/python benchmarks/bench_inference.py --master "local-cluster[2,1,1024]"
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

BATCH = 1024


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rows", type=int, default=100_000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--master", default="local[2]")
    ap.add_argument("--out", default=None, help="default: benchmarks/results/inference.json "
                    "(local[2]) or inference-local-cluster.json")
    args = ap.parse_args(argv)
    name = "inference" if args.master.startswith("local[") else "inference-local-cluster"
    args.out = args.out or str(ROOT / f"benchmarks/results/{name}.json")
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("SPARK_CONF_DIR", str(ROOT / "conf/logging"))
    import numpy as np
    import torch
    from pyspark.sql import functions as F

    from spark_dl import get_session
    from spark_dl.data import arrays_to_arrow, load_mnist
    from spark_dl.ml import TorchEstimator

    x, y = load_mnist(str(ROOT / "data/mnist/t10k-images-idx3-ubyte.gz"),
                      str(ROOT / "data/mnist/t10k-labels-idx1-ubyte.gz"))
    x = (x.reshape(len(x), -1) / 255.0).astype(np.float32)
    reps = -(-args.rows // len(x))
    X, Y = np.tile(x, (reps, 1))[:args.rows], np.tile(y, reps)[:args.rows].astype(np.int64)
    profile = "local-cluster" if args.master.startswith("local-cluster") else "local"
    spark = get_session(profile, master=args.master)

    rows = args.rows

    def make(batches):
        for b in batches:
            for i in b.column("id").to_numpy():
                lo, hi = i * rows // 2, (i + 1) * rows // 2
                xs = np.tile(x, (reps, 1))[lo:hi]
                ys = np.tile(y, reps)[lo:hi]
                yield arrays_to_arrow(xs, ys)
    df = spark.range(2, numPartitions=2).mapInArrow(make, "features array<float>, label long")
    df = df.cache()
    df.count()
    train = df.limit(8000)
    model = TorchEstimator(model="cnn", inputShape=[1, 28, 28], numClasses=10,
                           strategy="allreduce", replicas=2, epochs=1, batchSize=32,
                           lr=0.02).fit(train)
    model._set(batchSize=BATCH)
    net = model._network()()
    net.load_state_dict(torch.load(io.BytesIO(model.state), weights_only=True))
    net.eval()

    def plain(threads):
        torch.set_num_threads(threads)
        t0 = time.perf_counter()
        preds = []
        with torch.no_grad():
            for i in range(0, rows, BATCH):
                t = torch.from_numpy(X[i:i + BATCH]).reshape(-1, 1, 28, 28)
                preds.append(net(t).argmax(1).numpy())
        secs = time.perf_counter() - t0
        return rows / secs, float((np.concatenate(preds) == Y).mean())

    def spark_dl():
        t0 = time.perf_counter()
        out = model.transform(df).agg(F.sum("prediction").alias("s"),
                                      F.avg((F.col("prediction") == F.col("label"))
                                            .cast("double")).alias("acc")).collect()[0]
        return rows / (time.perf_counter() - t0), float(out.acc)

    systems = {"plain-1t": lambda: plain(1), "plain-2t": lambda: plain(2), "spark_dl": spark_dl}
    spark_dl()                                                  # warm the Python workers
    raw = {k: [] for k in systems}
    for _ in range(args.repeats):
        for k, fn in systems.items():                           # interleaved
            raw[k].append(fn())
    base = statistics.median(r[0] for r in raw["plain-1t"])
    summary = {k: {"samples_per_s": round(statistics.median(r[0] for r in v)),
                   "vs_plain_1t": round(statistics.median(r[0] for r in v) / base, 3),
                   "accuracy": round(v[-1][1], 4)} for k, v in raw.items()}
    for k, v in summary.items():
        print(k, json.dumps(v))
    infos = spark.sparkContext._jsc.sc().statusTracker().getExecutorInfos()
    executors = max(len(infos) - 1, 1)                         # less the driver's entry
    Path(args.out).write_text(json.dumps({
        "date": time.strftime("%Y-%m-%d %H:%M"), "machine": platform.machine(),
        "cpus": os.cpu_count(), "torch": torch.__version__, "master": args.master,
        "executors": executors, "rows": rows, "batch": BATCH,
        "repeats": args.repeats, "summary": summary, "raw": raw}, indent=1))
    spark.stop()


if __name__ == "__main__":
    main()
