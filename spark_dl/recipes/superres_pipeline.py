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
    cnn_lr: float = 1e-4            # 1e-3 kills most of the SRCNN's second layer (design/0041)
    cascade_lr: float = 1e-4
    lr_decay: float = 1.0           # every stage's learning rate is multiplied by it per epoch
    cnn_residual: bool = False      # SRCNN adds its output to its bicubic input (not the thesis)
    cnn_noisy_skip: bool = False    # the SRCNN also sees bicubic(noisy LR) (not the thesis)
    tile_stride: int = 8            # evaluation: the SSDA denoises LR tiles every so many pixels
    self_ensemble: bool = False     # evaluation: also each method averaged over 8 flips/rotations
    batch_size: int = 64
    strategy: str = "allreduce"     # or "downpour"
    replicas: int = 0               # 0: the cluster's task slots
    init_from: str = ""             # a finished run's out_dir: stages 1-2 loaded, not trained
    init_cascade: str = "cascade"   # with init_from, stage 3 starts from its "cascade" (continues
                                    # the fine-tuning) or its "conventional" (fine-tunes anew)
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
        _check(self.init_cascade in ("cascade", "conventional"), "init_cascade",
               self.init_cascade, "must be 'cascade' or 'conventional'")
        _check(not self.init_from or Path(self.init_from).resolve()
               != Path(self.run.out_dir).resolve(), "init_from", self.init_from,
               "must differ from run.out_dir (the continuation would overwrite the run it "
               "starts from); set run.out_dir to a new folder")


