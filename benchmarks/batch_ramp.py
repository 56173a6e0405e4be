"""Would a growing global batch let k replicas reach 98% sooner? A one-process simulation of
AllReduce's update at k replicas (averaged_weights.py's: the thesis CNN, fit's linear rule and
its warmup, the relative cut, SGD momentum 0.9, lr 0.02 halved per epoch, bench_scaling's
data, the weights' moving average over a tenth of an epoch validated every quarter epoch),
where for the first ``ramp`` epochs the global batch is smaller than k x 16 rows: it starts at
``start`` x 16 and doubles at equal intervals up to k x 16 (every replica would take its 16
rows in k / k_j steps of 16 k_j / k rows each: "Don't decay the learning rate, increase the
batch size", Smith et al. 2018; the batch warmup of large language models). The rate follows
the linear rule at the stage's batch, k_j x lr, and never exceeds fit's warmup; the cut acts
from k_j = 2 on. A run stops at its first validation at or above 98%.

Fewer rows per replica cost more time per row, and this model's step is mostly fixed cost, so
the script also times one process's step (forward, backward, SGD with momentum; one thread) at
each batch a replica would take, and gives each run's time to 98% as if the k replicas scaled
perfectly (no communication, no contention: a lower bound), in units of one replica's time
for an epoch at batch 16:

    time = sum over the stages run of  epochs_j / (k x rows/s(16 k_j / k) / rows/s(16))

Accuracy by simulation, time by that bound; bench_scaling.py times real fits.

    .venv/bin/python benchmarks/batch_ramp.py [--ks 1,2] [--seeds 16] [--first-seed 0]
        [--epochs 2] [--ramps 0,0.125] [--out benchmarks/results/batch-ramp.json]

``--ramps``: comma-separated ramp lengths in epochs (0: no ramp), each optionally
``R@S`` to start at S x 16 rows (default 1 x 16: one replica's batch).
"""

from __future__ import annotations

import argparse
import math
import multiprocessing
import statistics
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]
import scaled_rate_clip as sim  # noqa: E402
from averaged_weights import Averages  # noqa: E402

SPAN = 0.1                       # the synchronous strategies' default average, in epochs


def stages(k: int, ramp: float, start: int) -> list[int]:
    """Every k_j a run takes, in order: ``start`` doubled until k (just k without a ramp)."""
    if ramp <= 0 or start >= k:
        return [k]
    return [start * 2 ** j for j in range(math.ceil(math.log2(k / start)))] + [k]


def stage(t: float, k: int, ramp: float, start: int) -> int:
    """k_j: the global batch in one replica's batches at ``t`` epochs (the ramp's stages of
    equal length, then k)."""
    ks = stages(k, ramp, start)
    return k if t >= ramp or len(ks) == 1 else ks[int(t / (ramp / (len(ks) - 1)))]


def run(data: str, k: int, epochs: int, seed: int, ramp: float, start: int) -> dict:
    """One trajectory: the averaged weights' accuracy at every quarter epoch until 98%, and
    the epochs spent at every stage's batch."""
    import torch

    from spark_dl.optim import clip as clip_rule
    from spark_dl.optim.schedule import LRSchedule
    x, y, vx, vy, model = sim.start(data, seed)
    opt = torch.optim.SGD(model.parameters(), lr=sim.LR, momentum=sim.MOMENTUM)
    schedule = LRSchedule(sim.LR, k, "linear", "auto", sim.DECAY, epochs)
    cut = clip_rule.GradClip("auto", k > 1, "cpu")
    n = len(x)
    watch = Averages((SPAN,))             # its window counted in 16-row batches, whatever
    watch.start(model, n // sim.BATCH)    # the stage's batch
    acc, spent, mark = watch.accuracy[SPAN], {}, 0.25
    for e in range(epochs):
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1000 + e))
        pos = 0
        while pos < n and not (acc and acc[-1] >= sim.TARGET):
            t = e + pos / n
            kj = stage(t, k, ramp, start)
            b = sim.BATCH * kj
            opt.param_groups[0]["lr"] = min(schedule.at(t), sim.DECAY ** e * sim.LR * kj)
            idx = perm[pos:pos + b]
            pos += b
            spent[kj] = spent.get(kj, 0.0) + len(idx) / n
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x[idx].float() / 255), y[idx]).backward()
            if kj > 1:
                cut([p.grad for p in model.parameters()])
            opt.step()
            watch.step(kj)
            while e + pos / n >= mark - 1e-9 and mark <= epochs:
                model.eval()
                with torch.no_grad():
                    watch.mark(model, vx, vy)
                model.train()
                mark += 0.25
        if acc and acc[-1] >= sim.TARGET:
            break
    first = next(((i + 1) / 4 for i, a in enumerate(acc) if a >= sim.TARGET), None)
    return {"k": k, "seed": seed, "ramp": ramp, "start": start, "accuracy": acc,
            "epochs_to_target": first,
            "epochs_at_batch": {str(sim.BATCH * kj): round(v, 4) for kj, v in spent.items()}}


