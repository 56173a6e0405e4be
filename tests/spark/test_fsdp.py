"""FSDP on real Spark (local[2]) with real gloo process groups and torch's fully_shard: the
replicas hold shards of one model and step AllReduce's update."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pyarrow as pa
import pytest
import torch
from torch import nn

from spark_dl import FSDP, AllReduce, fit
from spark_dl.errors import ConfigError
from spark_dl.models import ThesisCNN

from .test_allreduce import assert_same_weights, data, frame, small_fc

KW = dict(batch_size=8, lr=0.1, shuffle=False, dtype="float64", lr_scaling=None, log=None,
          shape=(1, 28, 28), num_classes=10)


def cnn():
    return ThesisCNN(batch_norm=True)


def digits(n, seed=0):
    g = np.random.default_rng(seed)
    x = g.normal(size=(n, 784)).astype(np.float32)
    y = (x[:, :10].argmax(1)).astype(np.int64)
    return x, y


def test_fsdp_steps_allreduces_update_and_resumes_from_its_shards(spark, tmp_path):
    """SGD with momentum on the same shards (unequal: the short one idles its last step) and
    seeds: the weights gathered from the shards are AllReduce's, BatchNorm's running
    statistics too, and the validation on every replica reports AllReduce's figures. A fit
    resumed from the shards of its first epoch goes on as an uninterrupted one, and on one
    replica (the shards of two resharded) as AllReduce's resumed on one."""
    x, y = digits(88)
    df, one = frame(spark, x, y, [48, 40]), frame(spark, x, y, [88])
    kw = dict(KW, momentum=0.9, validation=digits(30, seed=1))
    cut, ar = tmp_path / "cut", tmp_path / "allreduce"
    sharded = fit(df, cnn, strategy=FSDP(), epochs=1, run_dir=cut, **kw)
    synced = fit(df, cnn, strategy=AllReduce(average=0), epochs=1, run_dir=ar, **kw)
    assert_same_weights(sharded.model, synced.model)
    info = sharded.info
    assert info["units"] == ["classifier", "features.9", "features.8", "features.5",
                             "features.4", "features.1", "features.0"]   # convs, BatchNorms
    assert info["world"] == 2
    assert info["steps_per_epoch"] == 6
    assert [h["samples"] for h in sharded.history] == [88]
    for key in ("loss", "val_loss", "val_accuracy"):
        assert sharded.history[0][key] == pytest.approx(synced.history[0][key], abs=1e-9)
    assert info["validated_by"] == "2 replicas, all the rows each"
    memory = info["memory_per_replica"]
    assert len(memory) == 2 and all(m["peak_rss_mb"] > 0 for m in memory)
    assert [m["idle_steps"] for m in memory] == [0, 1]      # 40 rows: 5 batches of 8, not 6
    whole_mb = sum(p.numel() for p in cnn().parameters()) * 8 / 2**20
    assert info["model_parameters_mb"] == pytest.approx(whole_mb)
    assert sum(m["parameters_mb"] for m in memory) == pytest.approx(whole_mb)
    assert all(m["parameters_mb"] < whole_mb * 0.6 for m in memory)      # about half each
    # the driver's estimate: replica 0's shards as FSDP cut them (parameters, gradients,
    # momentum), the worker before the model measured; no cap in local mode
    estimate = info["memory_estimate"]
    assert estimate["limit_mb"] is None and estimate["optimizer_slots"] == 1
    assert estimate["shards_mb"] == pytest.approx(
        memory[0]["parameters_mb"] + memory[0]["gradients_mb"] + memory[0]["optimizer_mb"])
    assert all(0 < m["start_rss_mb"] <= m["peak_rss_mb"] for m in memory)
    # the checkpoint: each replica's shards, no model in checkpoint.pt; the result whole
    ckpt = torch.load(cut / "checkpoint.pt", weights_only=True)
    assert "model" not in ckpt and "optimizer" not in ckpt
    assert sorted(os.listdir(cut / "checkpoint-fsdp" / "epoch-1")) == \
        [".metadata", "__0_0.distcp", "__1_0.distcp"]
    # replica 0 wrote the model gathered whole into the run directory, which the driver read
    assert info["model_via"] == "run directory" and "model_file" not in info
    saved = torch.load(cut / "model.pt", weights_only=True)
    assert {k: v.shape for k, v in saved.items()} == \
        {k: v.shape for k, v in cnn().state_dict().items()}

    shutil.copytree(cut, tmp_path / "fewer")
    again = fit(df, cnn, strategy=FSDP(), epochs=2, run_dir=cut, **kw)
    whole = fit(df, cnn, strategy=FSDP(), epochs=2, run_dir=tmp_path / "whole", **kw)
    assert again.info["resumed_from_epoch"] == 1
    assert_same_weights(again.model, whole.model)
    assert again.history == [{**h, "seconds": again.history[i]["seconds"],
                              "samples_per_s": again.history[i]["samples_per_s"]}
                             for i, h in enumerate(whole.history)]
    assert sorted(os.listdir(cut / "checkpoint-fsdp")) == ["epoch-1", "epoch-2"]

    fewer = fit(one, cnn, strategy=FSDP(), epochs=2, replicas=1, run_dir=tmp_path / "fewer",
                **kw)
    alone = fit(one, cnn, strategy=AllReduce(average=0), epochs=2, replicas=1, run_dir=ar,
                **kw)
    assert fewer.info["resumed_from_epoch"] == 1 and fewer.info["world"] == 1
    assert_same_weights(fewer.model, alone.model)
    assert fewer.history[1]["val_loss"] == pytest.approx(alone.history[1]["val_loss"],
                                                         abs=1e-9)


