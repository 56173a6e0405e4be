"""Where a 2-process DDP step's time goes on this machine: the thesis CNN at batch 16, one
thread per process, the same fixed batch every step, in-process (no Spark), for each way of
averaging the gradients; medians over --repeats runs of --steps steps (after 100 warm-up
steps), each run's time the slower rank's:

  one         a single process, no averaging (the calibration)
  nocomm      two processes, no averaging (what sharing the cores costs by itself)
  ddp         DistributedDataParallel, gloo's all-reduce (TorchDistributor's path)
  ddp-shm     DDP with spark_dl's shared-memory hook (spark_dl.run(comm_hook="shm"))
  flat-gloo   the flat gradient through gloo's all_reduce
  flat-shm    the flat gradient through the shared-memory all-reduce (fit's AllReduce)

    .venv/bin/python benchmarks/ddp_step_cost.py [--repeats 3] [--steps 1200]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]
MODES = ("one", "nocomm", "ddp", "ddp-shm", "flat-gloo", "flat-shm")


def _worker(rank: int, world: int, mode: str, port: int, steps: int, queue) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from spark_dl.models import build_model
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = build_model("cnn")
    if mode.startswith("ddp"):
        model = DDP(model)
        if mode == "ddp-shm":
            from spark_dl.transport.ddp_hook import ShmCommHook
            ShmCommHook.register(model)
    shm = None
    if mode == "flat-shm":
        from spark_dl.transport.shm import ShmAllReduce
        token = torch.tensor([os.getpid()])
        dist.broadcast(token, 0)
        shm = ShmAllReduce(sum(p.numel() for p in model.parameters()), torch.float32,
                           f"sdl-bench-{int(token)}", 60)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x, y = torch.rand(16, 1, 28, 28), torch.randint(0, 10, (16,))

    def step():
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        if mode.startswith("flat"):
            flat = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
            shm(flat) if shm is not None else dist.all_reduce(flat)
            flat /= world
            off = 0
            for p in model.parameters():
                p.grad.copy_(flat[off:off + p.numel()].view_as(p.grad))
                off += p.numel()
        opt.step()
    for _ in range(100):
        step()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    queue.put((time.perf_counter() - t0) / steps * 1e3)
    dist.barrier()
    if shm is not None:
        shm.close()
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=1200)
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/ddp-step-cost.json"))
    args = ap.parse_args(argv)
    import torch.multiprocessing as mp
    from _results import write_results
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    ms: dict[str, list[float]] = {m: [] for m in MODES}
    for _ in range(args.repeats):                     # interleaved: one of each per repeat
        for mode in MODES:
            world = 1 if mode == "one" else 2
            port = _free_port()
            procs = [ctx.Process(target=_worker, args=(r, world, mode, port, args.steps, queue))
                     for r in range(world)]
            for p in procs:
                p.start()
            for p in procs:
                p.join()
            ms[mode].append(max(queue.get() for _ in procs))
    summary = {m: {"ms_per_step": round(statistics.median(v), 3),
                   "runs": [round(t, 3) for t in v]} for m, v in ms.items()}
    write_results(args.out, "ddp_step_cost.py", argv,
                  {"model": "thesis cnn", "batch": 16, "threads_per_process": 1,
                   "steps": args.steps, "repeats": args.repeats}, summary, {})


if __name__ == "__main__":
    main()
