"""Mixed precision in every strategy (amp="bf16" on the CPU here; fp16 with loss scaling):
float32 master weights, training that goes down, and Downpour's wire in bfloat16 (half the
bytes) by default with amp."""

from __future__ import annotations

import pytest
import torch

from spark_dl import AllReduce, Downpour, Gossip, fit
from spark_dl.errors import ConfigError
from spark_dl.models.fc import FCNet

from .test_allreduce import data, frame, small_fc


def wide_fc():
    return FCNet((12, 200, 3), act="sigmoid")


def test_downpour_bf16_sends_half_the_bytes(spark, tmp_path):
    x, y = data(192, seed=11)
    df = frame(spark, x, y, [96, 96])
    runs = {amp: fit(df, wide_fc, strategy=Downpour(amp=amp), batch_size=8, epochs=2, lr=0.5,
                     run_dir=tmp_path / str(amp), log=None) for amp in (None, "bf16")}
    full, half = (runs[a].info["server"] for a in (None, "bf16"))
    # 3,203 parameters: each push and pull carries 12.8 kB in float32, 6.4 kB in bfloat16
    assert 0.45 < half["bytes_in"] / full["bytes_in"] < 0.55
    assert 0.45 < half["bytes_out"] / full["bytes_out"] < 0.55
    for res in runs.values():
        assert all(p.dtype == torch.float32 for p in res.model.parameters())
        assert res.history[-1]["loss"] < res.history[0]["loss"]


@pytest.mark.parametrize("strategy,replicas", [
    (Downpour(amp="bf16", partitions=2), 1),          # a model-parallel replica
    (Downpour(amp="fp16", mode="sync"), 2),
    (Gossip(amp="bf16", alpha=0.5), 2),
    (AllReduce(amp="bf16", balance="speed"), 2),
])
def test_amp_trains_in_every_strategy(spark, tmp_path, strategy, replicas):
    x, y = data(192, seed=12)
    res = fit(frame(spark, x, y, [96, 96]), small_fc, strategy=strategy, replicas=replicas,
              batch_size=8, epochs=3, lr=0.5, run_dir=tmp_path / "run", log=None)
    assert all(p.dtype == torch.float32 for p in res.model.parameters())
    assert res.history[-1]["loss"] < 0.9 * res.history[0]["loss"]


def test_amp_options_are_checked(spark, tmp_path):
    x, y = data(32)
    df = frame(spark, x, y, [16, 16])
    for cls in (AllReduce, Downpour, Gossip):
        with pytest.raises(ConfigError, match="amp must be one of None, 'bf16', 'fp16'"):
            cls(amp="int8")
        with pytest.raises(ConfigError, match="use dtype='float32' with amp"):
            fit(df, small_fc, strategy=cls(amp="bf16"), dtype="float64", log=None,
                run_dir=tmp_path / cls.__name__)
    with pytest.raises(ConfigError, match=r"use amp='bf16' \(no loss scaling\) with partitions"):
        Downpour(amp="fp16", partitions=2)
    with pytest.raises(ConfigError, match=r"use model_parallel=.collective. with amp"):
        fit(df, small_fc, strategy=Downpour(amp="bf16", partitions=2, model_parallel="master"),
            replicas=1, log=None, run_dir=tmp_path / "thesis")
