"""Run tracking: TensorBoard event files and an MLflow run hold the fit's own history."""

from __future__ import annotations

import csv

import pytest

from spark_dl import fit
from spark_dl.errors import ConfigError

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
