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
        [--first-seed 0] [--epochs 3] [--spans 0,0.02,0.05,0.1,0.2] [--lr-factors 1]
        [--warmups auto] [--cuts fit] [--momenta 0.9] [--nesterov off]
        [--out benchmarks/results/averaged-weights.json]
"""

from __future__ import annotations

import argparse
import copy
import multiprocessing
import statistics
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]
import scaled_rate_clip as sim  # noqa: E402


class Averages:
    """The watch of ``sim.simulate``: the moving average over each of ``spans`` (> 0), kept
    on the trajectory and validated at its marks."""

    def __init__(self, spans: tuple[float, ...]):
        self.spans = spans
        self.accuracy: dict[float, list[float]] = {a: [] for a in spans}

    def start(self, model, epoch_steps: int) -> None:
        from spark_dl.optim.average import WeightAverage
        self.probe = copy.deepcopy(model).eval()
        self.averages = {a: WeightAverage(model.parameters(), a, epoch_steps)
                         for a in self.spans}

    def step(self, steps: int = 1) -> None:
        """After each step (of ``steps`` units of ``epoch_steps``: batch_ramp.py's steps of
        several 16-row batches)."""
        for avg in self.averages.values():
            avg.update(steps)

    def mark(self, model, vx, vy) -> None:
        for a, avg in self.averages.items():
            for p, v in zip(self.probe.parameters(), avg.current()):
                p.copy_(v)
            self.accuracy[a].append(
                round((self.probe(vx).argmax(1) == vy).float().mean().item(), 4))


def run(data: str, k: int, epochs: int, seed: int, spans: tuple[float, ...],
        lr_factor: float = 1.0, warmup: float | str = "auto", cut: str = "fit",
        momentum: float = sim.MOMENTUM, nesterov: bool = False) -> dict:
    """One trajectory (the rate times ``lr_factor``, ``warmup`` epochs of warmup, "auto":
    fit's; ``cut``: "fit", grad_clip="auto"'s relative cut, "none", or its multiple of the
    running mean as a number; SGD's ``momentum``, Nesterov's if ``nesterov``): the accuracy
    of every span's average at every quarter epoch (span 0: the last weights)."""
    averages = Averages(tuple(a for a in spans if a > 0))
    out = sim.simulate(data, k, cut != "none", epochs, seed,
                       factor=None if cut in ("fit", "none") else float(cut), warmup=warmup,
                       lr_factor=lr_factor, watch=averages, momentum=momentum,
                       nesterov=nesterov)
    acc = {a: out["accuracy"] if a == 0 else averages.accuracy[a] for a in spans}
    first = {a: next(((i + 1) / 4 for i, v in enumerate(acc[a]) if v >= sim.TARGET), None)
             for a in spans}
    return {"k": k, "seed": seed, "lr_factor": lr_factor, "warmup": warmup, "cut": cut,
            "momentum": momentum, "nesterov": nesterov,
            "accuracy": {str(a): acc[a] for a in spans},
            "epochs_to_target": {str(a): first[a] for a in spans}}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--ks", default="1,2,16")
    ap.add_argument("--seeds", type=int, default=8)
    ap.add_argument("--first-seed", type=int, default=0)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--samples", type=int, default=48000)
    ap.add_argument("--spans", default="0,0.02,0.05,0.1,0.2")
    ap.add_argument("--lr-factors", default="1",
                    help="comma-separated multiples of the linear rule's rate, each a "
                         "trajectory of its own")
    ap.add_argument("--warmups", default="auto",
                    help="comma-separated warmups in epochs ('auto': fit's rule), each a "
                         "trajectory of its own")
    ap.add_argument("--cuts", default="fit",
                    help="comma-separated: 'fit' (grad_clip='auto''s relative cut), 'none', "
                         "or the cut's multiple of the running mean; each a trajectory")
    ap.add_argument("--momenta", default=str(sim.MOMENTUM),
                    help="comma-separated SGD momenta, each a trajectory")
    ap.add_argument("--nesterov", default="off",
                    help="comma-separated: 'off' (SGD's momentum), 'on' (Nesterov's); each a "
                         "trajectory")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/averaged-weights.json"))
    args = ap.parse_args(argv)
    from _results import write_results
    ks = [int(k) for k in args.ks.split(",")]
    spans = tuple(float(a) for a in args.spans.split(","))
    factors = [float(f) for f in args.lr_factors.split(",")]
    warmups = [w if w == "auto" else float(w) for w in args.warmups.split(",")]
    cuts = args.cuts.split(",")
    momenta = [float(m) for m in args.momenta.split(",")]
    nesterovs = [{"off": False, "on": True}[n] for n in args.nesterov.split(",")]
    data = sim.make_data(args.samples, Path(tempfile.mkdtemp(prefix="averaged-weights-")))
    variants = [(k, f, w, c, m, n) for k in ks for f in factors for w in warmups
                for c in cuts for m in momenta for n in nesterovs]
    jobs = [(data, k, args.epochs, s, spans, f, w, c, m, n) for k, f, w, c, m, n in variants
            for s in range(args.first_seed, args.first_seed + args.seeds)]
    with ProcessPoolExecutor(args.workers, mp_context=multiprocessing.get_context("spawn")) \
            as pool:
        runs = list(pool.map(run, *zip(*jobs)))
    summary = {}
    for k, f, w, c, m, n in variants:
        for a in spans:
            mine = [r for r in runs if (r["k"], r["lr_factor"], r["warmup"], r["cut"],
                                        r["momentum"], r["nesterov"]) == (k, f, w, c, m, n)]
            first = [r["epochs_to_target"][str(a)] for r in mine]
            counted = [f if f is not None else args.epochs + 0.25 for f in first]
            rate = "" if factors == [1.0] else f" lr x{f:g}"
            rate += "" if warmups == ["auto"] else f" warmup {w}"
            rate += "" if cuts == ["fit"] else f" cut {c}"
            rate += "" if momenta == [sim.MOMENTUM] else f" momentum {m:g}"
            rate += "" if nesterovs == [False] else f" nesterov {'on' if n else 'off'}"
            summary[f"k={k}{rate} average {a:g}"] = {
                "epochs_to_98": first, "reached": f"{sum(f is not None for f in first)}/"
                                                  f"{len(first)}",
                "mean_epochs_to_98": round(statistics.mean(counted), 3),
                "median_epochs_to_98": statistics.median(counted),
                "final_accuracy": statistics.median(r["accuracy"][str(a)][-1] for r in mine)}
    write_results(args.out, "averaged_weights.py", argv,
                  {"model": "thesis cnn", "samples": args.samples, "epochs": args.epochs,
                   "batch_per_replica": sim.BATCH, "lr_one_replica": sim.LR,
                   "lr_decay": sim.DECAY, "momentum": sim.MOMENTUM, "lr_scaling": "linear",
                   "target": sim.TARGET, "lr_factors": args.lr_factors,
                   "warmups": args.warmups, "cuts": args.cuts, "momenta": args.momenta,
                   "nesterov": args.nesterov,
                   "seeds": f"{args.first_seed}.."
                   f"{args.first_seed + args.seeds - 1}", "spans": args.spans},
                  summary, {"runs": runs})


if __name__ == "__main__":
    main()
