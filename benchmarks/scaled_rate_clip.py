"""Does the scaled rate's relative gradient cut (fit's grad_clip="auto") keep the linear rule
stable, and what does it cost? A one-process simulation of AllReduce's update at k replicas:
the thesis CNN steps on the mean gradient of k x --batch rows with fit's schedule (LRSchedule:
lr x k, its "auto" warmup, the per-epoch decay), SGD momentum 0.9, on the extended MNIST the
demo generates (bench_scaling's data: --samples distorted digits from the first 8,000 shipped
ones), validated on the last 2,000 real digits every quarter epoch. Each configuration runs
with the cut (spark_dl.optim.clip.GradClip("auto")) and without, for --seeds seeds (the
initial weights and the row order); per configuration: the epochs until 98% (the first
quarter-epoch validation at or above it), the final accuracy, the runs that fell to chance
(below 20% at the end) and the steps cut. Accuracy only, no timing: the 16-replica curves cost
one process here instead of 16 cores.

    .venv/bin/python benchmarks/scaled_rate_clip.py [--ks 2,8,16] [--seeds 3] [--epochs 3]
        [--workers 2] [--factor 2] [--out benchmarks/results/scaled-rate-clip.json]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]
MOMENTUM, LR, DECAY, BATCH, TARGET = 0.9, 0.02, 0.5, 16, 0.98
_FIT: dict = {}                  # fit's cut factor, kept before a run changes it


def start(data: str, seed: int):
    """One thread, the rows and held-out digits of ``data`` (make_data's .npz) as tensors,
    and the thesis CNN initialized from ``seed``: (x, y, vx, vy, model)."""
    import numpy as np
    import torch

    from spark_dl.models import build_model
    torch.set_num_threads(1)
    d = np.load(data)
    x, y = torch.from_numpy(d["x"]).reshape(-1, 1, 28, 28), torch.from_numpy(d["y"])
    vx, vy = torch.from_numpy(d["vx"]).reshape(-1, 1, 28, 28), torch.from_numpy(d["vy"])
    torch.manual_seed(seed)
    return x, y, vx, vy, build_model("cnn")


def simulate(data: str, k: int, clip: bool, epochs: int, seed: int,
             factor: float | None = None, warmup: float | str = "auto",
             stop: bool = False, lr_factor: float = 1.0, watch=None,
             momentum: float = MOMENTUM, nesterov: bool = False) -> dict:
    """One run: accuracy per quarter epoch and the steps the cut changed (``factor``: the
    cut's multiple of the running mean instead of fit's; ``warmup``: the warmup's epochs
    instead of fit's "auto"; ``stop``: end at the first validation at the target;
    ``lr_factor``: the scheduled rate times this, warmup's start included; ``momentum``:
    SGD's instead of MOMENTUM; ``nesterov``: SGD's Nesterov momentum; ``watch``: an
    observer of the trajectory, ``watch.start(model, steps_per_epoch)`` before the first
    step, ``watch.step()`` after each, ``watch.mark(model, vx, vy)`` at each validation)."""
    import torch

    from spark_dl.optim import clip as clip_rule
    from spark_dl.optim.schedule import LRSchedule
    fit_factor = _FIT.setdefault("factor", clip_rule.FACTOR)   # a pool's process runs
    clip_rule.FACTOR = fit_factor if factor is None else factor  # several: each its own
    x, y, vx, vy, model = start(data, seed)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=momentum, nesterov=nesterov)
    schedule = LRSchedule(LR, k, "linear", warmup, DECAY, epochs)
    cut = clip_rule.GradClip("auto" if clip else None, k > 1, "cpu")
    b = BATCH * k
    steps = len(x) // b
    marks = {round(steps * f) - 1 for f in (0.25, 0.5, 0.75, 1.0)}
    acc = []
    if watch is not None:
        watch.start(model, steps)
    for e in range(epochs):
        perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed * 1000 + e))
        for s in range(steps):
            opt.param_groups[0]["lr"] = lr_factor * schedule.at(e + s / steps)
            idx = perm[s * b:(s + 1) * b]
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x[idx].float() / 255), y[idx]).backward()
            cut([p.grad for p in model.parameters()])
            opt.step()
            if watch is not None:
                watch.step()
            if s in marks:
                model.eval()
                with torch.no_grad():
                    acc.append(round((model(vx).argmax(1) == vy).float().mean().item(), 4))
                    if watch is not None:
                        watch.mark(model, vx, vy)
                model.train()
                if stop and acc[-1] >= TARGET:
                    break
        if stop and acc and acc[-1] >= TARGET:
            break
    first = next((i for i, a in enumerate(acc) if a >= TARGET), None)
    return {"k": k, "clip": clip, "seed": seed, "warmup": warmup, "lr_factor": lr_factor,
            "warmup_epochs": schedule.warmup, "accuracy": acc,
            "epochs_to_target": None if first is None else (first + 1) / 4,
            "final_accuracy": acc[-1], "clipped_steps": cut.describe()["clipped_steps"],
            "steps": steps * epochs}


def make_data(samples: int, out: Path) -> str:
    import numpy as np
    import pyarrow.parquet as pq
    from bench_scaling import make_data as scaling_data

    from spark_dl import get_session
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("SPARK_CONF_DIR", str(ROOT / "conf/logging"))
    spark = get_session("local", master="local[2]")
    vx, vy = scaling_data(spark, samples, out / "extended")
    spark.stop()
    t = pq.read_table(out / "extended")
    x = np.frombuffer(b"".join(t.column("features").to_pylist()), np.uint8).reshape(-1, 784)
    path = out / "data.npz"
    np.savez(path, x=x, y=t.column("label").to_numpy().astype(np.int64), vx=vx, vy=vy)
    return str(path)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--ks", default="2,8,16")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--samples", type=int, default=48000)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--factor", type=float, default=None,
                    help="the cut at this multiple of the running mean (fit's: 2)")
    ap.add_argument("--warmups", default="auto",
                    help="comma-separated warmups in epochs ('auto': fit's rule), each a "
                         "configuration of its own")
    ap.add_argument("--cut", choices=("both", "on", "off"), default="both",
                    help="run with the cut, without it, or both (the default)")
    ap.add_argument("--stop", action="store_true",
                    help="end each run at its first validation at 98%% (epochs to 98%% only)")
    ap.add_argument("--lr-factors", default="1",
                    help="comma-separated multiples of the linear rule's rate, each a "
                         "configuration of its own")
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/scaled-rate-clip.json"))
    args = ap.parse_args(argv)
    factors = [float(f) for f in args.lr_factors.split(",")]
    warmups = [w if w == "auto" else float(w) for w in args.warmups.split(",")]
    cuts = {"both": (False, True), "on": (True,), "off": (False,)}[args.cut]
    from _results import write_results
    data = make_data(args.samples, Path(tempfile.mkdtemp(prefix="clip-sim-")))
    jobs = [(k, clip, seed, w, f) for k in map(int, args.ks.split(",")) for w in warmups
            for f in factors for seed in range(args.seeds) for clip in cuts]
    import multiprocessing
    with ProcessPoolExecutor(args.workers, mp_context=multiprocessing.get_context("spawn")) \
            as pool:
        runs = list(pool.map(simulate, *zip(*[(data, k, c, args.epochs, s, args.factor, w,
                                                args.stop, f) for k, c, s, w, f in jobs])))
    summary = {}
    for k in map(int, args.ks.split(",")):
        for clip, w, f in ((c, w, f) for w in warmups for f in factors for c in cuts):
            mine = [r for r in runs if r["k"] == k and r["clip"] == clip and r["warmup"] == w
                    and r["lr_factor"] == f]
            reached = [r["epochs_to_target"] for r in mine if r["epochs_to_target"]]
            name = f"k={k} {'clip auto' if clip else 'no clip'}"
            name += "" if warmups == ["auto"] else f" warmup {w}"
            summary[name + ("" if factors == [1.0] else f" lr x{f:g}")] = {
                "warmup_epochs": mine[0]["warmup_epochs"],
                "epochs_to_98": [r["epochs_to_target"] for r in mine],
                "median_epochs_to_98": statistics.median(reached) if reached else None,
                "reached": f"{len(reached)}/{len(mine)}",
                "final_accuracy": [r["final_accuracy"] for r in mine],
                "fell_to_chance": sum(r["final_accuracy"] < 0.2 for r in mine),
                "clipped_steps": [r["clipped_steps"] for r in mine]}
    write_results(args.out, "scaled_rate_clip.py", argv,
                  {"model": "thesis cnn", "samples": args.samples, "epochs": args.epochs,
                   "batch_per_replica": BATCH, "lr_one_replica": LR, "lr_decay": DECAY,
                   "momentum": MOMENTUM, "lr_scaling": "linear",
                   "warmups": args.warmups, "lr_factors": args.lr_factors,
                   "stop_at_target": args.stop,
                   "seeds": args.seeds, "target": TARGET,
                   "cut_factor": args.factor or 2.0}, summary, {"runs": runs})


if __name__ == "__main__":
    main()
