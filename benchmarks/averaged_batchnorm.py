"""BatchNorm under the averaged weights: AllReduce with ``average=0`` (the last weights and
their running statistics, the replicas' mean) against ``average=0.1`` (the default: the
weights' moving average, with BatchNorm statistics recomputed for the averaged weights on
1,024 training rows since 2026-11-28 16:20, spark_dl.optim.average.recompute_statistics;
before, the live model's statistics: results/averaged-batchnorm-live-statistics.json).

The thesis CNN with a BatchNorm after every convolution (fit's "cnn_bn"), 2 AllReduce
replicas on local[2], bench_scaling's data (--samples distorted digits from the first 8,000
shipped ones; the last 2,000 real digits held out), SGD lr 0.02 halved every epoch, momentum
0.9, batch 16 a replica, 2 epochs, validated every quarter epoch; ``average=0`` and
``average=0.1`` interleaved, seeds 0..--seeds-1. Accuracy only (no timing); writes
benchmarks/results/averaged-batchnorm.json.

    .venv/bin/python benchmarks/averaged_batchnorm.py [--seeds 3] [--samples 24000] [--out ...]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]
OUT = ROOT / "benchmarks" / "results" / "averaged-batchnorm.json"


def arguments(doc: str, argv, out: Path) -> argparse.Namespace:
    """--seeds, --samples and --out (default ``out``): this script's and
    downpour_batchnorm.py's."""
    ap = argparse.ArgumentParser(description=doc)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--samples", type=int, default=24000)
    ap.add_argument("--out", type=Path, default=out)
    return ap.parse_args(argv)


def digits(samples: int, prefix: str):
    """(the session on local[2], a scratch folder, the held-out digits (x, y), the DataFrame
    of ``samples`` distorted ones written there as Parquet): bench_scaling's data."""
    from bench_scaling import make_data

    from spark_dl import get_session
    spark = get_session("local", master="local[2]")
    tmp = Path(tempfile.mkdtemp(prefix=prefix))
    val = make_data(spark, samples, tmp / "data.parquet")
    return spark, tmp, val, spark.read.parquet((tmp / "data.parquet").as_uri())


def main(argv=None):
    args = arguments(__doc__, argv, OUT)
    from spark_dl import fit
    from spark_dl.strategies import AllReduce
    _, tmp, val, df = digits(args.samples, "averaged-bn-")
    runs = []
    for seed in range(args.seeds):
        for average in (0.0, 0.1):
            res = fit(df, "cnn_bn", strategy=AllReduce(average=average), shape=(1, 28, 28),
                      num_classes=10, optimizer="sgd", lr=0.02, lr_decay=0.5, momentum=0.9,
                      epochs=2, batch_size=16, replicas=2, threads=1, validation=val,
                      seed=seed, validate_every=0.25, run_dir=tmp / f"run-{seed}-{average}",
                      log=None, progress=False)
            run = {"seed": seed, "average": average,
                   "epochs": [e["epoch"] for e in res.info["evals"]],
                   "val_accuracy": [e["val_accuracy"] for e in res.info["evals"]]}
            runs.append(run)
            print(run, flush=True)
    by = {(r["seed"], r["average"]): r["val_accuracy"] for r in runs}
    marks = len(runs[0]["val_accuracy"])
    higher = [sum(by[(s, 0.1)][i] > by[(s, 0.0)][i] for s in range(args.seeds))
              for i in range(marks)]
    lower = [sum(by[(s, 0.1)][i] < by[(s, 0.0)][i] for s in range(args.seeds))
             for i in range(marks)]
    summary = {"averaged_higher_per_mark": higher, "averaged_lower_per_mark": lower,
               "marks": runs[0]["epochs"]}
    print(summary)
    args.out.write_text(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M"),
                               "model": "thesis cnn with BatchNorm (cnn_bn)", "replicas": 2,
                               "spark_master": "local[2]", "samples": args.samples,
                               "command": " ".join(["benchmarks/averaged_batchnorm.py",
                                                    *(argv or sys.argv[1:])]),
                               "summary": summary, "runs": runs}, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
