"""The 2-core target over more seeds than one run: pools bench_scaling.py results files.

A run of bench_scaling.py gives each strategy's time to the target at R replicas over one
replica's, by the medians of its seeds (usually 6). Validation comes every quarter epoch, so a
fit's time is its quarter epochs over its rate, and a run's verdict turns on how many of its
few seeds one replica or two needed a quarter more (docs/benchmarks.md, "What decides
AllReduce's and Gossip's 2-core ratio"). This script reads several runs with the same settings
(lr, data, epochs, target; different seeds) and reports, per strategy and replica count:

  runs           each run's ratio of medians, and how many runs met --ratio
  pooled         the ratio of the medians over every seed of every run (the machine's speed
                 drifts between runs: read it with the next)
  same seed      the median over every seed of R replicas' time over one replica's, each pair
                 from one run (drift cancels within a pair); seeds where one replica never
                 reached the target are left out, R replicas that never did count as slowest
  epochs         how many seeds needed each quarter epoch, one replica and R replicas

The reference of each strategy is bench_scaling.py's (Gossip: AllReduce's one replica).

    .venv/bin/python benchmarks/pool_scaling.py RUN.json [...] [--ratio 0.6] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_scaling import reference  # noqa: E402

SAME = ("model", "samples", "epochs", "batch_per_replica", "lr_one_replica", "lr_decay",
        "momentum", "lr_scaling", "target", "validate_every")


def load(files: list[str]) -> list[dict]:
    """The runs, after checking that they differ in nothing but their seeds."""
    runs = [json.loads(Path(f).read_text()) for f in files]
    for f, run in zip(files, runs):
        if not run.get("command", "").startswith("benchmarks/bench_scaling.py") or \
                run.get("accuracy_only"):
            raise SystemExit(f"{f}: not a timed bench_scaling.py run (no one-replica times)")
        for key in SAME:
            if run.get(key) != runs[0].get(key):
                raise SystemExit(f"{f}: {key} is {run.get(key)!r} where {files[0]} has "
                                 f"{runs[0].get(key)!r}: pool only runs of the same settings")
    seeds = [r["seed"] for run in runs for r in next(iter(run["raw"].values()))]
    if len(seeds) != len(set(seeds)):
        raise SystemExit(f"a seed appears in more than one run ({sorted(seeds)}): pooling it "
                         f"twice would weigh it double")
    return runs


def pool(runs: list[dict], ratio: float) -> dict:
    """Per system with R > 1 replicas and a one-replica reference in every run: the figures
    of the docstring."""
    summary = {}
    names = set.intersection(*(set(run["raw"]) for run in runs))
    for name in sorted(names):
        strategy, _, r = name.rpartition("-")
        if name == "plain-1t" or int(r) < 2:
            continue
        ref = reference(strategy, names)
        if ref not in names:
            continue
        never = float("inf")                    # a fit that never got there: last in line
        per_run, times, refs, pairs = [], [], [], []
        for run in runs:
            two = {x["seed"]: x["time_to_target_s"] or never for x in run["raw"][name]}
            one = {x["seed"]: x["time_to_target_s"] or never for x in run["raw"][ref]}
            row = run["summary"].get(name, {})
            per_run.append({"seeds": run["seeds"].split(",")[0],
                            "ratio": row.get("time_vs_one_replica"),
                            "met": (row.get("time_vs_one_replica") or ratio + 1) <= ratio})
            times += two.values()
            refs += one.values()
            pairs += [two[seed] / one[seed] for seed in two.keys() & one.keys()
                      if one[seed] < never]      # R replicas that never got there: inf
        t2, t1 = statistics.median(times), statistics.median(refs)
        same = statistics.median(pairs) if pairs else never

        def epochs(system):
            counts = Counter("never" if e is None else round(float(e), 2)  # Boosting: 0.750665
                             for run in runs for e in run["summary"][system]["epochs_to_target"])
            return {str(k): counts[k] for k in sorted(counts, key=lambda k: (k == "never",
                                                                               str(k)))}
        summary[name] = {
            "reference": ref, "seeds": len(times),
            "runs": per_run, "runs_met": f"{sum(p['met'] for p in per_run)}/{len(per_run)}",
            "reached": f"{sum(t < never for t in times)}/{len(times)}",
            "pooled": round(t2 / t1, 3) if t1 < never and t2 < never else None,
            "same_seed": round(same, 3) if same < never else None,
            "same_seed_pairs": len(pairs),
            "epochs_one_replica": epochs(ref), "epochs": epochs(name)}
    return summary


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="+", help="bench_scaling.py results files")
    ap.add_argument("--ratio", type=float, default=0.6)
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/scaling-pooled.json"))
    args = ap.parse_args(argv)
    if not args.ratio > 0:
        ap.error(f"--ratio must be > 0, got {args.ratio}")
    from _results import write_results
    runs = load(args.files)
    summary = pool(runs, args.ratio)
    settings = {key: runs[0].get(key) for key in SAME}
    write_results(args.out, "pool_scaling.py", argv,
                  {**settings, "ratio": args.ratio, "files": [Path(f).name for f in args.files],
                   "run_dates": [run["date"] for run in runs]}, summary, {})


if __name__ == "__main__":
    main()
