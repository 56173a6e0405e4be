"""The training jobs end to end on tiny configurations (the quality runs are benchmarks)."""

import json
import subprocess
import sys

import numpy as np
import pytest

from spark_dl import ConfigError, load_toml
from spark_dl.recipes.charlm import CharConfig
from spark_dl.recipes.cli import parse_overrides
from spark_dl.recipes.mnist import MnistJobConfig
from spark_dl.recipes.superres import SRCNNConfig, SSDAConfig, denoise_image
from spark_dl.superres import bicubic, load_y, modcrop, psnr, ssim

from ..conftest import ROOT


def _job(script, config, tmp_path, *sets):
    args = [sys.executable, str(ROOT / "jobs" / script), "--config", str(ROOT / config),
            "--set", f"run.out_dir='{tmp_path}'", "--set", "run.device=cpu"]
    for s in sets:
        args += ["--set", s]
    proc = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    files = list(tmp_path.glob("*.json"))
    assert len(files) == 1
    return json.loads(files[0].read_text())


def test_shipped_job_configs_load():
    for cls, name in [(MnistJobConfig, "cnn"), (MnistJobConfig, "fc"), (CharConfig, "char_lstm"),
                      (CharConfig, "char_lstm_gpu"), (CharConfig, "char_rnn"),
                      (SSDAConfig, "ssda"), (SRCNNConfig, "srcnn")]:
        load_toml(cls, ROOT / "conf" / "jobs" / f"{name}.toml")
    from spark_dl.recipes.superres_pipeline import SuperResConfig
    load_toml(SuperResConfig, ROOT / "conf" / "jobs" / "superres.toml")
    quality = load_toml(SuperResConfig, ROOT / "conf" / "jobs" / "superres-quality.toml")
    assert quality.ssda_layers == (1280,) and quality.tile_stride == 1 and quality.cnn_residual
    assert quality.self_ensemble and quality.thesis_conventional_epochs > 0
    sweep = load_toml(SuperResConfig, ROOT / "conf" / "jobs" / "superres-sweep.toml")
    assert not sweep.augment and sweep.thesis_conventional_epochs > 0
    with pytest.raises(ConfigError, match="'lr_decay' must be in"):
        load_toml(SuperResConfig, ROOT / "conf/jobs/superres.toml", {"lr_decay": 1.5})
    with pytest.raises(ConfigError, match="'tile_stride' must be between 1 and the LR patch "
                                          "side 16, got 17"):
        load_toml(SuperResConfig, ROOT / "conf/jobs/superres.toml", {"tile_stride": 17})
    load_toml(MnistJobConfig, ROOT / "conf" / "jobs" / "fc_hybrid.toml")
    with pytest.raises(ConfigError, match="'patch' must be a multiple of scale 3"):
        load_toml(SuperResConfig, ROOT / "conf/jobs/superres.toml", {"scale": 3})
    assert load_toml(CharConfig, ROOT / "conf/jobs/char_rnn.toml").kind == "rnn"
    with pytest.raises(ConfigError, match="unknown key 'hiden'"):
        load_toml(CharConfig, ROOT / "conf/jobs/char_lstm.toml", {"hiden": 3})
    with pytest.raises(ConfigError, match="'tbptt' must be <= seq_len"):
        load_toml(CharConfig, ROOT / "conf/jobs/char_lstm.toml", {"tbptt": 2000})
    assert parse_overrides(["a=1", "b=false", "c='x'", "d=word"]) == \
        {"a": 1, "b": False, "c": "x", "d": "word"}


def test_mnist_job(tmp_path):
    r = _job("train_mnist.py", "conf/jobs/cnn.toml", tmp_path, "data.extended_samples=1000",
             "train.epochs=2", "data.n_train_source=1000")
    assert r["train_samples"] == 2000 and len(r["history"]) == 2
    assert r["history"][1]["loss"] < r["history"][0]["loss"] and r["test_accuracy"] > 0.3
    assert (tmp_path / "cnn-sgd.pt").exists()


