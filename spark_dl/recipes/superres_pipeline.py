"""The super-resolution job (jobs/superres.py): patch pairs on Spark, the three stages trained
with a distributed engine, the evaluation report on a test folder."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

from ..config import _check
from .common import RunConfig

__all__ = ["SuperResConfig", "run_superres"]


@dataclasses.dataclass(frozen=True)
class SuperResConfig:
    train_images: str = "data/sr/T91"
    test_images: str = "data/sr/Set5"
    scale: int = 2
    patch: int = 32                 # HR patch side; the LR patch is patch / scale
    stride: int = 16
    augment: bool = True            # the 8 flips/rotations of every training image
    noise: str = "gaussian"         # gaussian, blur, salt_pepper, blur+gaussian, none
    sigma: float = 20.0             # Gaussian noise std on 0-255
    blur: float = 1.0
    amount: float = 0.05            # salt-and-pepper fraction
    ssda_layers: tuple = (1280, 1280, 256)
    pretrain_epochs: int = 1
    finetune_epochs: int = 1
    cnn_epochs: int = 1
    cascade_epochs: int = 1
    thesis_conventional_epochs: int = 0   # > 0: also an SRCNN trained on clean LR (see below)
    ssda_lr: float = 1e-3           # Adam, as the single-process SSDA job
    cnn_lr: float = 1e-4            # 1e-3 kills most of the SRCNN's second layer (docs/quality.md)
    cascade_lr: float = 1e-4
    lr_decay: float = 1.0           # every stage's learning rate is multiplied by it per epoch
    cnn_residual: bool = False      # SRCNN adds its output to its bicubic input (not the thesis)
    cnn_noisy_skip: bool = False    # the SRCNN also sees bicubic(noisy LR) (not the thesis)
    tile_stride: int = 8            # evaluation: the SSDA denoises LR tiles every so many pixels
    self_ensemble: bool = False     # evaluation: also each method averaged over 8 flips/rotations
    batch_size: int = 64
    strategy: str = "allreduce"     # or "downpour"
    replicas: int = 0               # 0: the cluster's task slots
    run: RunConfig = RunConfig()

    def __post_init__(self):
        object.__setattr__(self, "ssda_layers", tuple(self.ssda_layers))
        _check(self.scale >= 2, "scale", self.scale, "must be >= 2")
        _check(self.patch % self.scale == 0, "patch", self.patch,
               f"must be a multiple of scale {self.scale}")
        _check(self.strategy in ("allreduce", "downpour"), "strategy", self.strategy,
               "must be 'allreduce' or 'downpour'")
        _check(len(self.ssda_layers) >= 1 and all(isinstance(w, int) and w > 0
                                                   for w in self.ssda_layers),
               "ssda_layers", list(self.ssda_layers), "must list positive widths")
        _check(self.thesis_conventional_epochs >= 0, "thesis_conventional_epochs",
               self.thesis_conventional_epochs, "must be >= 0 (0: not trained)")
        _check(0 < self.lr_decay <= 1, "lr_decay", self.lr_decay,
               "must be in (0, 1] (1: a constant learning rate)")
        _check(1 <= self.tile_stride <= self.patch // self.scale, "tile_stride",
               self.tile_stride, f"must be between 1 and the LR patch side "
                                 f"{self.patch // self.scale}")


def run_superres(cfg: SuperResConfig, log=print, spark=None) -> dict:
    import torch

    from ..runs import new_run_dir
    from ..models.ssda import LayerSpec
    from ..session import get_session
    from ..superres.evaluate import evaluate_folder
    from ..superres.cascade import Cascade
    from ..superres.pipeline import finetune_cascade, train_cnn, train_cnn_on_clean, train_ssda
    from ..superres.prepare import Degradation, prepare_patches
    spark = spark or get_session()
    out = Path(cfg.run.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    degradation = Degradation(cfg.noise, cfg.sigma, cfg.blur, cfg.amount)
    t0 = time.perf_counter()
    prep = prepare_patches(spark, cfg.train_images, str((out / "patches").resolve()),
                           cfg.patch, cfg.scale, cfg.stride, degradation, cfg.augment,
                           seed=cfg.run.seed)
    log(f"patches: {prep.patches} pairs from {prep.images} images "
        f"({len(prep.skipped)} skipped) in {time.perf_counter() - t0:.1f} s")
    df = spark.read.parquet(prep.path)
    # App. B: the hidden layers sparse, the last one (the code) without sparsity
    specs = tuple(LayerSpec(w, 0.01, 0.05, 1e-4) for w in cfg.ssda_layers[:-1]) + \
        (LayerSpec(cfg.ssda_layers[-1], 0.0, 1.0, 1e-4),)
    lr_size = cfg.patch // cfg.scale
    fits = new_run_dir(out / "fits", "superres")      # a fresh folder: nothing to resume
    kw = dict(strategy=cfg.strategy, batch_size=cfg.batch_size, lr_decay=cfg.lr_decay,
              replicas=cfg.replicas or None, log=log, track=cfg.run.track)
    timings = {}
    t = time.perf_counter()
    ssda, h1 = train_ssda(df, lr_size, specs, cfg.pretrain_epochs, cfg.finetune_epochs,
                          cfg.ssda_lr, run_dir=fits, **kw)
    timings["ssda_s"] = time.perf_counter() - t
    t = time.perf_counter()
    conventional, h2 = train_cnn(df, ssda, lr_size, cfg.scale, cfg.cnn_epochs, cfg.cnn_lr,
                                 run_dir=fits / "cnn", residual=cfg.cnn_residual,
                                 noisy_skip=cfg.cnn_noisy_skip, **kw)
    timings["cnn_s"] = time.perf_counter() - t
    t = time.perf_counter()
    cascade, h3 = finetune_cascade(df, ssda, conventional.cnn, lr_size, cfg.scale,
                                   cfg.cascade_epochs, cfg.cascade_lr,
                                   run_dir=fits / "cascade", **kw)
    timings["cascade_s"] = time.perf_counter() - t
    pipelines = {"conventional": conventional, "cascade": cascade}
    histories = {"ssda": h1, "cnn": h2, "cascade": h3}
    if cfg.thesis_conventional_epochs:
        # the thesis's "conventional" method: the SSDA and an SRCNN trained for SR alone on
        # clean LR patches, as published; "conventional" above trained its SRCNN on the SSDA's
        # output, which already adapts it to the denoiser
        t = time.perf_counter()
        cnn_clean, h4 = train_cnn_on_clean(df, lr_size, cfg.scale, cfg.thesis_conventional_epochs,
                                           cfg.cnn_lr, run_dir=fits / "cnn-clean",
                                           residual=cfg.cnn_residual, **kw)
        timings["cnn_clean_s"] = time.perf_counter() - t
        pipelines["thesis_conventional"] = Cascade(lr_size, cfg.scale, ssda, cnn_clean)
        histories["cnn_clean"] = h4
    active = _active_units(df, pipelines, log)
    models = {}
    for name, net in pipelines.items():
        path = out / f"{name}.pt"          # the whole module: torch.load(..., weights_only=False)
        torch.save(net, path.with_suffix(".pt.tmp"))
        path.with_suffix(".pt.tmp").replace(path)
        models[name] = str(path.resolve())
    report = evaluate_folder(cfg.test_images, out / "report", cfg.scale, degradation,
                             {name: (net.ssda, net.cnn) for name, net in pipelines.items()},
                             seed=cfg.run.seed, stride=cfg.tile_stride,
                             ensemble=cfg.self_ensemble)
    avg = report["average"]
    log("average PSNR / SSIM: " + ", ".join(f"{m} {v['psnr']:.2f} / {v['ssim']:.4f}"
                                             for m, v in avg.items()))
    summary = {"patches": prep.patches, "skipped_images": prep.skipped, "timings": timings,
               "psnr_bicubic": avg["bicubic"]["psnr"],
               "psnr_conventional": avg["conventional"]["psnr"],
               "psnr_cascade": avg["cascade"]["psnr"],
               "cascade_gain_db": round(avg["cascade"]["psnr"] - avg["conventional"]["psnr"],
                                        3),
               "srcnn_active_units": active}
    if cfg.self_ensemble:
        summary["psnr_cascade+"] = avg["cascade+"]["psnr"]
    if "thesis_conventional" in avg:
        summary["psnr_thesis_conventional"] = avg["thesis_conventional"]["psnr"]
        summary["cascade_gain_over_thesis_conventional_db"] = round(
            avg["cascade"]["psnr"] - avg["thesis_conventional"]["psnr"], 3)
    return {**summary, "report": report, "histories": histories,
            "report_dir": str(out / "report"), "models": models}


def _active_units(df, pipelines: dict, log, rows: int = 256) -> dict:
    """Each pipeline's SRCNN units that fire on the first ``rows`` training inputs, per ReLU
    layer: [active, units]. Logged, and a warning where a layer has lost half its units (dead
    ReLUs: the stage's loss stays flat and the figures mean little; lower cnn_lr)."""
    import numpy as np
    import torch
    lr = torch.from_numpy(np.stack(df.select("lr").limit(rows).toPandas()["lr"])
                          .astype(np.float32))
    active = {}
    for name, net in pipelines.items():
        with torch.no_grad():
            counts = net.cnn.active_units(net.cnn_input(lr))
        active[name] = [list(c) for c in counts]
        log(f"SRCNN units active ({name}): " + ", ".join(f"{a}/{n}" for a, n in counts))
        if any(a < n / 2 for a, n in counts):
            log(f"warning: the {name} SRCNN has lost over half the units of a layer (dead "
                f"ReLUs, {counts}); its training stalled: lower cnn_lr (docs/quality.md)")
    return active
