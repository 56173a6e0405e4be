"""FSDP's memory rule (spark_dl.strategies.fsdp.memory) on models built on the meta device: the
figures per replica, the ResourceError that names the replicas that fit, and the planner of
``Downpour(partitions="auto")`` saying what FSDP would hold."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from spark_dl.errors import ResourceError
from spark_dl.models import FCNet, TransformerLM
from spark_dl.planning import cost_model
from spark_dl.planning.partitions import choose
from spark_dl.strategies.fsdp.memory import (
    MARGIN,
    check_memory,
    estimate,
    model_estimate,
    optimizer_slots,
)
from spark_dl.strategies.fsdp.units import wrap_units

MiB = 1 << 20


def meta(make):
    with torch.device("meta"):
        return make()


def two_layers():
    return nn.Sequential(nn.Linear(10, 6), nn.Linear(6, 4))


def test_the_rule_by_hand_on_two_linear_layers():
    net = meta(two_layers)
    units = wrap_units(net, None)
    assert units == ["1", "0"]
    est = estimate(net, units, itemsize=4, slots=2)           # float32, Adam
    assert (est.parameters, est.root, est.largest, est.buffers) == (94, 0, 66, 0)
    # replica 0's shard: ceil(rows / R) of every parameter
    assert est.shard(1) == 94 and est.shard(2) == 3 * 10 + 3 + 2 * 6 + 2
    assert est.shard(4) == 2 * 10 + 2 + 1 * 6 + 1
    parts = est.parts(2)
    assert parts["shards"] == 4 * (2 + 2) * 47                 # parameters, gradients, Adam's 2
    assert parts["gathered"] == 4 * 3 * 66                     # the largest unit, three times
    assert parts["result"] == 4 * 47 + 4 * 94                  # and the model gathered
    assert parts["need"] == parts["shards"] + parts["gathered"] + MARGIN
    # kept gathered from forward to backward: every unit, and the largest unit's gradient
    kept = estimate(net, units, 4, 2, reshard_after_forward=False)
    assert kept.parts(2)["gathered"] == 4 * (94 + 66)
    assert estimate(net, units, 8, 0).parts(1)["shards"] == 8 * 2 * 94     # float64, SGD


def test_optimizer_slots():
    assert [optimizer_slots("sgd"), optimizer_slots("sgd", 0.9), optimizer_slots("adam"),
            optimizer_slots("rmsprop"), optimizer_slots("adagrad")] == [0, 1, 2, 1, 1]
    with pytest.raises(ValueError, match="no state slots known for optimizer 'lbfgs'"):
        optimizer_slots("lbfgs")


def test_a_transformers_blocks_tied_weights_and_activations():
    def lm():
        return TransformerLM(vocab=512, layers=4, width=64, heads=2, context=16, tie=True)

    units, est = model_estimate(meta(lm), None, torch.float32, "adam", 0.0, shape=(16,),
                                batch_size=8)
    assert units[-1] == "pos" and "tok" not in units and "head" not in units
    block = sum(p.numel() for p in meta(lm).blocks[0].parameters())
    assert est.largest == block
    assert est.root == 512 * 64                   # the tied embedding and head: in the root, once
    assert est.parameters == sum(p.numel() for p in meta(lm).parameters())
    # the logits alone, (8, 16, 512) float32, held for backward and their gradient beside them
    assert est.activations >= 2 * 8 * 16 * 512 * 4
    _, unknown = model_estimate(meta(lm), None, torch.float32, "adam", 0.0)
    assert unknown.activations == 0 and unknown.parameters == est.parameters


def test_too_few_replicas_is_a_resource_error_naming_the_bytes_the_limit_and_the_fix():
    est = estimate(meta(lambda: FCNet((784, 2048, 2048, 10))), ["net.4", "net.2", "net.0"],
                   itemsize=4, slots=2)
    need1, need2 = est.need(1), est.need(2)
    assert need2 < need1
    limit = (need1 + need2) // 2
    check_memory(est, 2, limit, slots=2)                      # fits: nothing said
    with pytest.raises(ResourceError) as e:
        check_memory(est, 1, limit, slots=2)
    text = str(e.value)
    assert f"FSDP needs about {need1 / MiB:,.0f} MiB a replica over 1" in text
    assert f"may use {limit / MiB:,.0f} MiB (spark.executor.pyspark.memory" in text
    assert "It fits over 2 replicas" in text and "pass replicas=2 or more" in text
    assert est.replicas_needed(limit) == 2
    # more replicas than the cluster runs: say so
    tight = est.need(3)
    assert est.replicas_needed(tight) == 3
    with pytest.raises(ResourceError, match=r"replicas=3 or more \(the cluster runs 2 task\(s\) "
                                            r"at once: add executors"):
        check_memory(est, 1, tight, slots=2)
    # what no number of replicas divides: here the largest unit, gathered whole on each
    with pytest.raises(ResourceError, match="No number of replicas fits: every replica gathers "
                                            "the largest unit whole"):
        check_memory(est, 1, est.need(1 << 12) - 1, slots=2)
    # many small units: the whole model that replica 0 gathers to return it
    deep = meta(lambda: FCNet((784, *[512] * 8, 10)))
    est = estimate(deep, wrap_units(deep, None), itemsize=4, slots=2)
    with pytest.raises(ResourceError, match="No number of replicas fits: replica 0 gathers "
                                            "the whole model to return it"):
        check_memory(est, 1, est.need(1 << 12) - 1, slots=2)


def test_the_planner_says_what_fsdp_would_hold():
    link = cost_model.Link(t_lat=50e-6, t_data=1e-9)

    def pick(sizes, memory):
        return choose(lambda: FCNet(sizes), (784,), 16, cost_model.Cluster(4, memory, link),
                      "float32", "sgd", 0.9)

    small = pick((784, 480, 160, 10), 2 << 30)
    assert small.partitions == 1 and "nothing to split (nor to shard with FSDP)" in \
        small.explanation
    # deep and narrow: split in two, and FSDP would fit too (on the planner's basis: no
    # worker footprint)
    deep = pick((784, *[1024] * 8, 10), 80 << 20)
    assert deep.partitions == 2
    assert "FSDP over 4 replicas would hold" in deep.explanation
    assert "a replica: it fits" in deep.explanation
    # two wide layers: the column split holds a third of each; FSDP's replica 0 the whole
    # model at the end
    wide = pick((784, 4096, 4096, 10), 100 << 20)
    assert wide.partitions in (3, 4)
    assert "it does not fit at any number of replicas (every replica gathers the largest unit" \
        in wide.explanation
    with pytest.raises(ResourceError, match=r"no partitioning in \[1, 2, 3, 4\] fits.*FSDP "
                                            r"over 4 replicas would hold"):
        pick((784, 4096, 4096, 10), 30 << 20)
