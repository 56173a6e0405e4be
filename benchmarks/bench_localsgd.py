"""LocalSGD against AllReduce on the demo's data: bytes sent per sample and the held-out
accuracy at equal epochs.

The thesis CNN on the extended MNIST the demo generates (--samples distorted digits made from
the first 8,000 shipped digits), validated on the last 2,000 real digits every quarter epoch;
SGD lr --lr, momentum 0.9, --replicas replicas on local[R], one thread each, the same seeds.
Systems (interleaved over --seeds):

  allreduce        AllReduce(average=0): the global batch's gradient every step
  localsgd-H       LocalSGD(every=H): the replicas' parameters averaged every H steps
  diloco-H         LocalSGD(every=H, outer_lr=0.7, outer_momentum=0.9)

Reported per system and seed: the bytes each replica sent per sample it trained on (the
buffers it all-reduced), the accuracy at every quarter epoch, and the final accuracy.

    .venv/bin/python benchmarks/bench_localsgd.py --out benchmarks/results/localsgd.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from _common import scaling_data, write_results  # noqa: E402


def strategy(name: str):
    from spark_dl import AllReduce, LocalSGD
    if name == "allreduce":
        return AllReduce(average=0)
    kind, _, every = name.partition("-")
    outer = {"outer_lr": 0.7, "outer_momentum": 0.9} if kind == "diloco" else {}
    return LocalSGD(every=int(every), **outer)


def one(spark, data: Path, val, name: str, args, seed: int, runs: Path) -> dict:
    from spark_dl import fit
    res = fit(spark.read.parquet(data.as_uri()), "cnn", strategy=strategy(name),
              shape=(1, 28, 28), num_classes=10, optimizer="sgd", lr=args.lr, momentum=0.9,
              epochs=args.epochs, batch_size=args.batch, replicas=args.replicas, threads=1,
              validation=val, validate_every=0.25, seed=seed, device="cpu",
              run_dir=runs / f"{name}-{seed}-{time.time()}", log=None, progress=False)
    info = res.info
    sent = info["allreduce_bytes"] if name == "allreduce" else info["bytes_sent"]
    per_replica = res.history[-1]["samples"] * args.epochs / args.replicas
    return {"system": name, "seed": seed, "bytes_per_sample": sent / per_replica,
            "accuracy": {str(e["epoch"]): e["val_accuracy"] for e in info["evals"]},
            "final_accuracy": res.history[-1]["val_accuracy"],
            "train_seconds": info["train_seconds"]}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--systems", default="allreduce,localsgd-8,localsgd-32,diloco-32")
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--samples", type=int, default=48000)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=0.02)
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/localsgd.json"))
    args = ap.parse_args(argv)
    from spark_dl.session import get_session
    spark = get_session("local", master=f"local[{args.replicas}]")
    work = Path(tempfile.mkdtemp(prefix="bench-localsgd-"))
    val = scaling_data(spark, args.samples, work / "data")
    rows = []
    for seed in (int(s) for s in args.seeds.split(",")):
        for name in args.systems.split(","):
            rows.append(one(spark, work / "data", val, name, args, seed, work / "runs"))
            print(rows[-1], flush=True)
    summary = {}
    for name in args.systems.split(","):
        mine = [r for r in rows if r["system"] == name]
        summary[name] = {"bytes_per_sample": statistics.median(r["bytes_per_sample"]
                                                               for r in mine),
                         "final_accuracy": statistics.median(r["final_accuracy"]
                                                             for r in mine)}
    write_results(args.out, "bench_localsgd.py", argv, vars(args), summary, {"runs": rows})


if __name__ == "__main__":
    main()