def test_char_job_samples_text(tmp_path):
    r = _job("train_char.py", "conf/jobs/char_lstm.toml", tmp_path, "updates=30",
             "eval_every=15", "hidden=32", "layers=1", "seq_len=100", "tbptt=25",
             "sample_len=50", "val_fraction=0.01")   # validated on the last 11,000 chars
    assert r["updates"] == 30 and len(r["curve"]) == 2 and r["vocab"] == 65
    assert r["curve"][1]["val_loss"] < r["curve"][0]["val_loss"] < np.log(65)
    assert r["sample"].startswith("ROMEO:\n") and len(r["sample"]) == 7 + 50


def test_char_job_validates_a_moving_average_of_the_weights():
    from spark_dl.recipes.charlm import train_char
    from spark_dl.recipes.common import RunConfig
    small = dict(corpus=str(ROOT / "data/text/tinyshakespeare.txt"), hidden=16, layers=1,
                 seq_len=40, tbptt=20, batch_size=8, updates=20, eval_every=10,
                 sample_len=5, val_fraction=0.01, run=RunConfig(device="cpu"))
    # a decay of ~0: the average is the weights themselves
    r = train_char(CharConfig(**small, ema=1e-12), log=lambda m: None)
    assert r["ema"] == 1e-12 and len(r["curve"]) == 2
    for c in r["curve"]:
        assert c["val_loss_ema"] == pytest.approx(c["val_loss"], abs=1e-6)
    # a long memory: the average lags the weights (still near the initial ones)
    r = train_char(CharConfig(**small, ema=0.99, weight_decay=1e-4), log=lambda m: None)
    assert all(abs(c["val_loss_ema"] - c["val_loss"]) > 1e-4 for c in r["curve"])
    assert "val_loss_ema" not in train_char(CharConfig(**small), log=lambda m: None)["curve"][0]
    with pytest.raises(ConfigError, match="'ema' must be in"):
        CharConfig(**small, ema=1.0)
    with pytest.raises(ConfigError, match="without weight_decay and ema"):
        CharConfig(**small, ema=0.9, strategy="allreduce")


def test_ssda_and_srcnn_jobs(tmp_path):
    r = _job("train_ssda.py", "conf/jobs/ssda.toml", tmp_path / "a", "stride=32",
             "pretrain_epochs=1", "finetune_epochs=1",
             "layers=[{'hidden': 32, 'beta': 0.01, 'rho': 0.05}]")
    assert len(r["psnr_noisy"]) == 5 and r["mean_psnr_noisy"] == pytest.approx(22.3, abs=0.3)
    r = _job("train_srcnn.py", "conf/jobs/srcnn.toml", tmp_path / "b", "epochs=1",
             "augment=false", "stride=120")          # 471 training patches
    assert set(r["per_image"]) == {"baby", "bird", "butterfly", "head", "woman"}
    assert r["mean_psnr_bicubic"] == pytest.approx(33.69, abs=0.01)


def test_metrics_and_patch_denoising_of_an_identity_model():
    y = modcrop(load_y(ROOT / "data/sr/Set5/baby.png"), 2)
    up = bicubic(bicubic(y, (y.shape[0] // 2, y.shape[1] // 2)), y.shape)
    assert psnr(y, y) == float("inf") and ssim(y, y) == pytest.approx(1.0)
    assert 36.5 < psnr(up, y, border=2) < 37.5 and 0.9 < ssim(up, y, border=2) < 1.0
    with pytest.raises(ValueError, match="one shape"):
        psnr(y, y[:-1])
    identity = lambda x: x          # noqa: E731  overlapping patches averaged give the image back
    out = denoise_image(identity, y[:40, :50], patch=16, stride=4)
    np.testing.assert_allclose(out, y[:40, :50], atol=1e-6)
