"""The model zoo of the thesis: SSDA, char RNN/LSTM, SRCNN, CG/L-BFGS, the reference train_loop."""

import numpy as np
import pytest
import torch

from spark_dl.data import ShardData
from spark_dl.models import (
    SRCNN,
    SSDA,
    CharRNN,
    DenoisingLayer,
    FCNet,
    LayerSpec,
    kl_sparsity,
    masked_cross_entropy,
    pad_sequences,
    sample,
    train_tbptt,
)
from spark_dl.optim import NonlinearCG, make_optimizer
from spark_dl.train import evaluate, restore_checkpoint, seed_everything, train_loop, train_step

# ---- SSDA -------------------------------------------------------------------------------

def test_kl_term_gradient_matches_finite_differences_and_the_formula():
    rho_hat = torch.tensor([0.1, 0.3, 0.5, 0.9], dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda r: kl_sparsity(r, 0.05), (rho_hat,))
    kl_sparsity(rho_hat, 0.05).backward()
    r = rho_hat.detach()
    np.testing.assert_allclose(rho_hat.grad, -0.05 / r + 0.95 / (1 - r), rtol=1e-12)
    assert float(kl_sparsity(torch.full((3,), 0.05, dtype=torch.float64), 0.05)) == \
        pytest.approx(0, abs=1e-12)


def test_layer_loss_gradient_float64():
    torch.manual_seed(0)
    layer = DenoisingLayer(6, LayerSpec(4, beta=0.5, rho=0.2, weight_decay=0.1)).double()
    noisy, clean = torch.rand(5, 6, dtype=torch.float64), torch.rand(5, 6, dtype=torch.float64)
    w0 = layer.weight.detach().clone()

    def loss_of(w):
        with torch.no_grad():
            layer.weight.copy_(w)
        return layer.loss(noisy, clean).item()
    layer.weight.grad = None
    layer.loss(noisy, clean).backward()
    num = torch.zeros_like(w0)
    for idx in np.ndindex(*w0.shape):
        e = torch.zeros_like(w0)
        e[idx] = 1e-6
        num[idx] = (loss_of(w0 + e) - loss_of(w0 - e)) / 2e-6
    np.testing.assert_allclose(layer.weight.grad, num, rtol=1e-5, atol=1e-8)


def test_weights_are_tied():
    layer = DenoisingLayer(8, LayerSpec(3))
    assert [n for n, _ in layer.named_parameters()] == ["weight", "bias", "bias_out"]
    h = torch.rand(2, 3)
    expect = torch.sigmoid(h @ layer.weight + layer.bias_out)
    assert torch.allclose(layer.decode(h), expect)


def test_pretraining_then_finetuning_denoises_real_digits(mnist):
    x, _ = mnist
    clean = torch.from_numpy(x[:1500, 6:22, 6:22].reshape(1500, 256) / 255.0).float()
    gen = torch.Generator().manual_seed(0)
    noisy = (clean + 0.25 * torch.randn(clean.shape, generator=gen)).clamp(0, 1)
    shard = ShardData(torch.stack([noisy, clean], 1).numpy(), np.zeros(1500))
    def batches(epoch):
        for xb, _ in shard.batches(50, seed=1, epoch=epoch):
            yield xb[:, 0], xb[:, 1]
    torch.manual_seed(0)
    model = SSDA(256, [LayerSpec(128, 0.01, 0.05), LayerSpec(64, 0.0, 1.0)])
    history = model.pretrain(batches, lambda p: torch.optim.Adam(p, 3e-3), epochs=4)
    assert all(h[-1] < h[0] for h in history)                 # every layer's loss fell
    def mse(m):
        with torch.no_grad():
            return float(((m(noisy) - clean) ** 2).mean())
    pretrained = mse(model)
    opt = torch.optim.Adam(model.parameters(), 3e-3)
    losses = [model.finetune(batches(e), opt) for e in range(12)]
    assert losses[-1] < losses[0] and mse(model) < pretrained
    with pytest.raises(ValueError, match="SSDA expects 256 inputs per sample, got 100"):
        model(torch.rand(2, 100))


