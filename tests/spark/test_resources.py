"""resources={"cpus": C, "gpus": G}: checked as each surface takes it, and refused in local mode
(which schedules no stage-level profile) with what to do, before any Spark job. The profile's
cores as the training tasks see them: tests/cluster/test_clusters.py (local-cluster)."""

from __future__ import annotations

import pytest

import spark_dl
from spark_dl import ConfigError, TrainConfig, fit
from spark_dl.ml import TorchEstimator
from spark_dl.resources import check_resources

from .test_allreduce import data, frame, small_fc


@pytest.mark.parametrize("bad, match", [
    ({}, r"resources must be None or a dict such as \{'cpus': 4, 'gpus': 1\}"),
    ([4, 1], r"resources must be None or a dict"),
    ({"cores": 4}, r"resources has no key 'cores'; its keys: 'cpus' .* and 'gpus'"),
    ({"cpus": 0}, r"resources\['cpus'\] must be an integer >= 1 \(cores per task\), got 0"),
    ({"cpus": 2.5}, r"resources\['cpus'\] must be an integer >= 1"),
    ({"gpus": -1}, r"resources\['gpus'\] must be a number >= 0"),
    ({"gpus": 1.5}, r"resources\['gpus'\] must be .* above 1 a whole number\), got 1.5"),
])
def test_bad_resources_are_named(bad, match):
    with pytest.raises(ConfigError, match=match):
        check_resources(bad)
    with pytest.raises(ConfigError, match=r"train\." + match):
        TrainConfig(strategy="allreduce", resources=bad)


def test_good_resources_and_a_job_file_s():
    for good in (None, {"cpus": 4}, {"gpus": 1}, {"cpus": 2, "gpus": 0.5}, {"gpus": 0}):
        check_resources(good)
    assert TrainConfig(strategy="allreduce", resources={"cpus": 2}).fit_options["resources"] \
        == {"cpus": 2}
    with pytest.raises(ConfigError, match="strategy 'single' runs none"):
        TrainConfig(resources={"cpus": 2})


def test_local_mode_refuses_a_stage_profile_before_any_job(spark, tmp_path):
    x, y = data(16, seed=8)
    df = frame(spark, x, y, [8, 8])
    want = (r"resources=\{'cpus': 2\} asks for a stage-level resource profile, which Spark "
            r"does not schedule in local mode \(master 'local\[2\]'.*leave resources=None.*"
            r"standalone \(local-cluster\[N,C,M\] on one machine\), YARN or Kubernetes")
    jobs = spark.sparkContext.statusTracker().getJobIdsForGroup()
    with pytest.raises(ConfigError, match=want):
        fit(df, small_fc, resources={"cpus": 2}, run_dir=tmp_path / "fit", log=None)
    with pytest.raises(ConfigError, match=want):
        spark_dl.run(lambda: 0, replicas=1, resources={"cpus": 2}, run_dir=tmp_path / "run",
                     log=None)
    with pytest.raises(ConfigError, match=want):
        TorchEstimator(model="fc", inputShape=[12], numClasses=3,
                       resources={"cpus": 2}).fit(df)
    assert spark.sparkContext.statusTracker().getJobIdsForGroup() == jobs
    assert not (tmp_path / "fit").exists() and not (tmp_path / "run").exists()
