"""LocalSGD on real Spark (local[2]) with real gloo process groups: the replicas step on their
own and average every ``every`` steps, optionally as an outer Nesterov step (DiLoCo)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from spark_dl import LocalSGD, fit
from spark_dl.errors import ConfigError

from .test_allreduce import assert_same_weights, data, frame, reference_epochs, small_fc

KW = dict(batch_size=8, lr=0.5, shuffle=False, dtype="float64", lr_scaling=None, log=None)


def test_every_step_without_an_outer_step_is_allreduce(spark, tmp_path):
    """every=1, outer_lr=1, no outer momentum: averaging the parameters after each replica's
    step is stepping the averaged gradient (SGD with momentum is linear in it): AllReduce's
    fit, the one process's on the double batch (test_allreduce's
    test_two_replicas_equal_single_process_with_double_batch)."""
    x, y = data(96, seed=5)
    df = frame(spark, x, y, [48, 48])
    local = fit(df, small_fc, strategy=LocalSGD(every=1), epochs=2, momentum=0.9,
                run_dir=tmp_path / "local", **KW)
    assert_same_weights(local.model, reference_epochs(x, y, [48, 48], 8, 2, 0.5, 0.9))
    assert local.info["averages"] == 12 and local.info["world"] == 2
    assert [h["samples"] for h in local.history] == [96, 96]
    # the bytes each replica sends a step: one parameter vector (+ its weight), as AllReduce's
    # (12 x (numel + 2) x 8 there, its loss and count added: the same test)
    numel = sum(p.numel() for p in small_fc().parameters())
    assert local.history[-1]["bytes_sent_per_replica"] == 12 * (numel + 1) * 8


def by_hand(x, y, splits, batch, steps, lr, every, outer_lr, outer_momentum):
    """Two replicas of plain SGD on consecutive batches of their splits; every ``every`` steps
    and after the last, the outer step x <- x - outer_lr (Δ + μ v), v <- μ v + Δ, Δ = x - x̄
    (Nesterov), written out."""
    torch.manual_seed(0)
    start = small_fc().double()
    vec = torch.nn.utils.parameters_to_vector
    anchor = vec(start.parameters()).detach().clone()
    velocity = torch.zeros_like(anchor)
    replicas = [small_fc().double() for _ in splits]
    for r in replicas:
        torch.nn.utils.vector_to_parameters(anchor.clone(), r.parameters())
    bounds = np.cumsum([0] + list(splits))
    xt, yt = torch.from_numpy(x.astype(np.float64)), torch.from_numpy(y)
    for s in range(steps):
        for r, lo in zip(replicas, bounds[:-1]):
            idx = np.arange(lo + s * batch, lo + (s + 1) * batch)
            r.zero_grad()
            torch.nn.functional.cross_entropy(r(xt[idx]), yt[idx]).backward()
            with torch.no_grad():
                for p in r.parameters():
                    p -= lr * p.grad
        if (s + 1) % every == 0 or s == steps - 1:
            mean = sum(vec(r.parameters()).detach() for r in replicas) / len(replicas)
            delta = anchor - mean
            velocity = outer_momentum * velocity + delta
            anchor = anchor - outer_lr * (delta + outer_momentum * velocity)
            for r in replicas:
                torch.nn.utils.vector_to_parameters(anchor.clone(), r.parameters())
    return replicas[0]


@pytest.mark.compat
def test_the_outer_step_is_nesterovs_on_the_change_since_the_last_average(spark, tmp_path):
    x, y = data(96, seed=6)
    res = fit(frame(spark, x, y, [48, 48]), small_fc,
              strategy=LocalSGD(every=4, outer_lr=0.7, outer_momentum=0.9), epochs=1,
              run_dir=tmp_path / "run", **KW)
    # 6 steps: an average after step 4, and one after the last (steps 5 and 6)
    assert res.info["averages"] == 2
    assert_same_weights(res.model, by_hand(x, y, [48, 48], 8, 6, 0.5, 4, 0.7, 0.9))


def test_resume_goes_on_as_an_uninterrupted_fit(spark, tmp_path):
    """An average that straddles the epochs' end, the outer momentum and every replica's
    own weights and optimizer state come back from the checkpoint."""
    df = frame(spark, *data(96, seed=7), [48, 48])
    strategy = LocalSGD(every=5, outer_lr=0.7, outer_momentum=0.9)
    kw = dict(KW, momentum=0.9, strategy=strategy)
    fit(df, small_fc, epochs=1, run_dir=tmp_path / "cut", **kw)
    again = fit(df, small_fc, epochs=2, run_dir=tmp_path / "cut", **kw)
    whole = fit(df, small_fc, epochs=2, run_dir=tmp_path / "whole", **kw)
    assert again.info["resumed_from_epoch"] == 1
    assert again.info["averages"] == whole.info["averages"] == 3     # after 5, 10 and 12
    assert_same_weights(again.model, whole.model)
    assert again.history == [{**h, "seconds": again.history[i]["seconds"],
                              "samples_per_s": again.history[i]["samples_per_s"]}
                             for i, h in enumerate(whole.history)]


@pytest.mark.parametrize("options,fix", [
    ({"every": 0}, "every"), ({"outer_lr": 0}, "outer_lr"),
    ({"outer_momentum": 1.0}, "outer_momentum"), ({"sync_every": 2}, "`every`")])
def test_bad_options_name_the_fix(options, fix):
    with pytest.raises(ConfigError, match=fix):
        LocalSGD(**options)
