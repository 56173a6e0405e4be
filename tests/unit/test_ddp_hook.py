"""The shared-memory DDP communication hook on 2 real gloo ranks (127.0.0.1): with a bucket
cap that splits the model into several buckets of different sizes, the hook's gradients are
DDP's default all-reduce's, step after step (float64), and it leaves no segment in /dev/shm."""

from __future__ import annotations

import os

from .ranks import run_on_ranks


def _train(rank, world, hook):
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    from spark_dl import ShmCommHook
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(12, 40), torch.nn.Tanh(),
                              torch.nn.Linear(40, 30), torch.nn.Tanh(),
                              torch.nn.Linear(30, 3)).double()
    ddp = DDP(net, bucket_cap_mb=0.004)              # ~500 float64 values: several buckets
    state = ShmCommHook.register(ddp) if hook else None
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(rank)
    for _ in range(4):
        x = torch.randn(8, 12, generator=g, dtype=torch.float64)
        y = torch.randint(0, 3, (8,), generator=g)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
    calls = state.calls if state else 0
    if state:
        state.close()
    return {"weights": [p.detach().flatten().tolist() for p in net.parameters()],
            "calls": calls}


def _both(rank, world):
    """DDP's default all-reduce, then the hook, on the same ranks (one spawn)."""
    return {"plain": _train(rank, world, False), "hook": _train(rank, world, True)}


def test_the_shm_hook_equals_ddps_all_reduce(tmp_path):
    before = {f for f in os.listdir("/dev/shm") if f.startswith("sdl-hook-")}
    reports = run_on_ranks(_both, 2, tmp_path)
    plain, hooked = ([r[k] for r in reports] for k in ("plain", "hook"))
    assert hooked[0]["calls"] == hooked[1]["calls"] > 4     # more than one bucket a step
    for a, b in zip(plain[0]["weights"], hooked[0]["weights"]):
        assert max(abs(u - v) for u, v in zip(a, b)) <= 1e-12
    assert hooked[0]["weights"] == hooked[1]["weights"]     # every rank the same
    assert {f for f in os.listdir("/dev/shm") if f.startswith("sdl-hook-")} == before
