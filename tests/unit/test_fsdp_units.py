"""FSDP's units (spark_dl.strategies.fsdp.units): which blocks of a model are sharded on their
own, on models built on the meta device; the devices their shards may live on."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from spark_dl.errors import ConfigError
from spark_dl.models import ThesisCNN, TransformerLM
from spark_dl.strategies.fsdp.units import wrap_units


def meta(make):
    with torch.device("meta"):
        return make()


def test_the_default_takes_a_transformers_blocks_and_leaves_tied_weights_to_the_root():
    blocks = ["blocks.3", "blocks.2", "blocks.1", "blocks.0"]
    assert wrap_units(meta(TransformerLM), None) == ["head", "ln", *blocks, "pos", "tok"]
    # the head shares the token embedding's weights: both stay in the root
    assert wrap_units(meta(lambda: TransformerLM(tie=True)), None) == ["ln", *blocks, "pos"]
    assert wrap_units(meta(TransformerLM), ("_Block",)) == blocks
    assert wrap_units(meta(TransformerLM), lambda m: isinstance(m, nn.LayerNorm))[-1] == \
        "blocks.0.ln1"                           # the inner before the outer, the first last
    with pytest.raises(ConfigError, match="shares a parameter between tok and head"):
        wrap_units(meta(lambda: TransformerLM(tie=True)), ("Embedding", "Linear"))


def test_a_policy_may_not_name_a_container():
    listed = nn.Module()
    listed.blocks = nn.ModuleList([nn.Linear(2, 2)])
    with pytest.raises(ConfigError, match=r"blocks \(ModuleList\), which has no forward"):
        wrap_units(listed, ("ModuleList",))
    assert wrap_units(listed, None) == ["blocks.0"]
    assert wrap_units(meta(ThesisCNN), ("Sequential",)) == ["features"]


def test_replicas_that_share_a_gpu_or_mix_devices_are_refused():
    """What the tasks reported of their devices (runtime.stage's statuses): each replica's
    shards on a device of its own, or a ResourceError naming the replicas and the fix."""
    from spark_dl.errors import ResourceError
    from spark_dl.strategies.fsdp.task import check_devices

    def on(*devices):
        return [{"machine": m, "device": d} for m, d in devices]
    check_devices(on(("a", "cpu"), ("a", "cpu")))
    check_devices(on(("a", "cuda:0"), ("a", "cuda:1"), ("b", "cuda:0")))
    with pytest.raises(ResourceError, match=r"replicas \[0, 2\] share cuda:0 .*a GPU of its "
                                            r"own .*or train with AllReduce"):
        check_devices(on(("a", "cuda:0"), ("a", "cuda:1"), ("a", "cuda:0")))
    with pytest.raises(ResourceError, match=r"replica\(s\) \[1\] run on the CPU"):
        check_devices(on(("a", "cuda:0"), ("b", "cpu")))
