"""Object counting with MCNN (seed 002): synthetic flower-field scenes made in the executors,
density maps as targets, a distributed fit, then the counts of held-out scenes (MAE, RMSE,
relative error per count bin) and a picture strip (scene | true density | predicted density).

    python jobs/count_objects.py --config conf/jobs/counting.toml [--set train.model=mcnn-deconv]
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from pathlib import Path

import numpy as np
import torch

from ..config import TrainConfig, _check
from .common import RunConfig

__all__ = [
    "CountingData",
    "CountingJobConfig",
    "CountingTrainConfig",
    "DensityLoss",
    "count_errors",
    "count_objects",
]

TEST_START = 10_000_000           # held-out scene ids: never those of the training scenes


@dataclasses.dataclass(frozen=True)
class CountingData:
    n_train: int = 1200             # training scenes, made in the executors
    n_test: int = 200               # held-out scenes, made on the driver
    size: int = 48                  # scene side in pixels (a multiple of 4)
    max_objects: int = 30           # 0..max_objects flowers a scene (a few empty ones)
    seed: int = 0

    def __post_init__(self):
        _check(self.n_train >= 1 and self.n_test >= 1, "data.n_train/n_test",
               (self.n_train, self.n_test), "must be >= 1")
        _check(self.size >= 8 and self.size % 4 == 0, "data.size", self.size,
               "must be a multiple of 4, at least 8 (MCNN pools twice)")
        _check(self.max_objects >= 1, "data.max_objects", self.max_objects, "must be >= 1")


@dataclasses.dataclass(frozen=True)
class CountingTrainConfig(TrainConfig):
    MODELS = ("mcnn", "mcnn-deconv")
    model: str = "mcnn"             # "mcnn" (map at 1/4 resolution) or "mcnn-deconv" (full)
    strategy: str | dict = "allreduce"
    optimizer: str = "adam"
    lr: float = 1e-3
    batch_size: int = 8
    density_scale: float = 100.0    # the maps are learned x this (their values are tiny)


@dataclasses.dataclass(frozen=True)
class CountingJobConfig:
    data: CountingData = CountingData()
    train: CountingTrainConfig = CountingTrainConfig()
    run: RunConfig = RunConfig(out_dir="runs/counting")


class DensityLoss:
    """Pixel-wise mean squared error against the density map × ``scale`` (MCNN's Euclidean
    loss; the scale keeps the gradients of maps whose pixels hold ~0.01 objects useful)."""

    def __init__(self, scale: float):
        self.scale = scale

    def __call__(self, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if out.shape != target.shape:
            from ..errors import DataError
            raise DataError(f"the density maps are {tuple(target.shape[1:])} but the model "
                            f"outputs {tuple(out.shape[1:])}: make the maps at the model's "
                            f"resolution (MCNN: 1/4 of the image's side; mcnn-deconv: full)")
        return torch.nn.functional.mse_loss(out, target * self.scale)


def count_errors(pred: np.ndarray, true: np.ndarray, bins=(0, 1, 11, 21, 31)) -> dict:
    """MAE, RMSE and, per bin of true counts [bins[i], bins[i+1]), the mean absolute and
    relative errors (relative to the true count; the empty bin reports the absolute only)."""
    pred, true = np.asarray(pred, np.float64), np.asarray(true, np.float64)
    err = pred - true
    out = {"mae": float(np.abs(err).mean()), "rmse": float(np.sqrt((err ** 2).mean())),
           "mean_count": float(true.mean()), "bins": []}
    edges = list(bins) + [np.inf]
    for lo, hi in itertools.pairwise(edges):
        sel = (true >= lo) & (true < hi)
        if not sel.any():
            continue
        row = {"counts": f"{lo}-{int(hi) - 1}" if np.isfinite(hi) and hi - lo > 1 else
               (str(lo) if np.isfinite(hi) else f"{lo}+"),
               "scenes": int(sel.sum()), "mae": float(np.abs(err[sel]).mean())}
        if lo > 0:
            row["relative_error"] = float((np.abs(err[sel]) / true[sel]).mean())
        out["bins"].append(row)
    return out


def _model_fn(model: str):
    from ..models.mcnn import MCNN
    variant = "deconv" if model == "mcnn-deconv" else "pool"
    return lambda: MCNN(3, variant)


def _picture(path: Path, images, truth, pred, counts, predicted) -> None:
    """A strip per scene: the scene | its true density | the predicted one (same colour scale)."""
    from PIL import Image, ImageDraw
    rows = []
    for img, t, p, c, q in zip(images, truth, pred, counts, predicted):
        side = img.shape[-1] * 3
        top = max(float(t.max()), float(p.max()), 1e-9)
        cells = [Image.fromarray(img.transpose(1, 2, 0)).resize((side, side), Image.NEAREST)]
        for m in (t, p):
            v = np.clip(m / top, 0, 1)
            rgb = np.stack([v, v ** 2, 0.2 + 0.0 * v], -1)        # black -> yellow heat map
            cells.append(Image.fromarray((rgb * 255).astype(np.uint8)).resize(
                (side, side), Image.NEAREST))
        row = Image.new("RGB", (3 * side + 20, side + 16), "white")
        for i, cell in enumerate(cells):
            row.paste(cell, (i * (side + 10), 16))
        ImageDraw.Draw(row).text((2, 2), f"true {c}, predicted {q:.1f}", fill="black")
        rows.append(row)
    out = Image.new("RGB", (rows[0].width, sum(r.height for r in rows)), "white")
    y = 0
    for r in rows:
        out.paste(r, (0, y))
        y += r.height
    out.save(path)


def count_objects(cfg: CountingJobConfig, log=print, spark=None) -> dict:
    from ..compat import default_parallelism
    from ..data.counting import counting_scenes, scenes
    from ..fit import fit
    from ..session import get_session
    d, t = cfg.data, cfg.train
    say = log or (lambda _: None)
    spark = spark or get_session()
    down = 1 if t.model == "mcnn-deconv" else 4
    side = d.size // down
    replicas = t.replicas or default_parallelism(spark)
    df = counting_scenes(spark, d.n_train, d.size, replicas, d.seed, d.max_objects, down)
    t0 = time.perf_counter()
    tx, tmaps, tcounts = scenes(TEST_START, TEST_START + d.n_test, d.seed, d.size,
                                d.max_objects, down)
    vx = tx.astype(np.float32) / 255
    vy = tmaps.reshape(-1, 1, side, side) * np.float32(t.density_scale)
    say(f"counting: {d.n_train} training scenes of {d.size}x{d.size} made in the executors, "
        f"{d.n_test} held-out scenes here ({time.perf_counter() - t0:.1f} s); "
        f"{t.model}, density maps {side}x{side}")
    out_dir = Path(cfg.run.out_dir)
    res = fit(df, _model_fn(t.model), strategy=t.make_strategy(), shape=(3, d.size, d.size),
              label_shape=(1, side, side), loss=DensityLoss(t.density_scale),
              optimizer=t.optimizer, lr=t.lr, momentum=t.momentum, **t.fit_options, epochs=t.epochs,
              batch_size=t.batch_size, replicas=replicas, seed=t.seed, device=cfg.run.device,
              threads=cfg.run.threads, validation=(vx, vy / t.density_scale),
              run_dir=out_dir / f"{t.model}-{t.strategy}", log=log, track=cfg.run.track)
    model = res.model.eval()
    with torch.no_grad():
        pred = torch.cat([model(torch.from_numpy(vx[i:i + 64]))
                          for i in range(0, len(vx), 64)]) / t.density_scale
    predicted = pred.flatten(1).sum(1).numpy()
    errors = count_errors(predicted, tcounts)
    out_dir.mkdir(parents=True, exist_ok=True)
    picture = out_dir / f"{t.model}-density.png"
    _picture(picture, tx[:4], tmaps[:4].reshape(-1, side, side), pred[:4, 0].numpy(),
             tcounts[:4], predicted[:4])
    say(f"held-out counts: MAE {errors['mae']:.2f}, RMSE {errors['rmse']:.2f} (mean count "
        f"{errors['mean_count']:.1f}); " + ", ".join(
            f"{b['counts']}: MAE {b['mae']:.2f}" for b in errors["bins"]) + f"; {picture}")
    return {"model": t.model, "strategy": t.strategy, "replicas": res.info["world"],
            "epochs": t.epochs, "train_scenes": d.n_train, "test_scenes": d.n_test,
            "size": d.size, "wall_seconds": res.info["wall_seconds"], **errors,
            "picture": str(picture), "history": res.history}
