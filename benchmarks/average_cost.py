"""What the averaged weights cost a step: a replica's training step and a server's push,
without an average, with the average taken every step, and with it taken sparsely (every
window / 32 steps, the default since 2026-11-28; spark_dl/optim/average.py, "Sparse
updates").

Replica: a plain PyTorch loop (SGD, momentum 0.9, one thread) on random rows of MNIST's shape,
the step alone and the step plus ``WeightAverage.update()``, for the thesis CNN and two fully
connected nets (784-512-512-10, 0.67M parameters; 784-2048-2048-10, 5.8M), at batch 16.
Server: ``Shard.apply`` of a push of one mini-batch step on a 5.8M-value shard (momentum SGD),
the server's work per push. The average spans 0.1 epoch of --epoch-steps steps, past the
first epoch (a window of 300 steps at the default 3,000: taken every 9 steps); "every step"
is the same average with ``UPDATES_PER_WINDOW`` so large that the interval is 1 (the rule
before the sparse updates). Interleaved (none / every / sparse, --repeats times), medians,
ratios to "none"; writes benchmarks/results/average-cost.json.

    .venv/bin/python benchmarks/average_cost.py [--repeats 7] [--epoch-steps 3000]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from functools import partial
from pathlib import Path

import torch
from torch import nn

from spark_dl.models import build_model
from spark_dl.optim import average as _average
from spark_dl.optim.average import WeightAverage
from spark_dl.transport.ps.shard import Shard

OUT = Path(__file__).resolve().parent / "results" / "average-cost.json"
SPAN = 0.1


def fc(width: int) -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(784, width), nn.ReLU(),
                         nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10))


def replica_ms(model: nn.Module, variant: str, epoch_steps: int, steps: int,
               batch: int = 16) -> float:
    """Milliseconds a training step, with ``variant``'s average after each."""
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x, y = torch.randn(batch, 1, 28, 28), torch.randint(0, 10, (batch,))
    avg = None if variant == "none" else \
        WeightAverage(list(model.parameters()), SPAN, epoch_steps, steps=10 * epoch_steps)
    t = time.perf_counter()
    for _ in range(steps):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        if avg is not None:
            avg.update()
    if avg is not None:
        avg.current()                           # what a validation's read folds in
    return (time.perf_counter() - t) / steps * 1e3


def server_ms(variant: str, epoch_steps: int, pushes: int, n: int = 5_820_000) -> float:
    """Milliseconds a push of one mini-batch step on an ``n``-value shard."""
    shard = Shard(torch.randn(n), "momentum", lr=0.01, momentum=0.9,
                  average=0.0 if variant == "none" else SPAN)
    shard.steps = 10 * epoch_steps              # past the first epoch
    if shard.averaged is not None:
        shard.averaged.steps = shard.steps
    g = torch.randn(n)
    t = time.perf_counter()
    for _ in range(pushes):
        shard.apply(g, epoch_steps=epoch_steps)
    return (time.perf_counter() - t) / pushes * 1e3


def timed(variant: str, fn, *args):
    """``fn(variant, *args)``, with the average's rule of ``variant``."""
    keep = _average.UPDATES_PER_WINDOW
    if variant == "every step":
        _average.UPDATES_PER_WINDOW = 10 ** 12          # interval 1: the rule before
    try:
        return fn(variant, *args)
    finally:
        _average.UPDATES_PER_WINDOW = keep


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--epoch-steps", type=int, default=3000)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    variants = ("none", "every step", "sparse")
    cases = {"thesis cnn": (lambda: build_model("cnn"), 60),
             "fc 784-512-512-10": (lambda: fc(512), 200),
             "fc 784-2048-2048-10": (lambda: fc(2048), 40)}
    raw: dict = {}
    for name, (make, steps) in cases.items():
        model = make()
        params = sum(p.numel() for p in model.parameters())
        raw[name] = {"parameters": params, **{v: [] for v in variants}}
        replica_ms(model, "none", args.epoch_steps, 10)             # warm up
        for _ in range(args.repeats):
            for v in variants:
                raw[name][v].append(timed(v, partial(replica_ms, model), args.epoch_steps,
                                           steps))
    raw["server push, 5.8M values"] = {"parameters": 5_820_000, **{v: [] for v in variants}}
    for _ in range(args.repeats):
        for v in variants:
            raw["server push, 5.8M values"][v].append(
                timed(v, server_ms, args.epoch_steps, 30))
    summary = {}
    for name, r in raw.items():
        med = {v: statistics.median(r[v]) for v in variants}
        summary[name] = {"parameters": r["parameters"],
                         **{f"{v} ms": round(med[v], 3) for v in variants},
                         **{f"{v} x none": round(med[v] / med["none"], 3)
                            for v in variants[1:]}}
        print(f"{name:28s} {r['parameters']:>9,d} params: " + ", ".join(
            f"{v} {med[v]:.2f} ms" for v in variants)
            + f"  (every step {med['every step'] / med['none']:.3f}x, "
              f"sparse {med['sparse'] / med['none']:.3f}x)")
    OUT.write_text(json.dumps({
        "date": time.strftime("%Y-%m-%d %H:%M"), "threads": 1, "batch": 16, "span": SPAN,
        "epoch_steps": args.epoch_steps,
        "interval": _average.interval(SPAN, args.epoch_steps, 10 * args.epoch_steps),
        "repeats": args.repeats, "summary": summary, "raw": raw}, indent=1) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
