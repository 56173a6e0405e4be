"""Super-resolution stages on Spark vs plain PyTorch on the same patches and cores, and
inference throughput in megapixels/s.

Patches: T91 pairs made by the pipeline's Spark job (prepare_patches: HR 32x32 / LR 16x16,
Gaussian sigma 20, no augmentation), the first --rows of them, cached; the plain loops get the
same rows as numpy arrays. Stages (the job's models and losses, Adam: torch's fused kernel in
every system, as spark_dl's make_optimizer builds it):
  ssda      fine-tuning of the SSDA 1280-1280-256: noisy LR -> clean LR (1/2 squared error)
  cnn       SRCNN 9-5-5 on bicubic(SSDA(noisy LR)) -> HR, the SSDA frozen (MSE)
  cascade   the whole cascade end to end (MSE)
Systems, interleaved (A B C A B C ...), medians of --repeats:
  plain-1t  one process, the rows in shuffled batches of 128, 1 torch thread (the calibration)
  plain-2t  the same with 2 threads: the same cores as Spark gets
  spark_dl  spark_dl.fit(strategy="allreduce"), 2 replicas x batch 64 (global batch 128) on
            --master (default local-cluster[2,1,1024]: 2 executors of 1 core)
Each system trains --epochs epochs; the figure is the last epoch's samples/s (the loop's own
time: steady state), and the fit's wall time end to end.

Inference: super_resolve_folder (one Spark task per image group, the cascade fully
convolutional per image, colour kept, PNGs written) over Set5 copied --copies times, against
the same per-image work in a plain loop; HR megapixels written per second.

    .venv/bin/python benchmarks/bench_superres.py [--rows 2048] [--repeats 5]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
BATCH = 64                                        # per replica; the plain loops use 2 x BATCH


def _stages():
    """name -> (model factory, loss, features column, target column, target shape)."""
    import torch

    from spark_dl.models.srcnn import SRCNN
    from spark_dl.models.ssda import SSDA, LayerSpec
    from spark_dl.superres.cascade import Cascade
    from spark_dl.superres.pipeline import _half_squared_error
    torch.manual_seed(0)
    ssda = SSDA(256, (LayerSpec(1280, 0.01, 0.05, 1e-4), LayerSpec(1280, 0.01, 0.05, 1e-4),
                      LayerSpec(256, 0.0, 1.0, 1e-4)))
    frozen = Cascade(16, 2, copy.deepcopy(ssda), SRCNN())
    for p in frozen.ssda.parameters():
        p.requires_grad_(False)
    full = Cascade(16, 2, copy.deepcopy(ssda), SRCNN())
    mse = torch.nn.functional.mse_loss
    return {"ssda": (lambda: copy.deepcopy(ssda), _half_squared_error, "lr_clean", (256,)),
            "cnn": (lambda: copy.deepcopy(frozen), mse, "hr", (1, 32, 32)),
            "cascade": (lambda: copy.deepcopy(full), mse, "hr", (1, 32, 32))}


def plain(stage, data, threads, epochs):
    import torch
    model_fn, loss_fn, target, tshape = stage
    torch.set_num_threads(threads)
    t_wall = time.perf_counter()
    x = torch.from_numpy(data["lr"])
    y = torch.from_numpy(data[target]).reshape(len(x), *tshape)
    model = model_fn()
    from spark_dl.optim.factory import make_optimizer  # Adam as fit builds it (fused)
    opt = make_optimizer("adam", [p for p in model.parameters() if p.requires_grad], 1e-3)
    rate = 0.0
    for e in range(epochs):
        perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(e))
        t0 = time.perf_counter()
        for i in range(0, len(x), 2 * BATCH):
            idx = perm[i:i + 2 * BATCH]
            opt.zero_grad()
            loss_fn(model(x[idx]), y[idx]).backward()
            opt.step()
        rate = len(x) / (time.perf_counter() - t0)
    return rate, time.perf_counter() - t_wall


def engine(df, stage, epochs, runs):
    from spark_dl import fit
    model_fn, loss_fn, target, tshape = stage
    t0 = time.perf_counter()
    res = fit(df, model_fn, loss=loss_fn, features="lr", label=target, shape=(256,),
              label_shape=tshape, optimizer="adam", lr=1e-3, epochs=epochs, batch_size=BATCH,
              replicas=2, run_dir=runs / f"{time.time()}", log=None)
    return res.history[-1]["samples_per_s"], time.perf_counter() - t0


def _plain_folder(model, folder, out):
    """super_resolve_folder's per-image work, in this process."""
    import numpy as np
    from PIL import Image

    from spark_dl.superres.images import bicubic, rgb_to_y
    from spark_dl.superres.infer import _chroma, _rgb
    from spark_dl.superres.tiles import super_resolve
    pixels = 0
    for path in sorted(folder.iterdir()):
        img = np.asarray(Image.open(path).convert("RGB"))
        size = (img.shape[0] * 2, img.shape[1] * 2)
        y, (cb, cr) = rgb_to_y(img), _chroma(img)
        sr = super_resolve(y, 2, model.ssda, model.cnn, 16, 8)
        Image.fromarray(_rgb(sr, np.clip(bicubic(cb, size), 0, 1),
                             np.clip(bicubic(cr, size), 0, 1))).save(out / path.name)
        pixels += size[0] * size[1]
    return pixels


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=2048)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--copies", type=int, default=4, help="Set5 copies for inference")
    ap.add_argument("--master", default="local-cluster[2,1,1024]")
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/superres.json"))
    args = ap.parse_args(argv)
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("SPARK_CONF_DIR", str(ROOT / "conf/logging"))
    import numpy as np
    import torch

    from spark_dl import get_session
    from spark_dl.superres.cascade import Cascade
    from spark_dl.superres.infer import super_resolve_folder
    from spark_dl.superres.prepare import Degradation, prepare_patches

    work = Path(tempfile.mkdtemp(prefix="bench-superres-"))
    profile = "local-cluster" if args.master.startswith("local-cluster") else "local"
    spark = get_session(profile, master=args.master)
    prep = prepare_patches(spark, str(ROOT / "data/sr/T91"), str(work / "patches"), 32, 2, 16,
                           Degradation("gaussian", 20.0), False, seed=0)
    df = spark.read.parquet(prep.path).select("lr", "lr_clean", "hr").limit(args.rows) \
        .repartition(2).cache()
    pdf = df.toPandas()
    data = {c: np.stack(pdf[c].to_numpy()).astype(np.float32) for c in ("lr", "lr_clean", "hr")}
    rows = len(pdf)
    stages = _stages()
    systems = {"plain-1t": lambda s: plain(s, data, 1, args.epochs),
               "plain-2t": lambda s: plain(s, data, 2, args.epochs),
               "spark_dl": lambda s: engine(df, s, args.epochs, work / "runs")}
    engine(df, stages["ssda"], 1, work / "runs")                  # warm the Python workers
    raw = {st: {k: [] for k in systems} for st in stages}
    for r in range(args.repeats):
        for st, stage in stages.items():
            for k, fn in systems.items():                          # interleaved
                raw[st][k].append(fn(stage))
        print(f"repeat {r + 1}/{args.repeats}: " + ", ".join(
            f"{st} " + "/".join(f"{raw[st][k][-1][0]:,.0f}" for k in systems) for st in stages),
            flush=True)

    # inference over Set5 x copies
    folder = work / "set5"
    folder.mkdir()
    for i in range(args.copies):
        for p in sorted((ROOT / "data/sr/Set5").glob("*.png")):
            shutil.copy(p, folder / f"{p.stem}-{i}.png")
    torch.manual_seed(0)
    model = Cascade(16, 2, _stages()["ssda"][0]()).eval()
    inf = {"plain-1t": [], "plain-2t": [], "spark_dl": []}

    def spark_infer():
        out = work / f"sr-{time.time()}"
        t0 = time.perf_counter()
        rows_ = super_resolve_folder(spark, model, str(folder), str(out), scale=2, partitions=2)
        secs = time.perf_counter() - t0
        assert not any(r.error for r in rows_)
        shutil.rmtree(out)
        return sum(r.width * r.height for r in rows_) / 1e6 / secs

    def plain_infer(threads):
        torch.set_num_threads(threads)
        out = work / f"plain-{time.time()}"
        out.mkdir()
        t0 = time.perf_counter()
        with torch.no_grad():
            px = _plain_folder(model, folder, out)
        secs = time.perf_counter() - t0
        shutil.rmtree(out)
        return px / 1e6 / secs
    spark_infer()                                                  # warm
    for _ in range(args.repeats):
        inf["plain-1t"].append(plain_infer(1))
        inf["plain-2t"].append(plain_infer(2))
        inf["spark_dl"].append(spark_infer())

    summary = {}
    for st in stages:
        base = statistics.median(v[0] for v in raw[st]["plain-1t"])
        two = statistics.median(v[0] for v in raw[st]["plain-2t"])
        summary[st] = {k: {"samples_per_s": round(statistics.median(v[0] for v in vals), 1),
                           "seconds_per_epoch": round(rows / statistics.median(
                               v[0] for v in vals), 3),
                           "wall_s": round(statistics.median(v[1] for v in vals), 2),
                           "vs_plain_1t": round(statistics.median(v[0] for v in vals) / base, 3),
                           "vs_plain_2t": round(statistics.median(v[0] for v in vals) / two, 3)}
                       for k, vals in raw[st].items()}
    base = statistics.median(inf["plain-1t"])
    summary["inference_megapixels_per_s"] = {
        k: {"median": round(statistics.median(v), 3),
            "vs_plain_1t": round(statistics.median(v) / base, 3)} for k, v in inf.items()}
    print(json.dumps(summary, indent=1))
    infos = spark.sparkContext._jsc.sc().statusTracker().getExecutorInfos()
    Path(args.out).write_text(json.dumps({
        "date": time.strftime("%Y-%m-%d %H:%M"), "machine": platform.machine(),
        "cpus": os.cpu_count(), "torch": torch.__version__, "master": args.master,
        "executors": max(len(infos) - 1, 1), "rows": rows, "epochs": args.epochs,
        "batch_per_replica": BATCH, "repeats": args.repeats,
        "inference_images": args.copies * 5, "summary": summary, "raw": raw,
        "raw_inference": inf}, indent=1))
    spark.stop()
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
