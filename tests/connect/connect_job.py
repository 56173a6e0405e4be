"""spark_dl's main paths from a Spark Connect client: a local Connect server (pyspark's own,
``SparkSession.builder.remote("local[2]")``) in this process, the fits as a user of a
JVM-less client writes them. Writes a JSON report to argv[1]; tests/connect/test_connect.py
checks it (a classic session cannot share a process with the Connect server)."""

from __future__ import annotations

import json
import sys
import time
import traceback
from pathlib import Path

import numpy as np

from spark_dl import AllReduce, Downpour, Gossip, TaskError, fit, get_session
from spark_dl.compat import is_connect
from spark_dl.data import arrays_to_arrow
from spark_dl.models.fc import FCNet

SCHEMA = "features array<float>, label long"


def small_fc():
    return FCNet((12, 9, 3), act="sigmoid")


class Explodes(FCNet):
    """Raises in training step 3 of task 1."""

    def __init__(self):
        super().__init__((12, 9, 3), act="sigmoid")
        self.calls = 0

    def forward(self, x):
        from pyspark import TaskContext
        ctx = TaskContext.get()
        if self.training and ctx is not None and ctx.partitionId() == 1:
            self.calls += 1
            if self.calls == 3:
                raise ZeroDivisionError("the user's model divided by zero")
        return super().forward(x)


def main(out: str, runs: str) -> None:
    spark = get_session("local", remote="local[2]",
                        conf={"spark.sql.shuffle.partitions": "2"})
    report: dict = {"connect": is_connect(spark), "fits": {}}
    g = np.random.default_rng(0)
    x = g.normal(size=(96, 12)).astype(np.float32)
    y = x[:, :3].argmax(1).astype(np.int64)

    def rows(batches):
        for b in batches:
            for i in b.column("id").to_numpy():
                yield arrays_to_arrow(x[i * 48:(i + 1) * 48], y[i * 48:(i + 1) * 48])
    df = spark.range(2, numPartitions=2).mapInArrow(rows, SCHEMA)
    for name, strategy in (("allreduce", AllReduce()), ("downpour", Downpour()),
                           ("downpour-sync", Downpour(mode="sync")),
                           ("gossip", Gossip(alpha=0.5))):
        lines: list[str] = []
        t0 = time.perf_counter()
        try:
            res = fit(df, small_fc, strategy=strategy, optimizer="sgd", lr=0.5,
                      momentum=0.9, epochs=4, batch_size=8, validation=(x, y),
                      run_dir=Path(runs) / name, log=lines.append)
            report["fits"][name] = {"history": res.history, "log": lines,
                                    "seconds": time.perf_counter() - t0,
                                    "files": sorted(p.name for p in res.run_dir.iterdir())}
        except Exception:
            report["fits"][name] = {"error": traceback.format_exc()[-3000:]}
    t0 = time.perf_counter()
    try:
        fit(df, Explodes, batch_size=8, epochs=2, run_dir=Path(runs) / "explodes", log=None)
        report["task_error"] = {"error": "the fit did not fail"}
    except TaskError as e:
        report["task_error"] = {"type": type(e).__name__, "zero": isinstance(e, ZeroDivisionError),
                                "message": str(e), "task": e.task, "epoch": e.epoch,
                                "step": e.step, "seconds": time.perf_counter() - t0}
    except Exception:
        report["task_error"] = {"error": traceback.format_exc()[-3000:]}
    Path(out).write_text(json.dumps(report, default=str))
    spark.stop()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
