"""The planner's step pricing (cost_model.step_cost): one rank's run on the meta device, with a
CountingComm for the group, counts exactly the messages and bytes the F ranks' Comms count on
real processes (gloo on 127.0.0.1), whatever the model; and plan() prices CNNs and SSDAs."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

from spark_dl.model_parallel import CountingComm, partition_model
from spark_dl.models import FCNet, ThesisCNN
from spark_dl.models.ssda import SSDA, THESIS_SSDA_LAYERS, LayerSpec
from spark_dl.planning import cost_model

from .ranks import run_on_ranks
from .test_model_parallel import FC_SIZES
from .test_model_parallel_zoo import narrow_fc  # Linear(8, 1) kept whole at F = 2

BATCH = 5


# name: (factory, one sample's shape, the loss a real run trains with)
MODELS = {
    "cnn": (ThesisCNN, (1, 28, 28), lambda out, x: nn.functional.cross_entropy(
        out, torch.arange(len(out)) % 10)),
    "ssda": (lambda: SSDA(256, THESIS_SSDA_LAYERS), (256,),
             nn.functional.mse_loss),
    "narrow_fc": (narrow_fc, (12,), lambda out, x: out.logsumexp(1).mean()),
}


def _rank_main(rank, world):
    from spark_dl.model_parallel import Comm
    report, comm = {}, Comm()
    for name, (model_fn, shape, loss_fn) in MODELS.items():
        torch.manual_seed(0)
        part = partition_model(model_fn(), comm)
        x = torch.rand(BATCH, *shape, generator=torch.Generator().manual_seed(1))
        comm.reset()
        loss_fn(part(x), x).backward()
        report[name] = comm.counts()
    return report


def _counted(model_fn, shape, F):
    """Every rank's counts from rank 0's run on the meta device."""
    with torch.device("meta"):
        full = model_fn()
    comm = CountingComm(F)
    part = partition_model(full, comm)
    part(torch.zeros(BATCH, *shape, device="meta")).pow(2).sum().backward()
    return [c.counts() for c in comm.per_rank]


def test_counted_step_equals_the_real_ranks_counts(tmp_path):
    world = 2
    real = run_on_ranks(_rank_main, world, tmp_path)
    for name, (model_fn, shape, _) in MODELS.items():
        counted = _counted(model_fn, shape, world)
        for r in range(world):                     # rank by rank, kind by kind
            assert counted[r] == real[r][name], (name, r)
        cost = cost_model.step_cost(model_fn, shape, world, BATCH)
        assert cost.messages == sum(rep[name]["total_messages"] for rep in real) > 0
        assert cost.bytes == sum(rep[name]["total_bytes"] for rep in real)
    assert "kept_whole_broadcast" in real[0]["narrow_fc"]["messages"]


@pytest.mark.parametrize("F", [1, 2, 3, 4])
def test_counted_fc_step_equals_the_formula(F):
    for itemsize, dtype in ((4, torch.float32), (8, torch.float64)):
        cost = cost_model.step_cost(lambda: FCNet(FC_SIZES), (FC_SIZES[0],), F, 6, dtype)
        expect = cost_model.collective_counts(FC_SIZES, F, 6, itemsize)
        assert (cost.messages, cost.bytes) == (expect["messages"], expect["bytes"])
        assert cost.activation_bytes == cost_model.activation_bytes(FC_SIZES, F, 6, itemsize)
    # the flop counter: forward 2 B P, backward 4 B P less the first layer's dE/dx
    sizes, B = FC_SIZES, 6
    weights = [a * b for a, b in itertools.pairwise(sizes)]
    cols = [-(-b // F) for b in sizes[1:]]                  # rank 0's (the larger) slices
    mine = sum(a * c for a, c in zip(sizes[:-1], cols))
    assert cost.flops == 6 * B * mine - 2 * B * sizes[0] * cols[0]
    assert cost.parameters == mine + sum(cols) and cost.model_parameters == \
        sum(weights) + sum(sizes[1:])


def test_step_cost_of_the_thesis_cnn_and_ssda():
    cnn = cost_model.step_cost(ThesisCNN, (1, 28, 28), 1, 64)
    half = cost_model.step_cost(ThesisCNN, (1, 28, 28), 2, 64)
    assert half.flops == cnn.flops / 2 and half.parameters == cnn.parameters / 2
    # per conv layer a forward all-gather of its feature maps, an all-reduce of dE/dx but for
    # the first; then the classifier's: 4 all-gathers + 3 all-reduces of 2 messages each
    assert half.messages == 4 * 2 + 3 * 2 * 2
    assert cnn.activation_bytes > 64 * 6 * 24 * 24 * 4    # at least conv 1's feature maps
    ssda = cost_model.step_cost(lambda: SSDA(256, [LayerSpec(1280)]), (256,), 2, 64)
    # encode: gather h (B, 1280); decode: all-reduce of the partial reconstructions (B, 256);
    # backward: all-gather of dE/dh slices (the decoder), nothing for the input
    assert ssda.bytes == 64 * 4 * (1280 + 2 * 256 + 1280)
    with pytest.raises(ValueError, match=r"layer 0 \(LSTM\) has 3 units"):
        cost_model.step_cost(lambda: nn.Sequential(nn.LSTM(2, 3, batch_first=True)),
                             (4, 2), 4, 8)


def test_the_planner_plans_any_partitioned_model():
    link = cost_model.Link(t_lat=50e-6, t_data=1e-9)
    cluster = cost_model.Cluster(slots=4, memory_bytes=2 << 30, link=link, flops_per_s=1e10)
    # a factory of an FC net is priced as its widths are, but for the flop count
    by_formula = cost_model.plan(FC_SIZES, 16, cluster)
    measured = cost_model.plan(lambda: FCNet(FC_SIZES), 16, cluster, input_shape=(20,))
    for a, b in zip(by_formula.table, measured.table):
        assert a["comm_s"] == b["comm_s"] and a["ps_s"] == b["ps_s"]
        assert a["activation_bytes_per_task"] == b["activation_bytes_per_task"]
    # the SSDA's 1280-unit layers split F ways; a task's memory picks F
    P = sum(q.numel() for q in SSDA(256, THESIS_SSDA_LAYERS).parameters())
    tight = cost_model.Cluster(slots=4, memory_bytes=P * 4 * 3 // 2, link=link)
    p = cost_model.plan(lambda: SSDA(256, THESIS_SSDA_LAYERS), 64, tight, input_shape=(256,))
    assert p.partitions >= 3 and "MiB" in p.explanation
    assert {r["F"] for r in p.table if not r["fits"]} == {1, 2}
    # conv layers narrower than F are kept whole: the CNN prices at every F
    p = cost_model.plan(ThesisCNN, 64, cluster, candidates=[1, 2, 4, 8],
                        input_shape=(1, 28, 28), parameter_server=False)
    assert [r["F"] for r in p.table] == [1, 2, 4, 8]
    # recurrent layers are not: F beyond an LSTM's units is left out, ...
    lstm = lambda: nn.Sequential(nn.LSTM(2, 3, batch_first=True))    # noqa: E731
    p = cost_model.plan(lstm, 8, cluster, candidates=[1, 2, 4], input_shape=(4, 2))
    assert [r["F"] for r in p.table] == [1, 2]
    # ... unless no candidate is left
    with pytest.raises(ValueError, match=r"layer 0 \(LSTM\) has 3 units"):
        cost_model.plan(lstm, 8, cluster, candidates=[4], input_shape=(4, 2))
    with pytest.raises(ValueError, match=r"layer 1 \(Conv1d\) has no column-partitioned form"):
        cost_model.plan(lambda: nn.Sequential(nn.Unflatten(1, (1, 12)), nn.Conv1d(1, 2, 3)),
                        8, cluster, input_shape=(12,))
    with pytest.raises(ValueError, match="needs input_shape"):
        cost_model.plan(ThesisCNN, 64, cluster)
    assert cost_model.flat_input_shape(SSDA(256, [LayerSpec(8)])) == (256,)
    assert cost_model.flat_input_shape(FCNet(FC_SIZES)) == (20,)
    assert cost_model.flat_input_shape(ThesisCNN()) is None
