"""Column partitioning on real processes (gloo on 127.0.0.1, float64): the partitioned FC net,
CNN and LSTM compute the unpartitioned model's outputs and gradients, and the counted messages
and bytes are those of the cost model."""

from __future__ import annotations

import itertools
import json

import pytest
import torch

from spark_dl.model_parallel import split_sizes
from spark_dl.planning import cost_model

from .ranks import free_port, run_on_ranks

FC_SIZES = [20, 13, 7, 5]           # widths not divisible by 2, 3 or 4: uneven slices


def _rank_main(rank, world):
    from spark_dl.model_parallel import Comm, MasterBackpropFC, parameter_bytes, partition_model
    from spark_dl.models import FCNet, ThesisCNN
    from spark_dl.models.rnn import CharRNN
    report = {}
    comm = Comm()

    def check(name, ref, inputs, loss_fn):
        torch.manual_seed(0)
        part = partition_model(ref, comm)
        comm.reset()
        ref.zero_grad()
        out_ref = ref(*inputs)
        out_ref = out_ref[0] if isinstance(out_ref, tuple) else out_ref
        loss_fn(out_ref).backward()
        out = part(*inputs)
        out = out[0] if isinstance(out, tuple) else out
        loss_fn(out).backward()
        errs = [float((out - out_ref).abs().max())]
        refs = dict(ref.named_parameters())
        for pname, p in part.named_parameters():
            errs.append(_slice_error(pname, p, refs, rank, world, ref))
        report[name] = {"max_error": max(errs), "counts": comm.counts(),
                        "param_bytes": parameter_bytes(part),
                        "full_bytes": parameter_bytes(ref)}

    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, FC_SIZES[0], dtype=torch.float64, generator=g)
    y = torch.randint(0, FC_SIZES[-1], (6,), generator=g)
    torch.manual_seed(0)
    fc = FCNet(FC_SIZES).double()
    check("fc", fc, (x,), lambda o: torch.nn.functional.cross_entropy(o, y))
    torch.manual_seed(0)
    cnn = ThesisCNN(widths=(5, 7, 6)).double()
    xi = torch.randn(3, 1, 28, 28, dtype=torch.float64, generator=g)
    yi = torch.randint(0, 10, (3,), generator=g)
    check("cnn", cnn, (xi,), lambda o: torch.nn.functional.cross_entropy(o, yi))
    torch.manual_seed(0)
    lstm = CharRNN(vocab_size=9, hidden=11, layers=2, kind="lstm").double()
    ids = torch.randint(0, 9, (2, 5), generator=g)
    check("lstm", lstm, (ids,), lambda o: torch.nn.functional.cross_entropy(
        o.reshape(-1, 9), ids.roll(-1, 1).reshape(-1)))

    thesis_net = partition_model(FCNet((784, 480, 160, 10)), comm)
    report["thesis_net_bytes"] = [parameter_bytes(thesis_net),
                                  parameter_bytes(FCNet((784, 480, 160, 10)))]

    # the thesis's master algorithm on the FC net
    torch.manual_seed(0)
    ref = FCNet(FC_SIZES).double()
    ref.zero_grad()
    ref_loss = torch.nn.functional.cross_entropy(ref(x), y)
    ref_loss.backward()
    thesis = MasterBackpropFC(ref, comm)
    comm.reset()
    loss = thesis.step(x if rank == 0 else None, y if rank == 0 else None, batch=len(x))
    counts = comm.counts()
    errs = [abs(loss - float(ref_loss)) if rank == 0 else 0.0]
    linears = [m for m in ref.modules() if isinstance(m, torch.nn.Linear)]
    for i, m in enumerate(linears):
        cols = _cols(m.out_features, world, rank)
        errs.append(float((thesis.weight[i].grad - m.weight.grad[cols]).abs().max()))
        errs.append(float((thesis.bias[i].grad - m.bias.grad[cols]).abs().max()))
    state = thesis.full_state()
    errs.append(max(float((state[k] - v).abs().max()) for k, v in ref.state_dict().items()))
    report["thesis_fc"] = {"max_error": max(errs), "counts": counts}
    return report


