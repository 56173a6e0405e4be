"""Run tracking: TensorBoard event files and an MLflow run hold the fit's own history; the MLflow
run holds the fitted model too, which pyfunc loads and spark_udf serves."""

from __future__ import annotations

import csv

import numpy as np
import pytest
import torch

from spark_dl import fit
from spark_dl.errors import ConfigError
from spark_dl.inference import predict_udf

from .test_allreduce import data, frame, small_fc


def _tensorboard_scalars(logdir) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(logdir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def _local_mlflow(monkeypatch, tmp_path):
    """A file-backed MLflow store in tmp_path (no server, no database package needed)."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")


def _history(run_dir) -> list[dict]:
    with open(run_dir / "history.csv") as f:
        return list(csv.DictReader(f))


@pytest.mark.parametrize("strategy", ["allreduce", "downpour"])
def test_tensorboard_and_mlflow_get_the_history_of_the_run_directory(spark, tmp_path, strategy,
                                                                    monkeypatch):
    pytest.importorskip("tensorboard")
    mlflow = pytest.importorskip("mlflow")
    _local_mlflow(monkeypatch, tmp_path)
    x, y = data(96, seed=3)
    res = fit(frame(spark, x, y, [48, 48]), small_fc, strategy=strategy, batch_size=8,
              epochs=3, lr=0.3, validation=(x[:32], y[:32]), run_dir=tmp_path / "run",
              log=None, track=["tensorboard", "mlflow"])
    history = _history(res.run_dir)
    assert [int(h["epoch"]) for h in history] == [1, 2, 3]

    scalars = _tensorboard_scalars(res.run_dir / "tensorboard")
    for key in ("loss", "val_accuracy", "samples_per_s"):
        assert [s for s, _ in scalars[f"epoch/{key}"]] == [1, 2, 3]
        assert [v for _, v in scalars[f"epoch/{key}"]] == \
            pytest.approx([float(h[key]) for h in history], rel=1e-6)

    runs = mlflow.search_runs(search_all_experiments=True, output_format="list")
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"
    run = runs[0]
    assert run.info.run_name == res.run_dir.name
    assert run.data.params["strategy"] == strategy and run.data.params["epochs"] == "3"
    client = mlflow.tracking.MlflowClient()
    losses = sorted(client.get_metric_history(run.info.run_id, "val_loss"), key=lambda m: m.step)
    assert [m.step for m in losses] == [1, 2, 3]
    assert [m.value for m in losses] == pytest.approx([float(h["val_loss"]) for h in history],
                                                      rel=1e-6)
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"config.json", "history.csv", "loss.png", "model.pt"} <= artifacts


def test_mlflow_logs_into_the_users_active_run(spark, tmp_path, monkeypatch):
    mlflow = pytest.importorskip("mlflow")
    _local_mlflow(monkeypatch, tmp_path)
    x, y = data(48, seed=4)
    with mlflow.start_run(run_name="mine") as mine:
        fit(frame(spark, x, y, [48]), small_fc, strategy="downpour", batch_size=8, epochs=2,
            run_dir=tmp_path / "run", log=None, track="mlflow")
        assert mlflow.active_run().info.run_id == mine.info.run_id     # still open: the user's
    runs = mlflow.search_runs(search_all_experiments=True, output_format="list")
    assert [r.info.run_name for r in runs] == ["mine"]
    steps = mlflow.tracking.MlflowClient().get_metric_history(mine.info.run_id, "loss")
    assert sorted(m.step for m in steps) == [1, 2]


def test_unknown_tracker_is_refused_before_any_spark_job(spark, tmp_path):
    x, y = data(16, seed=5)
    with pytest.raises(ConfigError, match=r"unknown tracker\(s\) \['wandb'\]; choose from "
                                          r"\['tensorboard', 'mlflow'\]"):
        fit(frame(spark, x, y, [16]), small_fc, track=["tensorboard", "wandb"],
            run_dir=tmp_path / "run", log=None)
    assert not (tmp_path / "run").exists()


def test_mlflow_holds_the_model_which_pyfunc_predicts_and_spark_udf_serves(spark, tmp_path,
                                                                          monkeypatch):
    """track="mlflow": the fitted model is the run's MLflow PyTorch model ("model"), its
    signature from the training rows (no validation: the first rows fit reads); pyfunc
    predicts on a pandas DataFrame of the feature rows what the model does, and spark_udf's
    predictions on the Spark DataFrame equal predict_udf's."""
    mlflow = pytest.importorskip("mlflow")
    pyfunc = pytest.importorskip("mlflow.pyfunc")
    import pandas as pd
    _local_mlflow(monkeypatch, tmp_path)
    x, y = data(64, seed=6)
    df = frame(spark, x, y, [32, 32])
    res = fit(df, small_fc, batch_size=16, epochs=1, lr=0.3, run_dir=tmp_path / "run",
              log=None, track="mlflow")
    assert mlflow.get_run(res.mlflow_run_id).info.status == "FINISHED"
    uri = f"runs:/{res.mlflow_run_id}/model"
    served = pyfunc.load_model(uri)
    (given,), (scores,) = served.metadata.signature.inputs.inputs, \
        served.metadata.signature.outputs.inputs
    assert (given.type, given.shape) == (np.dtype("float32"), (-1, 12))
    assert str(scores.type) == "Array(float)"
    with torch.no_grad():
        want = res.model.eval()(torch.from_numpy(x)).numpy()
    # (float32 sums of batches of other sizes: equal to a few units in the last place)
    np.testing.assert_allclose(served.predict(pd.DataFrame({"features": list(x)})), want,
                               rtol=1e-5, atol=1e-6)
    as_lists = pd.DataFrame({"features": [r.tolist() for r in x[:5]]})
    np.testing.assert_allclose(served.predict(as_lists), want[:5], rtol=1e-5, atol=1e-6)

    udf, ours = pyfunc.spark_udf(spark, uri), predict_udf(res.model, (12,))
    rows = df.select(udf("features").alias("mlflow"), ours("features").alias("spark_dl")) \
        .collect()
    assert len(rows) == 64
    np.testing.assert_allclose([r.mlflow for r in rows], [r.spark_dl for r in rows],
                               rtol=1e-5, atol=1e-6)


def test_the_estimator_logs_its_model_to_mlflow(spark, tmp_path, monkeypatch):
    pyfunc = pytest.importorskip("mlflow.pyfunc")
    import pandas as pd

    from spark_dl.ml import TorchEstimator
    _local_mlflow(monkeypatch, tmp_path)
    monkeypatch.chdir(tmp_path)                      # its run directory: runs/ in here
    x, y = data(64, seed=7)
    df = spark.createDataFrame([(i, r.tolist(), int(c)) for i, (r, c) in enumerate(zip(x, y))],
                               "id long, features array<float>, label long")
    model = TorchEstimator(model="fc", hiddenLayers=[8], inputShape=[12], numClasses=3,
                           epochs=1, batchSize=16, replicas=2, track="mlflow").fit(df)
    assert model.mlflow_run_id is not None
    served = pyfunc.load_model(f"runs:/{model.mlflow_run_id}/model")
    scores = served.predict(pd.DataFrame({"features": list(x)}))
    assert scores.shape == (64, 3)
    predicted = {r.id: r.prediction for r in model.transform(df).select("id", "prediction")
                 .collect()}
    assert [predicted[i] for i in range(64)] == scores.argmax(1).tolist()