def test_fsdp_gives_allreduces_weights_on_the_transformer(spark, tmp_path):
    """The zoo's transformer (two blocks, tied head) on token ids in float64, SGD with
    momentum, unequal shards: FSDP's weights are AllReduce's (<= 1e-9)."""
    from spark_dl.models import build_model
    T, V = 8, 11
    g = np.random.default_rng(3)
    ids = g.integers(0, V, size=(40, T + 1))
    rows = [([int(v) for v in r[:-1]], [int(v) for v in r[1:]]) for r in ids]
    bounds = [0, 24, 40]

    def shard(batches):
        for b in batches:
            for i in b.column("id").to_numpy():
                part = rows[bounds[i]:bounds[i + 1]]
                typed = pa.list_(pa.int32())
                yield pa.RecordBatch.from_pydict(
                    {"features": pa.array([r[0] for r in part], typed),
                     "label": pa.array([r[1] for r in part], typed)})
    df = spark.range(2, numPartitions=2).mapInArrow(
        shard, "features array<int>, label array<int>")

    def lm():
        return build_model("transformer", vocab=V, layers=2, width=16, heads=2, context=T,
                           dropout=0.0, tie=True)
    kw = dict(KW, shape=(T,), label_shape=(T,), num_classes=None, momentum=0.9, epochs=1,
              loss="sequence_cross_entropy")
    sharded = fit(df, lm, strategy=FSDP(), run_dir=tmp_path / "fsdp", **kw)
    synced = fit(df, lm, strategy=AllReduce(average=0), run_dir=tmp_path / "ar", **kw)
    assert sharded.info["units"] == ["ln", "blocks.1", "blocks.0", "pos"]
    assert [m["idle_steps"] for m in sharded.info["memory_per_replica"]] == [0, 1]
    assert_same_weights(sharded.model, synced.model)
    assert sharded.history[0]["loss"] == pytest.approx(synced.history[0]["loss"], abs=1e-9)


def test_a_barrier_stage_reads_an_rdd_union_through_a_shuffle(spark):
    """Spark refuses a barrier stage over union()'s or coalesce()'s RDDs; a DataFrame made
    of such an RDD is repartitioned first, as one whose plan unions is."""
    from spark_dl.strategies.base import _narrow_merges
    sc = spark.sparkContext
    assert _narrow_merges(sc.parallelize([(1,)], 1).union(sc.parallelize([(2,)], 1))
                          .toDF("a long"))
    assert _narrow_merges(sc.parallelize([(1,), (2,)], 2).coalesce(1).toDF("a long"))
    assert _narrow_merges(spark.range(2).union(spark.range(3)))
    assert not _narrow_merges(sc.parallelize([(1,), (2,)], 2).toDF("a long"))
    assert not _narrow_merges(spark.range(4))