def run_superres(cfg: SuperResConfig, log=print, spark=None) -> dict:
    from ..runs import new_run_dir
    from ..session import get_session
    from ..superres.evaluate import evaluate_folder
    from ..superres.pipeline import finetune_cascade
    from ..superres.prepare import Degradation, prepare_patches
    spark = spark or get_session()
    out = Path(cfg.run.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    loaded = _load_run(cfg, log) if cfg.init_from else {}    # a mismatch fails before any work
    degradation = Degradation(cfg.noise, cfg.sigma, cfg.blur, cfg.amount)
    t0 = time.perf_counter()
    prep = prepare_patches(spark, cfg.train_images, str((out / "patches").resolve()),
                           cfg.patch, cfg.scale, cfg.stride, degradation, cfg.augment,
                           seed=cfg.run.seed)
    log(f"patches: {prep.patches} pairs from {prep.images} images "
        f"({len(prep.skipped)} skipped) in {time.perf_counter() - t0:.1f} s")
    df = spark.read.parquet(prep.path)
    lr_size = cfg.patch // cfg.scale
    fits = new_run_dir(out / "fits", "superres")      # a fresh folder: nothing to resume
    kw = dict(strategy=cfg.strategy, batch_size=cfg.batch_size, lr_decay=cfg.lr_decay,
              replicas=cfg.replicas or None, log=log, track=cfg.run.track)
    timings, histories = {}, {}
    if loaded:
        conventional, start = loaded["conventional"], loaded[cfg.init_cascade]
    else:
        conventional = _train_conventional(cfg, df, lr_size, fits, kw, timings, histories)
        start = conventional
    t = time.perf_counter()
    cascade, histories["cascade"] = finetune_cascade(
        df, start.ssda, start.cnn, lr_size, cfg.scale, cfg.cascade_epochs, cfg.cascade_lr,
        run_dir=fits / "cascade", **kw)
    timings["cascade_s"] = time.perf_counter() - t
    pipelines = {"conventional": conventional, "cascade": cascade}
    if "thesis_conventional" in loaded:
        pipelines["thesis_conventional"] = loaded["thesis_conventional"]
    elif cfg.thesis_conventional_epochs:
        pipelines["thesis_conventional"] = _train_thesis_conventional(
            cfg, df, lr_size, conventional.ssda, fits, kw, timings, histories)
    active = _active_units(df, pipelines, log)
    models = _save_pipelines(pipelines, out)
    report = evaluate_folder(cfg.test_images, out / "report", cfg.scale, degradation,
                             {name: (net.ssda, net.cnn) for name, net in pipelines.items()},
                             seed=cfg.run.seed, stride=cfg.tile_stride,
                             ensemble=cfg.self_ensemble)
    avg = report["average"]
    log("average PSNR / SSIM: " + ", ".join(f"{m} {v['psnr']:.2f} / {v['ssim']:.4f}"
                                             for m, v in avg.items()))
    summary = _summary(cfg, prep, timings, avg, active)
    return {**summary, "report": report, "histories": histories,
            "report_dir": str(out / "report"), "models": models}


def _train_conventional(cfg: SuperResConfig, df, lr_size: int, fits: Path, kw: dict,
                        timings: dict, histories: dict):
    """Stages 1 and 2: the SSDA denoiser, then the SRCNN on its output; the Cascade of both
    (the "conventional" pipeline). Adds their seconds and histories to ``timings`` and
    ``histories``."""
    from ..models.ssda import app_b_layers
    from ..superres.pipeline import train_cnn, train_ssda
    # App. B: the hidden layers sparse, the last one without sparsity; a last layer as
    # wide as the LR patch (the thesis's 256) is the output layer
    specs = app_b_layers(cfg.ssda_layers, lr_size * lr_size)
    t = time.perf_counter()
    ssda, histories["ssda"] = train_ssda(df, lr_size, specs, cfg.pretrain_epochs,
                                         cfg.finetune_epochs, cfg.ssda_lr, run_dir=fits, **kw)
    timings["ssda_s"] = time.perf_counter() - t
    t = time.perf_counter()
    conventional, histories["cnn"] = train_cnn(
        df, ssda, lr_size, cfg.scale, cfg.cnn_epochs, cfg.cnn_lr, run_dir=fits / "cnn",
        residual=cfg.cnn_residual, noisy_skip=cfg.cnn_noisy_skip, **kw)
    timings["cnn_s"] = time.perf_counter() - t
    return conventional


def _train_thesis_conventional(cfg: SuperResConfig, df, lr_size: int, ssda, fits: Path,
                               kw: dict, timings: dict, histories: dict):
    """The thesis's "conventional" method: ``ssda`` and an SRCNN trained for SR alone on
    clean LR patches, as published ("conventional" trains its SRCNN on the SSDA's output,
    which already adapts it to the denoiser). Adds its seconds and history."""
    from ..superres.cascade import Cascade
    from ..superres.pipeline import train_cnn_on_clean
    t = time.perf_counter()
    cnn_clean, histories["cnn_clean"] = train_cnn_on_clean(
        df, lr_size, cfg.scale, cfg.thesis_conventional_epochs, cfg.cnn_lr,
        run_dir=fits / "cnn-clean", residual=cfg.cnn_residual, **kw)
    timings["cnn_clean_s"] = time.perf_counter() - t
    return Cascade(lr_size, cfg.scale, ssda, cnn_clean)


def _save_pipelines(pipelines: dict, out: Path) -> dict:
    """Each pipeline as ``<out>/<name>.pt`` (the whole module: superres.cascade.load_cascade),
    written atomically; name -> absolute path."""
    import torch
    models = {}
    for name, net in pipelines.items():
        path = out / f"{name}.pt"
        torch.save(net, path.with_suffix(".pt.tmp"))
        path.with_suffix(".pt.tmp").replace(path)
        models[name] = str(path.resolve())
    return models


def _summary(cfg: SuperResConfig, prep, timings: dict, avg: dict, active: dict) -> dict:
    """The run's headline figures: patches, timings, the average PSNR of each pipeline and
    the cascade's gains in dB."""
    summary = {"patches": prep.patches, "skipped_images": prep.skipped, "timings": timings,
               **({"init_from": str(Path(cfg.init_from).resolve()),
                   "init_cascade": cfg.init_cascade} if cfg.init_from else {}),
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
    return summary


def _load_run(cfg: SuperResConfig, log) -> dict:
    """The pipelines saved by a finished run in ``cfg.init_from`` (conventional, cascade and,
    if trained, thesis_conventional), checked against this run's configuration: the
    continuation trains and evaluates the same networks, on the same patch pairs, that the
    configuration describes."""
    import json

    from ..superres.cascade import load_cascade, takes_noisy
    root = Path(cfg.init_from)
    names = ["conventional", "cascade", "thesis_conventional"]
    loaded = {n: load_cascade(root / f"{n}.pt") for n in names
              if n != "thesis_conventional" or (root / f"{n}.pt").exists()}
    source = f"init_from {str(root)!r}: its"
    for name, net in loaded.items():
        widths = [layer.spec.hidden for layer in net.ssda.layers]
        got = {"patch": net.hr_size, "scale": net.hr_size // net.lr_size,
               "ssda_layers": widths, "cnn_residual": net.cnn.residual}
        if name != "thesis_conventional":     # its SRCNN was trained on clean LR, no skip
            got["cnn_noisy_skip"] = takes_noisy(net.cnn)
        _check_same(cfg, f"{source} {name}.pt was trained with", got)
    meta = root / "patches" / "_spark_dl.json"     # how the run's patch pairs were made
    if meta.exists():
        made = json.loads(meta.read_text())
        d = made["degradation"]
        _check_same(cfg, f"{source} patches were made with",
                    {"noise": d["kind"], "sigma": d["sigma"], "blur": d["blur"],
                     "amount": d["amount"], "stride": made["stride"],
                     "augment": made["augment"], "run.seed": made["seed"]})
    else:
        log(f"warning: {meta} is missing: the degradation and patches of init_from's run are "
            f"not checked against this configuration")
    if "thesis_conventional" in loaded and cfg.thesis_conventional_epochs:
        log("thesis_conventional_epochs not used: the thesis's baseline is init_from's")
    log(f"init_from {root}: " + ", ".join(loaded) + f" loaded (stages 1-2 not trained); the "
        f"cascade stage starts from its {cfg.init_cascade}")
    return loaded


def _check_same(cfg: SuperResConfig, where: str, saved: dict) -> None:
    """ConfigError naming the first key of ``saved`` (dotted for sections) whose value
    differs from the configuration's, with the value to set."""
    def fmt(v):
        return str(v).lower() if isinstance(v, bool) else repr(v) if isinstance(v, str) else v
    for key, value in saved.items():
        mine = cfg
        for part in key.split("."):
            mine = getattr(mine, part)
        mine = list(mine) if isinstance(mine, tuple) else mine
        _check(mine == value, key, mine, f"{where} {key} = {fmt(value)}; set {key} = "
                                         f"{fmt(value)}")


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
                f"ReLUs, {counts}); its training stalled: lower cnn_lr (docs/design/0041)")
    return active
