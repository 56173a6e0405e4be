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
    for name, path in (("demo", _demo), ("predict_udf", _predict_udf), ("ml", _ml),
                       ("superres", _superres), ("run", lambda s, p: _run(df, p))):
        t0 = time.perf_counter()
        try:
            report[name] = {**path(spark, Path(runs) / name),
                            "seconds": time.perf_counter() - t0}
        except Exception:
            report[name] = {"error": traceback.format_exc()[-3000:]}
    Path(out).write_text(json.dumps(report, default=str))
    spark.stop()


ROOT = Path(__file__).resolve().parents[2]


def count_rows(scale):
    """A torchrun-style function: the process group is up, the shard comes from the context."""
    import torch
    import torch.distributed as dist

    import spark_dl
    ctx = spark_dl.context()
    n = torch.tensor([sum(len(xb) for xb, _ in ctx.batches(0))], dtype=torch.float64)
    dist.all_reduce(n)
    ctx.log({"epoch": 1, "rows": float(n)})            # an epoch report: always sent
    return {"rank": dist.get_rank(), "world": dist.get_world_size(), "rows": float(n) * scale}


def _run(df, tmp: Path) -> dict:
    """spark_dl.run from the Connect client: rank 0's value comes back."""
    import spark_dl
    lines: list[str] = []
    out = spark_dl.run(count_rows, 1.0, df=df, shape=(12,), batch_size=16, run_dir=tmp,
                       log=lines.append)
    return {"value": out, "metrics": (tmp / "metrics.jsonl").read_text()}


def _demo(spark, tmp: Path) -> dict:
    """The README's demo job (extended MNIST made in the executors, Downpour) on 3,000 digits."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("demo_job", ROOT / "jobs" / "demo.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    res = mod.main(["--config", str(ROOT / "conf/jobs/demo.toml"),
                    "--set", f"data.images='{ROOT}/data/mnist/t10k-images-idx3-ubyte.gz'",
                    "--set", f"data.labels='{ROOT}/data/mnist/t10k-labels-idx1-ubyte.gz'",
                    "--set", "data.extended_samples=3000", "--set", "train.model='fc'",
                    "--set", f"data.shards_dir='{tmp / 'shards'}'"], spark=spark)
    return {"rows": res["manifest"]["rows"], "accuracy": res["accuracy"]}


def _predict_udf(spark, tmp: Path) -> dict:
    import torch

    from spark_dl.inference import predict_udf
    torch.manual_seed(0)
    net = FCNet((12, 9, 3))
    x = np.random.default_rng(1).normal(size=(64, 12)).astype(np.float32)
    df = spark.createDataFrame([(i, [float(v) for v in r]) for i, r in enumerate(x)],
                               "id long, x array<float>")
    got = df.select("id", predict_udf(net, (12,), output="class")("x").alias("c")) \
        .orderBy("id").collect()
    with torch.no_grad():
        want = net(torch.from_numpy(x)).argmax(1).tolist()
    return {"equal": [int(r.c) for r in got] == want}


def _ml(spark, tmp: Path) -> dict:
    from pyspark.ml import Pipeline, PipelineModel
    from pyspark.ml.feature import VectorAssembler

    from spark_dl.ml import TorchEstimator
    g = np.random.default_rng(0)
    x = g.normal(size=(400, 4))
    rows = [(i, *map(float, r), int(c)) for i, (r, c) in enumerate(zip(x, x[:, :3].argmax(1)))]
    df = spark.createDataFrame(rows, "id long, a double, b double, c double, d double, "
                                     "label long").repartition(2)
    model = Pipeline(stages=[
        VectorAssembler(inputCols=["a", "b", "c", "d"], outputCol="features"),
        TorchEstimator(model="fc", hiddenLayers=[16], inputShape=[4], numClasses=3,
                       strategy="allreduce", replicas=2, epochs=10, batchSize=32, lr=0.2)]
    ).fit(df)
    out = model.transform(df).select("id", "label", "prediction").toPandas()
    model.write().save(str(tmp / "pipeline"))
    again = PipelineModel.load(str(tmp / "pipeline")).transform(df) \
        .select("id", "prediction").toPandas()
    return {"accuracy": float((out.prediction == out.label).mean()),
            "same_after_load": dict(zip(again.id, again.prediction)) ==
            dict(zip(out.id, out.prediction))}


def _superres(spark, tmp: Path) -> dict:
    """The super-resolution job on a tiny configuration: patches (one corrupt image skipped),
    the three stages trained with the engine, the test image super-resolved."""
    import shutil

    from spark_dl import load_toml
    from spark_dl.recipes.superres_pipeline import SuperResConfig, run_superres
    train, test = tmp / "train", tmp / "test"
    train.mkdir(parents=True)
    test.mkdir()
    for name in ("t1.png", "t2.png"):
        shutil.copy(ROOT / "data" / "sr" / "T91" / name, train / name)
    (train / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n not an image")
    shutil.copy(ROOT / "data" / "sr" / "Set5" / "bird.png", test / "bird.png")
    cfg = load_toml(SuperResConfig, ROOT / "conf" / "jobs" / "superres.toml",
                    {"train_images": str(train), "test_images": str(test),
                     "ssda_layers": [32, 256], "finetune_epochs": 1, "cnn_epochs": 1,
                     "thesis_conventional_epochs": 1, "cnn_noisy_skip": True,
                     "batch_size": 32, "run.out_dir": str(tmp / "run")})
    out = run_superres(cfg, log=lambda _: None, spark=spark)
    return {"patches": out["patches"], "skipped": out["skipped_images"],
            "psnr_cascade": out["psnr_cascade"], "psnr_bicubic": out.get("psnr_bicubic"),
            "report": (tmp / "run" / "report" / "report.md").exists()}


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