def test_bf16_parameters_a_class_policy_adam_and_the_cut_train(spark, tmp_path):
    """bf16 parameters gathered, float32 reduced and stepped; Adam's state in the shards; the
    scaled rate's relative cut on the global norm of the shards' gradients."""
    x, y = data(96, seed=2)
    res = fit(frame(spark, x, y, [48, 48]), small_fc, optimizer="adam", lr=0.05, epochs=2,
              strategy=FSDP(wrap=["Linear"], reshard_after_forward=False, amp="bf16"),
              batch_size=8, shuffle=False, log=None, run_dir=tmp_path / "run")
    assert res.info["units"] == ["net.2", "net.0"] and res.info["amp"] == "bf16"
    assert res.history[1]["loss"] < res.history[0]["loss"]
    assert next(res.model.parameters()).dtype == torch.float32
    assert res.info["grad_clip"]["rule"].startswith("relative")
    assert res.info["grad_clip"]["steps"] == 12


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
        self.b.weight = self.a.weight

    def forward(self, x):
        return self.b(self.a(x))


@pytest.mark.parametrize("strategy,model,fix", [
    (FSDP(wrap=["Block"]), cnn, ("does not hold; its module classes: AvgPool2d, BatchNorm2d, "
                                 "Conv2d, Linear, ReLU, Sequential, ThesisCNN")),
    (FSDP(wrap=["ReLU"]), cnn, "matches no module of ThesisCNN that holds parameters"),
    (FSDP(wrap=lambda m: False), cnn, "matches no module"),
    (FSDP(), lambda: nn.Sequential(nn.ReLU()), "has none"),
    (FSDP(wrap=["Linear"]), Tied, "shares a parameter between a and b"),
])
def test_bad_models_and_policies_name_the_fix(spark, strategy, model, fix):
    x, y = digits(8)
    with pytest.raises(ConfigError, match=fix):
        fit(frame(spark, x[:, :4], y % 4, [4, 4]), model, strategy=strategy, log=None)


def test_too_few_replicas_for_the_python_workers_memory_is_refused_before_any_task(spark,
                                                                                   tmp_path):
    """spark.executor.pyspark.memory between what a replica needs at 1 and at 2 replicas (the
    session's conf: local mode does not enforce it): the fit at 1 stops on the driver with a
    ResourceError naming the bytes, the limit and the 2 replicas that fit."""
    from spark_dl.errors import ResourceError
    from spark_dl.models import FCNet
    from spark_dl.strategies.fsdp.memory import model_estimate

    def net():
        return FCNet((784, 512, 512, 10))

    with torch.device("meta"):
        _, est = model_estimate(net(), None, torch.float64, "adam", 0.0, shape=(784,),
                                batch_size=8)
    limit_kib = (est.need(1) + est.need(2)) // 2 >> 10
    x, y = digits(16)
    conf = spark.conf
    conf.set("spark.sql.legacy.setCommandRejectsSparkCoreConfs", "false")
    conf.set("spark.executor.pyspark.memory", f"{limit_kib}k")
    try:
        with pytest.raises(ResourceError, match=r"FSDP needs about .* a replica over 1: .*"
                                                r"It fits over 2 replicas .*pass replicas=2"):
            fit(frame(spark, x, y, [8, 8]), net, strategy=FSDP(), replicas=1,
                optimizer="adam", run_dir=tmp_path / "run", **dict(KW, shape=(784,)))
    finally:
        conf.unset("spark.executor.pyspark.memory")
        conf.unset("spark.sql.legacy.setCommandRejectsSparkCoreConfs")
    assert not (tmp_path / "run").exists()                  # refused before the run began


def test_bad_options_name_the_fix(spark):
    with pytest.raises(ConfigError, match=r"no option 'average'.*AllReduce"):
        FSDP(average=0.1)
    with pytest.raises(ConfigError, match="'bf16'"):
        FSDP(amp="fp16")
    with pytest.raises(ConfigError, match="wrap must be"):
        FSDP(wrap=3)
    x, y = digits(8)
    with pytest.raises(ConfigError, match="searches along a line"):
        fit(frame(spark, x, y, [4, 4]), cnn, strategy=FSDP(), optimizer="lbfgs", **KW)
