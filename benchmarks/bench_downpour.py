"""Downpour SGD vs the all-reduce engine vs single-process PyTorch: speed and time to accuracy.

The thesis CNN on the first ROWS shipped MNIST digits (validation: the last 2,000), SGD with
momentum (lr 0.05, 0.9; on the parameter server: its "momentum" optimizer), batch 16 per
replica, EPOCHS epochs, 2 replicas x 1 thread on Spark local[2]. Systems, interleaved, medians
of --repeats runs:

  plain-1t            single-process loop, 1 thread (the calibration)
  allreduce           spark_dl.fit(strategy="allreduce")
  downpour-1-1        strategy="downpour", async, n_fetch = n_push = 1, momentum 0.9 as the
                      others, the defaults: staleness rule "dana" (fit's momentum at the
                      workers, the server's look-ahead; a results file records the rule
                      its runs had), average=0.1 (the model returned and validated is the
                      server's moving average over a tenth of an epoch) and clip=2 (a
                      push's step at most twice the running gradient norm)
  downpour-1-1-noclip the same with clip=0 (no cut)
  downpour-1-1-last   the same with average=0: the server's last values
  downpour-1-1-plain  the plain rule (staleness="none", average=0) with server momentum 0.8,
                      the best plain setting (at 0.9 it diverges)
  downpour-1-1-ovl    as downpour-1-1 with overlap=True: the push of step t travels while step
                      t+1 computes (one more step of staleness, no waiting)
  downpour-4-4        async, n_fetch = n_push = 4, lr / 4 (with the default rule, "dana": a
                      worker's buffer decays once a push of 4)
  downpour-sync       the synchronous parameter server
  elephas-epoch       Elephas 7.3, asynchronous mode, frequency "epoch" (its default)
  elephas-batch       Elephas 7.3, asynchronous mode, frequency "batch" (Downpour-like)
                      (--elephas; needs benchmarks/setup_elephas.sh; runs in .venv-elephas;
                      a fit of 1 epoch and one of EPOCHS, samples/s from their difference)

Reported: the final accuracy of every run (median and spread, max - min), steady samples/s (median over epochs 2..), samples/s of the whole fit call (job
start-up included, Spark session excluded: the figure Elephas gets, which reports no epochs),
the accuracy after each epoch, and the training time to 97% validation accuracy (sum of epoch
times until the first epoch at or above 97%; evaluation and start-up excluded).

    .venv/bin/python benchmarks/bench_downpour.py [--repeats 5] [--elephas] [--out ...]
        [--systems downpour-1-1,downpour-1-1-ovl]   (a subset; allreduce and plain-1t always run)
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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from _common import mnist_arrays, mnist_frame, plain_curve, validation_digits  # noqa: E402

LR, MOMENTUM, BATCH, TARGET = 0.05, 0.9, 16, 0.97


def plain(rows, epochs, data=None, seed=0, batch=BATCH):
    """Single-process PyTorch, 1 thread, on the first ``rows`` digits (or ``data``: (x, y))."""
    return plain_curve(rows, epochs, data, seed, batch, lr=LR, momentum=MOMENTUM)


def engine(spark, rows, epochs, runs, lr=LR, momentum=MOMENTUM, strategy="allreduce"):
    from spark_dl import fit
    t0 = time.perf_counter()
    res = fit(mnist_frame(spark, rows), "cnn", strategy=strategy, shape=(1, 28, 28),
              num_classes=10, optimizer="sgd", lr=lr, momentum=momentum, batch_size=BATCH,
              epochs=epochs, replicas=2, validation=validation_digits(),
              run_dir=runs / f"{time.time()}", log=None)
    wall = time.perf_counter() - t0
    hist = [{"epoch": h["epoch"], "seconds": h["seconds"], "samples_per_s": h["samples_per_s"],
             "val_accuracy": h["val_accuracy"]} for h in res.history]
    extra = {"fit_wall_s": wall}
    if getattr(strategy, "name", strategy) == "downpour":
        extra |= {"staleness": res.info["staleness_histogram"],
                 "push_s": sum(w["push_seconds"] for w in res.info["workers"]),
                 "pull_s": sum(w["pull_seconds"] for w in res.info["workers"])}
    return hist, extra


def elephas(data, rows, epochs, frequency):
    """Elephas fits of 1 and ``epochs`` epochs in its own interpreter. Its history holds the
    two accuracies (after 1 and after ``epochs`` epochs) and, as the rate, the marginal
    samples/s between the two fits (Elephas reports no epoch times)."""
    proc = subprocess.run([str(ROOT / ".venv-elephas/bin/python"),
                           str(ROOT / "benchmarks/elephas_peer.py"), str(data), "--epochs",
                           f"1,{epochs}", "--frequency", frequency, "--lr", str(LR),
                           "--batch", str(BATCH)], capture_output=True, text=True, timeout=900,
                          check=False)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode or not lines:
        raise RuntimeError(f"elephas run failed ({proc.returncode}): {proc.stderr[-2000:]}")
    r = json.loads(lines[-1])
    one, full = r["fits"]
    rate = rows * (epochs - 1) / (full["fit_seconds"] - one["fit_seconds"])
    return ([{"epoch": 1, "seconds": one["fit_seconds"], "samples_per_s": rate,
              "val_accuracy": one["val_accuracy"]},
             {"epoch": epochs, "seconds": full["fit_seconds"], "samples_per_s": rate,
              "val_accuracy": full["val_accuracy"]}],
            {"fit_wall_s": full["fit_seconds"], "setup_s": r["setup_seconds"]})


def _time_to(hist, target):
    total = 0.0
    for h in hist:
        total += h["seconds"]
        if h["val_accuracy"] >= target:
            return total
    return None


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--rows", type=int, default=8000)
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--elephas", action="store_true",
                    help="add Elephas 7.3 (benchmarks/setup_elephas.sh installs it)")
    ap.add_argument("--systems", default=None,
                    help="comma-separated subset of the systems (allreduce and plain-1t are "
                         "always run: the ratios need them)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/downpour.json"))
    args = ap.parse_args(argv)
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("SPARK_CONF_DIR", str(ROOT / "conf/logging"))
    import torch

    from spark_dl import Downpour, get_session
    spark = get_session("local", master="local[2]")
    runs = Path(tempfile.mkdtemp(prefix="bench-downpour-"))
    R, E = args.rows, args.epochs
    systems = {
        "plain-1t": lambda: (plain(R, E), {}),
        "allreduce": lambda: engine(spark, R, E, runs),
        "downpour-1-1": lambda: engine(spark, R, E, runs, strategy=Downpour()),
        "downpour-1-1-last": lambda: engine(spark, R, E, runs, strategy=Downpour(average=0)),
        "downpour-1-1-noclip": lambda: engine(spark, R, E, runs, strategy=Downpour(clip=0)),
        "downpour-1-1-plain": lambda: engine(spark, R, E, runs, momentum=0.8,
                                             strategy=Downpour(staleness="none", average=0)),
        "downpour-1-1-ovl": lambda: engine(spark, R, E, runs, strategy=Downpour(overlap=True)),
        # a push of 4 accumulated steps is 4 steps' worth of gradient: lr / 4 keeps the step
        # size of one 64-sample batch (at lr 0.05 it diverges)
        "downpour-4-4": lambda: engine(spark, R, E, runs, strategy=Downpour(n_fetch=4, n_push=4),
                                       lr=LR / 4),
        "downpour-sync": lambda: engine(spark, R, E, runs, strategy=Downpour(mode="sync")),
    }
    if args.systems:
        wanted = {"allreduce", "plain-1t", *args.systems.split(",")}
        unknown = wanted - set(systems)
        if unknown:
            ap.error(f"unknown systems {sorted(unknown)}; known: {', '.join(systems)}")
        systems = {k: v for k, v in systems.items() if k in wanted}
    if args.elephas:
        import numpy as np
        data = runs / "digits.npz"
        (x, y), (vx, vy) = mnist_arrays(R), validation_digits()
        np.savez(data, x=x, y=y, vx=vx, vy=vy)
        for freq in ("epoch", "batch"):
            systems[f"elephas-{freq}"] = (lambda f=freq: elephas(data, R, E, f))
    engine(spark, R, 1, runs)                                  # warm the Python workers
    raw = {k: [] for k in systems}
    for _ in range(args.repeats):
        for k, fn in systems.items():                          # interleaved
            hist, extra = fn()
            raw[k].append({"history": hist, **extra})
    summary = {}
    for k, runs_k in raw.items():
        rate = statistics.median(statistics.median(h["samples_per_s"] for h in
                                                   r["history"][1:] or r["history"])
                                 for r in runs_k)
        ttt = [None if k.startswith("elephas") else _time_to(r["history"], TARGET)
               for r in runs_k]                   # Elephas: no epoch times to add up
        reached = [t for t in ttt if t is not None]
        summary[k] = {
            "steady_samples_per_s": round(rate),
            "val_accuracy_per_epoch_median": {
                h["epoch"]: round(statistics.median(r["history"][i]["val_accuracy"]
                                                    for r in runs_k), 4)
                for i, h in enumerate(runs_k[0]["history"])},
            "val_accuracy_final": sorted(round(r["history"][-1]["val_accuracy"], 4)
                                         for r in runs_k),
            "val_accuracy_final_median": round(statistics.median(
                r["history"][-1]["val_accuracy"] for r in runs_k), 4),
            "val_accuracy_final_spread": round(
                max(r["history"][-1]["val_accuracy"] for r in runs_k)
                - min(r["history"][-1]["val_accuracy"] for r in runs_k), 4),
            "time_to_97_s_median": round(statistics.median(reached), 2) if reached else None,
            "runs_reaching_97": f"{len(reached)}/{len(runs_k)}"}
        if "fit_wall_s" in runs_k[0]:
            n_epochs = runs_k[0]["history"][-1]["epoch"]
            summary[k]["fit_samples_per_s"] = round(statistics.median(
                R * n_epochs / r["fit_wall_s"] for r in runs_k))
        if "staleness" in runs_k[0]:
            summary[k]["staleness_example"] = runs_k[-1]["staleness"]
    base = summary["allreduce"]["steady_samples_per_s"]
    for k in summary:
        summary[k]["vs_allreduce"] = round(summary[k]["steady_samples_per_s"] / base, 3)
        summary[k]["vs_plain_1t"] = round(summary[k]["steady_samples_per_s"] /
                                          summary["plain-1t"]["steady_samples_per_s"], 3)
        for peer in ("elephas-epoch", "elephas-batch"):
            if peer in summary and not k.startswith("elephas"):
                summary[k][f"vs_{peer}"] = round(summary[k]["steady_samples_per_s"] /
                                                 summary[peer]["steady_samples_per_s"], 2)
                if "fit_samples_per_s" in summary[k]:
                    summary[k][f"fit_vs_{peer}"] = round(summary[k]["fit_samples_per_s"] /
                                                         summary[peer]["fit_samples_per_s"], 2)
    result = {"date": time.strftime("%Y-%m-%d %H:%M"), "machine": platform.machine(),
              "cpus": os.cpu_count(), "torch": torch.__version__, "rows": R, "epochs": E,
              "batch_per_replica": BATCH, "repeats": args.repeats, "summary": summary,
              "raw": raw}
    for k, v in summary.items():
        print(k, json.dumps(v))
    spark.stop()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
