"""All-reduce engine vs plain PyTorch and PySpark's TorchDistributor, side by side.

Same data (the first ROWS shipped MNIST digits), same model (thesis CNN or FC), SGD with
momentum, 3 epochs, batch B per replica, on this machine's cores. Systems, interleaved
(A B C D A B C D ...), medians of --repeats runs:

  plain-1t   single-process PyTorch loop over an in-memory tensor, 1 thread
  plain-2t   the same with 2 threads
  spark_dl   spark_dl.fit(strategy="allreduce"), 2 replicas x 1 thread on local[2]
  torchdist  pyspark.ml.torch.distributor.TorchDistributor(num_processes=2, local_mode=False)
             running DDP (gloo), each process 1 thread, on the same Spark session

Steady state = samples/s of epochs 2-3 (the epochs' own loop time); end-to-end = wall time of
the whole 3-epoch fit as the user sees it (data loading, launch, training, result). Spark's
start-up is measured once and reported separately.

    .venv/bin/python benchmarks/bench_allreduce.py [--repeats 5] [--out benchmarks/results/allreduce.json]
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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
EPOCHS, LR, MOMENTUM = 3, 0.01, 0.9

from _common import IMAGES, LABELS, mnist_frame, plain_rate, run_torchdistributor  # noqa: E402


def plain(model_name, rows, batch, threads):
    """Single-process reference: returns (steady samples/s, wall seconds)."""
    return plain_rate(model_name, rows, batch, threads, epochs=EPOCHS, lr=LR,
                      momentum=MOMENTUM)


def td_train(images, labels, model_name, rows, batch, epochs, lr, momentum):
    """Runs in each TorchDistributor process (torchrun): DDP over this rank's rows."""
    import time

    import numpy as np
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from spark_dl.data import load_mnist
    from spark_dl.models import build_model
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    lo, hi = rank * rows // world, (rank + 1) * rows // world
    x, y = load_mnist(images, labels)
    x = torch.from_numpy(x[lo:hi].reshape(hi - lo, -1).astype(np.float32) / 255)
    if model_name == "cnn":
        x = x.reshape(-1, 1, 28, 28)
    y = torch.from_numpy(y[lo:hi].astype(np.int64))
    torch.manual_seed(0)
    model = DDP(build_model(model_name))
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    secs = []
    for e in range(epochs):
        perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(e))
        t0 = time.perf_counter()
        for i in range(0, len(x), batch):
            idx = perm[i:i + batch]
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
            opt.step()
        secs.append(time.perf_counter() - t0)
    dist.destroy_process_group()
    return {"epoch_seconds": secs}


TD_FAILURES: list[str] = []


def torchdist(spark, model_name, rows, batch, timeout_s=120):
    """One TorchDistributor fit; a run that fails or hangs (its torchrun agents sometimes
    abort or wait out their 300 s exit barrier here) is cancelled after ``timeout_s``,
    recorded in TD_FAILURES and counted as missing (None)."""
    r, wall, error = run_torchdistributor(spark, td_train, IMAGES, LABELS, model_name, rows,
                                          batch, EPOCHS, LR, MOMENTUM, timeout_s=timeout_s)
    if r is None:
        TD_FAILURES.append(f"{model_name}:{batch}: " + error)
        return None, wall
    return rows / statistics.median(r["epoch_seconds"][1:]), wall


