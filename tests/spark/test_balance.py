"""Speed-proportional batches in the all-reduce engine (AllReduce(balance=...)) on real Spark:
unequal batches give the full-batch gradient, the split follows measured speeds, and an
adaptive fit moves rows away from a replica slowed down mid-fit."""

from __future__ import annotations

import itertools
import os

import numpy as np
import pytest
import torch

from spark_dl import AllReduce, fit
from spark_dl.errors import ConfigError

from .test_allreduce import assert_same_weights, data, frame, small_fc


def reference_wrapped(x, y, splits, shares, steps, epochs, lr, momentum):
    """Single-process SGD where step s trains on the union of every replica's rows of that
    step: replica p takes shares[p] rows at a time from its split, in order, wrapping around,
    from its first row again each epoch (shuffle=False). ``splits``: each replica's row count
    (consecutive rows), or the list of its row indices."""
    torch.manual_seed(0)
    model = small_fc().double()
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    if all(isinstance(n, int) for n in splits):
        bounds = np.cumsum([0] + list(splits))
        splits = [np.arange(lo, hi) for lo, hi in itertools.pairwise(bounds)]
    xt, yt = torch.from_numpy(x.astype(np.float64)), torch.from_numpy(y)
    for _ in range(epochs):
        for s in range(steps):
            idx = np.concatenate([rows[(s * b + np.arange(b)) % len(rows)]
                                  for rows, b in zip(splits, shares)])
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(xt[idx]), yt[idx]).backward()
            opt.step()
    return model


def test_fixed_shares_train_as_one_process_on_the_global_batch(spark, tmp_path):
    x, y = data(96, seed=5)
    res = fit(frame(spark, x, y, [48, 48]), small_fc, strategy=AllReduce(balance=[1, 3]),
              batch_size=16, epochs=2, lr=0.5, momentum=0.9, shuffle=False, dtype="float64",
              lr_scaling=None, run_dir=tmp_path / "run", log=None)
    # global batch 2 x 16 = 32 split 1:3; an epoch is 96 / 32 = 3 steps. The shards become
    # 24 : 72 rows first: replica 0 lends its last 24 rows to replica 1, which appends them
    # to its own 48; then every epoch is exactly one pass over the 96 rows
    bal = res.info["balance"]
    assert bal["first_split"] == [8, 24] and bal["rows"] == "move"
    assert res.info["steps_per_epoch"] == 3
    assert [h["balance"]["batches"] for h in res.history] == [[8, 24], [8, 24]]
    assert [h["balance"]["rows"] for h in res.history] == [[24, 72], [24, 72]]
    assert [h["samples"] for h in res.history] == [96, 96]
    shards = [np.arange(0, 24), np.concatenate([np.arange(48, 96), np.arange(24, 48)])]
    assert_same_weights(res.model, reference_wrapped(x, y, shards, [8, 24], 3, 2, 0.5, 0.9))
    # balance_rows="wrap": nothing moves, replica 1 goes round its 48 rows 1.5 times an epoch
    wrap = fit(frame(spark, x, y, [48, 48]), small_fc,
               strategy=AllReduce(balance=[1, 3], balance_rows="wrap"), batch_size=16,
               epochs=2, lr=0.5, momentum=0.9, shuffle=False, dtype="float64",
               lr_scaling=None, run_dir=tmp_path / "wrap", log=None)
    assert [h["balance"]["rows"] for h in wrap.history] == [[48, 48], [48, 48]]
    assert_same_weights(wrap.model, reference_wrapped(x, y, [48, 48], [8, 24], 3, 2, 0.5, 0.9))


