"""SSDA denoising and SRCNN super-resolution on T91 → Set5 (Y channel), single process.

SSDA: clean LR patches (T91 downscaled ×scale, 16×16) with Gaussian noise σ/255 → clean;
layer-wise pretraining, then fine-tuning; evaluated by denoising whole noisy Set5 LR images
patch by patch (overlapping patches averaged) and reporting PSNR before/after.
SRCNN: bicubic-upscaled LR → HR on 33×33 patches; evaluated on whole Set5 images (PSNR with
``scale`` pixels shaved) against bicubic.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from ..config import _check
from ..data import ShardData
from ..models import SRCNN, SSDA, THESIS_SSDA_LAYERS, LayerSpec
from ..superres import bicubic, load_y, modcrop, patches, psnr
from ..train import make_optimizer, seed_everything, train_epoch
from .common import RunConfig, pick_device

__all__ = ["SRCNNConfig", "SSDAConfig", "denoise_image", "train_srcnn", "train_ssda"]


def _images(folder: str, scale: int) -> list[np.ndarray]:
    files = sorted(p for p in Path(folder).iterdir() if p.suffix.lower() in (".png", ".jpg",
                                                                              ".jpeg", ".bmp"))
    if not files:
        raise ValueError(f"no images in {folder}; point the config at a folder of PNG/JPEG files")
    return [modcrop(load_y(p), scale) for p in files]


def _downscale(y: np.ndarray, scale: int) -> np.ndarray:
    return bicubic(y, (y.shape[0] // scale, y.shape[1] // scale))


@dataclasses.dataclass(frozen=True)
class SSDAConfig:
    train_dir: str = "data/sr/T91"
    test_dir: str = "data/sr/Set5"
    scale: int = 2
    patch: int = 16
    stride: int = 4
    sigma: float = 20.0             # Gaussian noise std on the 0-255 scale
    layers: tuple = tuple(dataclasses.asdict(s) for s in THESIS_SSDA_LAYERS)
    pretrain_epochs: int = 5
    finetune_epochs: int = 10
    batch_size: int = 128
    lr: float = 1e-3
    run: RunConfig = RunConfig()

    def __post_init__(self):
        _check(self.sigma >= 0, "sigma", self.sigma, "must be >= 0")
        _check(self.patch >= 2 and self.stride >= 1, "patch/stride", (self.patch, self.stride),
               "must be >= 2 and >= 1")


def denoise_image(model: SSDA, noisy: np.ndarray, patch: int, stride: int,
                  device="cpu") -> np.ndarray:
    """Denoise a whole image with overlapping patch×patch windows, averaging the overlaps."""
    h, w = noisy.shape
    if h < patch or w < patch:
        raise ValueError(f"image {h}x{w} is smaller than the {patch}x{patch} patches")
    ph, pw = (-(h - patch)) % stride, (-(w - patch)) % stride   # pad so windows cover all
    x = torch.from_numpy(np.ascontiguousarray(noisy)).to(device)[None, None]  # (1, 1, H, W)
    x = F.pad(x, (0, pw, 0, ph), mode="replicate")
    H, W = h + ph, w + pw
    cols = F.unfold(x, patch, stride=stride)                                 # (1, p², L)
    with torch.no_grad():
        out = model(cols[0].t()).t()[None]                                   # (1, p², L)
    ones = torch.ones_like(cols)
    rec = F.fold(out, (H, W), patch, stride=stride) / F.fold(ones, (H, W), patch, stride=stride)
    return rec[0, 0, :h, :w].cpu().numpy()


def train_ssda(cfg: SSDAConfig, log=print) -> dict:
    seed_everything(cfg.run.seed)
    device = pick_device(cfg.run)
    rng = np.random.default_rng(cfg.run.seed)
    clean = np.concatenate([patches(_downscale(y, cfg.scale), cfg.patch, cfg.stride)
                            for y in _images(cfg.train_dir, cfg.scale)])
    clean = clean.reshape(len(clean), -1)
    noisy = np.clip(clean + rng.normal(0, cfg.sigma / 255, clean.shape), 0, 1).astype(np.float32)
    shard = ShardData(np.stack([noisy, clean], 1), np.zeros(len(clean), np.int64))
    log(f"SSDA: {len(clean)} patches {cfg.patch}x{cfg.patch}, sigma {cfg.sigma}, device {device}")

    def batches(epoch):
        for xb, _ in shard.batches(cfg.batch_size, seed=cfg.run.seed, epoch=epoch):
            xb = xb.to(device)
            yield xb[:, 0], xb[:, 1]

    specs = [LayerSpec(**s) if isinstance(s, dict) else s for s in cfg.layers]
    model = SSDA(cfg.patch ** 2, specs).to(device)
    t0 = time.perf_counter()
    pre = model.pretrain(batches, lambda p: torch.optim.Adam(p, cfg.lr), cfg.pretrain_epochs)
    tests = []
    for y in _images(cfg.test_dir, cfg.scale):
        lr_img = _downscale(y, cfg.scale)
        tests.append((lr_img, np.clip(lr_img + rng.normal(0, cfg.sigma / 255, lr_img.shape),
                                      0, 1).astype(np.float32)))

    def score():
        model.eval()
        s = [psnr(denoise_image(model, n, cfg.patch, 1, device), c) for c, n in tests]
        model.train()
        return s
    after_pretrain = score()
    opt = torch.optim.Adam(model.parameters(), cfg.lr / 10)
    fine = [model.finetune(batches(e), opt) for e in range(cfg.finetune_epochs)]
    after_finetune = score()
    noisy_psnr = [psnr(n, c) for c, n in tests]
    log(f"Set5 LR PSNR: noisy {np.mean(noisy_psnr):.2f}, pretrained {np.mean(after_pretrain):.2f},"
        f" fine-tuned {np.mean(after_finetune):.2f} dB")
    return {"sigma": cfg.sigma, "layers": [s.hidden for s in specs], "patches": len(clean),
            "train_seconds": time.perf_counter() - t0, "pretrain_loss": pre,
            "finetune_loss": fine, "psnr_noisy": noisy_psnr, "psnr_pretrained": after_pretrain,
            "psnr_finetuned": after_finetune, "mean_psnr_noisy": float(np.mean(noisy_psnr)),
            "mean_psnr_pretrained": float(np.mean(after_pretrain)),
            "mean_psnr_finetuned": float(np.mean(after_finetune))}


@dataclasses.dataclass(frozen=True)
class SRCNNConfig:
    train_dir: str = "data/sr/T91"
    test_dir: str = "data/sr/Set5"
    scale: int = 2
    patch: int = 33
    stride: int = 14
    augment: bool = True            # flips and 90° rotations of the training images
    epochs: int = 20
    batch_size: int = 128
    optimizer: str = "adam"
    lr: float = 1e-3
    lr_decay: float = 0.9           # per epoch
    run: RunConfig = RunConfig()


def _augmented(y: np.ndarray):
    for k in range(4):
        r = np.rot90(y, k)
        yield r
        yield r[:, ::-1]


def train_srcnn(cfg: SRCNNConfig, log=print) -> dict:
    seed_everything(cfg.run.seed)
    device = pick_device(cfg.run)
    hr_p, lr_p = [], []
    for y in _images(cfg.train_dir, cfg.scale):
        for img in (_augmented(y) if cfg.augment else [y]):
            img = np.ascontiguousarray(img)
            up = bicubic(_downscale(img, cfg.scale), img.shape)
            hr_p.append(patches(img, cfg.patch, cfg.stride))
            lr_p.append(patches(up, cfg.patch, cfg.stride))
    hr, lr = np.concatenate(hr_p), np.concatenate(lr_p)
    shard = ShardData(np.stack([lr, hr], 1), np.zeros(len(hr), np.int64))
    log(f"SRCNN x{cfg.scale}: {len(hr)} patches {cfg.patch}x{cfg.patch}, device {device}")
    model = SRCNN().to(device)
    opt = make_optimizer(cfg.optimizer, model.parameters(), cfg.lr)
    sched = torch.optim.lr_scheduler.ExponentialLR(opt, cfg.lr_decay)
    tests = [(y, bicubic(_downscale(y, cfg.scale), y.shape)) for y in _images(cfg.test_dir,
                                                                               cfg.scale)]

    def score():
        model.eval()
        with torch.no_grad():
            out = [model(torch.from_numpy(up).to(device)[None, None])[0, 0].clamp(0, 1)
                   .cpu().numpy() for _, up in tests]
        model.train()
        return [psnr(o, y, cfg.scale) for o, (y, _) in zip(out, tests)]

    def batches(epoch):
        for xb, _ in shard.batches(cfg.batch_size, seed=cfg.run.seed, epoch=epoch):
            xb = xb.to(device)
            yield xb[:, :1], xb[:, 1:]
    t0, curve = time.perf_counter(), []
    for e in range(cfg.epochs):
        h = train_epoch(model, batches(e), opt, F.mse_loss)
        sched.step()
        s = score()
        curve.append({"epoch": e + 1, "loss": h["loss"], "mean_psnr": float(np.mean(s)),
                      "seconds": time.perf_counter() - t0})
        log(f"SRCNN epoch {e + 1}: loss {h['loss']:.6f}, Set5 {np.mean(s):.2f} dB")
    bic = [psnr(up, y, cfg.scale) for y, up in tests]
    names = [p.stem for p in sorted(Path(cfg.test_dir).iterdir())
             if p.suffix.lower() in (".png", ".jpg", ".jpeg", ".bmp")]
    return {"scale": cfg.scale, "patches": len(hr), "epochs": cfg.epochs,
            "train_seconds": time.perf_counter() - t0, "curve": curve,
            "per_image": {n: {"bicubic": b, "srcnn": s} for n, b, s in zip(names, bic, score())},
            "mean_psnr_bicubic": float(np.mean(bic)), "mean_psnr_srcnn": curve[-1]["mean_psnr"]}
