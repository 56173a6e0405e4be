"""spark-submit job for the slow tier: a model larger than a Python worker's memory limit.

    spark-submit --properties-file conf/spark/local-cluster.conf \
        --conf spark.executor.pyspark.memory=MEM memory_job.py OUT RUNS --partitions 1,2 \
        [--hidden 12288]

Fits the FC net 784-H-H-10 (float32) with Downpour SGD, one fit per entry of --partitions, on
64 random rows; writes {"fits": {F: {"ok": true, "bytes": [...]} | {"error": "Type: msg"}}}.
"""

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("runs")
    ap.add_argument("--partitions", default="1,2")
    ap.add_argument("--hidden", type=int, default=12288)
    args = ap.parse_args()

    import numpy as np

    from spark_dl import Downpour, fit, get_session
    from spark_dl.data import arrays_to_arrow
    from spark_dl.models import FCNet
    spark = get_session()
    H = args.hidden

    def rows(batches):
        for b in batches:
            for i in b.column("id").to_numpy():
                g = np.random.default_rng(int(i))
                yield arrays_to_arrow(g.random((32, 784), dtype=np.float32),
                                      g.integers(0, 10, 32))
    df = spark.range(2, numPartitions=2).mapInArrow(rows, "features array<float>, label long")
    report = {"fits": {}}
    for F in (int(f) for f in args.partitions.split(",")):
        try:
            res = fit(df, lambda: FCNet((784, H, H, 10)), strategy=Downpour(partitions=F),
                      replicas=1 if F > 1 else 2, batch_size=16, epochs=1, lr=0.01,
                      run_dir=Path(args.runs) / f"F{F}", log=None, timeout_s=600)
            report["fits"][F] = {"ok": True, "bytes": [
                w["model_parallel"]["parameter_bytes"] for w in res.info["workers"]
                if "model_parallel" in w], "history": res.history}
        except Exception as e:                  # the error is the result of this fit
            report["fits"][F] = {"error": f"{type(e).__name__}: {e}"[:2000]}
    Path(args.out).write_text(json.dumps(report))
    spark.stop()


if __name__ == "__main__":
    main()
