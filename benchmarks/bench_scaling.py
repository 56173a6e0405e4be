"""Scaling as time to accuracy: does adding replicas give a good model sooner?

The thesis CNN on the extended MNIST the demo generates (--samples distorted digits made from
the first 8,000 shipped digits, on the executors, written once as Parquet), validated on the
last 2,000 real digits every quarter epoch (fit's validate_every=0.25; validation's own time
kept out of the clock). SGD lr --lr for one replica's batch of --batch rows, momentum 0.9,
halved after every epoch (--lr-decay), fit's default lr_scaling="auto". Every system at every
replica count, interleaved (A B C ... A B C ...), medians of --repeats runs; repeat i runs
every system with seed i (the model's initial weights and the order of the rows):

  plain-1t          single-process PyTorch, 1 thread, the same rows, lr and evaluation marks
                    (the calibration: the limit of R replicas is R x its samples/s)
  ceiling-<R>       R of those processes at once (R >= 2), each on its own 1/R of the rows,
                    never communicating, not validating: what the machine does with R
                    processes; samples/s is the sum of theirs
  <strategy>-<R>    spark_dl.fit(strategy=<strategy>, replicas=R), the strategy at its
                    defaults, on local[max R], 1 thread a replica; a strategy is a name in
                    spark_dl.strategies.STRATEGIES (allreduce, downpour, gossip, boosting,
                    localsgd, ...); Gossip runs from 2 replicas

Reported per system: the training seconds until the held-out accuracy first reaches --target
(None when it never does), steady samples/s (median over epochs), its fraction of the limit
and of the ceiling at its replica count (the median of the repeats' ratios), the final
accuracy; per strategy, time to target at R replicas over one replica's (Gossip's one-replica
reference is AllReduce's), and "fixed_time": R replicas' final accuracy against what one
replica had validated within the same training time, seed by seed ("not_lower": in how many
seeds it is at least as high, of those where one replica had validated by then).

    .venv/bin/python benchmarks/bench_scaling.py [--replicas 1,2] [--repeats 3]
        [--strategies allreduce,downpour,gossip,boosting] [--epochs 2] [--samples 48000]
        [--accuracy-only] [--first-seed 0] [--out ...]

--accuracy-only runs the strategies at the replica counts given and nothing else (no plain
calibration, no ceiling): their curves, e.g. 16 replicas on local[16] on a machine with fewer
cores, where only the accuracy means anything.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from _common import scaling_data, write_results  # noqa: E402

MOMENTUM, EVERY = 0.9, 0.25


def first_at(evals: list[dict], target: float) -> float | None:
    """Training seconds of the first validation at or above ``target``."""
    return next((e["train_seconds"] for e in evals if e.get("val_accuracy", 0) >= target),
                None)


def accuracy_at(evals: list[dict], seconds: float) -> float | None:
    """The held-out accuracy a run had validated by ``seconds`` of training (its last
    evaluation at or before then), None before its first."""
    seen = [e["val_accuracy"] for e in evals if e["train_seconds"] <= seconds + 1e-9
            and "val_accuracy" in e]
    return seen[-1] if seen else None


def fixed_time(runs: list[dict], refs: list[dict]) -> dict | None:
    """The issue's fixed-time-budget target, seed by seed: each of ``runs``' own training
    time is the budget; its final accuracy against what the one-replica reference of the same
    seed (``refs``) had validated by then."""
    pairs = [(x["final_accuracy"], accuracy_at(ref["evals"], x["evals"][-1]["train_seconds"]),
              x["evals"][-1]["train_seconds"]) for x, ref in zip(runs, refs) if x["evals"]]
    if not pairs:
        return None
    known = [(a, one) for a, one, _ in pairs if one is not None]   # one had validated by then
    return {"budget_s": round(statistics.median(t for _, _, t in pairs), 3),
            "accuracy": statistics.median(a for a, _, _ in pairs),
            "one_replica_accuracy": statistics.median(one for _, one in known) if known
            else None,
            "not_lower": f"{sum(a >= one for a, one in known)}/{len(known)}",
            "no_reference_yet": len(pairs) - len(known)}


def reference(strategy: str, systems) -> str:
    """The one-replica system among ``systems`` that ``strategy``'s replicas are compared
    with: its own, else AllReduce's (Gossip's)."""
    return f"{strategy}-1" if f"{strategy}-1" in systems else "allreduce-1"


def plain(data: Path, val, args, seed: int, part: tuple[int, int] = (0, 1),
          barrier=None) -> dict:
    """Single-process, one-thread PyTorch over the same rows, evaluated at the same marks;
    ``part`` (i, R): the i-th of R interleaved slices of the rows only, started when
    ``barrier`` lets every process of the ceiling go, and evaluated only at the end when
    ``val`` is None."""
    import numpy as np
    import pyarrow.parquet as pq
    import torch

    from spark_dl.losses import val_metrics
    from spark_dl.models import build_model
    from spark_dl.runtime.validation import mid_epoch_steps
    torch.set_num_threads(1)
    table = pq.read_table(data)
    x = np.frombuffer(b"".join(table.column("features").to_pylist()), np.uint8)
    x = torch.from_numpy(x.reshape(-1, 1, 28, 28).astype(np.float32) / 255)
    y = torch.from_numpy(table.column("label").to_numpy().astype(np.int64))
    x, y = x[part[0]::part[1]], y[part[0]::part[1]]
    vx, vy = (x[:1], y[:1]) if val is None else \
        (torch.from_numpy(val[0]).reshape(-1, 1, 28, 28), torch.from_numpy(val[1]))
    torch.manual_seed(seed)
    model = build_model("cnn")
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=MOMENTUM)
    sched = torch.optim.lr_scheduler.ExponentialLR(opt, args.lr_decay)
    n, b = len(x), args.batch
    steps = -(-n // b)
    marks = (mid_epoch_steps(steps, EVERY) if val is not None else set()) | {steps - 1}
    evals, clock, rates = [], 0.0, []
    if barrier is not None:
        barrier.wait()
    for e in range(args.epochs):
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1000 + e))
        t0, epoch_s = time.perf_counter(), 0.0
        for s in range(steps):
            idx = perm[s * b:(s + 1) * b]
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
            opt.step()
            if s in marks:
                now = time.perf_counter()
                clock, epoch_s, t0 = clock + now - t0, epoch_s + now - t0, None
                evals.append({"epoch": e + (s + 1) / steps, "train_seconds": clock,
                              **val_metrics(model, (vx, vy), torch.nn.functional.cross_entropy,
                                            True)})
                model.train()
                t0 = time.perf_counter()
        rates.append(n / max(epoch_s, 1e-9))
        sched.step()
    return {"evals": evals, "samples_per_s": statistics.median(rates),
            "final_accuracy": evals[-1]["val_accuracy"]}


def _ceiling_process(data, args, seed, part, barrier, queue) -> None:
    try:
        queue.put((part[0], plain(data, None, args, seed, part, barrier)["samples_per_s"]))
    except BaseException as e:           # the parent reports it
        queue.put((part[0], f"{type(e).__name__}: {e}"))


def ceiling(data: Path, args, seed: int, replicas: int) -> dict:
    """``replicas`` one-thread processes at once, each on its own 1/R of the rows, never
    communicating: their summed samples/s."""
    import multiprocessing as mp
    ctx = mp.get_context("spawn")
    barrier, queue = ctx.Barrier(replicas), ctx.Queue()
    procs = [ctx.Process(target=_ceiling_process,
                         args=(data, args, seed, (i, replicas), barrier, queue))
             for i in range(replicas)]
    for p in procs:
        p.start()
    rates = dict(queue.get(timeout=3600) for _ in procs)
    for p in procs:
        p.join()
    errors = [r for r in rates.values() if isinstance(r, str)]
    if errors:
        raise RuntimeError(f"a ceiling process failed: {errors[0]}")
    return {"samples_per_s": sum(rates.values()),
            "per_process": [round(rates[i]) for i in range(replicas)]}


def spark_dl_fit(spark, data: Path, val, strategy: str, replicas: int, args, runs: Path,
                 seed: int) -> dict:
    from spark_dl import fit
    df = spark.read.parquet(data.as_uri())
    t0 = time.perf_counter()
    res = fit(df, "cnn", strategy=strategy, shape=(1, 28, 28), num_classes=10,
              optimizer="sgd", lr=args.lr, lr_decay=args.lr_decay, momentum=MOMENTUM,
              epochs=args.epochs, batch_size=args.batch, replicas=replicas, threads=1,
              validation=val, seed=seed,
              device="cpu",                     # CPU replicas, also on a machine with a GPU
              validate_every=EVERY, run_dir=runs / f"{strategy}-{replicas}-{time.time()}",
              log=None, progress=False)
    wall = time.perf_counter() - t0
    evals = res.info["evals"]
    return {"evals": evals, "wall_s": wall,
            "samples_per_s": statistics.median(h["samples_per_s"] for h in res.history),
            "final_accuracy": res.history[-1].get("val_accuracy"),
            "lr": [h.get("lr") for h in res.history],
            "timings_rank0": res.info.get("timings_rank0")}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--replicas", default="1,2")
    ap.add_argument("--strategies", default="allreduce,downpour,gossip,boosting")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--samples", type=int, default=48000)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=0.02)
    ap.add_argument("--lr-decay", type=float, default=0.5)
    ap.add_argument("--target", type=float, default=0.98)
    ap.add_argument("--accuracy-only", action="store_true")
    ap.add_argument("--first-seed", type=int, default=0,
                    help="repeat i runs with seed first_seed + i (more seeds for a run kept)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/scaling.json"))
    args = ap.parse_args(argv)
    from spark_dl.strategies import STRATEGIES
    strategies = args.strategies.split(",")
    unknown = [s for s in strategies if s not in STRATEGIES]
    if unknown:
        ap.error(f"unknown strategies {unknown}; choose from {', '.join(STRATEGIES)}")
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("SPARK_CONF_DIR", str(ROOT / "conf/logging"))
    from spark_dl import get_session
    counts = [int(r) for r in args.replicas.split(",")]
    spark = get_session("local", master=f"local[{max(counts)}]")
    tmp = Path(tempfile.mkdtemp(prefix="bench-scaling-"))
    data = tmp / "extended"
    val = scaling_data(spark, args.samples, data)

    systems = {} if args.accuracy_only else {
        "plain-1t": lambda seed: plain(data, val, args, seed),
        **{f"ceiling-{r}": (lambda seed, r=r: ceiling(data, args, seed, r))
           for r in counts if r > 1}}
    for strategy in strategies:
        for r in counts:
            if strategy == "gossip" and r < 2:
                continue
            systems[f"{strategy}-{r}"] = (
                lambda seed, s=strategy, r=r: spark_dl_fit(spark, data, val, s, r, args, tmp,
                                                           seed))
    raw: dict[str, list[dict]] = {k: [] for k in systems}

    def report(done: int):
        """The summary of the repeats so far, written after each (a run cut short keeps them)."""
        def med(values):
            values = [v for v in values if v is not None]
            return statistics.median(values) if values else None

        plain_rate = med(r["samples_per_s"] for r in raw.get("plain-1t", ()))
        summary = {}
        for name, runs in raw.items():
            r = 1 if name == "plain-1t" else int(name.rsplit("-", 1)[1])
            ceil = raw.get("plain-1t" if r == 1 else f"ceiling-{r}", [])
            rate = med(x["samples_per_s"] for x in runs)
            if name.startswith("ceiling-"):
                summary[name] = {"replicas": r, "samples_per_s": round(rate),
                                 "fraction_of_limit": round(rate / (r * plain_rate), 3)
                                 if plain_rate else None}
                continue
            reached = [x["time_to_target_s"] for x in runs]
            epochs = [next((e["epoch"] for e in x["evals"] if e.get("val_accuracy", 0) >=
                            args.target), None) for x in runs]
            summary[name] = {
                "replicas": r, "time_to_target_s": med(reached),
                "reached": f"{sum(t is not None for t in reached)}/{len(runs)}",
                "epochs_to_target": epochs, "median_epochs_to_target": med(epochs),
                "samples_per_s": round(rate),
                "fraction_of_limit": round(rate / (r * plain_rate), 3) if plain_rate else None,
                "fraction_of_ceiling": med(round(x["samples_per_s"] / c["samples_per_s"], 3)
                                           for x, c in zip(runs, ceil)) if ceil else None,
                "final_accuracy": med(x["final_accuracy"] for x in runs),
                "final_accuracy_spread": round(max(x["final_accuracy"] for x in runs) -
                                               min(x["final_accuracy"] for x in runs), 4)}
        for strategy in strategies:
            ref = reference(strategy, raw)
            one = summary.get(ref)
            for r in counts:
                row = summary.get(f"{strategy}-{r}")
                if r > 1 and row and one and row["time_to_target_s"] and one["time_to_target_s"]:
                    row["time_vs_one_replica"] = round(row["time_to_target_s"] /
                                                       one["time_to_target_s"], 3)
                if r > 1 and f"{strategy}-{r}" in raw and ref in raw:     # seed by seed
                    pairs = [a["time_to_target_s"] / b["time_to_target_s"]
                             for a, b in zip(raw[f"{strategy}-{r}"], raw[ref])
                             if a["time_to_target_s"] and b["time_to_target_s"]]
                    row["time_vs_one_replica_same_seed"] = (
                        round(statistics.median(pairs), 3) if pairs else None)
                    row["fixed_time"] = fixed_time(raw[f"{strategy}-{r}"], raw[ref])
        settings = {"model": "thesis cnn", "samples": args.samples, "epochs": args.epochs,
                    "batch_per_replica": args.batch, "lr_one_replica": args.lr,
                    "lr_decay": args.lr_decay,
                    "momentum": MOMENTUM, "lr_scaling": "auto", "target": args.target,
                    "validate_every": EVERY, "repeats": args.repeats, "repeats_done": done,
                    "seeds": f"{args.first_seed}..{args.first_seed + args.repeats - 1}, one "
                             f"per repeat, shared by every system",
                    "accuracy_only": args.accuracy_only,
                    "spark_master": f"local[{max(counts)}]"}
        write_results(args.out, "bench_scaling.py", argv, settings, summary, raw)

    for i in range(args.repeats):                      # interleaved A B C ... A B C ...
        for name, run in systems.items():
            out = run(args.first_seed + i)
            out["seed"] = args.first_seed + i
            raw[name].append(out)
            if name.startswith("ceiling-"):
                print(f"[{i + 1}/{args.repeats}] {name}: {out['samples_per_s']:,.0f} "
                      f"samples/s", flush=True)
                continue
            out["time_to_target_s"] = first_at(out["evals"], args.target)
            print(f"[{i + 1}/{args.repeats}] {name}: time to {args.target:.1%} "
                  f"{out['time_to_target_s']}, {out['samples_per_s']:,.0f} samples/s, final "
                  f"{out['final_accuracy']}", flush=True)
        report(i + 1)

    spark.stop()


if __name__ == "__main__":
    main()
