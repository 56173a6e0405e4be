"""Column partitioning of the rest of the thesis's networks on real processes (gloo on
127.0.0.1, float64, F = 1, 2, 3, widths that do not divide): the SSDA (layer-wise pretraining
loss of eq. 5.3 and fine-tuning loss of eq. 5.4), the Elman RNN, and models with layers too
narrow to split (kept whole) compute the unpartitioned model's losses and gradients."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from spark_dl.model_parallel import Comm, merge_partitions, partition_model, split_sizes

from .test_model_parallel import group_reports


def narrow_fc():
    """A 1-unit bottleneck: at F >= 2 its Linear(8, 1) cannot be split and is kept whole."""
    return nn.Sequential(nn.Linear(12, 8), nn.Sigmoid(), nn.Linear(8, 1), nn.Tanh(),
                         nn.Linear(1, 3))


def _cols(n, world, rank):
    sizes = split_sizes(n, world)
    a = sum(sizes[:rank])
    return slice(a, a + sizes[rank])


def _grads_of(part, ref, world, rank) -> float:
    """Largest difference between the partitioned model's gradients, merged over the ranks
    (all-gathered), and the reference's."""
    import torch.distributed as dist
    parts = []
    for p in range(world):                    # every rank's gradients, as a model of slices
        q = partition_model(ref, Comm.layout(p, world))
        parts.append(q)
    mine = dict(part.named_parameters())
    for p, q in enumerate(parts):
        for name, t in q.named_parameters():
            g = mine[name].grad if name in mine and mine[name].grad is not None else None
            buf = (g if g is not None else torch.zeros_like(t)).contiguous().clone() \
                if p == rank else torch.zeros_like(t)
            if world > 1:
                dist.broadcast(buf, p)
            with torch.no_grad():
                t.copy_(buf)
    merged = merge_partitions(ref, parts)     # the slices' gradients, in the model's layout
    err = 0.0
    for name, r in ref.named_parameters():
        g = r.grad if r.grad is not None else torch.zeros_like(r)   # untouched: none
        err = max(err, float((merged[name] - g).abs().max()))
    return err


def _rank_main(rank, world):
    from spark_dl.model_parallel import kept_whole
    from spark_dl.models.rnn import CharRNN
    from spark_dl.models.ssda import SSDA, LayerSpec
    report = {}
    comm = Comm()
    g = torch.Generator().manual_seed(1)

    def check(name, ref, loss_fn):
        part = partition_model(ref, comm)
        ref.zero_grad()
        ref_loss = loss_fn(ref)
        ref_loss.backward()
        loss = loss_fn(part)
        loss.backward()
        report[name] = {"loss_error": abs(loss.item() - ref_loss.item()),
                        "grad_error": _grads_of(part, ref, world, rank),
                        "kept_whole": kept_whole(part)}
        return part

    # SSDA: 12 inputs, layers 7 (sparse) and 5 (no sparsity), pretraining and fine-tuning
    torch.manual_seed(0)
    ssda = SSDA(12, (LayerSpec(7, beta=0.1, rho=0.1, weight_decay=1e-2),
                     LayerSpec(5, beta=0.0, rho=1.0, weight_decay=1e-3))).double()
    noisy = torch.rand(6, 12, dtype=torch.float64, generator=g)
    clean = torch.rand(6, 12, dtype=torch.float64, generator=g)
    check("ssda_pretrain_1", ssda, lambda m: m.layers[0].loss(noisy, clean))
    with torch.no_grad():
        codes = ssda.encode(noisy, 1), ssda.encode(clean, 1)
    check("ssda_pretrain_2", ssda, lambda m: m.layers[1].loss(*codes))
    check("ssda_finetune", ssda, lambda m: m.finetune_loss(noisy, clean))
    # App. B's shape: the last layer, as wide as the input, is the output (no decoders)
    torch.manual_seed(0)
    out_stack = SSDA(12, (LayerSpec(7, beta=0.1, rho=0.1, weight_decay=1e-2, init_gain=4.0),
                          LayerSpec(12, 0.0, 1.0, 1e-3, output=True))).double()
    check("ssda_output_pretrain_2", out_stack, lambda m: m.layers[1].loss(
        *(m.encode(t, 1).detach() for t in (noisy, clean))))
    check("ssda_output_finetune", out_stack, lambda m: m.finetune_loss(noisy, clean))

    # Elman RNN (tanh), 2 layers of 11 units
    torch.manual_seed(0)
    rnn = CharRNN(vocab_size=9, hidden=11, layers=2, kind="rnn").double()
    ids = torch.randint(0, 9, (2, 5), generator=g)
    check("rnn", rnn, lambda m: nn.functional.cross_entropy(
        m(ids)[0].reshape(-1, 9), ids.roll(-1, 1).reshape(-1)))

    # a Linear layer narrower than F, kept whole
    torch.manual_seed(0)
    net = narrow_fc().double()
    x = torch.randn(6, 12, dtype=torch.float64, generator=g)
    y = torch.randint(0, 3, (6,), generator=g)
    check("narrow_fc", net, lambda m: nn.functional.cross_entropy(m(x), y))

    # SRCNN at F: its 1-channel output conv is kept whole
    from spark_dl.models import SRCNN
    torch.manual_seed(0)
    sr = SRCNN(widths=(5, 4), kernels=(5, 1, 3)).double()
    img = torch.rand(1, 1, 12, 12, dtype=torch.float64, generator=g)
    target = torch.rand(1, 1, 12, 12, dtype=torch.float64, generator=g)
    check("srcnn", sr, lambda m: nn.functional.mse_loss(m(img), target))

    # BatchNorm after a split convolution: kept whole (it normalises the gathered output),
    # training mode; its running statistics follow the batch as the unpartitioned model's
    torch.manual_seed(0)
    bn = nn.Sequential(nn.Conv2d(2, 6, 3, padding=1), nn.BatchNorm2d(6), nn.ReLU(),
                       nn.Flatten(), nn.Linear(6 * 4 * 4, 3)).double()
    x4 = torch.randn(5, 2, 4, 4, dtype=torch.float64, generator=g)
    y4 = torch.randint(0, 3, (5,), generator=g)
    part = check("batchnorm", bn, lambda m: nn.functional.cross_entropy(m(x4), y4))
    report["batchnorm"]["stats_error"] = max(
        float((part[1].running_mean - bn[1].running_mean).abs().max()),
        float((part[1].running_var - bn[1].running_var).abs().max()))
    return report


