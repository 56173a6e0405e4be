"""The ship segmentation job (seed 000) on real Spark with a tiny config: scenes made in the
executors, the U-Net trained by the boosting parameter server (keys of 2
mini-batches from the data-key scheduler, a push per key), held-out IoU / Dice / F2 and the picture written."""

from __future__ import annotations

import json

import numpy as np

from spark_dl.config import from_mapping
from spark_dl.data.ships import ship_batch, ship_scenes
from spark_dl.recipes.ships import ShipsJobConfig, mask_scores, segment_ships


def test_ship_scenes_made_in_the_executors_are_the_drivers(spark):
    rows = ship_scenes(spark, 5, size=32, partitions=2, seed=4).collect()
    x, m, s = ship_batch(0, 5, seed=4, size=32)
    got = {bytes(r.features): (np.array(r.label, np.float32), r.ships) for r in rows}
    for i in range(5):
        mask, ships = got[x[i].tobytes()]
        assert ships == s[i] and np.array_equal(mask, m[i].reshape(-1))


def test_segment_ships_job_runs_tiny_with_the_boosting_server(spark, tmp_path):
    cfg = from_mapping(ShipsJobConfig, {
        "data": {"n_train": 64, "n_test": 8, "size": 16},
        "train": {"epochs": 1, "widths": [4, 8, 16, 32]},
        "run": {"out_dir": str(tmp_path)}})
    r = segment_ships(cfg, log=None, spark=spark)
    assert r["strategy"] == "boosting" and r["replicas"] == 2
    assert 0 <= r["f2"] <= 1 and 0 <= r["iou"] <= 1
    # 64 rows in keys of 2 mini-batches of 8: one push per key, every key once
    info = json.loads((tmp_path / "unet-boosting" / "info.json").read_text())
    assert info["mode"] == "sequential" and info["n_push"] == 2 and info["keys"]["count"] == 4
    # the default rule (since 2026-11-29 evening): 2 workers carry fit's momentum 0.9, the
    # server steps at fit's rate and sends the look-ahead
    assert (info["staleness"], info["worker_momentum"], info["server_momentum"],
            info["server_rate"], info["look_ahead"]) == ("dana", 0.9, 0.0, 1.0, True)
    assert [sorted(k for k, _ in ep) for ep in info["keys"]["served"]] == \
        [list(range(info["keys"]["count"]))]
    assert info["server"]["versions"] == [info["keys"]["count"]]
    assert (tmp_path / "unet-masks.png").stat().st_size > 500


def test_mask_scores():
    truth = np.zeros((2, 8, 8), np.float32)
    truth[0, 2:4, 2:4] = 1
    prob = np.zeros((2, 8, 8), np.float32)
    prob[0, 2:4, 2:4] = 0.9
    s = mask_scores(prob, truth)
    assert s == {"iou": 1.0, "dice": 1.0, "f2": 1.0, "empty_correct": 1.0}
