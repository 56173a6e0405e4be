"""Slow tier: jobs submitted with spark-submit to local-cluster and to a standalone cluster."""

import json
import os
import re
import shutil
import socket
import subprocess

import numpy as np
import pytest

from spark_dl.data import distort_range, mnist_split

from ..conftest import MNIST_IMAGES, MNIST_LABELS, ROOT

pytestmark = pytest.mark.slow
PROBE = ROOT / "tests" / "cluster" / "partition_probe.py"


def _env():
    env = dict(os.environ, SPARK_LOCAL_IP="127.0.0.1",
               SPARK_CONF_DIR=str(ROOT / "conf" / "logging"))
    env.pop("PYSPARK_GATEWAY_PORT", None)
    return env


def _submit(venv_bin, *args, timeout=300):
    proc = subprocess.run([str(venv_bin / "spark-submit"), *map(str, args)], cwd=ROOT,
                          env=_env(), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc.stdout


def _check_probe(report, n=4000, partitions=4):
    parts = sorted(report["partitions"], key=lambda p: p["partition"])
    assert [p["partition"] for p in parts] == list(range(partitions))
    # Two executor JVMs, each of which processed partitions of its own.
    jvms = {p["jvm_pid"] for p in parts}
    assert len(jvms) == 2 and len({p["cwd"] for p in parts}) == 2
    # Each task trained on exactly the rows of its own partition: spark.range gives partition p
    # the ids [p*n/P, (p+1)*n/P), whose digits and labels only depend on the ids.
    (x, y), _ = mnist_split(MNIST_IMAGES, MNIST_LABELS)
    for p in parts:
        lo, hi = p["partition"] * n // partitions, (p["partition"] + 1) * n // partitions
        _, labels = distort_range(x, y, lo, hi, seed=0)
        assert p["rows"] == hi - lo and p["label_sum"] == int(labels.sum())
        assert p["last_loss"] < p["first_loss"]


def test_local_cluster_executors_train_on_their_own_partitions(venv_bin, tmp_path):
    out = tmp_path / "probe.json"
    _submit(venv_bin, "--properties-file", ROOT / "conf/spark/local-cluster.conf", PROBE, out)
    report = json.loads(out.read_text())
    assert report["master"] == "local-cluster[2,1,1024]"
    _check_probe(report)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def standalone(tmp_path):
    env = dict(_env(), SPARK_DL_MASTER_PORT=str(_free_port()),
               SPARK_DL_CLUSTER_DIR=str(tmp_path / "cluster"))
    script = ROOT / "scripts" / "standalone-cluster.sh"
    started = subprocess.run([str(script), "start"], env=env, capture_output=True, text=True,
                             timeout=240)
    assert started.returncode == 0, started.stderr[-4000:]
    try:
        yield started.stdout.strip().splitlines()[-1]
    finally:
        subprocess.run([str(script), "stop"], env=env, timeout=60)


@pytest.mark.cluster
def test_standalone_cluster_runs_the_demo_and_the_probe(venv_bin, standalone, tmp_path):
    # A relative shards_dir: executors work in their own directories, the path must be
    # resolved on the driver (against ROOT, the job's working directory).
    shards = f"work/test-standalone-{os.getpid()}"
    assert re.fullmatch(r"spark://127\.0\.0\.1:\d+", standalone)
    common = ["--master", standalone, "--properties-file", ROOT / "conf/spark/standalone.conf"]
    out = _submit(venv_bin, *common, ROOT / "jobs/demo.py", "--config",
                  ROOT / "conf/jobs/demo.toml", "--set", "data.extended_samples=3000",
                  "--set", f"data.shards_dir='{shards}'")
    assert "extended MNIST: 3000 distorted digits in 4 shards" in out
    acc = float(re.search(r"test accuracy \(cnn, last 2000 MNIST digits\): ([\d.]+)%", out)[1])
    assert 20 < acc <= 100                                # 3000 samples, one pass: well above 10%
    try:
        manifest = json.loads((ROOT / shards / "_manifest.json").read_text())
        assert manifest["rows"] == 3000 and len(list((ROOT / shards).glob("*.parquet"))) == 4
    finally:
        shutil.rmtree(ROOT / shards, ignore_errors=True)

    _submit(venv_bin, *common, PROBE, tmp_path / "probe.json")
    report = json.loads((tmp_path / "probe.json").read_text())
    assert report["master"] == standalone
    _check_probe(report)