def step_costs(batches: list[int], repeats: int = 5, steps: int = 300) -> dict[int, float]:
    """Milliseconds a step of one process (one thread) at each batch: the thesis CNN's
    forward, backward and SGD step with momentum, batches interleaved, medians of
    ``repeats``."""
    import torch

    from spark_dl.models import build_model
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = build_model("cnn")
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    ms: dict[int, list[float]] = {b: [] for b in batches}
    for _ in range(repeats):
        for b in batches:
            x, y = torch.rand(b, 1, 28, 28), torch.randint(0, 10, (b,))
            for i in range(steps + 20):                   # 20 steps of warmup, untimed
                if i == 20:
                    t0 = time.perf_counter()
                opt.zero_grad()
                torch.nn.functional.cross_entropy(model(x), y).backward()
                opt.step()
            ms[b].append((time.perf_counter() - t0) / steps * 1e3)
    return {b: statistics.median(v) for b, v in ms.items()}


def ideal_time(r: dict, costs: dict[int, float]) -> float | None:
    """A run's time to 98% with k perfectly scaling replicas, in one replica's epochs at
    batch 16 (the module's formula); None when it did not get there."""
    if r["epochs_to_target"] is None:
        return None
    rate16 = sim.BATCH / costs[sim.BATCH]
    total = 0.0
    for rows, epochs in r["epochs_at_batch"].items():
        per_replica = int(rows) // r["k"]
        total += epochs / (r["k"] * (per_replica / costs[per_replica]) / rate16)
    return round(total, 4)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--ks", default="1,2")
    ap.add_argument("--seeds", type=int, default=16)
    ap.add_argument("--first-seed", type=int, default=0)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--samples", type=int, default=48000)
    ap.add_argument("--ramps", default="0,0.125")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/batch-ramp.json"))
    args = ap.parse_args(argv)
    from _results import write_results
    ks = [int(k) for k in args.ks.split(",")]
    ramps = [(float(r.partition("@")[0]), int(r.partition("@")[2] or 1))
             for r in args.ramps.split(",")]
    for k in ks:
        if k & (k - 1) or k > sim.BATCH:
            ap.error(f"--ks: {k} is not a power of two up to {sim.BATCH} (a replica's "
                     f"{sim.BATCH} rows split in halves, at least one row each)")
    for _, s in ramps:
        if s & (s - 1) or s < 1:
            ap.error(f"--ramps: the start {s} is not a power of two")
    variants = sorted({(k, r, s) if r > 0 and s < k else (k, 0.0, 1)   # else: no ramp
                       for k in ks for r, s in ramps})
    costs = step_costs(sorted({sim.BATCH * kj // k for k, r, s in variants
                               for kj in stages(k, r, s)}))
    data = sim.make_data(args.samples, Path(tempfile.mkdtemp(prefix="batch-ramp-")))
    seeds = range(args.first_seed, args.first_seed + args.seeds)
    jobs = [(data, k, args.epochs, seed, r, s) for k, r, s in variants for seed in seeds]
    with ProcessPoolExecutor(args.workers, mp_context=multiprocessing.get_context("spawn")) \
            as pool:
        runs = list(pool.map(run, *zip(*jobs)))
    for r in runs:
        r["ideal_time"] = ideal_time(r, costs)
    late = args.epochs + 0.25               # a run that never got there: that, at full batch

    def timed(r: dict) -> float:
        return r["ideal_time"] if r["ideal_time"] is not None else round(late / r["k"], 4)
    one = {r["seed"]: timed(r) for r in runs if r["k"] == 1}
    summary = {}
    for k, ramp, start in variants:
        mine = [r for r in runs if (r["k"], r["ramp"], r["start"]) == (k, ramp, start)]
        first = [r["epochs_to_target"] for r in mine]
        times = [timed(r) for r in mine]
        name = f"k={k}" + (f" ramp {ramp:g} from {sim.BATCH * start}" if ramp else "")
        summary[name] = {
            "epochs_to_98": first, "reached": f"{sum(f is not None for f in first)}/{len(first)}",
            "at_half_an_epoch": sum(f is not None and f <= 0.5 for f in first),
            "median_epochs_to_98": statistics.median(f if f is not None else late
                                                     for f in first),
            "ideal_time_to_98": times, "median_ideal_time": statistics.median(times)}
        if one and k > 1:
            summary[name]["median_ideal_time_x_one_replica"] = round(statistics.median(
                t / one[r["seed"]] for t, r in zip(times, mine)), 3)
    write_results(args.out, "batch_ramp.py", argv,
                  {"model": "thesis cnn", "samples": args.samples, "epochs": args.epochs,
                   "batch_per_replica": sim.BATCH, "lr_one_replica": sim.LR,
                   "lr_decay": sim.DECAY, "momentum": sim.MOMENTUM, "lr_scaling": "linear",
                   "average": SPAN, "target": sim.TARGET, "ramps": args.ramps,
                   "seeds": f"{args.first_seed}..{args.first_seed + args.seeds - 1}",
                   "step_ms_one_thread": {str(b): round(v, 3) for b, v in costs.items()}},
                  summary, {"runs": runs})


if __name__ == "__main__":
    main()
