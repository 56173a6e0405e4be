"""The counting job (seed 002) on real Spark with a tiny config: scenes made in the executors,
MCNN trained with a strategy, held-out counts and the picture strip written."""

from __future__ import annotations

import json

import numpy as np
import pytest

from spark_dl.config import from_mapping
from spark_dl.data.counting import counting_scenes, scenes
from spark_dl.recipes.counting import CountingJobConfig, count_objects


def test_scenes_made_in_the_executors_are_the_drivers(spark):
    df = counting_scenes(spark, 6, size=32, partitions=2, seed=3, max_objects=8)
    rows = sorted(df.collect(), key=lambda r: r["count"])
    x, maps, counts = scenes(0, 6, seed=3, size=32, max_objects=8)
    got = {bytes(r.features): (np.array(r.label, np.float32), r["count"]) for r in rows}
    for i in range(6):
        m, c = got[x[i].tobytes()]
        assert c == counts[i] and np.allclose(m, maps[i])


@pytest.mark.parametrize("model,strategy", [("mcnn", "allreduce"),
                                            ("mcnn-deconv", {"name": "downpour",
                                                             "mode": "sync"})])
def test_count_objects_job_runs_tiny(spark, tmp_path, model, strategy):
    cfg = from_mapping(CountingJobConfig, {
        "data": {"n_train": 48, "n_test": 12, "size": 16, "max_objects": 6},
        "train": {"model": model, "strategy": strategy, "epochs": 2, "batch_size": 8},
        "run": {"out_dir": str(tmp_path)}})
    r = count_objects(cfg, log=None, spark=spark)
    assert r["replicas"] == 2 and len(r["history"]) == 2
    assert np.isfinite(r["mae"]) and r["rmse"] >= r["mae"]
    assert sum(b["scenes"] for b in r["bins"]) == 12
    assert (tmp_path / f"{model}-density.png").stat().st_size > 1000
    info = json.loads((tmp_path / f"{model}-{r['strategy']}" / "info.json").read_text())
    assert info["world"] == 2
