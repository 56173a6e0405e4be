"""Spark ML: TorchEstimator inside a Pipeline, saved and loaded in a new SparkSession."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from pyspark.ml import Pipeline, PipelineModel
from pyspark.ml.feature import VectorAssembler

from spark_dl.compat import SPARK_VERSION
from spark_dl.errors import ConfigError, DataError
from spark_dl.ml import TorchEstimator, TorchModel

from ..conftest import ROOT


def _frame(spark, n=400, seed=0):
    g = np.random.default_rng(seed)
    x = g.normal(size=(n, 4))
    y = x[:, :3].argmax(1)
    rows = [(int(i), *map(float, r), int(c)) for i, (r, c) in enumerate(zip(x, y))]
    return spark.createDataFrame(rows, "id long, a double, b double, c double, d double, "
                                       "label long").repartition(2)


def test_pipeline_fits_saves_and_loads_in_a_new_session(spark, tmp_path):
    df = _frame(spark)
    pipe = Pipeline(stages=[
        VectorAssembler(inputCols=["a", "b", "c", "d"], outputCol="features"),
        TorchEstimator(model="fc", hiddenLayers=[16], inputShape=[4], numClasses=3,
                       strategy="allreduce", replicas=2, epochs=10, batchSize=32, lr=0.2,
                       warmupEpochs=4, gradClip="none")])
    model = pipe.fit(df)
    assert isinstance(model.stages[-1], TorchModel)
    history = model.stages[-1].history
    assert len(history) == 10
    # fit's linear rule for 2 replicas (0.4) reached over warmupEpochs=4, not "auto"'s 0.4
    assert history[0]["lr"] < 0.25 and history[4]["lr"] == pytest.approx(0.4)
    out = model.transform(df).select("id", "label", "prediction").toPandas()
    assert (out.prediction == out.label).mean() > 0.85
    path = str(tmp_path / "pipeline")
    model.write().save(path)
    # a fresh driver process, its own SparkSession: load and predict the same rows. A plain
    # Python driver (no PYSPARK_PYTHON, the venv not on PATH): get_session gives the executors
    # its interpreter, or they would start the system python3 without torch (this driver
    # also stands for test_session's plain-driver check: one JVM start for both)
    script = textwrap.dedent(f"""
        import json, sys
        sys.path.insert(0, {str(ROOT)!r})
        from pyspark.ml import PipelineModel
        from spark_dl import get_session
        from tests.spark.test_ml import _frame
        spark = get_session("local", master="local[2]")
        print(spark.sparkContext.parallelize([0], 1)
              .map(lambda _: __import__("torch").__version__).collect())
        loaded = PipelineModel.load({path!r})
        rows = loaded.transform(_frame(spark)).select("id", "prediction").collect()
        print(json.dumps({{r.id: r.prediction for r in rows}}))
    """)
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYSPARK_PYTHON", "PYSPARK_DRIVER_PYTHON", "VIRTUAL_ENV",
                        "PYSPARK_GATEWAY_PORT")}
    env["PATH"] = os.pathsep.join(p for p in env["PATH"].split(os.pathsep)
                                  if not p.startswith(sys.prefix))
    env["SPARK_CONF_DIR"] = str(ROOT / "conf" / "logging")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    import torch
    *_, executors_torch, predictions = proc.stdout.strip().splitlines()
    assert executors_torch == repr([torch.__version__])
    again = {int(k): v for k, v in json.loads(predictions).items()}
    assert again == dict(zip(out.id, out.prediction))
    # and in this session, with the same class
    same = PipelineModel.load(path).transform(df).select("id", "prediction").toPandas()
    assert dict(zip(same.id, same.prediction)) == dict(zip(out.id, out.prediction))


def test_estimator_params_and_bad_columns(spark):
    est = TorchEstimator(model="fc", inputShape=[4], numClasses=3, epochs=2)
    assert est.getOrDefault("epochs") == 2 and est.getOrDefault("hiddenLayers") == [128]
    est.setParams(lr=0.01)
    assert est.getOrDefault("lr") == 0.01
    # fit's warmup_epochs and grad_clip as words or numbers; bad ones named before any job
    assert est.copy({est.gradClip: 2}).getOrDefault("gradClip") == "2"
    assert TorchEstimator(gradClip=None).getOrDefault("gradClip") == "none"     # off, as fit's
    for param, value, words in ((est.gradClip, "off!", "'auto', 'none' or a number >= 0"),
                                (est.gradClip, -1, "'auto', 'none' or a number >= 0"),
                                (est.warmupEpochs, "none", "'auto' or a number >= 0")):
        with pytest.raises(ConfigError, match=f"{param.name} must be {words}, got"):
            est.copy({param: value}).fit(_frame(spark, n=4))
    with pytest.raises(TypeError, match="a string or a number"):
        est.setParams(gradClip=[1.0])
    # fit's nesterov: off by default, passed through, refused where fit refuses it
    assert est.getOrDefault("nesterov") is False
    with pytest.raises(ConfigError, match="nesterov=True with Downpour"):
        est.copy({est.nesterov: True, est.strategy: "downpour"}).fit(
            _frame(spark, n=4).selectExpr("array(a, b, c, d) as features", "label"))
    df = _frame(spark, n=40)
    with pytest.raises(DataError, match="features column 'features' not in the DataFrame"):
        est.fit(df)
    with pytest.raises(DataError, match="features column 'a' is double; it must be an ML "
                                        "Vector or array"):
        est.copy({est.featuresCol: "a"}).fit(df)
    with pytest.raises(DataError, match="label column 'y' not in the DataFrame"):
        est.copy({est.featuresCol: "a", est.labelCol: "y"}).fit(
            df.selectExpr("array(a, b, c, d) as a", "label"))
    # a shape parameter that does not match the data: named with both lengths, nothing trained
    assembled = df.selectExpr("array(a, b, c, d) as features", "label")
    with pytest.raises(DataError, match=r"has 4 values, expected 5 \(shape \(5,\)\)"):
        est.copy({est.inputShape: [5]}).fit(assembled)


@pytest.mark.compat
@pytest.mark.skipif(SPARK_VERSION >= (4, 0, 0), reason="on pyspark 4 the pipeline test above "
                    "saves and loads, in a new session too")
def test_a_torch_model_saves_and_loads_on_pyspark_3_5(spark, tmp_path):
    """The compat tier's persistence check: Spark ML's metadata written through 3.5's
    SparkContext path, the weights as Parquet; the same uid, Params and weights, and the loaded
    model predicts."""
    est = TorchEstimator(model="fc", inputShape=[4], numClasses=3, epochs=1)
    assembled = _frame(spark, n=40).selectExpr("array(a, b, c, d) as features", "label")
    model = est.fit(assembled)
    model.write().save(str(tmp_path / "model"))
    loaded = TorchModel.load(str(tmp_path / "model"))
    assert loaded.uid == model.uid and loaded.state == model.state
    assert loaded.getOrDefault("inputShape") == [4] and loaded.getOrDefault("numClasses") == 3
    predicted = loaded.transform(assembled).select("label", "prediction").collect()
    assert len(predicted) == 40 and {r.prediction for r in predicted} <= {0.0, 1.0, 2.0}
