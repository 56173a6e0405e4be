"""Asynchronous workers pushing in turn, simulated in one process: what staleness costs the
thesis CNN, and which server rate and momentum rule pays at W workers (accuracy only).

W workers each own a shard of the rows (a random W-th, one permutation of it an epoch) and
push in turn, as Downpour's CPU workers do (the server's staleness histograms show 94% of
the pushes of 2 workers one version old): each push's gradient is taken on the values the
worker fetched after its previous push, ``stale`` = W - 1 versions back unless given. The
server steps every push (plain SGD at ``rate`` x fit's rate, or with its own momentum
``sm``), clips it as Downpour's server does (clip x the running mean norm, from the 21st
push) and validates its moving average over a tenth of an epoch every quarter epoch, on the
2,000 held-out real digits. A worker's momentum ``wm`` (staleness rule "dana") ramps up
over ramp_length of its fit. One push is one mini-batch of 16 rows, fit's lr 0.02 halved per
epoch, 2 epochs; no linear scaling (Downpour's pushes carry one worker's batch). The data
are bench_scaling's (48,000 distorted digits from the first 8,000 shipped), made once.

A configuration is comma-separated key=value (defaults: Downpour's rule "dana" for W; the
rules "worker" and "worker+short" simulated here before were removed, their results are in
docs/guides/downpour.md, "Staleness rule"):
  W (1)  rule ("dana", the only one)
  wm (0.9 with W > 1)  sm (0.9 for W = 1, else 0)  rate (dana_rate(W) with wm, else 1;
  spark_dl.strategies.ps_rules.worker_rule)  stale (W - 1)  clip (2 with W > 1, 0: off)
  lr (0.02)  ramp (-1: ramp_length of the worker's fit; 0: none)
  look (1: the server's look-ahead of rule "dana", spark_dl.transport.ps.shard: a worker
  takes its gradient at the values it fetched less lr x every worker's momentum step to come;
  0: none)

    .venv/bin/python benchmarks/async_turns.py --configs "W=1;W=2;W=2,stale=0" --seeds 6 \
        [--out benchmarks/results/async-turns.json]
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
LR, MOMENTUM, DECAY, BATCH, TARGET, EPOCHS, AVERAGE = 0.02, 0.9, 0.5, 16, 0.98, 2, 0.1


def settings(config: str) -> dict:
    """A configuration's settings, Downpour's defaults for its W filled in."""
    from spark_dl.strategies.ps_rules import worker_rule
    given = dict(kv.split("=") for kv in config.split(",") if kv)
    unknown = set(given) - {"W", "rule", "wm", "sm", "rate", "stale", "clip", "lr", "ramp",
                            "look"}
    if unknown or given.get("rule", "dana") != "dana":
        raise SystemExit(f"unknown setting(s) {sorted(unknown)} or rule in {config!r} (rule: "
                         f"'dana' only; 'worker' and 'worker+short' were removed)")
    w = int(given.get("W", 1))
    s = {"W": w, "rule": "dana",
         "wm": float(given.get("wm", MOMENTUM if w > 1 else 0.0)),
         "sm": float(given.get("sm", MOMENTUM if w == 1 else 0.0)),
         "stale": int(given.get("stale", w - 1)), "clip": float(given.get("clip", 2 if w > 1
                                                                          else 0)),
         "lr": float(given.get("lr", LR)), "ramp": int(given.get("ramp", -1)),
         "look": bool(int(given.get("look", 1)))}
    s["rate"] = float(given.get("rate", worker_rule(s["wm"], w, False, "dana")[1]))
    return s


def simulate(data: str, config: str, seed: int) -> dict:
    """One run: the server is Downpour's own (spark_dl.transport.ps.Shard: the schedule,
    the clip, the server's momentum, the averaged values), a worker's momentum its task's
    (CarriedMomentum, ramped)."""
    import numpy as np
    import torch
    from scaled_rate_clip import start
    from torch.nn.utils import parameters_to_vector, vector_to_parameters

    from spark_dl.optim.schedule import LRSchedule
    from spark_dl.strategies.ps_worker import CarriedMomentum, ramp_length
    from spark_dl.transport.ps.shard import Shard
    s = settings(config)
    w_count, stale = s["W"], s["stale"]
    x, y, vx, vy, model = start(data, seed)
    params = list(model.parameters())
    values = parameters_to_vector(params).detach()
    lr = s["lr"] * s["rate"]
    server = Shard(values, "momentum" if s["sm"] else "sgd", lr, s["sm"], average=AVERAGE,
                   schedule=LRSchedule(lr, decay=DECAY), clip=s["clip"] or None,
                   ahead=s["look"] and bool(s["wm"]))
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    shards = [order[i::w_count] for i in range(w_count)]
    per_worker = len(shards[0]) // BATCH
    ramp = ramp_length(per_worker * EPOCHS) if s["ramp"] < 0 else max(s["ramp"], 1)
    carriers = [CarriedMomentum(values, s["wm"], ramp) for _ in range(w_count)]
    versions = [values.clone()]                 # the last stale + 1 server values
    epoch_pushes = per_worker * w_count
    marks = {round(epoch_pushes * f) for f in (0.25, 0.5, 0.75)} | {0}
    acc = []

    def gradient(at, idx):
        vector_to_parameters(at, params)
        for p in params:
            p.grad = None
        torch.nn.functional.cross_entropy(model(x[idx].float() / 255), y[idx]).backward()
        return torch.cat([p.grad.reshape(-1) for p in params]) * BATCH   # the row sum

    for e in range(EPOCHS):
        perms = [sh[torch.randperm(len(sh), generator=torch.Generator().manual_seed(
            seed * 1000 + e * 100 + i))] for i, sh in enumerate(shards)]
        for b in range(per_worker):
            for i in range(w_count):
                g = gradient(versions[max(0, len(versions) - 1 - stale)],
                             perms[i][b * BATCH:(b + 1) * BATCH])
                if s["wm"]:
                    carriers[i].carry(g, BATCH, 1)
                server.apply(g, 1.0 / BATCH, epoch_steps=epoch_pushes)
                if server.ahead is not None:      # as the real server does (rule "dana")
                    server.ahead.record(i, server.param.grad, carriers[i].next_momentum)
                versions = (versions + [server.fetched(epoch_pushes)])[-(stale + 1):]
                if server.steps % epoch_pushes in marks:
                    vector_to_parameters(server.avg, params)
                    with torch.no_grad():
                        acc.append(round((model(vx).argmax(1) == vy).float().mean().item(),
                                         4))
                    if acc[-1] >= TARGET or not np.isfinite(float(server.param.norm())):
                        return {"config": config, "seed": seed, "accuracy": acc,
                                "epochs_to_target": len(acc) / 4 if acc[-1] >= TARGET
                                else None, "clipped": server.clipped,
                                "pushes": server.steps}
    return {"config": config, "seed": seed, "accuracy": acc, "epochs_to_target": None,
            "clipped": server.clipped, "pushes": server.steps}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default="W=1;W=2;W=2,stale=0")
    ap.add_argument("--seeds", type=int, default=6)
    ap.add_argument("--first-seed", type=int, default=0)
    ap.add_argument("--samples", type=int, default=48000)
    ap.add_argument("--data", default=None, help="an .npz made before (scaled_rate_clip's)")
    ap.add_argument("--procs", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/async-turns.json"))
    args = ap.parse_args(argv)
    configs = args.configs.split(";")
    for c in configs:
        settings(c)
    from _results import write_results
    from scaled_rate_clip import make_data
    data = args.data or make_data(args.samples, Path(tempfile.mkdtemp(prefix="turns-")))
    seeds = range(args.first_seed, args.first_seed + args.seeds)
    jobs = [(data, c, seed) for seed in seeds for c in configs]
    with ProcessPoolExecutor(args.procs, mp_context=multiprocessing.get_context("spawn")) \
            as pool:
        runs = list(pool.map(simulate, *zip(*jobs)))
    summary = {}
    for c in configs:
        mine = [r for r in runs if r["config"] == c]
        reached = [r["epochs_to_target"] for r in mine if r["epochs_to_target"]]
        summary[c] = {"settings": settings(c),
                      "epochs_to_98": [r["epochs_to_target"] for r in mine],
                      "reached": f"{len(reached)}/{len(mine)}",
                      "mean_epochs_reached": round(statistics.mean(reached), 3)
                      if reached else None,
                      "clipped": [r["clipped"] for r in mine]}
        print(f"{c:34s} {summary[c]['epochs_to_98']} reached {summary[c]['reached']}, "
              f"mean {summary[c]['mean_epochs_reached']}", flush=True)
    write_results(args.out, "async_turns.py", argv,
                  {"model": "thesis cnn", "samples": args.samples, "epochs": EPOCHS,
                   "batch": BATCH, "lr_decay": DECAY, "average": AVERAGE, "target": TARGET,
                   "seeds": f"{seeds.start}..{seeds.stop - 1}"}, summary, {"runs": runs})


if __name__ == "__main__":
    main()
