"""Mixed precision (amp="bf16", autocast with float32 master weights) against float32 in every
engine, on the CPU: accuracy after equal epochs, speed, and the parameter server's bytes.

Systems, run in turn (A B C ... A B C ..., ``--repeats`` times; run i seeds every system with
i), 2 replicas on local[2], extended MNIST (bench_gossip's data), SGD lr 0.05, momentum 0.9:
  allreduce     the thesis CNN, AllReduce(amp=None | "bf16")
  downpour      the thesis CNN, Downpour(amp=None | "bf16") (async; bf16: a bfloat16 wire)
  mp-fc         the thesis FC net 784-480-160-10 as one model-parallel replica of 2 tasks,
                Downpour(partitions=2, amp=None | "bf16")

    .venv/bin/python benchmarks/bench_amp.py --repeats 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

LR, MOMENTUM, BATCH = 0.05, 0.9, 32


def engine(spark, path, epochs, runs, model, strategy, replicas, seed):
    from _common import validation_digits

    from spark_dl import fit
    from spark_dl.data import read_shards
    shape = (1, 28, 28) if model == "cnn" else (784,)
    t0 = time.perf_counter()
    res = fit(read_shards(spark, path), model, strategy=strategy, shape=shape, num_classes=10,
              optimizer="sgd", lr=LR, momentum=MOMENTUM, batch_size=BATCH, epochs=epochs,
              replicas=replicas, validation=validation_digits(), seed=seed,
              run_dir=runs / f"{time.time()}", log=None)
    server = res.info.get("server", {})
    return {"val_accuracy": [h["val_accuracy"] for h in res.history],
            "samples_per_s": [h["samples_per_s"] for h in res.history],
            "fit_wall_s": time.perf_counter() - t0,
            "ps_bytes": server.get("bytes_in", 0) + server.get("bytes_out", 0)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--rows", type=int, default=8000)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/amp.json"))
    args = ap.parse_args(argv)
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("SPARK_CONF_DIR", str(ROOT / "conf/logging"))
    from _common import extended_shards

    from spark_dl import AllReduce, Downpour, get_session
    spark = get_session("local", master="local[2]")
    runs = Path(tempfile.mkdtemp(prefix="bench-amp-"))
    path, _ = extended_shards(spark, args.rows, 2, runs / "data")
    E = args.epochs
    systems = {}
    for amp in (None, "bf16"):
        tag = amp or "fp32"
        systems[f"allreduce/{tag}"] = ("cnn", AllReduce(amp=amp), 2)
        systems[f"downpour/{tag}"] = ("cnn", Downpour(amp=amp), 2)
        systems[f"mp-fc/{tag}"] = ("fc", Downpour(amp=amp, partitions=2), 1)
    systems = dict(sorted(systems.items()))           # fp32 and bf16 of one engine side by side
    engine(spark, path, 1, runs, "cnn", AllReduce(), 2, 0)          # warm the Python workers
    raw = {k: [] for k in systems}
    for i in range(args.repeats):
        for k, (model, strategy, replicas) in systems.items():
            r = engine(spark, path, E, runs, model, strategy, replicas, i)
            raw[k].append(r)
            print(f"run {i + 1} {k}: accuracy {r['val_accuracy'][-1]:.4f}, "
                  f"{r['samples_per_s'][-1]:.0f} samples/s, PS bytes {r['ps_bytes']}",
                  flush=True)
    summary = {}
    for k, rs in raw.items():
        final = [r["val_accuracy"][-1] for r in rs]
        summary[k] = {"val_accuracy_final_median": round(statistics.median(final), 4),
                      "val_accuracy_final": sorted(round(a, 4) for a in final),
                      "samples_per_s_median": round(statistics.median(
                          statistics.median(r["samples_per_s"][1:] or r["samples_per_s"])
                          for r in rs)),
                      "ps_bytes_median": statistics.median(r["ps_bytes"] for r in rs)}
    for k, s in summary.items():
        if k.endswith("/bf16"):
            base = summary[k.replace("/bf16", "/fp32")]
            s["accuracy_vs_fp32_points"] = round(
                100 * (s["val_accuracy_final_median"] - base["val_accuracy_final_median"]), 2)
            s["speed_vs_fp32"] = round(s["samples_per_s_median"] / base["samples_per_s_median"],
                                       3)
            if base["ps_bytes_median"]:
                s["ps_bytes_vs_fp32"] = round(s["ps_bytes_median"] / base["ps_bytes_median"], 3)
    from _common import write_results
    write_results(args.out, "bench_amp.py", argv, {"rows": args.rows, "epochs": E, "batch": BATCH, "lr": LR,
                   "momentum": MOMENTUM, "repeats": args.repeats}, summary, raw)


if __name__ == "__main__":
    main()
