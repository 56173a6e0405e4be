"""Gossip's learning-rate rule at many replicas: accuracy per quarter epoch under fit's
``lr_scaling`` rules, on bench_scaling's data and settings (the thesis CNN, 48,000 distorted
digits, batch 16 a replica, SGD lr 0.02 for one replica, momentum 0.9, halved per epoch,
2 epochs, one thread a replica, seed 0).

On fewer cores than replicas the times mean nothing; the accuracies per epoch do.

    .venv/bin/python benchmarks/gossip_lr_rules.py [--replicas 8] [--rules linear,sqrt]
        [--out benchmarks/results/gossip-8-lr-rules.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--replicas", type=int, default=8)
    ap.add_argument("--rules", default="linear,sqrt")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("SPARK_CONF_DIR", str(ROOT / "conf/logging"))
    from bench_scaling import make_data

    from spark_dl import Gossip, fit, get_session
    R = args.replicas
    spark = get_session("local", master=f"local[{R}]")
    tmp = Path(tempfile.mkdtemp(prefix="gossip-rules-"))
    val = make_data(spark, 48000, tmp / "data")
    out = {"date": time.strftime("%Y-%m-%d %H:%M"), "cpus": os.cpu_count(), "replicas": R,
           "command": "benchmarks/gossip_lr_rules.py " + " ".join(argv or sys.argv[1:]),
           "evals": "(fractional epoch, training seconds, held-out accuracy)", "rules": {}}
    for rule in args.rules.split(","):
        t0 = time.time()
        res = fit(spark.read.parquet((tmp / "data").as_uri()), "cnn", strategy=Gossip(),
                  shape=(1, 28, 28), num_classes=10, optimizer="sgd", lr=0.02, lr_decay=0.5,
                  momentum=0.9, epochs=2, batch_size=16, replicas=R, threads=1,
                  validation=val, validate_every=0.25, device="cpu", lr_scaling=rule, seed=0,
                  run_dir=tmp / f"r-{rule}", log=None, progress=False)
        out["rules"][rule] = {
            "evals": [(e["epoch"], round(e["train_seconds"], 1), e["val_accuracy"])
                      for e in res.info["evals"]],
            "lr": [h["lr"] for h in res.history], "wall_s": round(time.time() - t0, 1)}
        print(rule, json.dumps(out["rules"][rule]), flush=True)
    path = Path(args.out or ROOT / f"benchmarks/results/gossip-{R}-lr-rules.json")
    path.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
