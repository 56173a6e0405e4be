"""spark-submit job for the cluster tests: which executor processed which partition.

Generates extended MNIST on the executors, then every task feeds its own partition through
the Arrow bridge into a small FC net for one pass and reports: partition, executor (its work
directory and JVM pid), rows, label sum and the loss of its first and last batch. The report
is written as JSON to the path given as the first argument.
"""

import json
import sys

import pyarrow as pa

from spark_dl import get_session
from spark_dl.data import extended_mnist, mnist_split

SCHEMA = pa.schema([("partition", pa.int32()), ("cwd", pa.string()), ("jvm_pid", pa.int64()),
                    ("rows", pa.int64()), ("label_sum", pa.int64()), ("first_loss", pa.float64()),
                    ("last_loss", pa.float64())])


def _probe_task(batches):
    import os

    import torch
    from pyspark import TaskContext

    from spark_dl.data import ShardData
    from spark_dl.models import FCNet
    from spark_dl.train import make_optimizer

    part = TaskContext.get().partitionId()
    shard = ShardData.from_arrow(batches, shape=(784,), num_classes=10,
                                 where=f"partition {part}")
    torch.manual_seed(0)
    model = FCNet((784, 64, 10), act="relu")
    opt = make_optimizer("adam", model.parameters(), 3e-3)
    losses = []
    for x, y in shard.batches(32, seed=part):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    with open(f"/proc/{os.getppid()}/stat") as f:        # python worker -> daemon -> executor JVM
        jvm = int(f.read().rsplit(")", 1)[1].split()[1])
    yield pa.RecordBatch.from_pylist([{
        "partition": part, "cwd": os.getcwd(), "jvm_pid": jvm, "rows": len(shard),
        "label_sum": int(shard.labels.sum()), "first_loss": losses[0], "last_loss": losses[-1]}], schema=SCHEMA)


def main(out_path, n=4000, partitions=4):
    spark = get_session()
    probe(spark, out_path, n, partitions)
    spark.stop()


def probe(spark, out_path, n=4000, partitions=4):
    """The probe on ``spark`` (a job of its own, or one that goes on to other work: the
    cluster tests' allreduce_job.py runs it with --probe before its fits)."""
    (x, y), _ = mnist_split("data/mnist/t10k-images-idx3-ubyte.gz",
                            "data/mnist/t10k-labels-idx1-ubyte.gz")
    df = extended_mnist(spark, x, y, n=n, partitions=partitions, seed=0)
    schema = ("partition int, cwd string, jvm_pid long, rows long, label_sum long, "
              "first_loss double, last_loss double")
    rows = [r.asDict() for r in df.mapInArrow(_probe_task, schema).collect()]
    report = {"master": spark.sparkContext.master, "n": n, "partitions": rows,
              "executors": sorted(spark.sparkContext._jsc.sc().getExecutorMemoryStatus()
                                  .keySet().mkString(",").split(","))}
    with open(out_path, "w") as f:
        json.dump(report, f, indent=1)
    print(json.dumps(report))


if __name__ == "__main__":
    main(sys.argv[1], *map(int, sys.argv[2:]))