def spark_dl_fit(spark, model_name, rows, batch, runs_dir, profile):
    from spark_dl import fit
    t0 = time.perf_counter()
    res = fit(mnist_frame(spark, rows), model_name, shape=(1, 28, 28) if model_name == "cnn"
              else (784,), num_classes=10, optimizer="sgd", lr=LR, momentum=MOMENTUM,
              epochs=EPOCHS, batch_size=batch, replicas=2, run_dir=runs_dir / f"{time.time()}",
              log=None)
    wall = time.perf_counter() - t0
    profile.append({"wall_s": wall, **res.info["timings_rank0"],
                    "driver_overhead_s": wall - res.info["timings_rank0"]["task_total_s"]})
    rate = statistics.median(h["samples_per_s"] for h in res.history[1:])
    return rate, wall


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--rows", type=int, default=8000)
    ap.add_argument("--configs", default="cnn:16,cnn:128,fc:16,fc:128")
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/allreduce.json"))
    args = ap.parse_args(argv)
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("SPARK_CONF_DIR", str(ROOT / "conf/logging"))
    import tempfile

    import torch

    from spark_dl import get_session
    t0 = time.perf_counter()
    spark = get_session("local", master="local[2]")
    spark.range(2, numPartitions=2).count()
    startup = time.perf_counter() - t0
    runs_dir = Path(tempfile.mkdtemp(prefix="bench-allreduce-"))

    results = {"date": time.strftime("%Y-%m-%d %H:%M"), "machine": platform.machine(),
               "cpus": os.cpu_count(), "torch": torch.__version__,
               "pyspark": spark.version, "repeats": args.repeats, "rows": args.rows,
               "epochs": EPOCHS, "spark_startup_s": startup, "configs": []}
    for spec in args.configs.split(","):
        model_name, batch = spec.split(":")
        batch = int(batch)
        # the systems run within this iteration (below), with this iteration's values
        systems = {
            "plain-1t": lambda: plain(model_name, args.rows, batch, 1),  # noqa: B023
            "plain-2t": lambda: plain(model_name, args.rows, batch, 2),  # noqa: B023
            "spark_dl": lambda: spark_dl_fit(spark, model_name, args.rows, batch,  # noqa: B023
                                             runs_dir, profile),  # noqa: B023
            "torchdist": lambda: torchdist(spark, model_name, args.rows, batch),  # noqa: B023
        }
        profile: list = []
        spark_dl_fit(spark, model_name, args.rows, batch, runs_dir, [])   # warm the workers
        rate = {k: [] for k in systems}
        wall = {k: [] for k in systems}
        for _ in range(args.repeats):                     # interleaved A B C D A B C D ...
            for k, fn in systems.items():
                r, w = fn()
                rate[k].append(r)
                wall[k].append(w)
        ok = [i for i, r in enumerate(rate["torchdist"]) if r is not None]
        med = {k: statistics.median(v[i] for i in (ok if k == "torchdist" else range(len(v))))
               for k, v in rate.items()}
        medw = {k: statistics.median(v[i] for i in (ok if k == "torchdist" else range(len(v))))
                for k, v in wall.items()}
        ratios_td = [rate["spark_dl"][i] / rate["torchdist"][i] for i in ok]
        walls_td = [wall["spark_dl"][i] / wall["torchdist"][i] for i in ok]
        row = {"model": model_name, "batch_per_replica": batch,
               "steady_samples_per_s": {k: round(v) for k, v in med.items()},
               "fit_wall_s": {k: round(v, 2) for k, v in medw.items()},
               "limit_2x_plain_1t": round(2 * med["plain-1t"]),
               "spark_dl_vs_limit": round(med["spark_dl"] / (2 * med["plain-1t"]), 3),
               "spark_dl_vs_torchdist_steady": round(statistics.median(ratios_td), 3),
               "spark_dl_vs_torchdist_wall": round(statistics.median(walls_td), 3),
               "spark_dl_vs_plain_2t": round(med["spark_dl"] / med["plain-2t"], 3),
               "torchdist_runs_ok": f"{len(ok)}/{args.repeats}",
               "spark_dl_profile_median": {k: round(statistics.median(p[k] for p in profile), 3)
                                           for k in profile[0]},
               "raw": {"samples_per_s": rate, "wall_s": wall}}
        results["configs"].append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "raw"}), flush=True)
    results["torchdist_failures"] = TD_FAILURES
    spark.stop()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1))
    print("written to", args.out)


if __name__ == "__main__":
    main()
