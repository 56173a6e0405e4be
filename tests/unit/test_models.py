import numpy as np
import pytest
import torch

from spark_dl.data import ShardData
from spark_dl.models import MODELS, FCNet, ResNet18, ThesisCNN, TransformerLM, build_model
from spark_dl.train import evaluate, make_optimizer, train_epoch


def test_shapes_of_the_thesis_nets():
    x = torch.rand(5, 784)
    assert build_model("fc")(x).shape == (5, 10)
    assert build_model("cnn")(x).shape == (5, 10)
    assert build_model("cnn")(x.view(5, 1, 28, 28)).shape == (5, 10)
    assert ThesisCNN(widths=(16, 32, 32))(x).shape == (5, 10)
    assert [m.out_features for m in FCNet().modules() if isinstance(m, torch.nn.Linear)] == \
        [480, 160, 10]


def test_wrong_shapes_and_names():
    with pytest.raises(ValueError, match=r"expects 784 input features.* got 100"):
        FCNet()(torch.rand(2, 100))
    with pytest.raises(ValueError, match=r"ThesisCNN expects inputs \(B, 1, 28, 28\)"):
        ThesisCNN()(torch.rand(2, 3, 28, 28))
    with pytest.raises(ValueError, match="unknown model 'vgg'"):
        build_model("vgg")
    with pytest.raises(ValueError, match="unknown activation 'swish'"):
        FCNet(act="swish")
    with pytest.raises(ValueError, match="unknown optimizer 'lbfgs2'; choose one of sgd"):
        make_optimizer("lbfgs2", FCNet().parameters(), 0.1)
    from spark_dl.models.rnn import CharRNN
    for ids, seen in (([[0, 10]], "0..10"), ([[-1, 3]], "-1..3")):
        with pytest.raises(ValueError, match=rf"ids must be in 0..9, got {seen}; encode with"):
            CharRNN(10, 4, 1)(torch.tensor(ids))


def _parameters(name: str, **config) -> int:
    with torch.device("meta"):                  # no memory, whatever the size
        return sum(p.numel() for p in build_model(name, **config).parameters())


def test_resnet18_cifar_style_shapes_and_sizes():
    assert _parameters("resnet18") == 11_173_962                  # the usual ResNet-18
    assert _parameters("resnet18", width=16) == 701_466 < _parameters("resnet18", width=32)
    torch.manual_seed(0)
    net = build_model("resnet18", width=4, num_classes=7, in_channels=1)
    assert sum(isinstance(m, torch.nn.BatchNorm2d) for m in net.modules()) == 20
    assert not any(isinstance(m, torch.nn.MaxPool2d) for m in net.modules())
    x = torch.rand(3, 1, 32, 32)
    assert net(x).shape == (3, 7)
    torch.testing.assert_close(net.eval()(x.view(3, -1)), net(x))  # flat rows of square images
    assert net(torch.rand(2, 1, 28, 28)).shape == (2, 7)
    with pytest.raises(ValueError, match=r"ResNet18 expects images \(B, 1, H, W\).* got "
                                         r"\(2, 3, 32, 32\)"):
        net(torch.rand(2, 3, 32, 32))
    with pytest.raises(ValueError, match="width must be a positive integer, got 0"):
        ResNet18(width=0)


def test_transformer_is_causal_and_sized_by_its_configuration():
    char = dict(vocab=65, layers=4, width=256, heads=4, context=128)
    assert _parameters("transformer", **char) == 3_225_600
    assert _parameters("transformer", **char, tie=True) == 3_225_600 - 65 * 256
    torch.manual_seed(0)
    net = build_model("transformer", vocab=11, layers=2, width=16, heads=2, context=8,
                      dropout=0.0).eval()
    ids = torch.randint(0, 11, (3, 8))
    out = net(ids)
    assert out.shape == (3, 8, 11) and out.dtype == torch.float32
    changed = ids.clone()
    changed[:, 5] = (changed[:, 5] + 1) % 11
    after = net(changed)                           # a later token changes no earlier logits
    torch.testing.assert_close(after[:, :5], out[:, :5])
    assert not torch.allclose(after[:, 5:], out[:, 5:])
    assert net(ids[:, :3]).shape == (3, 3, 11)     # shorter than the context
    from spark_dl.losses import sequence_cross_entropy
    assert float(sequence_cross_entropy(out, ids).detach()) == pytest.approx(np.log(11), rel=0.1)
    tied = TransformerLM(vocab=11, layers=1, width=16, heads=2, context=8, tie=True)
    assert tied.head.weight is tied.tok.weight
    for bad, match in ((ids.float(), r"takes integer token ids \(B, T\), got a torch.float32"),
                       (torch.zeros(2, 9, dtype=torch.long), "at most context=8 tokens, got 9"),
                       (torch.full((1, 2), 11), r"token ids must be in 0..10, got 11..11")):
        with pytest.raises(ValueError, match=match):
            net(bad)
    with pytest.raises(ValueError, match="width 16 must be a multiple of heads 3"):
        TransformerLM(width=16, heads=3)