def _cols(n, world, rank):
    sizes = split_sizes(n, world)
    a = sum(sizes[:rank])
    return slice(a, a + sizes[rank])


def _slice_error(pname, p, refs, rank, world, ref):
    """Compare a partitioned parameter with this rank's slice of the reference gradient."""
    if pname in refs:                                   # ColumnLinear / ColumnConv2d
        r = refs[pname]
        cols = _cols(r.shape[0], world, rank)
        return max(float((p.grad - r.grad[cols]).abs().max()),
                   float((p.detach() - r.detach()[cols]).abs().max()))
    # ColumnLSTM: rnn.w_ih.k / w_hh / b_ih / b_hh against the *_l{k} rows of my units
    module, kind, k = pname.rsplit(".", 2)
    lstm = dict(ref.named_modules())[module]
    H = lstm.hidden_size
    cols = _cols(H, world, rank)
    rows = torch.cat([torch.arange(H)[cols] + q * H for q in range(4)])
    key = {"w_ih": "weight_ih", "w_hh": "weight_hh", "b_ih": "bias_ih", "b_hh": "bias_hh"}[kind]
    grad = getattr(lstm, f"{key}_l{k}").grad[rows]
    return float((p.grad - grad).abs().max())


def on_ranks(body, world, tmp_path, *args):
    """``run_on_ranks``; one rank runs in this process (a gloo group of 1, as a spawned rank
    has: the same body, without the seconds of a fresh interpreter importing torch)."""
    if world > 1:
        return run_on_ranks(body, world, tmp_path, *args)
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                            world_size=1)
    try:
        return [json.loads(json.dumps(body(0, 1, *args)))]     # as a spawned rank's report
    finally:
        dist.destroy_process_group()


def _bodies(rank, world, names):
    """This file's body and test_model_parallel_zoo.py's, one after the other."""
    from . import test_model_parallel_zoo
    bodies = {"columns": _rank_main, "zoo": test_model_parallel_zoo._rank_main}
    return {name: bodies[name](rank, world) for name in names}


_REPORTS: dict = {}


def group_reports(world, tmp_path_factory) -> dict[str, list[dict]]:
    """The reports of ranks 0..world-1 of both files' bodies, by body ("columns", "zoo"): run
    once per world, on one group of ranks (each spawned rank imports torch anew: seconds)."""
    if world not in _REPORTS:
        names = ("columns", "zoo") if world <= 3 else ("columns",)
        reports = on_ranks(_bodies, world, tmp_path_factory.mktemp(f"ranks{world}"), names)
        _REPORTS[world] = {name: [r[name] for r in reports] for name in names}
    return _REPORTS[world]


# 4 ranks split every width unevenly as 3 do (the same layers and counts): the long tier
@pytest.mark.parametrize("world", [1, 2, 3, pytest.param(4, marks=pytest.mark.long)])
def test_partitioned_models_equal_the_unpartitioned_ones(world, tmp_path_factory):
    reports = group_reports(world, tmp_path_factory)["columns"]
    for r, rep in enumerate(reports):
        for name in ("fc", "cnn", "lstm", "thesis_fc"):
            assert rep[name]["max_error"] < 1e-6, (world, r, name, rep[name]["max_error"])

    def total(name, what):
        return sum(rep[name]["counts"][what] for rep in reports)
    # the thesis algorithm sends exactly what the cost model counts, message by message
    expect = cost_model.master_counts(FC_SIZES, world, batch=6, itemsize=8)
    assert total("thesis_fc", "total_messages") == expect["messages"]
    assert total("thesis_fc", "total_bytes") == expect["bytes"]
    # ... and the collective layers what the ring algorithms send
    expect = cost_model.collective_counts(FC_SIZES, world, batch=6, itemsize=8)
    assert total("fc", "total_messages") == expect["messages"]
    assert total("fc", "total_bytes") == expect["bytes"]
    # no parameter is held twice; on the thesis net every rank holds <= 1/F + 5% of them
    for name in ("fc", "cnn", "lstm"):
        assert sum(rep[name]["param_bytes"] for rep in reports) <= reports[0][name]["full_bytes"]
    for rep in reports:
        mine, full = rep["thesis_net_bytes"]
        assert mine / full <= 1 / world + 0.05


