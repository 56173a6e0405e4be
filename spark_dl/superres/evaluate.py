"""The evaluation report of the super-resolution pipeline (thesis Table 5.1 and Fig. 5.2).

For every image of a test folder (Set5): the Y channel cropped to a multiple of the scale is the
ground truth; its bicubic downscale, degraded, is the input. Methods compared, PSNR and SSIM with
``scale`` border pixels shaved:

    bicubic        bicubic upscale of the noisy LR image
    conventional   SSDA then CNN, each trained on its own (not tuned together)
    cascade        SSDA -> bicubic -> CNN fine-tuned end to end
    (and any other name -> (ssda, cnn) the caller passes, e.g. the job's thesis_conventional)
    name+          with ``ensemble``: each learned method again, averaged over the 8
                   flips/rotations of its input (tiles.self_ensemble; EDSR's "+" models)

Writes ``report.json``, ``report.md`` (a table per image and the average) and one PNG per image
(noisy LR | each method but bicubic, in order | ground truth).
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import numpy as np

from .images import bicubic, load_y, modcrop
from .metrics import psnr, ssim
from .prepare import Degradation, degrade
from .tiles import super_resolve

__all__ = ["evaluate_folder"]

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".tif", ".tiff")


def evaluate_folder(folder: str | Path, out_dir: str | Path, scale: int,
                    degradation: Degradation, methods: dict, seed: int = 0,
                    stride: int = 8, ensemble: bool = False) -> dict:
    """``methods``: name -> (ssda or None, cnn or None), applied by tiles.super_resolve (the
    SSDA on LR tiles every ``stride`` pixels, overlaps averaged); ``ensemble`` adds "name+"
    for each of them (the PNG strips show the plain outputs only).
    Returns {"images": {name: {method: {"psnr", "ssim"}}}, "average": {...}}."""
    from PIL import Image
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = sorted(p for p in Path(folder).iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)
    if not paths:
        raise FileNotFoundError(f"no images in {folder}")
    report: dict = {"scale": scale, "degradation": degradation.__dict__, "tile_stride": stride,
                    "self_ensemble": ensemble, "images": {}}
    runs = [(name, m, False) for name, m in {"bicubic": (None, None), **methods}.items()]
    if ensemble:
        runs += [(name + "+", m, True) for name, m in methods.items()]
    for path in paths:
        hr = modcrop(load_y(path), scale)
        rng = np.random.default_rng([seed, zlib.crc32(path.name.encode())])
        lr = degrade(np.clip(bicubic(hr, (hr.shape[0] // scale, hr.shape[1] // scale)), 0, 1)
                     [None], degradation, rng)[0]
        row, shown = {}, [np.clip(bicubic(lr, hr.shape), 0, 1)]
        for name, (ssda, cnn), ens in runs:
            sr = super_resolve(lr, scale, ssda, cnn, stride=stride, ensemble=ens)
            row[name] = {"psnr": round(psnr(sr, hr, border=scale), 3),
                         "ssim": round(ssim(sr, hr, border=scale), 4)}
            if name != "bicubic" and not ens:
                shown.append(sr)
        report["images"][path.stem] = row
        strip = np.concatenate(shown + [hr], axis=1)
        Image.fromarray((np.clip(strip, 0, 1) * 255).round().astype(np.uint8)) \
            .save(out_dir / f"{path.stem}.png")
    names = [name for name, _, _ in runs]
    report["average"] = {m: {k: round(float(np.mean([r[m][k] for r in report["images"]
                                                     .values()])), 4)
                             for k in ("psnr", "ssim")} for m in names}
    (out_dir / "report.json").write_text(json.dumps(report, indent=1))
    lines = ["| image | " + " | ".join(f"{m} PSNR / SSIM" for m in names) + " |",
             "| --- |" + " ---: |" * len(names)]
    for img, r in list(report["images"].items()) + [("average", report["average"])]:
        lines.append(f"| {img} | " + " | ".join(f"{r[m]['psnr']:.2f} / {r[m]['ssim']:.4f}"
                                               for m in names) + " |")
    (out_dir / "report.md").write_text("\n".join(lines) + "\n")
    return report
