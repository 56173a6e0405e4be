"""Ship segmentation (seed 000): synthetic satellite-like scenes made in the executors, the
bottleneck U-Net trained with the seed's "boosting" parameter server by default (Boosting:
the driver's data-key scheduler hands out chunks of n_push mini-batches (Boosting's default,
2), reshuffled every epoch; a worker trains a key's mini-batches and pushes, the server
applies every push as its own step in arrival order), then IoU, Dice and the Airbus F2 of
held-out scenes and a picture strip (scene | true mask | predicted mask).

    python jobs/segment_ships.py --config conf/jobs/ships.toml
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import numpy as np
import torch

from ..config import TrainConfig, _check
from .common import RunConfig

__all__ = ["ShipsData", "ShipsJobConfig", "ShipsTrainConfig", "mask_scores", "segment_ships"]

TEST_START = 10_000_000


@dataclasses.dataclass(frozen=True)
class ShipsData:
    n_train: int = 1600
    n_test: int = 200
    size: int = 48                  # pixels a side (a multiple of 8 for the U-Net)
    max_ships: int = 4
    seed: int = 0

    def __post_init__(self):
        _check(self.n_train >= 1 and self.n_test >= 1, "data.n_train/n_test",
               (self.n_train, self.n_test), "must be >= 1")
        _check(self.size >= 16 and self.size % 8 == 0, "data.size", self.size,
               "must be a multiple of 8, at least 16 (the U-Net pools three times)")


@dataclasses.dataclass(frozen=True)
class ShipsTrainConfig(TrainConfig):
    MODELS = ("unet",)
    model: str = "unet"
    strategy: str | dict = "boosting"
    optimizer: str = "sgd"
    lr: float = 0.004               # the seed's 0.01 is too high for one process (design/0043)
    momentum: float = 0.9
    batch_size: int = 8
    widths: tuple = (16, 32, 64, 128)
    norm: str = "group"             # the U-Net's normalisation: "group" or "batch" (BatchNorm)
    threshold: float = 0.5          # probability above which a pixel is a ship

    def __post_init__(self):
        super().__post_init__()
        from ..models.unet import NORMS
        _check(self.norm in NORMS, "train.norm", self.norm, f"must be one of {', '.join(NORMS)}")


@dataclasses.dataclass(frozen=True)
class ShipsJobConfig:
    data: ShipsData = ShipsData()
    train: ShipsTrainConfig = ShipsTrainConfig()
    run: RunConfig = RunConfig(out_dir="runs/ships")


def mask_scores(prob: np.ndarray, truth: np.ndarray, threshold: float = 0.5) -> dict:
    """Mean IoU and Dice over the images that have ships, and the mean Airbus F2 over all."""
    from ..segmentation import dice, f2_score, iou
    pred = prob > threshold
    true = truth > 0.5
    has = [i for i in range(len(true)) if true[i].any()]
    return {"iou": float(np.mean([iou(pred[i], true[i]) for i in has])) if has else 1.0,
            "dice": float(np.mean([dice(pred[i], true[i]) for i in has])) if has else 1.0,
            "f2": float(np.mean([f2_score(p, t) for p, t in zip(pred, true)])),
            "empty_correct": float(np.mean([not pred[i].any() for i in range(len(true))
                                            if not true[i].any()] or [1.0]))}


def _picture(path: Path, images, truth, prob) -> None:
    from PIL import Image
    side = images.shape[-1] * 3
    rows = []
    for img, t, p in zip(images, truth, prob):
        cells = [img.transpose(1, 2, 0), np.repeat((t[..., None] * 255).astype(np.uint8), 3, -1),
                 np.repeat((p[..., None] * 255).astype(np.uint8), 3, -1)]
        rows.append(np.concatenate([np.pad(np.asarray(Image.fromarray(c).resize(
            (side, side), Image.NEAREST)), ((4, 4), (4, 4), (0, 0)), constant_values=255)
            for c in cells], 1))
    Image.fromarray(np.concatenate(rows, 0)).save(path)


def segment_ships(cfg: ShipsJobConfig, log=print, spark=None) -> dict:
    from ..compat import default_parallelism
    from ..data.ships import ship_batch, ship_scenes
    from ..fit import fit
    from ..models.unet import FocalDiceLoss, UNet
    from ..session import get_session
    d, t = cfg.data, cfg.train
    say = log or (lambda _: None)
    spark = spark or get_session()
    replicas = t.replicas or default_parallelism(spark)
    df = ship_scenes(spark, d.n_train, d.size, replicas, d.seed, d.max_ships)
    t0 = time.perf_counter()
    tx, tmask, tships = ship_batch(TEST_START, TEST_START + d.n_test, d.seed, d.size,
                                   d.max_ships)
    vx = tx.astype(np.float32) / 255
    say(f"ships: {d.n_train} training scenes of {d.size}x{d.size} made in the executors, "
        f"{d.n_test} held-out scenes here ({time.perf_counter() - t0:.1f} s, "
        f"{int((tships == 0).sum())} without ships)")
    widths, norm = tuple(t.widths), t.norm
    strategy = t.make_strategy()          # "boosting": Boosting's defaults (keys of 2)
    out_dir = Path(cfg.run.out_dir)
    res = fit(df, lambda: UNet(3, widths, norm), strategy=strategy, shape=(3, d.size, d.size),
              label_shape=(1, d.size, d.size), loss=FocalDiceLoss(10.0, 2.0),
              optimizer=t.optimizer, lr=t.lr, momentum=t.momentum, **t.fit_options,
              weight_decay=1e-5, epochs=t.epochs, batch_size=t.batch_size,
              replicas=replicas, seed=t.seed, device=cfg.run.device, threads=cfg.run.threads,
              validation=(vx, tmask[:, None]), run_dir=out_dir / f"unet-{t.strategy}", log=log,
              track=cfg.run.track)
    model = res.model.eval()
    with torch.no_grad():
        prob = torch.cat([model(torch.from_numpy(vx[i:i + 64]))
                          for i in range(0, len(vx), 64)])[:, 0].numpy()
    scores = mask_scores(prob, tmask, t.threshold)
    out_dir.mkdir(parents=True, exist_ok=True)
    show = [i for i in range(len(tships)) if tships[i]][:3] + \
        [i for i in range(len(tships)) if not tships[i]][:1]
    picture = out_dir / "unet-masks.png"
    _picture(picture, tx[show], tmask[show], prob[show])
    say(f"held-out masks: IoU {scores['iou']:.3f}, Dice {scores['dice']:.3f}, F2 "
        f"{scores['f2']:.3f}, empty scenes left empty {scores['empty_correct']:.2f}; {picture}")
    return {"strategy": t.strategy, "replicas": res.info["world"], "epochs": t.epochs,
            "train_scenes": d.n_train, "test_scenes": d.n_test, "size": d.size,
            "wall_seconds": res.info["wall_seconds"], **scores, "picture": str(picture),
            "history": res.history}
