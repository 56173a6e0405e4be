"""Spark ML's own columns on real Spark (local[2]): ML vector features (dense and sparse rows
mixed) and double labels (StringIndexer's 0.0, 1.0, 2.0) through every strategy, spark_dl.run,
TorchEstimator and predict_udf, decoded in the tasks; string labels get the StringIndexer line;
a model factory that cannot be pickled is a TypeError naming it, before any job."""

from __future__ import annotations

import math
import re
import threading

import numpy as np
import pytest
import torch
from pyspark.ml.linalg import Vectors

import spark_dl
from spark_dl import AllReduce, Boosting, DataError, Downpour, Gossip, LocalSGD, fit
from spark_dl.inference import predict_udf
from spark_dl.ml import TorchEstimator
from spark_dl.models import FCNet

N, D = 64, 4
KW = dict(num_classes=3, epochs=1, batch_size=16, lr=0.1, log=None, progress=False)


def rows(n=N, seed=0):
    """(x (n, 4) float32 with zeros, labels 0..2): every other row has two zeros."""
    g = np.random.default_rng(seed)
    x = g.normal(size=(n, D)).astype(np.float32)
    x[::2, 1:3] = 0.0
    return x, x[:, :3].argmax(1)


def fc():
    return FCNet((D, 8, 3))


@pytest.fixture(scope="module")
def vectors(spark):
    """The rows as a vector column (even rows sparse, odd rows dense) and double labels, in
    two partitions; and the same rows as plain arrays."""
    x, y = rows()
    data = [(i, Vectors.sparse(D, {j: float(v) for j, v in enumerate(r) if v})
             if i % 2 == 0 else Vectors.dense(r.astype(np.float64)), float(c))
            for i, (r, c) in enumerate(zip(x, y))]
    df = spark.createDataFrame(data, ["id", "features", "label"]).repartition(2, "id")
    return df.cache(), x, y


@pytest.mark.parametrize("strategy", [AllReduce(), Downpour(), Gossip(), LocalSGD(every=2),
                                      Boosting()], ids=lambda s: s.name)
def test_every_strategy_trains_on_vectors_and_double_labels(spark, vectors, strategy,
                                                            tmp_path):
    df, x, y = vectors
    # validation labels as doubles too (AllReduce's replicas score them)
    held = {"validation": (x[:16], y[:16].astype(np.float64))} \
        if strategy.name == "allreduce" else {}
    res = fit(df, fc, strategy=strategy, run_dir=tmp_path / "run", **KW, **held)
    assert len(res.history) == 1 and math.isfinite(res.history[0]["loss"])
    assert res.model(torch.zeros(2, D)).shape == (2, 3)
    if held:
        assert 0 <= res.history[0]["val_accuracy"] <= 1


def read_shard_sums():
    """Each replica's decoded rows: sums of its features (by column) and labels, the dtype."""
    ctx = spark_dl.context()
    xs, ys = zip(*ctx.batches(0))
    x, y = torch.cat(xs), torch.cat(ys)
    import torch.distributed as dist
    sums = torch.cat([x.double().sum(0), y.double().sum().reshape(1),
                      torch.tensor([len(x)], dtype=torch.float64)])
    dist.all_reduce(sums)
    return {"sums": sums.tolist(), "dtypes": [str(x.dtype), str(y.dtype)]}


def test_run_reads_vectors_and_class_ids_in_its_tasks(spark, vectors, tmp_path):
    df, x, y = vectors
    out = spark_dl.run(read_shard_sums, df=df, num_classes=3, batch_size=16,
                       run_dir=tmp_path / "run", log=None, progress=False)
    assert out["dtypes"] == ["torch.float32", "torch.int64"]
    want = [*x.astype(np.float64).sum(0), float(y.sum()), N]
    assert out["sums"] == pytest.approx(want, rel=1e-6)


def test_estimator_and_predict_udf_take_vectors(spark, vectors):
    df, x, _ = vectors
    model = TorchEstimator(model="fc", hiddenLayers=[8], inputShape=[D], numClasses=3,
                           epochs=1, batchSize=16, lr=0.1).fit(df)
    out = model.transform(df).select("id", "prediction").orderBy("id").toPandas()
    assert len(out) == N and set(out.prediction) <= {0.0, 1.0, 2.0}
    # predict_udf on the vector column: the outputs of the rows as arrays
    net = fc()
    got = df.select("id", predict_udf(net, (D,))("features").alias("p")).orderBy("id") \
        .toPandas()
    with torch.no_grad():
        want = net(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(np.stack(got.p), want, rtol=1e-5, atol=1e-6)


def test_string_labels_name_the_string_indexer_line(spark, vectors, tmp_path):
    df, _, _ = vectors
    named = df.selectExpr("features", "concat('class ', cast(label as string)) as kind")
    line = re.escape('StringIndexer(inputCol="kind", outputCol="kind_idx").fit(df).transform(df)')
    with pytest.raises(DataError, match=f"{line}.*pass label=\"kind_idx\""):
        fit(named, fc, label="kind", run_dir=tmp_path / "a", **KW)
    with pytest.raises(DataError, match=f"{line}.*pass label=\"kind_idx\""):
        spark_dl.run(read_shard_sums, df=named, label="kind", run_dir=tmp_path / "b",
                     log=None)
    with pytest.raises(DataError, match=f"{line}.*pass labelCol=\"kind_idx\""):
        TorchEstimator(inputShape=[D], numClasses=3, labelCol="kind").fit(named)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_an_unpicklable_model_factory_is_a_type_error_naming_it(spark, vectors, tmp_path):
    df, _, _ = vectors
    lock = threading.Lock()

    def locked_fc():
        with lock:
            return fc()

    with pytest.raises(TypeError, match=r"the model factory .*locked_fc cannot be pickled.*"
                                        r"cannot pickle '_thread.lock'.*create locks"):
        fit(df, locked_fc, run_dir=tmp_path / "a", **KW)
    with pytest.raises(TypeError, match=r"the loss .*<lambda> cannot be pickled"):
        fit(df, fc, loss=lambda out, y: lock.locked(), run_dir=tmp_path / "b", **KW)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
