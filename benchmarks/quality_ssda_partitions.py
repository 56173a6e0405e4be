"""SSDA denoising with each replica's model split by columns over F tasks, against the unsplit
model (docs/quality.md, "Noise-resilient super-resolution": the SSDA split in two).

One Spark session (default ``local-cluster[2,2,1024]``: two executor JVMs of 2 cores) and one
set of patch pairs (the pipeline's own prepare_patches: T91, LR 16x16, Gaussian sigma 20, no
augmentation). Stage 1 of the super-resolution pipeline (superres.pipeline.train_ssda: greedy
layer-wise pretraining, then fine-tuning) with ``strategy="downpour"``, Adam on the server, for
every R x F in --configs; ``1x1`` is one task training alone (single-process SGD: the tests
prove a one-worker Downpour fit equal to it). The SSDA: one 1280-unit tied sigmoid layer with
the App. B sparsity (beta 0.01, rho 0.05, decay 1e-4), then a 256-unit code for --layers
1280,256. Figure: the denoised whole Set5 LR images (tiles every pixel, overlaps averaged;
the same noise for every config) in PSNR over the Y channel.

    PYTHONPATH=. .venv/bin/python benchmarks/quality_ssda_partitions.py \
        [--configs 1x1,1x2,2x2] [--out benchmarks/results/quality/ssda-partitions.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _set5(sigma: float, scale: int = 2):
    """(clean LR, noisy LR) of every Set5 image, the noise seeded once."""
    import numpy as np

    from spark_dl.superres.images import bicubic, load_y, modcrop
    rng = np.random.default_rng(0)
    out = []
    for path in sorted((ROOT / "data/sr/Set5").glob("*.png")):
        y = modcrop(load_y(path), scale)
        lr = bicubic(y, (y.shape[0] // scale, y.shape[1] // scale))
        out.append((path.stem, lr, np.clip(lr + rng.normal(0, sigma / 255, lr.shape), 0, 1)
                    .astype(np.float32)))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--master", default="local-cluster[2,2,1024]")
    ap.add_argument("--configs", default="1x1,1x2,2x2", help="R x F, comma-separated")
    ap.add_argument("--layers", default="1280")
    ap.add_argument("--pretrain-epochs", type=int, default=2)
    ap.add_argument("--finetune-epochs", type=int, default=4)
    ap.add_argument("--batch", type=int, default=64,
                    help="rows per replica step (each of its F tasks draws batch / F)")
    ap.add_argument("--sigma", type=float, default=20.0)
    ap.add_argument("--shuffle-rows", action="store_true",
                    help="shuffle the pairs across partitions (default: as prepare_patches "
                         "wrote them, the patches of an image together)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/quality/ssda-partitions.json"))
    args = ap.parse_args(argv)
    import numpy as np
    import torch

    from spark_dl import Downpour
    from spark_dl.models.ssda import LayerSpec
    from spark_dl.recipes.superres import denoise_image
    from spark_dl.session import get_session
    from spark_dl.superres.metrics import psnr
    from spark_dl.superres.pipeline import train_ssda
    from spark_dl.superres.prepare import Degradation, prepare_patches
    widths = [int(w) for w in args.layers.split(",")]
    specs = tuple(LayerSpec(w, 0.01, 0.05, 1e-4) for w in widths[:-1]) + \
        ((LayerSpec(widths[-1], 0.01, 0.05, 1e-4),) if len(widths) == 1 else
         (LayerSpec(widths[-1], 0.0, 1.0, 1e-4),))
    spark = get_session(master=args.master, conf={"spark.pyspark.python": sys.executable})
    scratch = Path(tempfile.mkdtemp(prefix="ssda-partitions-"))
    prep = prepare_patches(spark, str(ROOT / "data/sr/T91"), str(scratch / "patches"),
                           degradation=Degradation("gaussian", args.sigma), augment=False)
    df = spark.read.parquet(prep.path)
    if args.shuffle_rows:              # every task a random sample of all images' patches
        from pyspark.sql import functions as fn
        df = df.orderBy(fn.rand(seed=0))
    tests = _set5(args.sigma)
    result = {"date": time.strftime("%Y-%m-%d %H:%M"), "master": args.master,
              "torch": torch.__version__, "layers": widths, "sigma": args.sigma,
              "pretrain_epochs": args.pretrain_epochs, "finetune_epochs": args.finetune_epochs,
              "batch_per_replica_step": args.batch, "pairs": prep.patches,
              "shuffled_rows": args.shuffle_rows,
              "psnr_noisy": {n: psnr(noisy, clean) for n, clean, noisy in tests}, "runs": {}}
    for config in args.configs.split(","):
        R, F = (int(v) for v in config.split("x"))
        t0 = time.perf_counter()
        ssda, histories = train_ssda(
            df, 16, specs, args.pretrain_epochs, args.finetune_epochs, lr=1e-3,
            batch_size=args.batch // F, strategy=Downpour(partitions=F), optimizer="adam",
            replicas=R, seed=0, log=None, run_dir=scratch / f"run-{config}")
        ssda.eval()
        scores = {n: psnr(denoise_image(ssda.float(), noisy, 16, 1), clean)
                  for n, clean, noisy in tests}
        result["runs"][config] = {
            "replicas": R, "partitions": F, "seconds": time.perf_counter() - t0,
            "psnr": scores, "mean_psnr": float(np.mean(list(scores.values()))),
            "finetune_loss": [h["loss"] for h in histories[-1]]}
        print(config, json.dumps(result["runs"][config]), flush=True)
    result["mean_psnr_noisy"] = float(np.mean(list(result["psnr_noisy"].values())))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"noisy {result['mean_psnr_noisy']:.2f} dB; " + ", ".join(
        f"{c}: {r['mean_psnr']:.2f} dB" for c, r in result["runs"].items()))


if __name__ == "__main__":
    main()
