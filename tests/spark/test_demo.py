"""The README demo job, run in-process on the shared session with a small configuration."""

import importlib.util

from ..conftest import MNIST_IMAGES, MNIST_LABELS, ROOT


def _demo_module():
    spec = importlib.util.spec_from_file_location("demo_job", ROOT / "jobs" / "demo.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_demo_builds_shards_and_trains_one_pass(spark, tmp_path, capsys):
    result = _demo_module().main([
        "--config", str(ROOT / "conf/jobs/demo.toml"),
        "--set", f"data.images='{MNIST_IMAGES}'", "--set", f"data.labels='{MNIST_LABELS}'",
        "--set", "data.extended_samples=6000", "--set", "data.partitions=3",
        "--set", f"data.shards_dir='{tmp_path / 'shards'}'"], spark=spark)
    out = capsys.readouterr().out
    assert result["manifest"]["rows"] == 6000 and len(result["manifest"]["shards"]) == 3
    assert result["history"][0]["samples"] == 6000
    # one pass of 188 asynchronous steps; chance is 0.1. Where it ends depends on the order of
    # the two workers' pushes: 0.64-0.87 in 8 runs alone (2026-11-27), 0.47 once in a full run
    assert result["accuracy"] > 0.3
    assert "test accuracy (cnn, last 2000 MNIST digits)" in out


def test_demo_with_the_fc_net(spark, tmp_path):
    result = _demo_module().main([
        "--config", str(ROOT / "conf/jobs/demo.toml"),
        "--set", f"data.images='{MNIST_IMAGES}'", "--set", f"data.labels='{MNIST_LABELS}'",
        "--set", "data.extended_samples=3000", "--set", "train.model='fc'",
        "--set", f"data.shards_dir='{tmp_path / 'shards'}'"],
        spark=spark)
    assert result["accuracy"] > 0.5
