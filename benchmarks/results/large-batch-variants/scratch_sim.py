"""Scratch (2026-11-29): large-batch variants on the one-process AllReduce simulation of
benchmarks/averaged_weights.py (its loop, with a moving average over 0.1 epoch): torch's
SGD with nesterov=True, and LARC's clip mode (each weight tensor's rate at most
eta |w| / |g|). Not a maintained benchmark; kept to say how the files here were made:

    .venv/bin/python benchmarks/results/large-batch-variants/scratch_sim.py \
        baseline,nesterov,larc:0.02,larc:0.005 8 16 k16.json [data.npz]
"""
import json
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[3]),
                str(Path(__file__).resolve().parents[2])]
import scaled_rate_clip as sim  # noqa: E402


def run(data, k, seed, variant, epochs=2):
    import copy

    import torch

    from spark_dl.optim import clip as clip_rule
    from spark_dl.optim.average import WeightAverage
    from spark_dl.optim.schedule import LRSchedule
    x, y, vx, vy, model = sim.start(data, seed)
    name, _, arg = variant.partition(":")
    opt = torch.optim.SGD(model.parameters(), lr=sim.LR, momentum=sim.MOMENTUM,
                          nesterov=(name == "nesterov"))
    schedule = LRSchedule(sim.LR, k, "linear", "auto", sim.DECAY, epochs)
    cut = clip_rule.GradClip("auto", k > 1, "cpu")
    b = sim.BATCH * k
    steps = len(x) // b
    avg = WeightAverage(model.parameters(), 0.1, steps)
    probe = copy.deepcopy(model).eval()
    marks = {round(steps * f) - 1 for f in (0.25, 0.5, 0.75, 1.0)}
    acc, accl = [], []
    for e in range(epochs):
        perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed * 1000 + e))
        for s in range(steps):
            lr = schedule.at(e + s / steps)
            opt.param_groups[0]["lr"] = lr
            idx = perm[s * b:(s + 1) * b]
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x[idx].float() / 255), y[idx]).backward()
            cut([p.grad for p in model.parameters()])
            if name == "larc":          # clip mode: each tensor's lr at most eta |w| / |g|
                eta = float(arg)
                with torch.no_grad():
                    for p in model.parameters():
                        if p.dim() > 1:
                            g, w = p.grad.norm(), p.norm()
                            if g > 0 and w > 0:
                                p.grad.mul_(min(1.0, float(eta * w / g) / lr))
            opt.step()
            avg.update()
            if s in marks:
                with torch.no_grad():
                    model.eval()
                    accl.append(round((model(vx).argmax(1) == vy).float().mean().item(), 4))
                    model.train()
                    for p, v in zip(probe.parameters(), avg.current()):
                        p.copy_(v)
                    acc.append(round((probe(vx).argmax(1) == vy).float().mean().item(), 4))
    first = next((i for i, a in enumerate(acc) if a >= 0.98), None)
    firstl = next((i for i, a in enumerate(accl) if a >= 0.98), None)
    return {"variant": variant, "k": k, "seed": seed, "acc_avg": acc, "acc_last": accl,
            "epochs_avg": None if first is None else (first + 1) / 4,
            "epochs_last": None if firstl is None else (firstl + 1) / 4}

if __name__ == "__main__":
    import tempfile
    variants = sys.argv[1].split(",")
    seeds, k, out = int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    data = sys.argv[5] if len(sys.argv) > 5 else \
        sim.make_data(48000, Path(tempfile.mkdtemp(prefix="lars-")))
    print("data", data, flush=True)
    jobs = [(v, s) for s in range(seeds) for v in variants]
    t0 = time.time()
    with ProcessPoolExecutor(2) as ex:
        res = list(ex.map(run, [data] * len(jobs), [k] * len(jobs), [s for _, s in jobs],
                          [v for v, _ in jobs]))
    summ = {}
    for v in variants:
        mine = [r for r in res if r["variant"] == v]
        summ[v] = {"epochs_avg": [r["epochs_avg"] for r in mine],
                   "epochs_last": [r["epochs_last"] for r in mine],
                   "final_avg": [r["acc_avg"][-1] for r in mine]}
        print(v, summ[v], flush=True)
    with open(out, "w") as f:
        json.dump({"k": k, "summary": summ, "runs": res, "seconds": time.time() - t0,
                   "data": data}, f, indent=1)
