"""Heterogeneous replicas (seed 001): the thesis CNN with 2 replicas, one made ~2x slower by a
CPU-bound process pinned to its core, all-reduce with and without the speed-proportional split.

The slowdown is real, not a sleep: every replica's Python worker pins itself to core
(rank % 2) when it builds the model, and a busy process runs on core 1, so replica 1 gets half
a core (Linux's fair scheduler) while replica 0 has core 0 to itself. Two scenarios:
  slowed        the busy process runs for the whole fit
  slowed-late   it starts when epoch 1's checkpoint appears (a replica that slows mid-fit)
Systems, run in turn (A B C ... A B C ..., ``--repeats`` times; run i seeds every system with
i): AllReduce() (every replica batch_size rows a step), AllReduce(balance="speed") (split once
from a profile before training; shards made proportional to the split, and, as "speed-wrap",
with balance_rows="wrap": no rows moved), AllReduce(balance="adaptive") (re-split every epoch), and,
as the calibration, plain single-process PyTorch with 1 thread on the same rows and global
batch, on a core of its own, and the unbalanced fit with no busy process (the best case).

Epoch time: the history's seconds per epoch (slowed: every epoch; slowed-late: epochs 2..E,
the slowed ones), median over runs; accuracy: the model's after the last epoch on the last
2,000 test digits, as medians and as the median of the per-seed differences to the
unbalanced fit of the same seed.

    .venv/bin/python benchmarks/bench_balance.py --repeats 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

LR, MOMENTUM = 0.05, 0.9


def pinned_cnn():
    """The thesis CNN; in a task, its Python worker is pinned to core (partition % 2)."""
    from pyspark import TaskContext

    from spark_dl.models import build_model
    ctx = TaskContext.get()
    if ctx is not None:
        os.sched_setaffinity(0, {ctx.partitionId() % 2})
    return build_model("cnn")


def busy(core: int, start_when: str = "") -> subprocess.Popen:
    """A CPU-bound process pinned to ``core``, spinning from when ``start_when`` exists."""
    code = ("import os, sys, time\n"
            f"os.sched_setaffinity(0, {{{core}}})\n"
            "while sys.argv[1] and not os.path.exists(sys.argv[1]): time.sleep(0.005)\n"
            "while True: pass\n")
    return subprocess.Popen([sys.executable, "-c", code, start_when])


def engine(spark, path, epochs, batch, runs, balance, seed, late: bool | None, lr=LR,
           rows="move", lr_decay=1.0):
    from _common import validation_digits

    from spark_dl import AllReduce, fit
    from spark_dl.data import read_shards
    run = runs / f"{time.time()}"
    hog = busy(1, str(run / "checkpoint.pt") if late else "") if late is not None else None
    t0 = time.perf_counter()
    try:
        res = fit(read_shards(spark, path), pinned_cnn,
                  strategy=AllReduce(balance=balance, balance_rows=rows),
                  shape=(1, 28, 28), num_classes=10, optimizer="sgd", lr=lr, momentum=MOMENTUM,
                  lr_decay=lr_decay,
                  batch_size=batch, epochs=epochs, replicas=2, validation=validation_digits(),
                  seed=seed, run_dir=run, log=None)
    finally:
        if hog is not None:
            hog.kill()
            hog.wait()
    wall = time.perf_counter() - t0
    hist = [{"epoch": h["epoch"], "seconds": h["seconds"], "samples": h["samples"],
             "val_accuracy": h["val_accuracy"], **({"batches": h["balance"]["batches"],
                                                   "rows": h["balance"]["rows"],
                                                   "step_s": h["balance"]["step_s"]}
                                                  if "balance" in h else {})}
            for h in res.history]
    return hist, {"fit_wall_s": wall, "steps_per_epoch": res.info["steps_per_epoch"],
                  "profile": (res.info.get("balance") or {}).get("replicas")}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--rows", type=int, default=8000)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--batch", type=int, default=32, help="per replica (global: 2x)")
    ap.add_argument("--lr", type=float, default=LR, help="the fits' SGD learning rate")
    ap.add_argument("--lr-decay", type=float, default=1.0,
                    help="lr multiplied by it after every epoch (a steadier final model: "
                         "less noise in the accuracy comparisons)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/balance.json"))
    args = ap.parse_args(argv)
    if len(os.sched_getaffinity(0)) < 2:
        sys.exit("bench_balance needs 2 cores (one replica per core)")
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("SPARK_CONF_DIR", str(ROOT / "conf/logging"))
    from _common import extended_shards, plain_curve

    from spark_dl import get_session
    spark = get_session("local", master="local[2]")
    runs = Path(tempfile.mkdtemp(prefix="bench-balance-"))
    E, B = args.epochs, args.batch
    path, local = extended_shards(spark, args.rows, 2, runs / "data")
    systems = {"plain-1t": lambda seed: (plain_curve(len(local[0]), E, local, seed, 2 * B,
                                                        lr=LR, momentum=MOMENTUM), {}),
               "unslowed/unbalanced": lambda seed: engine(spark, path, E, B, runs, None, seed,
                                                          None, args.lr,
                                                          lr_decay=args.lr_decay)}
    for scenario, late in (("slowed", False), ("slowed-late", True)):
        for name, balance, rows in (("unbalanced", None, "move"), ("speed", "speed", "move"),
                                    ("speed-wrap", "speed", "wrap"),
                                    ("adaptive", "adaptive", "move")):
            if name == "speed-wrap" and late:
                continue
            systems[f"{scenario}/{name}"] = (
                lambda seed, b=balance, late=late, rows=rows: engine(
                    spark, path, E, B, runs, b, seed, late, args.lr, rows, args.lr_decay))
    engine(spark, path, 1, B, runs, None, 0, False)            # warm the Python workers
    raw = {k: [] for k in systems}
    for i in range(args.repeats):
        for k, fn in systems.items():
            hist, extra = fn(i)
            raw[k].append({"history": hist, **extra})
            print(f"run {i + 1} {k}: epochs {[round(h['seconds'], 2) for h in hist]} s, "
                  f"accuracy {hist[-1]['val_accuracy']:.4f}, "
                  f"split {[h.get('batches') for h in hist]}", flush=True)
    summary = {}
    for k, rs in raw.items():
        first = 1 if k.startswith("slowed-late") else 0
        epoch_s = [statistics.mean(h["seconds"] for h in r["history"][first:]) for r in rs]
        final = [r["history"][-1]["val_accuracy"] for r in rs]
        summary[k] = {"epoch_s_median": round(statistics.median(epoch_s), 3),
                      "epoch_s": sorted(round(s, 3) for s in epoch_s),
                      "val_accuracy_final_median": round(statistics.median(final), 4),
                      "val_accuracy_final": sorted(round(a, 4) for a in final)}
        if "batches" in rs[0]["history"][-1]:
            summary[k]["split_per_epoch_median"] = [
                [statistics.median(r["history"][e]["batches"][p] for r in rs) for p in (0, 1)]
                for e in range(E)]
    for scenario in ("slowed", "slowed-late"):
        base = summary[f"{scenario}/unbalanced"]
        for name in ("speed", "speed-wrap", "adaptive"):
            if f"{scenario}/{name}" not in summary:
                continue
            s = summary[f"{scenario}/{name}"]
            s["epoch_time_vs_unbalanced"] = round(s["epoch_s_median"] / base["epoch_s_median"],
                                                  3)
            s["accuracy_vs_unbalanced_points"] = round(
                100 * (s["val_accuracy_final_median"] - base["val_accuracy_final_median"]), 2)
            # run i of every system has seed i: the difference per seed, then its median
            # (the seed's noise cancels; the unbalanced fit is deterministic per seed)
            pairs = [100 * (a["history"][-1]["val_accuracy"] - b["history"][-1]["val_accuracy"])
                     for a, b in zip(raw[f"{scenario}/{name}"], raw[f"{scenario}/unbalanced"])]
            s["accuracy_vs_unbalanced_paired_points"] = sorted(round(d, 2) for d in pairs)
            s["accuracy_vs_unbalanced_paired_median_points"] = round(statistics.median(pairs), 2)
    plain_s = summary["plain-1t"]["epoch_s_median"]
    for s in summary.values():
        s["epoch_time_vs_plain_1t"] = round(s["epoch_s_median"] / plain_s, 3)
    from _common import write_results
    write_results(args.out, "bench_balance.py", argv, {"rows": args.rows, "epochs": E, "batch_per_replica": B,
                   "lr": args.lr, "lr_decay": args.lr_decay, "momentum": MOMENTUM, "repeats": args.repeats}, summary, raw)


if __name__ == "__main__":
    main()
