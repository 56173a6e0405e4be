"""Connect tier: fit from a Spark Connect client (no JVM in the client), every strategy, with
live progress, the history, the run directory and a task's error as from a classic session.
The fits run in their own process (tests/connect/connect_job.py): pyspark's local Connect
server cannot share a process with the classic session of the other tests."""

import json
import os
import subprocess
import sys

import pytest

from ..conftest import ROOT

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    pytest.importorskip("grpc_status", reason="pyspark[connect] is not installed")
    from spark_dl.compat import SPARK_VERSION
    if SPARK_VERSION < (4, 0, 0):   # tests/unit/test_compat.py checks the error it gets
        pytest.skip("pyspark 3.5 ships no local Spark Connect server (remote='local[2]')")
    tmp = tmp_path_factory.mktemp("connect")
    out = tmp / "report.json"
    env = dict(os.environ, SPARK_CONF_DIR=str(ROOT / "conf" / "logging"),
               PYSPARK_PYTHON=sys.executable, PYTHONPATH=str(ROOT))
    env.pop("PYSPARK_GATEWAY_PORT", None)
    proc = subprocess.run([sys.executable, "-m", "tests.connect.connect_job", str(out),
                           str(tmp / "runs")], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("strategy", ["allreduce", "downpour", "downpour-sync", "gossip"])
def test_every_strategy_trains_from_a_connect_client(report, strategy):
    assert report["connect"] is True
    fit = report["fits"][strategy]
    assert "error" not in fit, fit["error"]
    assert [h["epoch"] for h in fit["history"]] == [1, 2, 3, 4]
    assert fit["history"][-1]["val_accuracy"] > 0.6            # 3 classes: chance is 1/3
    assert fit["history"][-1]["loss"] < fit["history"][0]["loss"]
    # live progress reached the client: one line per epoch, as the tasks reported them
    assert sum(line.startswith("epoch ") for line in fit["log"]) == 4, fit["log"]
    assert {"config.json", "history.csv", "model.pt", "metrics.jsonl"} <= set(fit["files"])


def test_a_task_error_reaches_a_connect_client_in_seconds(report):
    e = report["task_error"]
    assert "error" not in e, e["error"]
    assert e["zero"] and (e["task"], e["epoch"], e["step"]) == (1, 1, 3)
    assert "ZeroDivisionError: the user's model divided by zero" in e["message"]
    assert e["seconds"] < 15


def test_the_demo_inference_spark_ml_and_super_resolution_work_from_a_connect_client(report):
    for path in ("demo", "predict_udf", "ml", "superres"):
        assert "error" not in report[path], report[path]["error"]
    assert report["demo"]["rows"] == 3000 and report["demo"]["accuracy"] > 0.5
    assert report["predict_udf"]["equal"]
    assert report["ml"]["accuracy"] > 0.8 and report["ml"]["same_after_load"]
    sr = report["superres"]
    assert sr["patches"] > 0 and sr["report"]
    assert list(sr["skipped"]) == [next(k for k in sr["skipped"] if k.endswith("broken.png"))]
    assert "corrupt or unreadable image" in next(iter(sr["skipped"].values()))


def test_spark_dl_run_works_from_a_connect_client(report):
    run = report["run"]
    assert "error" not in run, run["error"]
    assert run["value"] == {"rank": 0, "world": 2, "rows": 96.0}
    assert '"rows": 96.0' in run["metrics"]
