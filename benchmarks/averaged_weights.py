"""How soon does the weights' moving average reach 98%, against the last weights? A
one-process simulation of AllReduce's update at k replicas (scaled_rate_clip.py's: the thesis
CNN on the mean gradient of k x 16 rows, fit's schedule with the linear rule and its warmup,
the relative cut when k > 1, SGD momentum 0.9, lr 0.02 halved per epoch, bench_scaling's
data), where every step also updates the moving averages of spark_dl.optim.average over
each span of --spans (fractions of an epoch; 0: the last weights). Training reads the last
weights only, so one trajectory per (k, seed) serves every span: the comparison is paired.
Each is validated every quarter epoch on the last 2,000 real digits. Per k and span: the
epochs until 98% seed by seed, their mean and median, the final accuracy. Accuracy only, no
timing (bench_scaling.py times the real fit).

    .venv/bin/python benchmarks/averaged_weights.py [--ks 1,2,16] [--seeds 8]
        [--first-seed 0] [--epochs 3] [--spans 0,0.02,0.05,0.1,0.2]
        [--out benchmarks/results/averaged-weights.json]
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]
import scaled_rate_clip as sim  # noqa: E402


def run(data: str, k: int, epochs: int, seed: int, spans: tuple[float, ...]) -> dict:
    """One trajectory: the accuracy of every span's average at every quarter epoch."""
    import numpy as np
    import torch

    from spark_dl.models import build_model
    from spark_dl.optim import clip as clip_rule
    from spark_dl.optim.average import WeightAverage
    from spark_dl.optim.schedule import LRSchedule
    torch.set_num_threads(1)
    d = np.load(data)
    x, y = torch.from_numpy(d["x"]).reshape(-1, 1, 28, 28), torch.from_numpy(d["y"])
    vx, vy = torch.from_numpy(d["vx"]).reshape(-1, 1, 28, 28), torch.from_numpy(d["vy"])
    torch.manual_seed(seed)
    model, probe = build_model("cnn"), build_model("cnn").eval()
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=sim.LR, momentum=sim.MOMENTUM)
    schedule = LRSchedule(sim.LR, k, "linear", "auto", sim.DECAY, epochs)
    cut = clip_rule.GradClip("auto", k > 1, "cpu")
    b = sim.BATCH * k
    steps = len(x) // b
    marks = {round(steps * f) - 1 for f in (0.25, 0.5, 0.75, 1.0)}
    averages = {a: WeightAverage(params, a, steps) for a in spans if a > 0}
    acc: dict[float, list[float]] = {a: [] for a in spans}
    for e in range(epochs):
        perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed * 1000 + e))
        for s in range(steps):
            opt.param_groups[0]["lr"] = schedule.at(e + s / steps)
            idx = perm[s * b:(s + 1) * b]
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x[idx].float() / 255), y[idx]).backward()
            cut([p.grad for p in params])
            opt.step()
            for avg in averages.values():
                avg.update()
            if s in marks:
                with torch.no_grad():
                    for a in spans:
                        values = params if a == 0 else averages[a].values
                        for p, v in zip(probe.parameters(), values):
                            p.copy_(v)
                        acc[a].append(round((probe(vx).argmax(1) == vy).float().mean().item(), 4))
    first = {a: next(((i + 1) / 4 for i, v in enumerate(acc[a]) if v >= sim.TARGET), None)
             for a in spans}
    return {"k": k, "seed": seed, "accuracy": {str(a): acc[a] for a in spans},
            "epochs_to_target": {str(a): first[a] for a in spans}}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--ks", default="1,2,16")
    ap.add_argument("--seeds", type=int, default=8)
    ap.add_argument("--first-seed", type=int, default=0)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--samples", type=int, default=48000)
    ap.add_argument("--spans", default="0,0.02,0.05,0.1,0.2")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/averaged-weights.json"))
    args = ap.parse_args(argv)
    from _results import write_results
    ks = [int(k) for k in args.ks.split(",")]
    spans = tuple(float(a) for a in args.spans.split(","))
    data = sim.make_data(args.samples, Path(tempfile.mkdtemp(prefix="averaged-weights-")))
    jobs = [(data, k, args.epochs, s, spans) for k in ks
            for s in range(args.first_seed, args.first_seed + args.seeds)]
    with ProcessPoolExecutor(args.workers, mp_context=multiprocessing.get_context("spawn")) \
            as pool:
        runs = list(pool.map(run, *zip(*jobs)))
    summary = {}
    for k in ks:
        for a in spans:
            mine = [r for r in runs if r["k"] == k]
            first = [r["epochs_to_target"][str(a)] for r in mine]
            counted = [f if f is not None else args.epochs + 0.25 for f in first]
            summary[f"k={k} average {a:g}"] = {
                "epochs_to_98": first, "reached": f"{sum(f is not None for f in first)}/"
                                                  f"{len(first)}",
                "mean_epochs_to_98": round(statistics.mean(counted), 3),
                "median_epochs_to_98": statistics.median(counted),
                "final_accuracy": statistics.median(r["accuracy"][str(a)][-1] for r in mine)}
    write_results(args.out, "averaged_weights.py", argv,
                  {"model": "thesis cnn", "samples": args.samples, "epochs": args.epochs,
                   "batch_per_replica": sim.BATCH, "lr_one_replica": sim.LR,
                   "lr_decay": sim.DECAY, "momentum": sim.MOMENTUM, "lr_scaling": "linear",
                   "target": sim.TARGET, "seeds": f"{args.first_seed}.."
                   f"{args.first_seed + args.seeds - 1}", "spans": args.spans},
                  summary, {"runs": runs})


if __name__ == "__main__":
    main()
