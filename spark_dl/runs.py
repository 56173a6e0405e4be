"""Run directories: what every fit leaves behind (config, metrics, history, plot, checkpoint).

    runs/allreduce-20261123-131502-5f3a/
        config.json      the fit's arguments
        metrics.jsonl    every progress and epoch message, as it arrived on the driver
        history.csv      one row per epoch
        loss.png         loss (and validation accuracy) per epoch
        checkpoint.pt    model, optimizer, epoch, RNG states, the weights' average (written
                         by the tasks every epoch)
        workers/         rank-R.json: host, pid, device of each task
"""

from __future__ import annotations

import csv
import json
import os
import secrets
import time
from pathlib import Path

from PIL import Image, ImageDraw

__all__ = ["new_run_dir", "plot_convergence", "plot_history", "write_history", "write_json"]


def new_run_dir(root: str | Path = "runs", prefix: str = "fit") -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path = Path(root) / f"{prefix}-{stamp}-{secrets.token_hex(2)}"
    path.mkdir(parents=True, exist_ok=False)
    return path.resolve()


def write_json(path: Path, obj) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(obj, indent=1, default=str))
    os.replace(tmp, path)


def write_history(path: Path, history: list[dict]) -> None:
    keys = list(dict.fromkeys(k for row in history for k in row))
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(history)


def plot_history(path: Path, history: list[dict], title: str = "") -> None:
    """A small line chart (Pillow only): training loss, validation loss and accuracy per epoch."""
    series = {k: [(r["epoch"], r[k]) for r in history if k in r]
              for k in ("loss", "val_loss", "val_accuracy")}
    series = {k: v for k, v in series.items() if v}
    W, H, pad = 640, 400, 50
    img = Image.new("RGB", (W, H), "white")
    d = ImageDraw.Draw(img)
    d.text((pad, 10), title or "training history", fill="black")
    d.rectangle([pad, pad, W - pad, H - pad], outline="black")
    xs = [x for v in series.values() for x, _ in v] or [1]
    x0, x1 = min(xs), max(max(xs), min(xs) + 1)
    colors = {"loss": (31, 119, 180), "val_loss": (255, 127, 14), "val_accuracy": (44, 160, 44)}
    for i, (name, pts) in enumerate(series.items()):
        ys = [y for _, y in pts]
        y0, y1 = min(ys), max(max(ys), min(ys) + 1e-12)
        xy = [(pad + (x - x0) / (x1 - x0) * (W - 2 * pad),
               H - pad - (y - y0) / (y1 - y0) * (H - 2 * pad)) for x, y in pts]
        if len(xy) > 1:
            d.line(xy, fill=colors[name], width=2)
        for px, py in xy:
            d.ellipse([px - 3, py - 3, px + 3, py + 3], fill=colors[name])
        d.text((pad + 10, pad + 8 + 14 * i), f"{name}: {ys[0]:.4g} -> {ys[-1]:.4g} "
               f"(range {y0:.4g}..{y1:.4g})", fill=colors[name])
    d.text((pad, H - pad + 8), f"epoch {x0}", fill="black")
    d.text((W - pad - 60, H - pad + 8), f"epoch {x1}", fill="black")
    img.save(path)


_COLORS = [(31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189)]


def plot_convergence(path: Path, runs: dict[str, list[dict]], title: str = "") -> None:
    """The thesis's Fig. 4.3 for one or more fits (name -> history): (a) log10 of the training
    error (the epoch's mean loss) and (b) the mean |gradient| per coordinate of the updates
    (history key ``grad_mean_abs``, recorded by the Downpour server), per epoch."""
    import math
    panels = [("(a) log10 training loss", "loss", math.log10),
              ("(b) mean |gradient|", "grad_mean_abs", float)]
    W, H, pad = 480, 360, 50
    img = Image.new("RGB", (2 * W, H + 20), "white")
    d = ImageDraw.Draw(img)
    d.text((pad, 4), title, fill="black")
    for p, (label, key, f) in enumerate(panels):
        left = p * W
        series = {name: [(r["epoch"], f(r[key])) for r in h
                         if r.get(key) is not None and (key != "loss" or r[key] > 0)]
                  for name, h in runs.items()}
        series = {k: v for k, v in series.items() if v}
        box = [left + pad, pad, left + W - 20, H - 20]
        d.rectangle(box, outline="black")
        d.text((left + pad, pad - 16), label, fill="black")
        if not series:
            continue
        xs = [x for v in series.values() for x, _ in v]
        ys = [y for v in series.values() for _, y in v]
        x0, x1 = min(xs), max(max(xs), min(xs) + 1)
        y0, y1 = min(ys), max(max(ys), min(ys) + 1e-12)
        for i, (name, pts) in enumerate(series.items()):
            color = _COLORS[i % len(_COLORS)]
            xy = [(box[0] + (x - x0) / (x1 - x0) * (box[2] - box[0]),
                   box[3] - (y - y0) / (y1 - y0) * (box[3] - box[1])) for x, y in pts]
            if len(xy) > 1:
                d.line(xy, fill=color, width=2)
            for px, py in xy:
                d.ellipse([px - 3, py - 3, px + 3, py + 3], fill=color)
            d.text((box[0] + 8, box[1] + 6 + 14 * i),
                   f"{name}: {pts[0][1]:.4g} -> {pts[-1][1]:.4g}", fill=color)
        d.text((box[0] - 45, box[1]), f"{y1:.3g}", fill="black")
        d.text((box[0] - 45, box[3] - 10), f"{y0:.3g}", fill="black")
        d.text((box[0], box[3] + 4), f"epoch {x0}", fill="black")
        d.text((box[2] - 50, box[3] + 4), f"epoch {x1}", fill="black")
    img.save(path)