def test_layer_spec_validation():
    with pytest.raises(ValueError, match="rho must be in"):
        LayerSpec(10, rho=0)
    with pytest.raises(ValueError, match="init_gain must be > 0"):
        LayerSpec(10, init_gain=0)


def test_the_thesis_stack_ends_in_its_output_layer():
    """App. B's third layer (256 units, no sparsity) is the denoised patch: 256-1280-1280-256,
    no decoders, the sigmoid init below the output; a single layer keeps its tied decoder."""
    from spark_dl.models.ssda import THESIS_SSDA_LAYERS, app_b_layers
    assert [(s.hidden, s.beta, s.rho, s.init_gain, s.output) for s in THESIS_SSDA_LAYERS] == \
        [(1280, 0.01, 0.05, 4.0, False), (1280, 0.01, 0.05, 4.0, False),
         (256, 0.0, 1.0, 1.0, True)]
    torch.manual_seed(0)
    model = SSDA(16, app_b_layers((12, 16), 16))
    x = torch.rand(3, 16)
    assert torch.equal(model(x), model.encode(x))
    assert model.layers[0].weight.abs().max() > (6 / 28) ** 0.5        # bound 4 * sqrt(6/28)
    assert SSDA(64).layers[-1].spec.output and SSDA(64)(torch.rand(2, 64)).shape == (2, 64)
    one = SSDA(16, app_b_layers((12,), 16))
    assert not one.layers[0].spec.output and one.layers[0].spec.init_gain == 1.0
    h = one.layers[0].encode(x)
    assert torch.equal(one(x), one.layers[0].decode(h))
    with pytest.raises(ValueError, match=r"must be as wide as the input \(16\).*width 12"):
        SSDA(16, (LayerSpec(12, output=True),))
    with pytest.raises(ValueError, match="output=True on layer 1 of 2"):
        SSDA(16, (LayerSpec(16, output=True), LayerSpec(16)))


# ---- char RNN / LSTM -----------------------------------------------------------------------

def test_masked_loss_ignores_padded_steps():
    torch.manual_seed(0)
    ids, mask = pad_sequences([[1, 2, 3, 4], [2, 3]])
    assert ids.tolist() == [[1, 2, 3, 4], [2, 3, 0, 0]]
    assert mask.tolist() == [[True] * 4, [True, True, False, False]]
    logits = torch.randn(2, 4, 5)
    targets = torch.randint(0, 5, (2, 4))
    a = masked_cross_entropy(logits, targets, mask)
    logits2, targets2 = logits.clone(), targets.clone()
    logits2[1, 2:] = 100 * torch.randn(2, 5)
    targets2[1, 2:] = 4
    assert torch.equal(a, masked_cross_entropy(logits2, targets2, mask))
    flat = [(b, t) for b in range(2) for t in range(4) if mask[b, t]]
    ref = torch.stack([torch.nn.functional.cross_entropy(logits[b, t][None], targets[b, t][None])
                       for b, t in flat]).mean()
    assert torch.allclose(a, ref)


def test_masked_lstm_loss_gradient_float64():
    torch.manual_seed(0)
    model = CharRNN(5, hidden=4, layers=2, kind="lstm").double()
    ids, mask = pad_sequences([[1, 2, 3, 4, 0, 1], [2, 3, 1]])
    targets = torch.roll(ids, -1, 1)
    w = model.rnn.weight_hh_l1
    def loss():
        return masked_cross_entropy(model(ids)[0], targets, mask)
    model.zero_grad()
    loss().backward()
    g = w.grad.clone()
    for idx in [(0, 0), (3, 2), (9, 1), (15, 3)]:
        with torch.no_grad():
            w[idx] += 1e-6
            up = loss().item()
            w[idx] -= 2e-6
            down = loss().item()
            w[idx] += 1e-6
        assert (up - down) / 2e-6 == pytest.approx(float(g[idx]), rel=1e-5, abs=1e-9)