def test_published_counts_agree_with_the_implementation_where_the_thesis_is_exact():
    # F = 2, widths divisible by 2: the printed K counts every message of the thesis's scheme;
    # the implementation adds the softmax normaliser's 2 (F - 1) per example
    sizes, F, M = [784, 480, 160, 10], 2, 1
    pub = cost_model.thesis_published(sizes, F, M)
    impl = cost_model.master_counts(sizes, F, batch=1, itemsize=1)
    assert pub["K"] + 2 * (F - 1) == impl["messages"]
    phases = impl["phases"]
    # init: x and the label columns (N1); forward: a^i (N2, the same for F = 2)
    assert phases["init"][1] == pub["N1"]
    assert phases["forward"][1] == pub["N2"]
    assert pub["N"] == pytest.approx(pub["data"] / pub["K"])


def test_split_sizes_and_the_planner():
    assert split_sizes(10, 4) == [3, 3, 2, 2]
    with pytest.raises(ValueError, match="at least one"):
        split_sizes(3, 4)
    link = cost_model.Link(t_lat=50e-6, t_data=1e-9)
    small = cost_model.Cluster(slots=4, memory_bytes=2 << 30, link=link)
    p = cost_model.plan([784, 480, 160, 10], 16, small)
    assert p.partitions == 1 and p.replicas == 4          # fits: pure data parallelism
    wide = [784, 8192, 8192, 10]                     # 74M parameters, 843 MiB of state
    tight = cost_model.Cluster(slots=4, memory_bytes=400 << 20, link=link)
    p = cost_model.plan(wide, 16, tight)
    assert p.partitions >= 3 and "MiB" in p.explanation
    fitting = [r for r in p.table if r["fits"]]
    assert {r["F"] for r in p.table if not r["fits"]} == {1, 2}
    assert max(fitting, key=lambda r: r["samples_per_s"])["F"] == p.partitions
    with pytest.raises(ValueError, match="no partitioning"):
        cost_model.plan(wide, 16, cost_model.Cluster(slots=2, memory_bytes=100 << 20, link=link))


