"""How many training rows an averaged ResNet's BatchNorm statistics need (design note 0022):
the held-out accuracy and loss of the model AllReduce returns (its averaged weights) with
statistics recomputed on N rows, N from 128 to 2,048, several draws of the rows each.

ResNet-18 (``spark_dl.models.build_model('resnet18', width=--width)``), the first --rows
shipped digits padded to 32x32 as uint8 Parquet, AllReduce with 2 replicas, batch 32, SGD lr
0.05 momentum 0.9, --epochs; then on the driver, per returned model, N rows drawn at random
from the training rows (batches of 32, as each replica's first mini-batches are) through
``spark_dl.optim.average.recompute_statistics``, and the 2,000 held-out digits evaluated;
also the seconds of a pass over N rows of the full-size (width 64) model, one thread.

    .venv/bin/python benchmarks/bn_statistics_rows.py [--width 16] [--rows 4000]
        [--epochs 1] [--seeds 2] [--draws 3] [--out ...]
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from _common import IMAGES, LABELS, write_results  # noqa: E402

ROWS = (128, 256, 512, 1024, 2048)


def padded(x):
    import numpy as np
    return np.pad(x, ((0, 0), (2, 2), (2, 2)))


def evaluate(net, x, y) -> dict:
    import torch
    import torch.nn.functional as F
    net.eval()
    with torch.no_grad():
        out = torch.cat([net(x[i:i + 500]) for i in range(0, len(x), 500)])
    return {"accuracy": float((out.argmax(1) == y).float().mean()),
            "loss": float(F.cross_entropy(out, y))}


def statistics_rows(model, train_x, val_x, val_y, draws: int) -> dict:
    """{N: the held-out figures of ``model`` with BatchNorm statistics recomputed on N
    training rows, one per draw of the rows}."""
    import torch

    from spark_dl.optim.average import recompute_statistics
    out = {}
    for n in ROWS:
        for draw in range(draws):
            net = copy.deepcopy(model)
            pick = torch.randperm(len(train_x), generator=torch.Generator().manual_seed(draw))[:n]
            recompute_statistics(net, (train_x[pick[i:i + 32]] for i in range(0, n, 32)))
            out.setdefault(str(n), []).append(evaluate(net, val_x, val_y))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--width", type=int, default=16)
    ap.add_argument("--rows", type=int, default=4000)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--draws", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/bn-statistics-rows.json"))
    args = ap.parse_args(argv)
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("SPARK_CONF_DIR", str(ROOT / "conf/logging"))
    os.environ["PYTHONPATH"] = str(ROOT)
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq
    import torch

    from spark_dl import fit, get_session
    from spark_dl.data import pixels_to_arrow
    from spark_dl.data.mnist import mnist_split
    from spark_dl.models import build_model
    from spark_dl.optim.average import recompute_statistics
    (tx, ty), (vx, vy) = mnist_split(IMAGES, LABELS, args.rows, 2000)
    tx, vx = padded(tx), padded(vx)
    tmp = Path(tempfile.mkdtemp(prefix="bn-rows-"))
    (tmp / "images").mkdir()
    for p in range(2):
        lo, hi = p * len(tx) // 2, (p + 1) * len(tx) // 2
        pq.write_table(pa.Table.from_batches([pixels_to_arrow(tx[lo:hi], ty[lo:hi])]),
                       tmp / "images" / f"part-{p}.parquet")
    train_x = torch.from_numpy(tx[:, None].astype(np.float32) / 255)
    val_x = torch.from_numpy(vx[:, None].astype(np.float32) / 255)
    val_y = torch.from_numpy(vy.astype(np.int64))
    spark = get_session("local", master="local[2]")
    torch.set_num_threads(2)
    raw, summary = {"models": []}, {}
    for seed in range(args.seeds):
        t0 = time.perf_counter()
        res = fit(spark.read.parquet((tmp / "images").as_uri()),
                  lambda: build_model("resnet18", width=args.width, in_channels=1,
                                      num_classes=10),
                  shape=(1, 32, 32), num_classes=10, optimizer="sgd", lr=0.05, momentum=0.9,
                  epochs=args.epochs, batch_size=32, replicas=2, threads=1, device="cpu",
                  seed=seed, run_dir=tmp / f"run-{seed}", log=None, progress=False)
        entry = {"seed": seed, "fit_s": time.perf_counter() - t0,
                 "returned": evaluate(res.model, val_x, val_y),
                 "rows": statistics_rows(res.model, train_x, val_x, val_y, args.draws)}
        raw["models"].append(entry)
        print(seed, entry["returned"], {n: [round(r["accuracy"], 4) for r in v]
                                        for n, v in entry["rows"].items()}, flush=True)
    for n in ROWS:
        accs = [r["accuracy"] for m in raw["models"] for r in m["rows"][str(n)]]
        losses = [r["loss"] for m in raw["models"] for r in m["rows"][str(n)]]
        spread = [max(r["accuracy"] for r in m["rows"][str(n)]) -
                  min(r["accuracy"] for r in m["rows"][str(n)]) for m in raw["models"]]
        summary[str(n)] = {"mean_accuracy": round(statistics.mean(accs), 4),
                           "mean_loss": round(statistics.mean(losses), 4),
                           "largest_spread_over_draws": round(max(spread), 4)}
    summary["returned_by_fit_1024"] = [round(m["returned"]["accuracy"], 4)
                                       for m in raw["models"]]
    torch.set_num_threads(1)
    full = build_model("resnet18", width=64, in_channels=1, num_classes=10)
    pass_s = {}
    for n in (256, 1024):
        t = time.perf_counter()
        recompute_statistics(full, (train_x[i:i + 32] for i in range(0, n, 32)))
        pass_s[str(n)] = round(time.perf_counter() - t, 2)
    summary["full_size_pass_s_one_thread"] = pass_s
    write_results(args.out, "bn_statistics_rows.py", argv,
                  {"width": args.width, "rows": args.rows, "epochs": args.epochs,
                   "seeds": args.seeds, "draws": args.draws,
                   "load_average": os.getloadavg()[0]}, summary, raw)
    spark.stop()


if __name__ == "__main__":
    main()
