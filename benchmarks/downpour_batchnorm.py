"""How much do Downpour's averaged models lose by keeping the workers' BatchNorm statistics?

Downpour's server averages the weights (``average``, 0.1 epoch by default) but holds no rows,
so the model it validates and returns carries the running statistics its workers reported,
which belong to their live weights, not to the average (AllReduce recomputes them:
spark_dl.optim.average.recompute_statistics). Here, per seed, 2 Downpour replicas train the
thesis CNN with a BatchNorm after every convolution (fit's "cnn_bn") on local[2],
bench_scaling's data (--samples distorted digits from the first 8,000 shipped ones; the last
2,000 real digits held out), SGD lr 0.02 halved every epoch, momentum 0.9, batch 16, 2 epochs,
with ``average=0`` (the last values) and ``average=0.1``; the returned model is validated as
returned and again after ``recompute_statistics`` on 1,024 of the training rows (drawn by the
seed), the pass AllReduce makes. Accuracy only; writes
benchmarks/results/downpour-batchnorm.json.

    .venv/bin/python benchmarks/downpour_batchnorm.py [--seeds 3] [--samples 24000] [--out ...]
"""

from __future__ import annotations

import copy
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]
from averaged_batchnorm import arguments, digits  # noqa: E402

OUT = ROOT / "benchmarks" / "results" / "downpour-batchnorm.json"
ROWS = 1024


def main(argv=None):
    args = arguments(__doc__, argv, OUT)
    import numpy as np
    import pyarrow.parquet as pq
    import torch

    from spark_dl import fit
    from spark_dl.optim.average import recompute_statistics
    from spark_dl.strategies import Downpour
    _, tmp, (vx, vy), df = digits(args.samples, "downpour-bn-")
    pixels = pq.read_table(tmp / "data.parquet").column("features").to_pylist()
    rows = torch.from_numpy(np.frombuffer(b"".join(pixels), np.uint8).reshape(-1, 1, 28, 28)
                            .astype(np.float32) / 255)
    held_x, held_y = torch.from_numpy(vx).reshape(-1, 1, 28, 28), torch.from_numpy(vy)

    @torch.no_grad()
    def accuracy(model) -> float:
        model.eval()
        return round((model(held_x).argmax(1) == held_y).float().mean().item(), 4)

    runs = []
    for seed in range(args.seeds):
        for average in (0.0, 0.1):
            res = fit(df, "cnn_bn", strategy=Downpour(average=average), shape=(1, 28, 28),
                      num_classes=10, optimizer="sgd", lr=0.02, lr_decay=0.5, momentum=0.9,
                      epochs=2, batch_size=16, replicas=2, threads=1, validation=(vx, vy),
                      seed=seed, validate_every=0.25, run_dir=tmp / f"run-{seed}-{average}",
                      log=None, progress=False)
            recomputed = copy.deepcopy(res.model)
            pick = torch.randperm(len(rows), generator=torch.Generator().manual_seed(seed))
            recompute_statistics(recomputed.train(), [rows[pick[i:i + 16]]
                                                      for i in range(0, ROWS, 16)])
            run = {"seed": seed, "average": average, "returned": accuracy(res.model),
                   "recomputed": accuracy(recomputed),
                   "val_accuracy": [e["val_accuracy"] for e in res.info["evals"]]}
            runs.append(run)
            print(run, flush=True)
    summary = {}
    for average in (0.0, 0.1):
        mine = [r for r in runs if r["average"] == average]
        summary[f"average {average:g}"] = {
            "returned": [r["returned"] for r in mine],
            "recomputed": [r["recomputed"] for r in mine],
            "recomputed_higher": sum(r["recomputed"] > r["returned"] for r in mine),
            "recomputed_lower": sum(r["recomputed"] < r["returned"] for r in mine)}
    print(summary)
    args.out.write_text(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M"),
                               "model": "thesis cnn with BatchNorm (cnn_bn)", "replicas": 2,
                               "strategy": "Downpour (defaults but average)",
                               "spark_master": "local[2]", "samples": args.samples,
                               "statistics_rows": ROWS,
                               "command": " ".join(["benchmarks/downpour_batchnorm.py",
                                                    *(argv or sys.argv[1:])]),
                               "summary": summary, "runs": runs}, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
