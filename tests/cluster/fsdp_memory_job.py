"""spark-submit job for the slow tier: a transformer whose parameters, gradients and Adam state
do not fit one Python worker, under FSDP.

    spark-submit --properties-file conf/spark/local-cluster.conf \
        --conf spark.executor.pyspark.memory=MEM fsdp_memory_job.py OUT RUNS --replicas 1,2 \
        [--width 768 --layers 14]

Fits the zoo's transformer (float32, Adam) with FSDP, one fit per entry of --replicas, on 16
windows of 32 random token ids; writes {"fits": {R: {"ok": true, "memory": [...],
"estimate": {...}, "history": [...]} | {"error": "Type: msg"}}, "parameters": P}.
"""

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

T, VOCAB = 32, 256


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("runs")
    ap.add_argument("--replicas", default="1,2")
    ap.add_argument("--width", type=int, default=768)
    ap.add_argument("--layers", type=int, default=14)
    args = ap.parse_args()

    import numpy as np
    import torch

    from spark_dl import FSDP, fit, get_session
    from spark_dl.models import build_model
    spark = get_session()
    width, layers = args.width, args.layers

    def model():
        return build_model("transformer", vocab=VOCAB, layers=layers, width=width,
                           heads=8, context=T, dropout=0.0)

    g = np.random.default_rng(0)
    ids = g.integers(0, VOCAB, (16, T + 1))
    rows = [([int(v) for v in r[:-1]], [int(v) for v in r[1:]]) for r in ids]
    df = spark.createDataFrame(rows, "input array<int>, target array<int>").repartition(2)
    with torch.device("meta"):
        report = {"fits": {}, "parameters": sum(p.numel() for p in model().parameters())}
    for R in (int(r) for r in args.replicas.split(",")):
        t0 = time.perf_counter()
        try:
            res = fit(df, model, strategy=FSDP(), replicas=R, features="input",
                      label="target", shape=(T,), label_shape=(T,),
                      loss="sequence_cross_entropy", optimizer="adam", lr=1e-3, epochs=1,
                      batch_size=4, shuffle=False, run_dir=Path(args.runs) / f"R{R}",
                      log=None, progress=False, timeout_s=600)
            report["fits"][R] = {"ok": True, "memory": res.info["memory_per_replica"],
                                 "estimate": res.info["memory_estimate"],
                                 "history": res.history}
        except Exception as e:                  # the error is the result of this fit
            report["fits"][R] = {"error": f"{type(e).__name__}: {e}"[:2000]}
        report["fits"][R]["seconds"] = time.perf_counter() - t0
    Path(args.out).write_text(json.dumps(report))
    spark.stop()


if __name__ == "__main__":
    main()