@pytest.mark.parametrize("kind", ["lstm", "rnn"])
def test_chunked_forward_with_carried_state_equals_the_full_sequence(kind):
    torch.manual_seed(0)
    model = CharRNN(7, hidden=8, layers=2, kind=kind)
    ids = torch.randint(0, 7, (3, 20))
    full, _ = model(ids)
    state, parts = None, []
    for t in range(0, 20, 6):
        out, state = model(ids[:, t:t + 6], state)
        parts.append(out)
    assert torch.allclose(torch.cat(parts, 1), full, atol=1e-6)


def test_tbptt_learns_a_pattern_and_sampling_follows_it():
    torch.manual_seed(0)
    text = np.array([0, 1, 2, 3] * 60)
    ids = torch.as_tensor(np.stack([np.roll(text, -s) for s in range(4)]))   # (4, 240)
    model = CharRNN(4, hidden=16, layers=1, kind="lstm")
    opt = make_optimizer("rmsprop", model.parameters(), 1e-2)
    losses = [train_tbptt(model, ids[:, :-1], ids[:, 1:], opt, chunk=20)[0] for _ in range(15)]
    assert losses[-1] < 0.1 < losses[0]
    out = sample(model, [0, 1], length=12, temperature=0.5,
                 generator=torch.Generator().manual_seed(0))
    assert out == [2, 3, 0, 1] * 3
    with pytest.raises(ValueError, match="temperature must be > 0"):
        sample(model, [0], temperature=0)


def test_rnn_bad_inputs():
    model = CharRNN(4, hidden=3, layers=1)
    with pytest.raises(ValueError, match=r"ids must be in 0..3, got 0..9"):
        model(torch.tensor([[0, 9]]))
    with pytest.raises(ValueError, match="expects ids \\(B, T\\)"):
        model(torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="longer than the configured max_len=3"):
        pad_sequences([[1, 2], [1, 2, 3, 4]], max_len=3)
    with pytest.raises(ValueError, match="vocab_size must be >= 1"):
        CharRNN(0)
    with pytest.raises(ValueError, match="unknown recurrent kind 'gru'"):
        CharRNN(4, kind="gru")


# ---- SRCNN -----------------------------------------------------------------------------

def test_srcnn_shapes_and_channels():
    m = SRCNN()
    assert m(torch.rand(2, 1, 33, 20)).shape == (2, 1, 33, 20)
    assert [c.kernel_size for c in m.modules() if isinstance(c, torch.nn.Conv2d)] == \
        [(9, 9), (5, 5), (5, 5)]
    assert [c.out_channels for c in m.modules() if isinstance(c, torch.nn.Conv2d)] == [64, 32, 1]
    with pytest.raises(ValueError, match=r"expects images \(B, 1, H, W\), got \(2, 3, 8, 8\)"):
        m(torch.rand(2, 3, 8, 8))


def test_residual_srcnn_starts_as_the_identity_and_learns_the_difference():
    torch.manual_seed(0)
    m = SRCNN(residual=True)
    x = torch.rand(2, 1, 12, 12)
    assert torch.equal(m(x), x)                       # last layer at zero: y = x exactly
    loss = ((m(x) - (x + 0.1)) ** 2).mean()
    loss.backward()                                   # only the last layer gets a gradient first
    assert m.body[-1].weight.grad.abs().sum() > 0 and m.body[-1].bias.grad.item() < 0
    assert m.body[0].weight.grad.abs().sum() == 0


# ---- optimizers and the reference loop ---------------------------------------------------

