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

from spark_dl.errors import DataError
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
                       strategy="allreduce", replicas=2, epochs=30, batchSize=32, lr=0.2)])
    model = pipe.fit(df)
    assert isinstance(model.stages[-1], TorchModel)
    assert len(model.stages[-1].history) == 30
    out = model.transform(df).select("id", "label", "prediction").toPandas()
    assert (out.prediction == out.label).mean() > 0.85
    path = str(tmp_path / "pipeline")
    model.write().save(path)
    # a fresh driver process, its own SparkSession: load and predict the same rows
    script = textwrap.dedent(f"""
        import json, sys
        sys.path.insert(0, {str(ROOT)!r})
        from pyspark.ml import PipelineModel
        from spark_dl import get_session
        from tests.spark.test_ml import _frame
        spark = get_session("local", master="local[2]")
        loaded = PipelineModel.load({path!r})
        rows = loaded.transform(_frame(spark)).select("id", "prediction").collect()
        print(json.dumps({{r.id: r.prediction for r in rows}}))
    """)
    env = dict(os.environ, PYSPARK_PYTHON=sys.executable,
               SPARK_CONF_DIR=str(ROOT / "conf" / "logging"))
    env.pop("PYSPARK_GATEWAY_PORT", None)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    again = {int(k): v for k, v in json.loads(proc.stdout.strip().splitlines()[-1]).items()}
    assert again == dict(zip(out.id, out.prediction))
    # and in this session, with the same class
    same = PipelineModel.load(path).transform(df).select("id", "prediction").toPandas()
    assert dict(zip(same.id, same.prediction)) == dict(zip(out.id, out.prediction))


def test_estimator_params_and_bad_columns(spark):
    est = TorchEstimator(model="fc", inputShape=[4], numClasses=3, epochs=2)
    assert est.getOrDefault("epochs") == 2 and est.getOrDefault("hiddenLayers") == [128]
    est.setParams(lr=0.01)
    assert est.getOrDefault("lr") == 0.01
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