def test_speed_balance_profiles_every_replica(spark, tmp_path):
    x, y = data(400, seed=6)
    res = fit(frame(spark, x, y, [200, 200]), small_fc,
              strategy=AllReduce(balance="speed", max_batch=40), batch_size=20, epochs=2,
              lr=0.3, run_dir=tmp_path / "run", log=None)
    bal = res.info["balance"]
    assert bal["mode"] == "speed" and bal["global_batch"] == 40
    assert sum(bal["first_split"]) == 40 and min(bal["first_split"]) >= 1
    for rep in bal["replicas"]:
        assert rep["rows"] == 200 and rep["cap"] == 40            # max_batch under the memory
        assert rep["c_s_per_sample"] > 0 and rep["samples_per_s_at_batch"] > 0
        assert rep["bytes_per_sample"] > 12 * 4
    for h in res.history:
        assert h["balance"]["batches"] == bal["first_split"]     # "speed": split once
        assert len(h["balance"]["step_s"]) == 2 and min(h["balance"]["step_s"]) > 0
        assert h["samples"] == 400


def test_balance_options_are_checked_on_the_driver(spark, tmp_path):
    x, y = data(40)
    df = frame(spark, x, y, [20, 20])
    with pytest.raises(ConfigError, match="'speed', 'adaptive' or a list"):
        AllReduce(balance="fastest")
    with pytest.raises(ConfigError, match="3 shares but the fit has 2 replicas"):
        fit(df, small_fc, strategy=AllReduce(balance=[1, 1, 1]), log=None,
            run_dir=tmp_path / "a")
    with pytest.raises(ConfigError, match="balance_rows must be one of 'move', 'wrap'"):
        AllReduce(balance="speed", balance_rows="shuffle")
    with pytest.raises(ConfigError, match="max_batch=4 rows per replica cannot hold"):
        fit(df, small_fc, strategy=AllReduce(balance="speed", max_batch=4), batch_size=8,
            log=None, run_dir=tmp_path / "b")


def slowed_cnn(flag: str, extra: int = 20):
    """A factory of the thesis CNN whose replica 1, once ``flag`` exists, runs ``extra``
    more forward passes (without gradients) before each training step's own: a slowdown of
    about 1 + extra / 3 (a backward costs about two forwards) that is part of the work itself,
    so it is as large on a busy machine as on an idle one."""
    def factory():
        from pyspark import TaskContext

        from spark_dl.models import build_model
        net = build_model("cnn")
        ctx = TaskContext.get()
        if ctx is None or ctx.partitionId() != 1:
            return net

        def hook(module, inputs):
            if module.training and os.path.exists(flag):
                with torch.no_grad():
                    for _ in range(extra):
                        module.forward(*inputs)
        net.register_forward_pre_hook(hook)
        return net
    return factory


