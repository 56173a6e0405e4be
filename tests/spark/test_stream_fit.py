"""Every engine trains from streamed shards (spilled to Spark's local dir) on real Spark."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from spark_dl import Downpour, fit
from spark_dl.data import pixels_to_arrow
from spark_dl.data.mnist import PIXEL_SCHEMA
from spark_dl.errors import ConfigError
from spark_dl.models.fc import FCNet


def pixel_frame(spark, x, y, partitions=2):
    """uint8 images (n, 64) as a binary column, ``partitions`` consecutive slices."""
    bounds = np.linspace(0, len(x), partitions + 1).astype(int)

    def rows(batches):
        for b in batches:
            for i in b.column("id").to_numpy():
                for lo in range(bounds[i], bounds[i + 1], 100):  # several Arrow batches
                    hi = min(lo + 100, bounds[i + 1])
                    yield pixels_to_arrow(x[lo:hi], y[lo:hi])
    return spark.range(partitions, numPartitions=partitions).mapInArrow(rows, PIXEL_SCHEMA)


def pixel_data(n, seed=0):
    g = np.random.default_rng(seed)
    x = g.integers(0, 256, (n, 64), dtype=np.uint8)
    y = (x[:, :4].astype(np.int64).argmax(1)).astype(np.int64)
    return x, y


def net():
    return FCNet((64, 16, 4), act="relu")


def _state(res):
    return {k: v.clone() for k, v in res.model.state_dict().items()}


def test_allreduce_streamed_equals_in_memory_and_a_small_buffer_still_learns(spark, tmp_path):
    x, y = pixel_data(1200)
    df = pixel_frame(spark, x, y)
    common = dict(strategy="allreduce", optimizer="sgd", lr=0.1, momentum=0.9, epochs=3,
                  batch_size=32, seed=3, progress=False, log=None, lr_scaling=None,
                  validation=(x[:300].astype(np.float32) / 255, y[:300]))
    mem = fit(df, net, data="memory", run_dir=tmp_path / "memory", **common)
    whole = fit(df, net, data="stream", shuffle_buffer=10_000, run_dir=tmp_path / "whole",
                **common)
    assert mem.info["data"] == ["memory", "memory"] and whole.info["data"] == ["stream"] * 2
    # the buffer holds the whole shard: the same batches, so the same model, bit for bit
    a, b = _state(mem), _state(whole)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert [h["loss"] for h in mem.history] == [h["loss"] for h in whole.history]
    small = fit(df, net, data="stream", shuffle_buffer=100, run_dir=tmp_path / "small",
                **common)
    assert small.info["rows_per_replica"] == [600, 600]
    assert small.history[-1]["loss"] < 0.8 * small.history[0]["loss"]
    assert abs(small.history[-1]["val_accuracy"] - mem.history[-1]["val_accuracy"]) < 0.1


@pytest.mark.compat
def test_transform_decodes_every_batch_in_the_tasks(spark, tmp_path):
    """A transform that inverts the pixels trains exactly like the inverted data."""
    x, y = pixel_data(400, seed=1)
    common = dict(strategy="allreduce", lr=0.05, epochs=1, batch_size=25, seed=0,
                  progress=False, log=None, data="stream")

    def invert(xb, yb):
        return torch.from_numpy(1.0 - xb.astype(np.float32) / 255), torch.from_numpy(yb)
    via = fit(pixel_frame(spark, x, y), net, transform=invert, run_dir=tmp_path / "t", **common)
    direct = fit(pixel_frame(spark, 255 - x, y), net, run_dir=tmp_path / "d", **common)
    a, b = _state(via), _state(direct)
    assert all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)
    with pytest.raises(TypeError, match="transform must be a function"):
        fit(pixel_frame(spark, x, y), net, transform="invert", log=None)
    with pytest.raises(ConfigError, match="data must be one of auto, memory, stream"):
        fit(pixel_frame(spark, x, y), net, data="disk", log=None)
    with pytest.raises(ConfigError, match="shuffle_buffer"):
        fit(pixel_frame(spark, x, y), net, shuffle_buffer="huge", log=None)


@pytest.mark.parametrize("partitions", [1, 2])
def test_downpour_and_model_parallel_replicas_train_from_streamed_shards(spark, tmp_path,
                                                                        partitions):
    x, y = pixel_data(800, seed=2)
    replicas = 2 // partitions
    res = fit(pixel_frame(spark, x, y, 2), net,
              strategy=Downpour(partitions=partitions,
                                mode="sequential" if partitions > 1 else "async"),
              replicas=replicas, optimizer="adam", lr=1e-2, epochs=4, batch_size=20,
              data="stream", shuffle_buffer=120, progress=False, log=None, run_dir=tmp_path / "dp",
              validation=(x[:200].astype(np.float32) / 255, y[:200]))
    assert {w["data"] for w in res.info["workers"]} == {"stream"}
    assert res.info["total_rows"] == 800
    assert res.history[-1]["loss"] < 0.95 * res.history[0]["loss"]
    assert res.history[-1]["val_accuracy"] > 0.4                       # chance: 0.25
