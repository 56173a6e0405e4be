"""Why the boosting parameter server falls behind one process: its arithmetic, taken apart.

The ships job (conf/jobs/ships.toml: 1,600 scenes of 48x48, the U-Net, focal + Dice loss, SGD
lr 0.01 momentum 0.9, batch 8, 4 epochs) replayed in one process without Spark, through the
parameter server's own Shard (its optimizer, schedule and push scaling), so that each
ingredient of the strategy can be switched on alone:

  k            mini-batches per push (Boosting's n_push: a key of k x 8 scenes, one step)
  R            workers; they push in turn (the arrival order of equally fast workers), each
               computing its key on the values it fetched after its own previous push:
               staleness R - 1 ("random": a random worker pushes next, staleness varies)
  momentum     the server's
  scaling      push_scaling: a push of k mini-batches steps f(k) x their mean gradient
  cyclic       the seed's cyclic learning rate, 1e-2..1e-1 (triangular, one cycle an epoch)
  "-local"     (a suffix) each mini-batch's gradient of a key is computed after the key's
               earlier ones were stepped locally (plain SGD at the server's rate, on the
               worker's copy): the push sums gradients taken where k sequential steps would
  "-lmom"      (a suffix) local steps with the job's momentum on the worker (its momentum
               buffer kept across its keys), the push is the worker's displacement over
               the key, and the server (momentum 0) adds it: momentum SGD on the workers
  "-ramp"      (a suffix, after -lmom) each worker's momentum grows from 0 over its first
               MOMENTUM_RAMP mini-batches (spark_dl.strategies.ps_worker.ramped, the
               "worker" rule's since 2026-11-28)
  "-own"       (a suffix, before "-avg") each worker trains the keys of its own partition
               only (Downpour's shards: partition w = the w-th part of the rows), in its own
               order; when one runs out first the other takes the rest of the epoch
  "-slr"       (a suffix, before "-avg") a push computed tau >= 2 versions ago steps
               lr / tau (Downpour's staleness "lr" rule; with a lowered momentum: "lr+momentum")
  "-dc"        (a suffix, before "-avg") delay compensation (DC-ASGD-a, Zheng et al., 2017):
               the server adds lambda g * g * (x_now - x_worker) to a push's mean gradient g,
               lambda = 2 / sqrt(a running mean of g^2): the first-order correction of a
               gradient taken at the worker's older values
  "-look"      (a suffix, after -dc) lookahead: after its push a worker is sent the server's
               values moved on by R - 1 momentum steps, x - (R - 1) lr v, where the server is
               expected to be when its next push lands (weight prediction; measured harmful
               with pushes in turns: docs/quality.md, "Lookahead")
  "-clip"      (a suffix, after -look) the server's cap, Shard(clip=2): a push's step gradient
               at most twice the running mean of the steps' norms (Downpour's default)
  "-fresh"     (a suffix, after -clip and -slr, before -own; needs -local and pushes in
               turns, and takes none of -lmom, -dc, -look, -slr, -own, the cyclic rate)
               the workers run side by side a mini-batch at a time in lockstep (worker 0
               first: one timing, a favourable one, docs/quality.md "Fresh values
               mid-key"), and a worker whose server moved since its fetch takes the new
               values less its own steps of the key before its next mini-batch (Boosting's
               ``fresh``); "-conc": side by side without that (the control)
  "-avg"       (the last suffix; they go in the order -local, -lmom, -dc, -look, -clip, -slr,
               -conc, -fresh, -own, -avg,
               e.g. k4r2-m04-local-clip-fresh-avg or r2-m04-rand-own-avg) the model scored is the server's moving average over
               0.1 epoch of pushes (Downpour's ``average``), not its last values; "-avg25",
               "-avg50", "-avg100": over 0.25, 0.5, 1 epoch

Keys are cut as the strategy cuts them (contiguous rows of the Parquet copy: the two
partitions of 800 scenes, k x 8 rows a key), reshuffled every epoch (KeyScheduler's order),
rows shuffled within a key. Reported: held-out IoU, Dice, F2 after the last epoch.

    .venv/bin/python benchmarks/boosting_emulation.py --configs one,k4,k4r2,... [--seeds 0,1]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from spark_dl.data.ships import ship_batch  # noqa: E402
from spark_dl.models.unet import FocalDiceLoss, UNet  # noqa: E402
from spark_dl.optim.schedule import LRSchedule  # noqa: E402
from spark_dl.recipes.ships import TEST_START, mask_scores  # noqa: E402
from spark_dl.strategies.ps_worker import ramped  # noqa: E402
from spark_dl.transport.ps.rule import push_factor  # noqa: E402
from spark_dl.transport.ps.shard import Shard  # noqa: E402

# name -> (k, R, server momentum, scaling, order, cyclic lr)
CONFIGS = {
    "one": (1, 1, 0.9, "linear", "turns", False),       # one process: 800 steps of 8
    "k4": (4, 1, 0.9, "linear", "turns", False),        # a push of 4 as one step, no peers
    "k4-none": (4, 1, 0.9, "none", "turns", False),     # ... stepping their mean (lr x 1)
    "r2": (1, 2, 0.9, "linear", "turns", False),        # two workers, pushes of 1
    "k4r2": (4, 2, 0.9, "linear", "turns", False),      # Boosting as shipped
    "k4r2-rand": (4, 2, 0.9, "linear", "random", False),  # ... in a random order
    "k4r2-m04": (4, 2, 0.4, "linear", "turns", False),  # ... momentum 0.9 - (1 - 1/2)
    "k4r2-cyc": (4, 2, 0.9, "linear", "turns", True),   # ... the seed's cyclic lr
    "k4r2-m04-rand": (4, 2, 0.4, "linear", "random", False),
    "r2-m04": (1, 2, 0.4, "linear", "turns", False),
    "r2-m06": (1, 2, 0.6, "linear", "turns", False),    # Downpour's "halfway" at 2 workers
    "r2-m04-rand": (1, 2, 0.4, "linear", "random", False),  # Downpour, pushes in any order
    "r2-m0-rand": (1, 2, 0.0, "linear", "random", False),   # ... the server's momentum 0
    "r2-rand": (1, 2, 0.9, "linear", "random", False),      # ... the job's momentum 0.9
    "k4r2-m06": (4, 2, 0.6, "linear", "turns", False),  # between the rule's 0.4 and 0.9
    "k4r2-m04-cyc": (4, 2, 0.4, "linear", "turns", True),   # the defaults' momentum, cyclic
    "k4r2-m04-none": (4, 2, 0.4, "none", "turns", False),   # ... a push steps the mean
}


def cyclic(t: float, low: float = 1e-2, high: float = 1e-1) -> float:
    """Triangular cyclic rate, one cycle per epoch (t in epochs)."""
    f = t - math.floor(t)
    return low + (high - low) * (1 - abs(2 * f - 1))


def keys_of(n: int, key_rows: int, files: int = 2) -> list[tuple[int, int]]:
    per = n // files
    return [(a, min(a + key_rows, lo + per)) for lo in range(0, n, per)
            for a in range(lo, lo + per, key_rows)]


def run(name: str, seed: int, x, m, vx, vm, epochs: int, batch: int, lr: float,
        widths: tuple) -> dict:
    label, average = name, 0.1 if name.endswith("-avg") else 0.0
    for span in ("-avg25", "-avg50", "-avg100"):           # a longer window: 0.25 .. 1 epoch
        if name.endswith(span):
            average, name = int(span[4:]) / 100, name.removesuffix(span) + "-avg"
    base = name.removesuffix("-avg")
    own = base.endswith("-own")
    base = base.removesuffix("-own")
    fresh = base.endswith("-fresh")
    base = base.removesuffix("-fresh")
    conc = base.endswith("-conc")                     # side by side, no rebase: the control
    base = base.removesuffix("-conc")
    slr = base.endswith("-slr")
    base = base.removesuffix("-slr")
    clip = base.endswith("-clip")
    base = base.removesuffix("-clip")
    look = base.endswith("-look")
    base = base.removesuffix("-look")
    dc = base.endswith("-dc")
    base = base.removesuffix("-dc")
    ramp = base.endswith("-ramp")
    base = base.removesuffix("-ramp")
    lmom = base.endswith("-lmom")
    base = base.removesuffix("-lmom")
    local = base.endswith("-local")
    k, R, momentum, scaling, order, cyc = CONFIGS[base.removesuffix("-local")]
    if ramp and not lmom:
        raise SystemExit(f"{label}: -ramp ramps the workers' momentum: it needs -lmom")
    if (fresh or conc) and (not local or lmom or dc or look or slr or own or cyc
                            or order != "turns"):
        raise SystemExit(f"{label}: -fresh and -conc emulate local steps in turns only "
                         f"(no -lmom, -dc, -look, -slr, -own, random order or cyclic rate)")
    worker_momentum, momentum = (momentum, 0.0) if lmom else (0.0, momentum)
    torch.manual_seed(seed)
    net = UNet(3, widths)
    params = list(net.parameters())
    flat = torch.nn.utils.parameters_to_vector(params).detach()
    shard = Shard(flat, "momentum", lr, momentum, average=average,
                  schedule=LRSchedule(lr, 1, "none", 0, 1.0, epochs),
                  clip=2.0 if clip else None)      # "-clip": the server's own cap
    loss_fn = FocalDiceLoss(10.0, 2.0)
    keys = keys_of(len(x), k * batch)
    held = [shard.param.detach().clone() for _ in range(R)]     # each worker's fetched values
    bufs = [torch.zeros_like(flat) for _ in range(R)]           # "-lmom": each worker's momentum
    carried = [0] * R                                           # "-ramp": its mini-batches so far
    meansq = torch.zeros_like(flat)                             # "-dc": running mean of g^2
    fetched = [0] * R                                           # the version each worker holds
    rng = np.random.default_rng(seed + 7)
    steps_per_epoch = sum(-(-(b - a) // batch) for a, b in keys)
    t0, losses = time.perf_counter(), []
    if fresh or conc:
        _concurrent(net, params, shard, loss_fn, keys, x, m, R, batch, seed, epochs,
                    steps_per_epoch, scaling, losses, rebase=fresh)
    for epoch in range(0 if fresh or conc else epochs):
        order_keys = np.random.default_rng([seed, epoch]).permutation(len(keys))
        if own:                             # worker w: the keys of partition w, own order
            mine = [[int(q) for q in order_keys if int(q) * R // len(keys) == w]
                    for w in range(R)]
        for i, key in enumerate(order_keys):
            w = i % R if order == "turns" else int(rng.integers(R))
            if own:
                w = w if mine[w] else 1 - w if R == 2 else next(v for v in range(R) if mine[v])
                key = mine[w].pop()
            torch.nn.utils.vector_to_parameters(held[w], params)
            a, b = keys[key]
            rows = np.random.default_rng([seed, epoch, int(key)]).permutation(np.arange(a, b))
            for p in params:
                p.grad = None
            samples, steps, before = 0, 0, None
            for j in range(0, len(rows), batch):
                idx = rows[j:j + batch]
                out = net(x[idx])
                loss = loss_fn(out, m[idx])
                (loss * len(idx)).backward()
                losses.append(float(loss.detach()))
                if lmom:                    # momentum SGD on the worker's copy
                    with torch.no_grad():
                        g = torch.cat([p.grad.reshape(-1) for p in params])
                        new = (g if before is None else g - before) / len(idx)
                        before = g
                        bufs[w].mul_(ramped(worker_momentum, carried[w]) if ramp
                                     else worker_momentum).add_(new)
                        carried[w] += 1
                        cur = torch.nn.utils.parameters_to_vector(params)
                        cur.sub_(shard.lr_now(steps_per_epoch) * bufs[w])
                        torch.nn.utils.vector_to_parameters(cur, params)
                elif local:                 # x <- x - lr g of this mini-batch, on the copy
                    with torch.no_grad():
                        for p, g0 in zip(params, before or [None] * len(params)):
                            new = p.grad if g0 is None else p.grad - g0
                            p.sub_(shard.lr_now(steps_per_epoch) * new / len(idx))
                    before = [p.grad.clone() for p in params]
                samples += len(idx)
                steps += 1
            grad = torch.cat([p.grad.reshape(-1) for p in params])
            if lmom:                        # the displacement, as a gradient the server's
                rate = shard.lr_now(steps_per_epoch)            # momentum-free step adds
                grad = (held[w] - torch.nn.utils.parameters_to_vector(params).detach()) / rate
                shard.apply(grad, 1.0, steps, steps_per_epoch, summed=steps)
                held[w] = shard.param.detach().clone()
                fetched[w] = shard.version
                continue
            if dc:                          # g + lambda g*g*(x_now - x_worker), on the mean
                g = grad * (push_factor(scaling, steps) / samples)
                meansq.mul_(0.95).add_(g * g, alpha=0.05)
                lam = 2.0 / (meansq.sqrt() + 1e-7)
                g.add_(lam * g * g * (shard.param.detach() - held[w]))
                grad = g * (samples / push_factor(scaling, steps))
            tau = shard.version - fetched[w]
            if slr and tau > 1:
                grad = grad / tau
            if cyc:
                shard.schedule = LRSchedule(cyclic(shard.steps / steps_per_epoch), 1, "none",
                                            0, 1.0, epochs)
            shard.apply(grad, push_factor(scaling, steps) / samples, steps, steps_per_epoch,
                        summed=steps)
            held[w] = shard.param.detach().clone()          # the worker fetches after its push
            if look:                        # where the server will be when this push lands:
                buf = shard.opt.state[shard.param].get("momentum_buffer")   # R - 1 steps on
                if buf is not None:
                    held[w].sub_(buf, alpha=(R - 1) * shard.lr_now(steps_per_epoch))
            fetched[w] = shard.version
    torch.nn.utils.vector_to_parameters(shard.param.detach() if shard.avg is None
                                        else shard.avg, params)
    net.eval()
    with torch.no_grad():
        prob = torch.cat([net(vx[i:i + 64]) for i in range(0, len(vx), 64)])[:, 0].numpy()
    scores = mask_scores(prob, vm)
    return {"config": label, "seed": seed, "k": k, "R": R, "momentum": momentum,
            "average": average, "widths": list(widths),
            "scaling": scaling, "order": order, "cyclic": cyc, **scores,
            "last_loss": float(np.mean(losses[-100:])),
            "epoch_losses": [float(np.mean(losses[e * steps_per_epoch:(e + 1) * steps_per_epoch]))
                             for e in range(epochs)],
            "seconds": time.perf_counter() - t0,
            "server_steps": shard.version, **({"clipped": shard.clipped} if clip else {})}


def _concurrent(net, params, shard, loss_fn, keys, x, m, R, batch, seed, epochs,
                steps_per_epoch, scaling, losses, rebase: bool = True) -> None:
    """"-fresh": the R workers run side by side, a mini-batch each per tick (worker 0 first),
    each on its own key (local steps), and before each mini-batch a worker whose server has
    moved since its last fetch takes the new values less its own steps of the key so far
    (x_server - lr sum g): the key's later gradients see the pushes that landed meanwhile."""
    flat0 = shard.param.detach()
    local = [flat0.clone() for _ in range(R)]          # each worker's copy
    moved = [torch.zeros_like(flat0) for _ in range(R)]  # its steps of the current key
    gsum = [torch.zeros_like(flat0) for _ in range(R)]
    fetched = [shard.version] * R
    for epoch in range(epochs):
        order_keys = [int(q) for q in np.random.default_rng([seed, epoch]).permutation(len(keys))]
        todo = [None] * R                              # each worker's rows left of its key
        counts = [0] * R
        while order_keys or any(t is not None for t in todo):
            for w in range(R):
                if todo[w] is None:
                    if not order_keys:
                        continue                       # the epoch's last keys: it waits
                    key = order_keys.pop(0)
                    a, b = keys[key]
                    rows = np.random.default_rng([seed, epoch, key]).permutation(np.arange(a, b))
                    todo[w] = [rows[j:j + batch] for j in range(0, len(rows), batch)]
                    counts[w] = 0
                if rebase and shard.version != fetched[w]:     # rebase on the server's new values
                    local[w] = shard.param.detach() - moved[w]
                    fetched[w] = shard.version
                idx = todo[w].pop(0)
                torch.nn.utils.vector_to_parameters(local[w], params)
                for p in params:
                    p.grad = None
                loss = loss_fn(net(x[idx]), m[idx])
                (loss * len(idx)).backward()
                losses.append(float(loss.detach()))
                g = torch.cat([p.grad.reshape(-1) for p in params])
                gsum[w].add_(g)
                step = g * (shard.lr_now(steps_per_epoch) / len(idx))
                local[w] = local[w] - step
                moved[w].add_(step)
                counts[w] += len(idx)
                if not todo[w]:                        # the key's push, then a fetch
                    n = counts[w]
                    steps = -(-n // batch)
                    shard.apply(gsum[w], push_factor(scaling, steps) / n, steps,
                                steps_per_epoch, summed=steps)
                    gsum[w].zero_()
                    moved[w].zero_()
                    local[w] = shard.param.detach().clone()
                    fetched[w] = shard.version
                    todo[w] = None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", default="one,k4,k4r2,k4r2-m04")
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--n-train", type=int, default=1600)
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--widths", default="16,32,64,128", help="the U-Net's (the job's default)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    tx, tm, _ = ship_batch(0, args.n_train, 0, 48, 4)
    x = torch.from_numpy(tx).float() / 255
    m = torch.from_numpy(tm)[:, None]
    vx_, vm, _ = ship_batch(TEST_START, TEST_START + 200, 0, 48, 4)
    vx = torch.from_numpy(vx_).float() / 255
    out = []
    for seed in (int(s) for s in args.seeds.split(",")):
        for name in args.configs.split(","):
            r = run(name, seed, x, m, vx, vm, args.epochs, 8, args.lr,
                    tuple(int(w) for w in args.widths.split(",")))
            print(json.dumps(r), flush=True)
            out.append(r)
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
