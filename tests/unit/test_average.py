"""The weights' moving average that the synchronous strategies validate and return
(spark_dl.optim.average): the parameter server's rule, on the replicas."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch

from spark_dl.errors import ConfigError
from spark_dl.optim.average import (
    AveragedModel,
    WeightAverage,
    batch_norms,
    check_average,
    interval,
    recompute_statistics,
)
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
    for t in range(1, steps + 1):         # two and a half, or 1.4, epochs
        grad = torch.randn(7, generator=g, dtype=torch.float64)
        shard.apply(grad, epoch_steps=epoch_steps)
        x.sub_(grad, alpha=0.1)
        avg.update()
        if t % 25 == 0:                   # read now and then (a read folds in the pending)
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


def train(live, shown, steps: int, lr: float) -> None:
    """``steps`` SGD steps of ``live`` on random rows of 3 features, ``shown`` updated after
    each."""
    opt = torch.optim.SGD(live.parameters(), lr=lr)
    for _ in range(steps):
        opt.zero_grad()
        live(torch.randn(8, 3)).pow(2).sum().backward()
        opt.step()
        shown.update()


def test_the_averaged_model_has_the_average_and_the_live_buffers():
    torch.manual_seed(0)
    live = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    shown = AveragedModel(live, 0.5, epoch_steps=20)
    train(live, shown, 10, lr=0.5)
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


def test_recomputed_statistics_are_update_bns_without_dropout_and_restore_the_layers():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(5, 6), torch.nn.BatchNorm1d(6, momentum=0.3),
                              torch.nn.Dropout(0.5), torch.nn.Linear(6, 4),
                              torch.nn.BatchNorm1d(4))
    for _ in range(3):                                # some live statistics to replace
        net(torch.randn(8, 5) * 3 + 1)
    batches = [torch.randn(n, 5) for n in (8, 8, 5)]
    want = copy.deepcopy(net)
    want[2].p = 0.0                                   # update_bn runs the whole net in train
    torch.optim.swa_utils.update_bn(batches, want)    # mode: without its dropout, ours
    net.eval()
    state = torch.get_rng_state()
    assert recompute_statistics(net, batches) == 21
    assert torch.equal(torch.get_rng_state(), state)  # no dropout mask drawn
    for k in ("1.running_mean", "1.running_var", "4.running_mean", "4.running_var"):
        assert torch.allclose(net.state_dict()[k], want.state_dict()[k], atol=1e-6), k
    assert not net.training and net[1].momentum == 0.3 and net[4].momentum == 0.1
    assert int(net[1].num_batches_tracked) == 3       # the live count, not the pass's
    assert recompute_statistics(torch.nn.Linear(2, 2), batches) == 0   # nothing to do


def test_batch_norms_are_the_layers_with_running_statistics():
    net = torch.nn.Sequential(torch.nn.BatchNorm2d(3), torch.nn.BatchNorm1d(3,
                              track_running_stats=False), torch.nn.LayerNorm(3))
    assert batch_norms(net) == [net[0]]


def weight_normed() -> torch.nn.Module:
    torch.manual_seed(3)
    with pytest.warns(FutureWarning):               # the old API, still common in audio nets
        return torch.nn.Sequential(torch.nn.utils.weight_norm(torch.nn.Linear(3, 4)),
                                   torch.nn.ReLU(), torch.nn.Linear(4, 2))


def test_a_model_a_deep_copy_cannot_copy_is_made_again_without_drawing_random_numbers():
    live = weight_normed()
    live(torch.randn(5, 3))                         # its weight is now a computed non-leaf
    with pytest.raises(RuntimeError):
        copy.deepcopy(live)
    state = torch.get_rng_state()
    shown = AveragedModel(live, 0.5, epoch_steps=20, make=weight_normed)
    assert torch.equal(torch.get_rng_state(), state)
    train(live, shown, 6, lr=0.1)
    with pytest.raises(RuntimeError):               # no maker: the deep copy's own error
        AveragedModel(live, 0.5, epoch_steps=20)
    model = shown.read()
    assert model is not live and [n for n, _ in model.named_parameters()] == \
        [n for n, _ in live.named_parameters()]
    for p, v in zip(model.parameters(), shown.average.current()):
        assert torch.equal(p, v)
    assert not torch.equal(model[0].weight_v, live[0].weight_v)
    x = torch.randn(4, 3)
    assert torch.allclose(model(x), torch.func.functional_call(
        live, dict(zip([n for n, _ in live.named_parameters()], shown.average.current())), x))


class FrozenNorm(torch.nn.Module):
    """A fine-tuned net that keeps its pretrained BatchNorm in evaluation mode."""

    def __init__(self):
        super().__init__()
        self.pretrained = torch.nn.BatchNorm1d(3)
        self.head = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.BatchNorm1d(3))
        with torch.no_grad():
            self.pretrained.running_mean.fill_(5.0)

    def train(self, mode: bool = True):
        super().train(mode)
        self.pretrained.eval()
        return self

    def forward(self, x):
        return self.head(self.pretrained(x))


def test_recomputed_statistics_leave_a_batchnorm_the_model_keeps_in_evaluation_mode():
    torch.manual_seed(0)
    net = FrozenNorm().train()
    assert batch_norms(net) == [net.head[1]]
    assert recompute_statistics(net, [torch.randn(8, 3) for _ in range(3)]) == 24
    assert torch.equal(net.pretrained.running_mean, torch.full((3,), 5.0))
    assert not torch.equal(net.head[1].running_mean, torch.zeros(3))
    assert net.training and net.head.training and not net.pretrained.training   # as before
    net.eval()
    assert batch_norms(net) == [net.head[1]] and not net.training


def test_the_average_follows_a_parameter_whose_data_is_rebound():
    p = torch.nn.Parameter(torch.zeros(3))
    avg = WeightAverage([p], 0.5, epoch_steps=4)
    for _ in range(4):
        p.data = p.data + 1.0                       # as a max-norm constraint written so does
        avg.update()
    assert avg.current()[0].mean().item() > 3.0     # the last values (a window of 2 steps)


class CountingShard:
    """A shard that counts how often its batches are read (a stream's each fill a window)."""

    def __init__(self, shard):
        self.shard, self.reads = shard, 0

    def batches(self, *args, **kwargs):
        self.reads += 1
        return self.shard.batches(*args, **kwargs)


@pytest.mark.parametrize("held", [True, False])
def test_the_statistics_rows_are_read_once_and_kept_while_they_are_small(tmp_path,
                                                                         monkeypatch, held):
    import numpy as np

    from spark_dl.data import arrays_to_arrow
    from spark_dl.data.stream import open_shard
    from spark_dl.runtime import buffers
    from spark_dl.runtime.stage import LocalStepConfig
    g = np.random.default_rng(0)
    x, y = g.normal(3.0, 2.0, size=(200, 5)).astype(np.float32), np.arange(200) % 3
    stream = open_shard([arrays_to_arrow(x[a:a + 40], y[a:a + 40]) for a in range(0, 200, 40)],
                        shape=(5,), data="stream", shuffle_buffer=50, directory=str(tmp_path))
    if not held:
        monkeypatch.setattr(buffers, "HELD_BYTES", 1000)   # 3 batches of 16 x 5 floats: 960
    shard = CountingShard(stream)
    restat = buffers.OwnStatistics(LocalStepConfig(batch_size=16, seed=4), shard, 4, rank=0,
                                 world=1, device=torch.device("cpu"), dtype=torch.float32)
    net = torch.nn.Sequential(torch.nn.Linear(5, 5), torch.nn.BatchNorm1d(5)).train()
    state = torch.get_rng_state()
    first = restat(net)[1].running_mean.clone()
    assert torch.equal(torch.get_rng_state(), state)
    want = torch.nn.Sequential(*copy.deepcopy(list(net)))
    rows = torch.cat([b for b, _ in itertools.islice(
        stream.batches(16, seed=4 * 1000003, epoch=0), 4)])
    recompute_statistics(want, [rows[i:i + 16] for i in range(0, 64, 16)])
    assert torch.allclose(first, want[1].running_mean)            # the first 4 mini-batches
    assert torch.equal(restat(net)[1].running_mean, first)        # the same rows again
    assert shard.reads == (1 if held else 2)
    assert (restat.held is not None) == held
    stream.close()