def test_cg_solves_a_quadratic():
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(20, 20, generator=gen, dtype=torch.float64)
    A = q @ q.T + 0.5 * torch.eye(20, dtype=torch.float64)
    b = torch.randn(20, generator=gen, dtype=torch.float64)
    x = torch.zeros(20, dtype=torch.float64, requires_grad=True)
    opt = NonlinearCG([x], lr=1.0, max_iter=500)
    def closure():
        opt.zero_grad()
        f = 0.5 * x @ A @ x - b @ x
        f.backward()
        return f
    opt.step(closure)
    np.testing.assert_allclose(x.detach(), torch.linalg.solve(A, b), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("name", ["cg", "lbfgs", "sgd", "rmsprop", "adagrad", "adam"])
def test_every_optimizer_trains_the_fc_net(name, mnist):
    x, y = mnist
    xs = torch.from_numpy(x[:500].reshape(500, -1) / 255.0).float()
    ys = torch.from_numpy(y[:500])
    torch.manual_seed(0)
    model = FCNet((784, 32, 10))
    lr = {"cg": 1.0, "lbfgs": 1.0, "sgd": 0.5, "rmsprop": 1e-3, "adagrad": 0.05, "adam": 1e-2}
    opt = make_optimizer(name, model.parameters(), lr[name], max_iter=5)
    before = evaluate(model, xs, ys)["loss"]
    for _ in range(10):
        train_step(model, xs, ys, opt)                          # full batch
    assert evaluate(model, xs, ys)["loss"] < 0.8 * before


def test_fit_history_checkpoint_and_determinism(mnist, tmp_path):
    x, y = mnist
    shard = ShardData(x[:600].reshape(600, -1).astype(np.float32) / 255, y[:600])
    def run(ckpt):
        seed_everything(3)
        model = FCNet((784, 16, 10))
        opt = make_optimizer("sgd", model.parameters(), 0.1)
        h = train_loop(model, lambda e: shard.batches(32, seed=3, epoch=e), opt, epochs=2,
                       evaluate_fn=lambda m: evaluate(m, shard.features[:100], y[:100]),
                       checkpoint=ckpt, log=None)
        return model, opt, h
    m1, _opt1, h1 = run(tmp_path / "a.pt")
    m2, _, h2 = run(tmp_path / "b.pt")
    assert h1 == [{**r, "seconds": r["seconds"]} for r in h1] and len(h1) == 2
    assert [r["loss"] for r in h1] == [r["loss"] for r in h2]
    for p, q in zip(m1.parameters(), m2.parameters()):
        assert torch.equal(p, q)
    assert {"epoch", "loss", "samples", "val_loss", "val_accuracy"} <= set(h1[0])
    fresh = FCNet((784, 16, 10))
    info = restore_checkpoint(tmp_path / "a.pt", fresh)
    assert info["epoch"] == 2 and info["history"][1]["loss"] == h1[1]["loss"]
    for p, q in zip(m1.parameters(), fresh.parameters()):
        assert torch.equal(p, q)
    assert not list(tmp_path.glob(".*tmp*"))                  # atomic write left nothing


def test_charlm_carries_the_state_over_a_sequence_of_windows():
    """carry=2: the second batch starts from the first's final state (detached), the third
    from zero again; a batch of another size, or eval mode, starts from zero."""
    from spark_dl.models import CharLM
    torch.manual_seed(0)
    lm = CharLM(7, hidden=5, layers=1, kind="lstm", carry=2)
    g = torch.Generator().manual_seed(1)
    a, b, c = (torch.randint(0, 7, (3, 4), generator=g) for _ in range(3))
    rnn = lm.rnn
    with torch.no_grad():
        ref_a, state = rnn(a)
        ref_b, _ = rnn(b, state)
        ref_c, _ = rnn(c)
        out = [lm(a), lm(b), lm(c)]
    assert torch.allclose(out[0], ref_a) and torch.allclose(out[1], ref_b)
    assert torch.allclose(out[2], ref_c)                   # a new sequence: reset
    assert not torch.allclose(out[1], rnn(b)[0])           # the carried state mattered
    with torch.no_grad():
        lm(a)                                               # batch 4 starts a sequence
        assert torch.allclose(lm(b[:2]), rnn(b[:2])[0])     # another batch size: reset
        lm.eval()
        assert torch.allclose(lm(c), ref_c)                 # eval: always from zero
    with pytest.raises(ValueError, match="carry must be >= 1"):
        CharLM(7, carry=0)