def test_an_unknown_model_name_lists_the_zoo():
    assert list(MODELS) == ["fc", "cnn", "cnn_bn", "resnet18", "transformer"]
    with pytest.raises(ValueError, match="unknown model 'resnet'; the zoo has fc, cnn, cnn_bn, "
                                         "resnet18, transformer"):
        build_model("resnet")


def test_reference_loop_learns_real_digits(mnist):
    x, y = mnist
    torch.manual_seed(0)
    shard = ShardData(x[:2000].reshape(2000, -1).astype("float32") / 255, y[:2000])
    model = build_model("cnn")
    opt = make_optimizer("adam", model.parameters(), 3e-3)
    before = evaluate(model, shard.features[-500:], y[1500:2000])
    h = [train_epoch(model, shard.batches(32, epoch=e), opt) for e in range(4)]
    after = evaluate(model, x[-1000:].reshape(1000, -1) / 255, y[-1000:])
    assert h[3]["loss"] < h[0]["loss"] < before["loss"]
    assert after["accuracy"] > 0.8 and h[0]["samples"] == 2000


def test_adam_is_the_fused_kernel_and_the_same_update():
    """make_optimizer("adam") takes torch's fused Adam where it exists (CPU since torch 2.4):
    the same trajectory as the default implementation, float64 to rounding."""
    torch.manual_seed(0)
    ref, fused = FCNet().double(), FCNet().double()
    fused.load_state_dict(ref.state_dict())
    opts = [torch.optim.Adam(ref.parameters(), lr=1e-2, weight_decay=1e-4),
            make_optimizer("adam", fused.parameters(), 1e-2, weight_decay=1e-4)]
    assert opts[1].defaults.get("fused") is True
    x, y = torch.rand(16, 784, dtype=torch.float64), torch.randint(0, 10, (16,))
    for _ in range(5):
        for model, opt in zip((ref, fused), opts):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
    for a, b in zip(ref.parameters(), fused.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_a_loaded_checkpoint_keeps_the_optimizers_own_hyperparameters():
    """load_optimizer_state takes the checkpoint's state (the momentum buffers, the rate)
    but not its hyperparameters: a fit resumed with nesterov=True, another momentum or
    another weight decay steps with those."""
    from spark_dl.optim.factory import load_optimizer_state
    model = FCNet((4, 3))
    classic = make_optimizer("sgd", model.parameters(), 0.1, 0.9)
    model(torch.rand(2, 4)).sum().backward()
    classic.step()
    resumed = make_optimizer("sgd", model.parameters(), 0.5, 0.8, weight_decay=1e-4,
                             nesterov=True)
    load_optimizer_state(resumed, classic.state_dict())
    group = resumed.param_groups[0]
    assert (group["nesterov"], group["momentum"], group["weight_decay"]) == (True, 0.8, 1e-4)
    assert group["lr"] == 0.1                             # the rate from the checkpoint
    assert all("momentum_buffer" in s for s in resumed.state.values())
    adam = make_optimizer("adam", model.parameters(), 0.01)
    adam.step()
    fresh = make_optimizer("adam", model.parameters(), 0.02, weight_decay=1e-3)
    load_optimizer_state(fresh, adam.state_dict())
    assert fresh.param_groups[0]["weight_decay"] == 1e-3
    assert all(float(s["step"]) == 1 for s in fresh.state.values())   # Adam's moments kept
