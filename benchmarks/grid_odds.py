"""How often can a run of bench_scaling meet the 2-core target (2 replicas reach 98% in at most
0.6x one replica's time), given how many epochs each needs? The validations come every quarter
epoch, so a fit's time to 98% is its epochs to 98% (0.5, 0.75, ...) over its rate, and a run's
ratio is the median of 2 replicas' times over the median of one replica's, over its seeds.

The epochs come from averaged_weights.py's one-process simulation of AllReduce's update at
k = 1 and k = 2 replicas (fit's defaults: the linear rule with its warmup, the average over a
tenth of an epoch; files given as arguments, any number, pooled by seed). Per variant (k, rate
multiple, warmup, cut, momentum, Nesterov's or not): how many seeds reach the target at each
quarter epoch, the mean epochs, and the accuracy at each quarter. Then for each rule that ran
at both k = 1 and k = 2, fit's first: k = 2 against k = 1 seed by seed (the same seed: the
same initial weights), and the odds that a run of --seeds-per-run seeds meets --ratio when two
replicas step at each of --rates times one replica's samples a second:

  as simulated   n seeds drawn without replacement, both systems on the same seeds
  as one         both systems' epochs drawn from one replica's: the odds if two replicas
                 needed no more epochs than one

Timing noise is left out: the ratio is the epochs' medians over the rate.

    .venv/bin/python benchmarks/grid_odds.py RESULTS.json [...] [--span 0.1]
        [--rates 1.75,1.9,2.0] [--seeds-per-run 6,10,20] [--ratio 0.6] [--draws 20000]
        [--out benchmarks/results/grid-odds.json]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))


DEFAULT = (1.0, "auto", "fit", 0.9, False)     # fit's rule: (lr_factor, warmup, cut, ...)


def load(files: list[str], span: str) -> dict[tuple, dict[int, dict]]:
    """(k, lr_factor, warmup, cut, momentum, nesterov) -> seed -> {"epochs": epochs to target
    (None: never), "accuracy": the quarter-epoch accuracies} of the average over ``span``."""
    runs: dict[tuple, dict[int, dict]] = {}
    for f in files:
        for r in json.loads(Path(f).read_text())["raw"]["runs"]:
            key = (r["k"], r["lr_factor"], str(r["warmup"]), r.get("cut", DEFAULT[2]),
                   r.get("momentum", DEFAULT[3]), r.get("nesterov", DEFAULT[4]))
            runs.setdefault(key, {})[r["seed"]] = {"epochs": r["epochs_to_target"][span],
                                                   "accuracy": r["accuracy"][span]}
    return runs


def label_of(k, factor: float, warmup: str, cut: str, momentum: float, nesterov: bool) -> str:
    """A variant's label: its k and rule."""
    return (f"k={k} lr x{factor:g} warmup {warmup} cut {cut} momentum {momentum:g}"
            + (" nesterov" if nesterov else ""))


def odds(one: list[float], two: list[float], n: int, rate: float, ratio: float, draws: int,
         paired: bool, rng: random.Random) -> float:
    """The share of ``draws`` runs of ``n`` seeds whose median time of two replicas over that
    of one is at most ``ratio`` (time: epochs over the rate; one replica's rate 1)."""
    met = 0
    for _ in range(draws):
        if paired:
            idx = rng.sample(range(len(one)), n)
            a, b = [one[i] for i in idx], [two[i] for i in idx]
        else:
            a, b = [rng.choice(one) for _ in range(n)], [rng.choice(two) for _ in range(n)]
        met += statistics.median(b) / rate <= ratio * statistics.median(a)
    return met / draws


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="+", help="averaged_weights.py results files")
    ap.add_argument("--span", default="0.1")
    ap.add_argument("--rates", default="1.75,1.9,2.0")
    ap.add_argument("--seeds-per-run", default="6,10,20")
    ap.add_argument("--ratio", type=float, default=0.6)
    ap.add_argument("--draws", type=int, default=20000)
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/grid-odds.json"))
    args = ap.parse_args(argv)
    from _results import write_results
    runs = load(args.files, args.span)
    never = 1.25                                # a fit that never got there within an epoch
    summary: dict = {"variants": {}}
    for key, seeds in sorted(runs.items(), key=str):
        epochs = [s["epochs"] or never for s in seeds.values()]
        quarters = len(next(iter(seeds.values()))["accuracy"])
        summary["variants"][label_of(*key)] = {
            "seeds": len(seeds), "epochs_to_target": dict(sorted(Counter(
                s["epochs"] for s in seeds.values() if s["epochs"]).items())),
            "never": sum(s["epochs"] is None for s in seeds.values()),
            "mean_epochs": round(statistics.mean(epochs), 3),
            "mean_accuracy": [round(statistics.mean(s["accuracy"][q] for s in seeds.values()),
                                    4) for q in range(quarters)]}
    for rule in sorted({key[1:] for key in runs if key[0] == 2 and (1, *key[1:]) in runs},
                       key=lambda r: (r != DEFAULT, str(r))):
        one, two = runs[(1, *rule)], runs[(2, *rule)]
        both = sorted(one.keys() & two.keys())
        if len(both) < 2:
            continue
        label = label_of("1, 2", *rule)
        print(f"{label}, seeds both ran: {len(both)}")
        quarters = len(one[both[0]]["accuracy"])
        gaps = [[two[s]["accuracy"][q] - one[s]["accuracy"][q] for s in both]
                for q in range(quarters)]
        pair = {"seeds": len(both),
                "k2_minus_k1_accuracy_mean": [round(statistics.mean(g), 4) for g in gaps],
                "k2_minus_k1_accuracy_standard_error": [
                    round(statistics.stdev(g) / len(g) ** 0.5, 4) for g in gaps],
                "odds": []}
        rng = random.Random(0)              # each rule its own draws, whatever else ran
        e1 = [one[s]["epochs"] or never for s in both]
        e2 = [two[s]["epochs"] or never for s in both]
        for n in (int(x) for x in args.seeds_per_run.split(",") if int(x) <= len(both)):
            for rate in (float(x) for x in args.rates.split(",")):
                row = {"seeds_per_run": n, "rate": rate,
                       "as_simulated": odds(e1, e2, n, rate, args.ratio, args.draws, True, rng),
                       "as_one": odds(e1, e1, n, rate, args.ratio, args.draws, False, rng)}
                pair["odds"].append(row)
                print(f"  {n:3d} seeds, two replicas at {rate:.2f}x: meets {args.ratio} in "
                      f"{row['as_simulated']:.2f} of runs as simulated, "
                      f"{row['as_one']:.2f} if two needed the epochs of one", flush=True)
        print("  k=2 - k=1, same seed:", pair["k2_minus_k1_accuracy_mean"], "+-",
              pair["k2_minus_k1_accuracy_standard_error"])
        summary.setdefault("pairs", {})[label] = pair
    for name, v in summary["variants"].items():
        print(f"{name}: {v['seeds']} seeds, epochs {v['epochs_to_target']} never "
              f"{v['never']}, mean {v['mean_epochs']}, accuracy {v['mean_accuracy']}")
    write_results(args.out, "grid_odds.py", argv,
                  {"span": args.span, "ratio": args.ratio, "draws": args.draws,
                   "files": [Path(f).name for f in args.files], "never_counted_as": never},
                  summary, {})


if __name__ == "__main__":
    main()