def test_the_planner_prices_the_server_the_activations_and_a_measured_rate():
    sizes = [784, 480, 160, 10]
    P = sum(a * b + b for a, b in itertools.pairwise(sizes))
    link = cost_model.Link(t_lat=50e-6, t_data=1e-9)
    flops = cost_model.probe_flops()
    assert 1e8 < flops < 1e14                       # a real measurement, of a real CPU
    cluster = cost_model.Cluster(slots=4, memory_bytes=2 << 30, link=link, flops_per_s=flops)
    p = cost_model.plan(sizes, 16, cluster)
    for row in p.table:                             # push + fetch, R replicas share the link
        assert row["ps_s"] == pytest.approx(2 * (50e-6 + row["R"] * P * 4 * 1e-9))
        assert row["step_s"] == pytest.approx(row["compute_s"] + row["comm_s"] + row["ps_s"])
        # seed 002 §3.2: every layer's output kept for backward (and its gradient)
        F = row["F"]
        assert row["activation_bytes_per_task"] == 16 * 4 * (
            2 * sum(sizes) + sum(-(-b // F) for b in sizes[1:]))
    assert "parameter server" in p.explanation and "activations" in p.explanation
    no_ps = cost_model.plan(sizes, 16, cluster, parameter_server=False)
    assert all(r["ps_s"] == 0 for r in no_ps.table)
    # activations alone can rule a split out: a huge batch does not fit any F
    with pytest.raises(ValueError, match="of activations at F="):
        cost_model.plan(sizes, 200_000, cost_model.Cluster(4, 1 << 30, link, flops))


@pytest.mark.parametrize("F", [1, 2, 3])
def test_cut_and_merge_give_back_the_model(F):
    # the driver cuts a model into the partitions' slices (Comm.layout) and merges the
    # parameter server's slices back: for the FC net, the CNN and the LSTM, exactly
    from spark_dl.model_parallel import Comm, merge_partitions, partition_model
    from spark_dl.models import FCNet, ThesisCNN
    from spark_dl.models.rnn import CharRNN
    torch.manual_seed(0)
    for net in (FCNet([20, 13, 7, 5]), ThesisCNN(widths=(5, 7, 6)),
                CharRNN(vocab_size=9, hidden=11, layers=2, kind="lstm")):
        parts = [partition_model(net, Comm.layout(p, F)) for p in range(F)]
        merged = merge_partitions(net, parts)
        ref = net.state_dict()
        assert merged.keys() == ref.keys()
        for k, v in ref.items():
            assert torch.equal(merged[k], v), (type(net).__name__, F, k)
        sizes = sum(sum(q.numel() for q in part.parameters()) for part in parts)
        assert sizes <= sum(q.numel() for q in net.parameters())


def test_partitioning_refuses_what_it_cannot_split():
    from spark_dl.model_parallel import Comm, partition_model
    net = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.LayerNorm(6),
                              torch.nn.Linear(6, 2))
    with pytest.raises(ValueError, match=r"module 1 \(LayerNorm\) has parameters or buffers"):
        partition_model(net, Comm.layout(0, 2))
    with pytest.raises(ValueError, match="without dropout between layers"):
        partition_model(torch.nn.Sequential(torch.nn.LSTM(3, 4, 2, batch_first=True,
                                                          dropout=0.5)), Comm.layout(0, 2))


def test_flat_views_keep_tied_weights_tied():
    from spark_dl.strategies.ps_worker import flat_parameters as _flatten
    a, b = torch.nn.Linear(3, 3), torch.nn.Linear(3, 3)
    b.weight = a.weight                                  # tied
    net = torch.nn.Sequential(a, b)
    flat, grad = _flatten(net, 9 + 3 + 3, "cpu", torch.float32)
    assert net[0].weight is net[1].weight
    assert net[0].weight.data_ptr() == flat.data_ptr()
    net(torch.ones(2, 3)).sum().backward()
    assert grad.abs().sum() > 0
    with torch.device("meta"):
        meta = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 3))
    meta[1].weight = meta[0].weight
    flat, _ = _flatten(meta, 15, "cpu", torch.float32)
    assert meta[0].weight is meta[1].weight and meta[0].weight.device.type == "cpu"


@pytest.mark.parametrize("F", [1, 2])
def test_a_partition_lives_on_the_requested_device(F):
    # what a model-parallel Downpour task builds (its slice, kept-whole BatchNorm buffers made
    # real) lands, parameters, gradients and buffers, on the task's device ("meta" stands in
    # for a GPU here: nothing may stay behind on the CPU)
    from spark_dl.model_parallel import Comm
    from spark_dl.strategies.downpour.task import _partitioned_model
    from spark_dl.strategies.ps_worker import flat_parameters as _flatten

    def bn_fc():
        return torch.nn.Sequential(torch.nn.Linear(12, 8), torch.nn.BatchNorm1d(8),
                                   torch.nn.ReLU(), torch.nn.Linear(8, 3))
    part = _partitioned_model(bn_fc, Comm.layout(0, F), torch.float32)
    numel = sum(p.numel() for p in part.parameters() if p.requires_grad)
    assert any(b.device.type == "cpu" for b in part.buffers())      # made real on the CPU
    flat, grad = _flatten(part, numel, torch.device("meta"), torch.float32)
    assert flat.is_meta and grad.is_meta
    assert all(p.is_meta and p.grad.is_meta for p in part.parameters())
    assert all(b.is_meta for b in part.buffers())
