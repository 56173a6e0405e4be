"""Which denoiser for the super-resolution pipeline's first stage? Per-patch quality of SSDA
variants on the same T91 pairs, single process, a fixed budget of Adam steps.

Pairs: LR 16x16 patches of T91 (Y channel, halved by bicubic, stride 16, no augmentation:
17,202 pairs) with Gaussian noise sigma 20, made in-process by the pipeline's own make_pairs;
the last 2,000 pairs (from the last images) are held out. Every variant trains end to end on
1/2 ||y - y_hat||^2 with Adam 1e-3, batch 64, --steps steps, 1 thread; the figure is the
held-out per-patch PSNR (no tile averaging). References: the noisy patches, a 3x3 mean filter.

    .venv/bin/python benchmarks/ssda_variants.py [--steps 3000] [--variants ssda1,ssda3,mlp]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _pairs(sigma: float):
    import numpy as np

    from spark_dl.superres.images import load_y
    from spark_dl.superres.prepare import Degradation, make_pairs
    rng = np.random.default_rng(0)
    noisy, clean = [], []
    for path in sorted((ROOT / "data/sr/T91").glob("*.png")):
        _, lr_clean, lr = make_pairs(load_y(path), 32, 2, 16, Degradation("gaussian", sigma),
                                     rng, augment=False)
        noisy.append(lr.reshape(len(lr), -1))
        clean.append(lr_clean.reshape(len(lr_clean), -1))
    return np.concatenate(noisy).astype(np.float32), np.concatenate(clean).astype(np.float32)


def _variants():
    from torch import nn

    from spark_dl.models.ssda import SSDA, LayerSpec
    return {
        "ssda1": ("SSDA 1280 (one tied sigmoid layer)",
                  lambda: SSDA(256, (LayerSpec(1280, 0.0, 1.0),))),
        "ssda2": ("SSDA 1280-1280", lambda: SSDA(256, (LayerSpec(1280), LayerSpec(1280, 0.0, 1.0)))),
        "ssda3": ("SSDA 1280-1280-256 (the thesis's sizes)",
                  lambda: SSDA(256, (LayerSpec(1280), LayerSpec(1280), LayerSpec(256, 0.0, 1.0)))),
        "mlp": ("ReLU MLP 256-1280-1280-256, untied (reference)",
                lambda: nn.Sequential(nn.Linear(256, 1280), nn.ReLU(), nn.Linear(1280, 1280),
                                      nn.ReLU(), nn.Linear(1280, 256))),
    }


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--sigma", type=float, default=20.0)
    ap.add_argument("--variants", default="ssda1,ssda2,ssda3,mlp")
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/ssda_variants.json"))
    args = ap.parse_args(argv)
    import numpy as np
    import torch
    torch.set_num_threads(1)
    x, y = (torch.from_numpy(a) for a in _pairs(args.sigma))
    vx, vy, x, y = x[-2000:], y[-2000:], x[:-2000], y[:-2000]

    def psnr(a, b):
        return float(-10 * np.log10(((a - b) ** 2).mean().item()))
    img = vx.reshape(-1, 1, 16, 16)
    mean3 = torch.nn.functional.avg_pool2d(torch.nn.functional.pad(img, (1, 1, 1, 1),
                                                                   mode="replicate"), 3, 1)
    results = {"pairs": len(x) + 2000, "held_out": 2000, "steps": args.steps, "batch": 64,
               "noisy_db": round(psnr(vx, vy), 2),
               "mean_3x3_db": round(psnr(mean3.reshape(len(vx), -1), vy), 2), "variants": {}}
    print(f"noisy {results['noisy_db']} dB, 3x3 mean {results['mean_3x3_db']} dB", flush=True)
    for key in args.variants.split(","):
        name, make = _variants()[key]
        torch.manual_seed(0)
        model = make()
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        g = torch.Generator().manual_seed(0)
        t0 = time.perf_counter()
        for _ in range(args.steps):
            idx = torch.randint(len(x), (64,), generator=g)
            loss = 0.5 * ((model(x[idx]) - y[idx]) ** 2).sum(1).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        with torch.no_grad():
            db = psnr(model(vx), vy)
        results["variants"][key] = {"name": name, "held_out_db": round(db, 2),
                                    "seconds": round(time.perf_counter() - t0, 1)}
        print(f"{name}: {db:.2f} dB", flush=True)
    Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
