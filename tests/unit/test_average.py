"""The weights' moving average that the synchronous strategies validate and return
(spark_dl.optim.average): the parameter server's rule, on the replicas."""

from __future__ import annotations

import pytest
import torch

from spark_dl.errors import ConfigError
from spark_dl.optim.average import AveragedModel, WeightAverage, check_average, interval
from spark_dl.transport.ps.shard import Shard


@pytest.mark.parametrize("epoch_steps,steps", [(12, 30), (1000, 1400)])
def test_the_average_follows_the_servers_rule_step_by_step(epoch_steps, steps):
    # the server's averaged shard and the replicas' average see the same SGD trajectory
    # (a window of at most 3 steps, and one of up to 250, taken every 1 to 7 steps)
    g = torch.Generator().manual_seed(0)
    start = torch.randn(7, generator=g, dtype=torch.float64)
    shard = Shard(start, "sgd", lr=0.1, momentum=0.0, average=0.25)
    x = start.clone()
    avg = WeightAverage([x], 0.25, epoch_steps=epoch_steps)
    for _ in range(steps):               # two and a half, or 1.4, epochs
        grad = torch.randn(7, generator=g, dtype=torch.float64)
        shard.apply(grad, epoch_steps=epoch_steps)
        x.sub_(grad, alpha=0.1)
        avg.update()
        assert torch.allclose(avg.current()[0], shard.avg, rtol=0, atol=1e-12)
    assert not torch.allclose(avg.current()[0], x)      # it averages: it lags the last values


def test_a_long_window_takes_the_values_every_interval_steps_and_folds_in_the_rest_when_read():
    # a window of 0.5 x 640 = 320 steps (from the second epoch on): the values are taken
    # every 320 / 32 = 10 steps with the weight of 10 steps; reading folds in the pending
    # ones; and the average is within a few percent of its lag from the every-step average's
    assert interval(0.5, 640, 640) == 10 and interval(0.5, 640, 100) == 1
    g = torch.Generator().manual_seed(1)
    x = torch.zeros(50, dtype=torch.float64)
    avg = WeightAverage([x], 0.5, epoch_steps=640, steps=640)
    sparse, dense = x.clone(), x.clone()
    for t in range(1, 1001):
        x.add_(torch.randn(50, generator=g, dtype=torch.float64))     # a random walk
        avg.update()
        dense += (x - dense) / 320
        if t % 10 == 0:
            sparse += (x - sparse) * 10 / 320
            assert avg.pending == 0
            assert torch.allclose(avg._values[0], sparse, rtol=0, atol=1e-9)
        else:
            assert avg.pending == t % 10
    for _ in range(4):
        x.add_(torch.randn(50, generator=g, dtype=torch.float64))
        avg.update()
        dense += (x - dense) / 320
    sparse += (x - sparse) * 4 / 320                 # read after 4 steps of the next 10
    assert torch.allclose(avg.current()[0], sparse, rtol=0, atol=1e-9) and avg.pending == 0
    lag = float((dense - x).norm())
    assert float((sparse - dense).norm()) < 0.05 * lag


def test_a_window_of_one_step_or_less_is_the_last_values():
    x = torch.zeros(3)
    avg = WeightAverage([x], 0.1, epoch_steps=10)    # 0.1 x 10 steps: one step
    for i in range(25):
        x.fill_(float(i))
        avg.update()
        assert torch.equal(avg.current()[0], x)
    assert avg.steps == 25


def test_the_window_grows_with_the_steps_of_the_first_epoch():
    # after t steps of the first epoch the weight of the newest is 1 / (span x t)
    x = torch.zeros(1, dtype=torch.float64)
    avg = WeightAverage([x], 0.5, epoch_steps=100)
    for _ in range(4):
        avg.update()                                 # windows 0.5, 1.0, 1.5, 2.0: x = 0
    x.fill_(1.0)
    avg.update()                                     # window 2.5
    assert float(avg.current()[0]) == pytest.approx(1 / 2.5)


def test_state_round_trip_and_a_checkpoint_without_one():
    x = torch.arange(4.0)
    avg = WeightAverage([x], 1.0, epoch_steps=4)
    for i in range(6):
        x.add_(float(i))
        avg.update()
    state = avg.state_dict()
    other = WeightAverage([x], 1.0, epoch_steps=4)
    other.load_state_dict(state)
    assert torch.equal(other.current()[0], avg.current()[0]) and other.steps == 6
    x.add_(1.0)
    avg.update()
    other.update()
    assert torch.equal(other.current()[0], avg.current()[0])
    other.load_state_dict(None)                      # an older checkpoint: from the live values
    assert torch.equal(other.current()[0], x)


def test_the_averaged_model_has_the_average_and_the_live_buffers():
    torch.manual_seed(0)
    live = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    shown = AveragedModel(live, 0.5, epoch_steps=20)
    opt = torch.optim.SGD(live.parameters(), lr=0.5)
    for _ in range(10):
        opt.zero_grad()
        live(torch.randn(8, 3)).pow(2).sum().backward()
        opt.step()
        shown.update()
    model = shown.read()
    assert model is not live and model.training
    assert not torch.equal(model[0].weight, live[0].weight)
    assert torch.equal(model[0].weight, shown.average.current()[0])
    assert torch.equal(model[1].running_mean, live[1].running_mean)
    assert not any(p.requires_grad for p in model.parameters())
    live.eval()
    assert not shown.read().training


@pytest.mark.parametrize("bad", [-0.1, "0.1", True, float("nan"), float("inf")])
def test_bad_average_is_a_config_error(bad):
    with pytest.raises(ConfigError, match="average must be a number >= 0"):
        check_average(bad)
    for good in (None, 0, 0.1, 2):
        check_average(good)
