"""A model's buffers (BatchNorm's running statistics) through the parameter server, over real
sockets: the workers' latest reports and their mean, the rule for buffers that are not
floating point or change shape, checkpoints, and bad reports."""

from __future__ import annotations

import pytest
import torch

from spark_dl.transport.ps import ParameterServer, PSClient, PSError, StepRule
from spark_dl.transport.ps.buffers import buffer_spec, load_buffers, read_buffers, spec_numel

SECRET = b"b" * 32


def bn_net() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3), torch.nn.ReLU(),
                               torch.nn.Linear(3, 2))


def test_only_floating_buffers_travel_and_a_reshaped_one_is_not_reported():
    net = bn_net()
    spec = buffer_spec(net)
    # num_batches_tracked (int64) is skipped: the returned model keeps model_fn()'s value
    assert spec == (("1.running_mean", (3,)), ("1.running_var", (3,)))
    assert spec_numel(spec) == 6
    net[1].running_mean.fill_(2.0)
    out = read_buffers(net, spec, torch.empty(6))
    assert out.tolist() == [2.0] * 3 + [1.0] * 3
    net[1].running_var = torch.ones(5)                  # another shape: not reported
    out = read_buffers(net, spec, torch.empty(6))
    assert out[:3].tolist() == [2.0] * 3 and torch.isnan(out[3:]).all()
    other = bn_net()
    load_buffers(other, spec, torch.arange(6.0))
    assert other[1].running_mean.tolist() == [0.0, 1.0, 2.0]
    assert other[1].running_var.tolist() == [3.0, 4.0, 5.0]
    assert int(other[1].num_batches_tracked) == 0
    load_buffers(net, spec, torch.arange(6.0))          # a reshaped buffer is left alone
    assert net[1].running_var.tolist() == [1.0] * 5


def test_the_server_returns_the_mean_of_the_workers_latest_buffers():
    initial = torch.tensor([0.0, 0.0, 1.0, 1.0], dtype=torch.float64)
    ps = ParameterServer(torch.zeros(3, dtype=torch.float64), SECRET,
                         rule=StepRule(optimizer="sgd"), workers=2, buffers=initial)
    try:
        assert torch.equal(ps.buffers(), initial)       # nobody reported: model_fn()'s
        a = PSClient(ps.address, SECRET, 0, dtype=torch.float64)
        b = PSClient(ps.address, SECRET, 1, dtype=torch.float64)
        for c in (a, b):
            c.hello(rows=4, batch_size=1)
        g = torch.zeros(3, dtype=torch.float64)
        a.push(g, 1, buffers=torch.tensor([9.0, 9.0, 9.0, 9.0]))
        a.push(g, 1, buffers=torch.tensor([1.0, 2.0, 3.0, 4.0]))    # the latest counts
        assert ps.buffers().tolist() == [1.0, 2.0, 3.0, 4.0]
        # worker 1 reports its last value as not its own (NaN): the mean is worker 0's there;
        # elsewhere each report weighs the mini-batches its worker trained: 2 (a) and 3 (b)
        b.push(g, 1, 3, buffers=torch.tensor([3.0, 4.0, 5.0, float("nan")],
                                             dtype=torch.float64))
        mean = [(2 * 1.0 + 3 * 3.0) / 5, (2 * 2.0 + 3 * 4.0) / 5, (2 * 3.0 + 3 * 5.0) / 5, 4.0]
        assert ps.buffers().tolist() == pytest.approx(mean, rel=1e-12)
        assert ps.stats_of_buffers.reports == 3 and ps.versions == [3]
        state = ps.state_dict()
        assert state["buffers"].tolist() == pytest.approx(mean, rel=1e-12)
        a.close()
        b.close()
    finally:
        ps.close()
    again = ParameterServer(torch.zeros(3, dtype=torch.float64), SECRET, buffers=initial)
    try:                                                # a resumed fit starts from the mean
        again.load_state_dict(state)
        assert again.buffers().tolist() == pytest.approx(mean, rel=1e-12)
        c = PSClient(again.address, SECRET, 0, dtype=torch.float64)
        c.hello(rows=1, batch_size=1)
        c.report_buffers(torch.full((4,), float("nan")))
        c.pull(torch.empty(3, dtype=torch.float64))     # the report is in before the reply
        assert again.buffers().tolist() == pytest.approx(mean, rel=1e-12)
        c.close()
    finally:
        again.close()


def test_bad_buffer_reports_are_refused():
    ps = ParameterServer(torch.zeros(3), SECRET, buffers=torch.zeros(4))
    plain = ParameterServer(torch.zeros(3), SECRET)               # a model without buffers
    try:
        c = PSClient(ps.address, SECRET, 0)
        c.report_buffers(torch.zeros(4))                          # before its hello
        with pytest.raises(PSError, match="a buffers frame before the connection's hello"):
            c.hello(rows=1, batch_size=1)
        c = PSClient(ps.address, SECRET, 0)
        c.hello(rows=1, batch_size=1)
        with pytest.raises(PSError, match=r"a buffers report of 20 bytes, expected 16 \(4 "):
            c.push(torch.zeros(3), 1, buffers=torch.zeros(5))
        c = PSClient(plain.address, SECRET, 0)
        c.hello(rows=1, batch_size=1)
        with pytest.raises(PSError, match="expected 0 "):
            c.push(torch.zeros(3), 1, buffers=torch.zeros(1))
        assert ps.versions == [0] and plain.versions == [0]
        assert torch.equal(ps.buffers(), torch.zeros(4))
        other = ParameterServer(torch.zeros(3), SECRET, buffers=torch.zeros(2))
        with pytest.raises(ValueError, match="4 buffer values, this one 2"):
            other.load_state_dict(ps.state_dict())
        other.close()
    finally:
        ps.close()
        plain.close()


def test_a_split_model_keeps_batchnorm_whole_and_its_statistics_are_partition_0s():
    from spark_dl.planning.partitions import Layout
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.BatchNorm1d(6), torch.nn.ReLU(),
                              torch.nn.Linear(6, 2))
    layout = Layout(net, 2)
    assert layout.buffer_spec == (("1.running_mean", (6,)), ("1.running_var", (6,)))
    assert layout.flatten_buffers().tolist() == [0.0] * 6 + [1.0] * 6
    # BatchNorm's weight and bias: partition 0's shard only (kept whole, trained there)
    # (Linear 4 -> 3 of 6 columns, BatchNorm 6 + 6, Linear 6 -> 1 of 2), then without BN
    assert layout.bounds == [0, 15 + 12 + 7, 15 + 12 + 7 + 15 + 7]
    flat = layout.flatten()
    layout.load(flat, torch.arange(12.0))
    assert net[1].running_mean.tolist() == list(range(6))
    assert net[1].running_var.tolist() == list(range(6, 12))
