"""spark-submit job for the slow tier: data several times larger than a Python worker's memory.

    spark-submit --properties-file conf/spark/local-cluster.conf \
        --conf spark.executor.pyspark.memory=MEM stream_job.py OUT RUNS --gib 6 --data auto,memory

Generates ``--gib`` GiB of uint8 rows (``--row-bytes`` pixels each, a binary column) in two
partitions inside the executors, and fits a linear classifier on them with Downpour SGD
(2 workers, one epoch), once per entry of ``--data``; writes
{"rows": N, "fits": {mode: {"ok": true, "history": [...], "workers": [...]} | {"error": ...}}}.
"""

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

BLOCK = 1024                  # rows generated at a time


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("runs")
    ap.add_argument("--gib", type=float, default=6.0)
    ap.add_argument("--row-bytes", type=int, default=4096)
    ap.add_argument("--data", default="auto,memory")
    ap.add_argument("--buffer", default="64MB")
    args = ap.parse_args()

    import numpy as np

    from spark_dl import fit, get_session
    from spark_dl.data import pixels_to_arrow
    from spark_dl.data.mnist import PIXEL_SCHEMA
    from spark_dl.models import FCNet
    spark = get_session()
    d = args.row_bytes
    blocks = int(args.gib * 2**30 // (BLOCK * d))

    def rows(batches):                  # cheap deterministic pixels; label = first pixel % 10
        cols = np.arange(d, dtype=np.int64)
        for b in batches:
            for i in b.column("id").to_numpy():
                r = np.arange(BLOCK, dtype=np.int64)[:, None] + int(i) * BLOCK
                x = ((r * 7 + cols * 3 + (r * cols) % 13) % 251).astype(np.uint8)
                yield pixels_to_arrow(x, x[:, 0] % 10)
    df = spark.range(blocks, numPartitions=2).mapInArrow(rows, PIXEL_SCHEMA)
    report = {"rows": blocks * BLOCK, "bytes": blocks * BLOCK * d, "fits": {}}
    for mode in args.data.split(","):
        try:
            res = fit(df, lambda: FCNet((d, 10)), strategy="downpour", replicas=2,
                      optimizer="adam", lr=1e-3, epochs=1, batch_size=2048, data=mode,
                      shuffle_buffer=args.buffer, shape=(d,), num_classes=10,
                      run_dir=Path(args.runs) / mode, log=None, progress=False,
                      timeout_s=600)
            report["fits"][mode] = {"ok": True, "history": res.history,
                                    "workers": res.info["workers"]}
        except Exception as e:                  # the error is the result of this fit
            report["fits"][mode] = {"error": f"{type(e).__name__}: {e}"[:2000]}
    Path(args.out).write_text(json.dumps(report))
    spark.stop()


if __name__ == "__main__":
    main()
