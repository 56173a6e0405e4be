"""The differentiable bicubic layer against Pillow, and the cascade's shapes and gradients."""

import numpy as np
import pytest
import torch

from spark_dl.superres.cascade import Bicubic, Cascade
from spark_dl.superres.images import bicubic


@pytest.mark.parametrize("size, out", [((16, 16), (32, 32)), ((10, 7), (30, 21)),
                                       ((12, 12), (48, 48))])
def test_bicubic_layer_equals_pillow(size, out):
    g = np.random.default_rng(0)
    img = g.random(size).astype(np.float32)
    layer = Bicubic(size, out)
    got = layer(torch.from_numpy(img)[None, None])[0, 0].numpy()
    assert np.abs(got - bicubic(img, out)).max() < 1e-5


def test_bicubic_layer_passes_gradients_and_rejects_other_sizes():
    layer = Bicubic((4, 4), (8, 8))
    x = torch.rand(2, 1, 4, 4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(layer, (x,))
    with pytest.raises(ValueError, match=r"built for \(4, 4\) inputs, got \(5, 5\)"):
        layer(torch.rand(1, 1, 5, 5))


def test_cascade_maps_noisy_lr_to_hr_and_trains_end_to_end():
    torch.manual_seed(0)
    model = Cascade(lr_size=16, scale=2)
    lr = torch.rand(4, 256)
    hr = torch.rand(4, 1, 32, 32)
    out = model(lr)
    assert out.shape == (4, 1, 32, 32)
    assert model.denoise(lr).shape == (4, 1, 16, 16)
    torch.nn.functional.mse_loss(out, hr).backward()
    # fine-tuning reaches the denoiser through the bicubic layer; the default SSDA's last
    # layer is the output (App. B), so its tied decoders' biases take no part after pretraining
    grads = {n: p.grad for n, p in model.ssda.named_parameters()}
    assert all(g is not None and g.abs().sum() > 0 for n, g in grads.items()
               if not n.endswith("bias_out"))
    assert all(g is None for n, g in grads.items() if n.endswith("bias_out"))
    assert model.up.a_h.grad is None                 # the resize itself is fixed
    with pytest.raises(ValueError, match="the SSDA takes 64 inputs, the LR patch has 256"):
        from spark_dl.models.ssda import SSDA
        Cascade(lr_size=16, ssda=SSDA(64))


def test_upscaler_is_the_cascade_without_its_denoiser():
    """The SRCNN trained on clean LR (the thesis's conventional method) sees bicubic(LR)."""
    from spark_dl.models.srcnn import SRCNN
    from spark_dl.superres.cascade import Upscaler
    torch.manual_seed(0)
    cnn = SRCNN()
    up = Upscaler(16, 2, cnn)
    x = torch.rand(3, 256)
    want = cnn(Bicubic((16, 16), (32, 32))(x.reshape(3, 1, 16, 16)))
    assert torch.allclose(up(x), want) and up(x).shape == (3, 1, 32, 32)


def test_active_units_counts_the_relus_that_fire():
    """A fresh SRCNN on real-looking inputs has live units in both ReLU layers; units whose
    bias is pushed far below any input's reach are counted dead, one by one."""
    from spark_dl.models.srcnn import SRCNN
    torch.manual_seed(0)
    cnn = SRCNN(residual=True)
    model = Cascade(16, 2, cnn=cnn)
    x = model.cnn_input(torch.rand(8, 256)).detach()
    assert x.shape == (8, 1, 32, 32)
    fresh = cnn.active_units(x)
    assert [n for _, n in fresh] == [64, 32] and all(a > n // 2 for a, n in fresh)
    with torch.no_grad():
        cnn.body[2].bias[:20] = -1e3                   # 20 of the second layer's 32 units
        h2 = cnn.body[2](cnn.body[1](cnn.body[0](x)))  # before its ReLU
    alive = (h2 > 0).permute(1, 0, 2, 3).reshape(32, -1).any(1)
    assert not alive[:20].any()
    assert cnn.active_units(x) == [fresh[0], (int(alive.sum()), 32)]
    with pytest.raises(ValueError, match="SRCNN expects images"):
        cnn.active_units(torch.rand(2, 3, 8, 8))


def test_noisy_skip_feeds_the_cnn_the_noisy_input_beside_the_denoised():
    """SRCNN(inputs=2) in the cascade sees [bicubic(SSDA(x)), bicubic(x)]; with the residual
    it starts as the identity on the denoised plane; gradients reach both planes' weights."""
    from spark_dl.models.srcnn import SRCNN
    torch.manual_seed(0)
    cnn = SRCNN(residual=True, inputs=2)
    assert (cnn.inputs, cnn.channels, SRCNN().inputs) == (2, 1, 1)
    model = Cascade(16, 2, cnn=cnn)
    lr = torch.rand(3, 256)
    x = model.cnn_input(lr)
    up = Bicubic((16, 16), (32, 32))
    assert x.shape == (3, 2, 32, 32)
    assert torch.allclose(x[:, :1], up(model.denoise(lr)))
    assert torch.allclose(x[:, 1:], up(lr.reshape(3, 1, 16, 16)))
    assert torch.allclose(model(lr), x[:, :1])          # the last layer starts at zero
    with torch.no_grad():
        cnn.body[-1].weight.normal_(0, 0.01)
    torch.nn.functional.mse_loss(model(lr), torch.rand(3, 1, 32, 32)).backward()
    first = cnn.body[0].weight.grad
    assert first[:, 0].abs().sum() > 0 and first[:, 1].abs().sum() > 0
    assert all(p.grad.abs().sum() > 0 for n, p in model.ssda.named_parameters()
               if not n.endswith("bias_out"))         # the output stack decodes nothing
    with pytest.raises(ValueError, match="SRCNN expects images \\(B, 2, H, W\\)"):
        cnn(torch.rand(1, 1, 8, 8))
    with pytest.raises(ValueError, match="inputs = 3"):
        Cascade(16, 2, cnn=SRCNN(inputs=3))
    with pytest.raises(ValueError, match="must include the 2 channels"):
        SRCNN(channels=2, inputs=1)


def _saved_run(folder):
    """A folder as a finished super-resolution run leaves it: conventional.pt, cascade.pt,
    thesis_conventional.pt and the patches' description (sigma 20, stride 16, seed 0)."""
    import json

    from spark_dl.models.srcnn import SRCNN
    from spark_dl.models.ssda import SSDA, LayerSpec
    torch.manual_seed(0)
    ssda = SSDA(256, (LayerSpec(32),))
    for name in ("conventional", "cascade", "thesis_conventional"):
        inputs = 1 if name == "thesis_conventional" else 2         # the noisy skip
        torch.save(Cascade(16, 2, ssda, SRCNN(residual=True, inputs=inputs)),
                   folder / f"{name}.pt")
    (folder / "patches").mkdir()
    (folder / "patches" / "_spark_dl.json").write_text(json.dumps(
        {"size": 32, "scale": 2, "stride": 16, "augment": False, "seed": 0, "degradation":
         {"kind": "gaussian", "sigma": 20.0, "blur": 1.0, "amount": 0.05}}))
    return folder


def test_a_saved_cascade_loads_without_unpickling_anything_else(tmp_path):
    from spark_dl.superres.cascade import load_cascade
    _saved_run(tmp_path)
    saved = torch.load(tmp_path / "cascade.pt", weights_only=False)
    model = load_cascade(tmp_path / "cascade.pt")
    lr = torch.rand(2, 256)
    assert torch.equal(model(lr), saved(lr))
    torch.save(torch.nn.Linear(2, 2), tmp_path / "linear.pt")      # a class it does not build
    with pytest.raises(ValueError, match=r"linear.pt is not a cascade saved by the "
                                         r"super-resolution job .*Linear"):
        load_cascade(tmp_path / "linear.pt")
    torch.save([1, 2], tmp_path / "list.pt")
    with pytest.raises(ValueError, match="holds a list, not a Cascade"):
        load_cascade(tmp_path / "list.pt")
    (tmp_path / "cut.pt").write_bytes((tmp_path / "cascade.pt").read_bytes()[:500])
    with pytest.raises(ValueError, match=r"cut.pt is not a cascade"):
        load_cascade(tmp_path / "cut.pt")
    with pytest.raises(FileNotFoundError, match="give the out_dir of a finished"):
        load_cascade(tmp_path / "missing.pt")


def test_init_from_checks_the_saved_run_against_the_configuration(tmp_path):
    """The continuation (init_from) trains the networks the configuration describes, on the
    same patch pairs: a saved run with another SSDA, skip, residual, scale or degradation is
    refused, naming the key to set."""
    from pathlib import Path

    from spark_dl import load_toml
    from spark_dl.config import ConfigError
    from spark_dl.recipes.superres_pipeline import SuperResConfig, _load_run
    conf = Path(__file__).resolve().parents[2] / "conf" / "jobs" / "superres.toml"
    (tmp_path / "run").mkdir()
    run = _saved_run(tmp_path / "run")
    ok = {"init_from": str(run), "ssda_layers": [32], "cnn_residual": True,
          "cnn_noisy_skip": True, "run.out_dir": str(tmp_path / "next")}
    logged = []
    loaded = _load_run(load_toml(SuperResConfig, conf, {**ok, "thesis_conventional_epochs": 1}),
                       log=logged.append)
    assert sorted(loaded) == ["cascade", "conventional", "thesis_conventional"]
    assert loaded["thesis_conventional"].cnn.inputs == 1          # no skip in the baseline
    assert "thesis_conventional_epochs not used" in logged[0]
    for key, value, message in [
            ("ssda_layers", [64], ("its conventional.pt was trained with ssda_layers = \\[32\\]; "
                                   "set ssda_layers = \\[32\\]")),
            ("cnn_noisy_skip", False, ("its conventional.pt was trained with cnn_noisy_skip = "
                                       "true; set cnn_noisy_skip = true")),
            ("cnn_residual", False, ("its conventional.pt was trained with cnn_residual = true; "
                                     "set cnn_residual = true")),
            ("scale", 4, "its conventional.pt was trained with scale = 2; set scale = 2"),
            ("patch", 48, "its conventional.pt was trained with patch = 32; set patch = 32"),
            ("sigma", 25.0, "its patches were made with sigma = 20.0; set sigma = 20.0"),
            ("noise", "blur", ("its patches were made with noise = 'gaussian'; set noise = "
                               "'gaussian'")),
            ("run.seed", 1, "its patches were made with run.seed = 0; set run.seed = 0")]:
        with pytest.raises(ConfigError, match=f"'{key}' init_from .*: {message}, got"):
            _load_run(load_toml(SuperResConfig, conf, {**ok, key: value}), log=lambda _: None)
    with pytest.raises(ConfigError, match="'init_cascade' must be 'cascade' or 'conventional'"):
        load_toml(SuperResConfig, conf, {**ok, "init_cascade": "ssda"})
    with pytest.raises(ConfigError, match=r"'init_from' must differ from run.out_dir"):
        load_toml(SuperResConfig, conf, {**ok, "run.out_dir": str(run)})
    (run / "patches" / "_spark_dl.json").unlink()                 # unchecked, and said so
    logged.clear()
    _load_run(load_toml(SuperResConfig, conf, {**ok, "sigma": 25.0}), log=logged.append)
    assert "_spark_dl.json is missing" in logged[0]
    (run / "cascade.pt").unlink()
    with pytest.raises(FileNotFoundError, match=r"cascade.pt: give the out_dir"):
        _load_run(load_toml(SuperResConfig, conf, ok), log=lambda _: None)
