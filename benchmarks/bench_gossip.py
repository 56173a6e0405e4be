"""RD-PSGD (seed 003) against all-reduce and D-PSGD: the thesis CNN on extended MNIST, accuracy
after equal epochs and bytes each replica sends per step, interleaved runs, medians.

Systems (one Spark session, run A B C ... A B C ..., ``--repeats`` times; run i initialises
and shuffles every system with seed i, so the medians and spreads are over seeds):
  plain-1t     single-process PyTorch, 1 thread, the same rows, batch and epochs (calibration)
  allreduce    spark_dl.fit(strategy="allreduce"): gradients averaged every step
  dpsgd        Gossip(alpha=1): D-PSGD, the whole model to each ring neighbour every step
  rdpsgd-A     Gossip(alpha=A) for A in --alphas: a shared random mask of A x the coordinates

Bytes per replica per step: gossip counts what it sent (``info["bytes_sent"]``); all-reduce's
are the ring algorithm's 2 (R - 1) / R x the gradient (what a ring sends per replica over a
network; on one host spark_dl sums through shared memory and sends nothing).

The low-bandwidth case, the paper's, is priced with the cost model (planning/cost_model.py,
eq. 3.4) and the measured bytes: an epoch = steps x (compute of a step + T_lat x messages +
bytes x T_data) at 100 Mbit/s and 1 Gbit/s, T_lat 100 us; the compute of a step is the median
step of the calibration (plain-1t), which every replica runs in parallel on its own batch.

    .venv/bin/python benchmarks/bench_gossip.py --master 'local[2]' --replicas 2
    .venv/bin/python benchmarks/bench_gossip.py --master 'local-cluster[4,1,1024]' --replicas 4
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from _common import extended_shards, plain_curve, validation_digits  # noqa: E402

LR, MOMENTUM, BATCH = 0.05, 0.9, 16
BANDWIDTHS = {"100Mbit": 100e6 / 8, "1Gbit": 1e9 / 8}      # bytes per second
LATENCY_S = 100e-6


def plain(data, epochs, seed):
    """Single-process PyTorch, 1 thread: per-epoch accuracy, seconds a step."""
    hist = plain_curve(len(data[0]), epochs, data, seed, BATCH, lr=LR, momentum=MOMENTUM)
    steps = -(-len(data[0]) // BATCH)
    return [{**h, "step_s": h["seconds"] / steps} for h in hist], {}


def engine(spark, path, epochs, replicas, runs, strategy, seed=0):
    from spark_dl import fit
    from spark_dl.data import read_shards
    t0 = time.perf_counter()
    res = fit(read_shards(spark, path), "cnn", strategy=strategy, shape=(1, 28, 28),
              num_classes=10, optimizer="sgd", lr=LR, momentum=MOMENTUM, batch_size=BATCH,
              epochs=epochs, replicas=replicas, validation=validation_digits(), seed=seed,
              run_dir=runs / f"{time.time()}", log=None)
    wall = time.perf_counter() - t0
    steps = res.info["steps_per_epoch"] * epochs
    params = sum(p.numel() for p in res.model.parameters())
    if "bytes_sent" in res.info:                        # gossip: what each replica sent
        per_step = statistics.mean(res.info["bytes_sent"]) / steps
        messages = res.info["neighbours"] * 2           # send and receive per neighbour
    else:                                               # a ring all-reduce of the gradient
        per_step = 2 * (replicas - 1) / replicas * params * 4
        messages = 2 * (replicas - 1)
    hist = [{"epoch": h["epoch"], "seconds": h["seconds"], "samples_per_s": h["samples_per_s"],
             "val_accuracy": h["val_accuracy"],
             **({"consensus_distance": h["consensus_distance"]}
                if "consensus_distance" in h else {})} for h in res.history]
    return hist, {"fit_wall_s": wall, "bytes_per_step": per_step, "messages_per_step": messages,
                  "steps_per_epoch": res.info["steps_per_epoch"], "parameters": params}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--master", default="local[2]")
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--rows", type=int, default=8000)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--alphas", default="0.5,0.1,0.05")
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/gossip.json"))
    args = ap.parse_args(argv)
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("SPARK_CONF_DIR", str(ROOT / "conf/logging"))
    from spark_dl import Gossip, get_session
    from spark_dl.planning.cost_model import Link, predict_seconds
    spark = get_session("local", master=args.master)
    runs = Path(tempfile.mkdtemp(prefix="bench-gossip-"))
    R, E = args.replicas, args.epochs
    path, local = extended_shards(spark, args.rows, R, runs / "data")
    systems = {"plain-1t": lambda seed: plain(local, E, seed),
               "allreduce": lambda seed: engine(spark, path, E, R, runs, "allreduce", seed),
               "dpsgd": lambda seed: engine(spark, path, E, R, runs, Gossip(alpha=1.0), seed)}
    for a in args.alphas.split(","):
        systems[f"rdpsgd-{a}"] = (lambda seed, a=float(a): engine(spark, path, E, R, runs,
                                                                  Gossip(alpha=a), seed))
    engine(spark, path, 1, R, runs, "allreduce")                # warm the Python workers
    raw = {k: [] for k in systems}
    for i in range(args.repeats):
        for k, fn in systems.items():                # interleaved; run i: seed i for all
            hist, extra = fn(i)
            raw[k].append({"history": hist, **extra})
            print(f"run {i + 1} {k}: accuracy {hist[-1]['val_accuracy']:.4f}", flush=True)
    step_s = statistics.median(h["step_s"] for r in raw["plain-1t"] for h in r["history"])
    summary = {}
    for k, rs in raw.items():
        final = [r["history"][-1]["val_accuracy"] for r in rs]
        s = {"val_accuracy_final_median": round(statistics.median(final), 4),
             "val_accuracy_final": sorted(round(a, 4) for a in final),
             "val_accuracy_per_epoch_median": {
                 h["epoch"]: round(statistics.median(r["history"][j]["val_accuracy"]
                                                     for r in rs), 4)
                 for j, h in enumerate(rs[0]["history"])}}
        if k != "plain-1t":
            s["steady_samples_per_s"] = round(statistics.median(statistics.median(
                h["samples_per_s"] for h in r["history"][1:] or r["history"]) for r in rs))
            s["bytes_per_replica_per_step"] = round(statistics.median(
                r["bytes_per_step"] for r in rs))
            if "consensus_distance" in rs[0]["history"][-1]:
                s["consensus_distance_final_median"] = statistics.median(
                    r["history"][-1]["consensus_distance"] for r in rs)
            steps = rs[0]["steps_per_epoch"]
            s["priced_epoch_s"] = {
                name: round(steps * (step_s + predict_seconds(
                    {"messages": rs[0]["messages_per_step"],
                     "bytes": s["bytes_per_replica_per_step"]}, Link(LATENCY_S, 1 / bw))), 2)
                for name, bw in BANDWIDTHS.items()}
        summary[k] = s
    dpsgd = summary["dpsgd"]["bytes_per_replica_per_step"]
    base = summary["allreduce"]
    for k, s in summary.items():
        if k != "plain-1t":
            s["bytes_vs_dpsgd"] = round(s["bytes_per_replica_per_step"] / dpsgd, 4)
            s["accuracy_vs_allreduce_points"] = round(
                100 * (s["val_accuracy_final_median"] - base["val_accuracy_final_median"]), 2)
            s["rate_vs_plain_1t"] = round(s["steady_samples_per_s"] / (BATCH / step_s), 3)
    key = f"{args.master} x{R}" + (f", {E} epochs" if E != 3 else "")
    out = Path(args.out)
    doc = json.loads(out.read_text()) if out.exists() else {}
    doc[key] = {"date": time.strftime("%Y-%m-%d %H:%M"), "host": platform.node(),
                "cpus": os.cpu_count(), "rows": args.rows, "epochs": E, "batch": BATCH,
                "lr": LR, "momentum": MOMENTUM, "repeats": args.repeats,
                "calibration_step_s": round(step_s, 5), "latency_s": LATENCY_S,
                "command": "benchmarks/bench_gossip.py " + " ".join(argv or sys.argv[1:]),
                "summary": summary, "raw": raw}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1))
    print(json.dumps({key: summary}, indent=1))


if __name__ == "__main__":
    main()