def test_adaptive_balance_moves_rows_from_a_replica_slowed_mid_fit(spark, mnist, tmp_path):
    images, labels = mnist
    n = 1500
    x = images[:n].reshape(n, -1).astype(np.float32) / 255
    run = tmp_path / "run"
    # replica 1 slows down about 4x once epoch 1's checkpoint is written
    res = fit(frame(spark, x, labels[:n], [n // 2, n // 2]),
              slowed_cnn(str(run / "checkpoint.pt"), extra=10),
              strategy=AllReduce(balance="adaptive"),
              shape=(1, 28, 28), num_classes=10, batch_size=32, epochs=4, lr=0.05,
              momentum=0.9, run_dir=run, log=None)
    splits = [h["balance"]["batches"] for h in res.history]
    times = [h["balance"]["step_s"] for h in res.history]
    assert all(sum(s) == 64 for s in splits)
    # epoch 2 ran slowed: replica 1's compute per row is clearly longer than replica 0's ...
    per_row = [t[1] / s[1] / (t[0] / s[0]) for s, t in zip(splits, times)]
    assert per_row[1] > 1.4, (splits, times)
    # ... so epochs 3 and 4 give replica 0 the larger share
    assert all(s[0] > 1.25 * s[1] for s in splits[2:]), (splits, times)
    # the shards follow the split: rows moved to replica 0 when it got the larger share
    from spark_dl.balance import row_targets
    assert all(h["balance"]["rows"] == row_targets(n, h["balance"]["batches"])
               for h in res.history)
    assert res.history[-1]["samples"] == n + 64 - n % 64 and \
        res.info["steps_per_epoch"] == 24


def test_uneven_column_widths_train_as_one_process(spark, tmp_path):
    """Downpour(partitions=2, widths=[2, 1]): partition 0 holds two thirds of every layer's
    columns (a task twice as fast), and the replica still computes single-process SGD."""
    from spark_dl import Downpour

    from .test_allreduce import reference_epochs
    x, y = data(40, seed=12)
    res = fit(frame(spark, x, y, [24, 16]), small_fc,
              strategy=Downpour(partitions=2, widths=[2, 1], wire_dtype="float64"),
              replicas=1, batch_size=8, epochs=2, lr=0.5, momentum=0.9, shuffle=False,
              dtype="float64", run_dir=tmp_path / "run", log=None)
    assert_same_weights(res.model, reference_epochs(x, y, [24, 16], 8, 2, 0.5, 0.9))
    # 12-9-3: layer 1's 9 units as 6 + 3, layer 2's 3 as 2 + 1 (weights and biases)
    assert res.info["model_parallel"]["parameters_per_partition"] == [6 * 13 + 2 * 10,
                                                                      3 * 13 + 1 * 10]
    assert res.info["model_parallel"]["widths"] == [2.0, 1.0]
    with pytest.raises(ConfigError, match="give partitions=F > 1 and F shares"):
        Downpour(partitions=2, widths=[1, 1, 1])


def test_sync_parameter_server_rounds_split_the_batch_too(spark, tmp_path):
    """Downpour(mode="sync", balance=[1, 3]): every round the server averages the workers'
    gradients weighted by samples, 8 and 24 rows: single-process SGD on the union."""
    from spark_dl import Downpour
    x, y = data(96, seed=5)
    res = fit(frame(spark, x, y, [48, 48]), small_fc,
              strategy=Downpour(mode="sync", balance=[1, 3], wire_dtype="float64"),
              batch_size=16, epochs=2, lr=0.5, momentum=0.9, shuffle=False, dtype="float64",
              lr_scaling=None, run_dir=tmp_path / "run", log=None)
    assert res.info["balance"] == [8, 24]
    assert res.info["server"]["versions"] == [6]                  # 2 epochs x 96 / 32 rounds
    assert_same_weights(res.model, reference_wrapped(x, y, [48, 48], [8, 24], 3, 2, 0.5, 0.9))
    speed = fit(frame(spark, x, y, [48, 48]), small_fc,
                strategy=Downpour(mode="sync", balance="speed"), batch_size=16, epochs=1,
                lr=0.5, run_dir=tmp_path / "speed", log=None)
    assert sum(speed.info["balance"]) == 32 and min(speed.info["balance"]) >= 1
    with pytest.raises(ConfigError, match="balance='adaptive' is AllReduce's"):
        Downpour(mode="sync", balance="adaptive")
    with pytest.raises(ConfigError, match="with mode='sync' and partitions=1"):
        Downpour(balance="speed")


def test_column_widths_from_the_tasks_measured_speeds(spark, tmp_path):
    from spark_dl import Downpour
    x, y = data(96, seed=13)
    res = fit(frame(spark, x, y, [48, 48]), small_fc,
              strategy=Downpour(partitions=2, widths="speed"), replicas=1, batch_size=8,
              epochs=2, lr=0.5, run_dir=tmp_path / "run", log=None)
    mp = res.info["model_parallel"]
    assert [p["task"] for p in mp["probed_speeds"]] == [0, 1]
    assert all(p["flops"] > 1e6 for p in mp["probed_speeds"])
    assert mp["widths"] == [p["flops"] for p in mp["probed_speeds"]]   # one replica: its own
    assert sum(mp["parameters_per_partition"]) == sum(p.numel() for p in
                                                      res.model.parameters())
    assert res.history[-1]["loss"] < res.history[0]["loss"]