@pytest.mark.parametrize("world", [1, 2, 3])
def test_ssda_rnn_and_kept_whole_layers_equal_the_unpartitioned_models(world, tmp_path_factory):
    reports = group_reports(world, tmp_path_factory)["zoo"]         # with test_model_parallel
    for rep in reports:
        for name, r in rep.items():
            assert r["loss_error"] < 1e-10 and r["grad_error"] < 1e-10, (world, name, r)
        assert rep["narrow_fc"]["kept_whole"] == (["2"] if world > 1 else [])
        assert rep["srcnn"]["kept_whole"] == (["body.4"] if world > 1 else [])  # 1 channel
        assert rep["batchnorm"]["kept_whole"] == ["1"] and rep["batchnorm"]["stats_error"] < 1e-12


def test_cut_and_merge_the_ssda_rnn_and_a_kept_whole_layer():
    from spark_dl.models.rnn import CharRNN
    from spark_dl.models.ssda import SSDA, LayerSpec
    torch.manual_seed(0)
    for net in (SSDA(12, (LayerSpec(7), LayerSpec(5))), CharRNN(9, 11, 2, kind="rnn"),
                narrow_fc()):
        for F in (2, 3):
            parts = [partition_model(net, Comm.layout(p, F)) for p in range(F)]
            merged, ref = merge_partitions(net, parts), net.state_dict()
            assert merged.keys() == ref.keys()
            for k, v in ref.items():
                assert torch.equal(merged[k], v), (type(net).__name__, F, k)
            # the server holds every trainable number once: kept-whole layers in partition 0
            held = sum(q.numel() for part in parts for q in part.parameters() if q.requires_grad)
            assert held <= sum(q.numel() for q in net.parameters())


def test_what_cannot_be_partitioned_names_the_layer():
    from spark_dl.models.ssda import SSDA, LayerSpec
    gru = nn.Sequential(nn.Linear(4, 6), nn.GRU(6, 5, batch_first=True))
    with pytest.raises(ValueError, match=r"layer 1 \(GRU\) has no column-partitioned form; "
                                         r".*Linear, Conv2d, LSTM, RNN, SSDA DenoisingLayer and BatchNorm"):
        partition_model(gru, Comm.layout(0, 2))
    with pytest.raises(ValueError, match=r"layer layers.1 \(DenoisingLayer\) has 2 units, fewer "
                                         r"than partitions=3: use partitions <= 2"):
        partition_model(SSDA(12, (LayerSpec(7), LayerSpec(2))), Comm.layout(0, 3))
    with pytest.raises(ValueError, match=r"layer rnn \(RNN\) has 2 units"):
        from spark_dl.models.rnn import CharRNN
        partition_model(CharRNN(9, 2, 1, kind="rnn"), Comm.layout(0, 3))
