"""Where a DDP step's time goes on this machine with --world processes (2 by default, one
a core): the thesis CNN at batch 16, one thread per process, the same fixed batch every step,
for each way of averaging the gradients, outside Spark and inside spark_dl.run; medians over
--repeats runs (interleaved) of --steps steps (after 100 warm-up steps), each run's time the
slowest rank's:

  one         a single process, no averaging (the calibration)
  nocomm      --world processes, no averaging (what sharing the machine costs by itself);
              and an estimate of what a barrier every step would cost them: their i-th
              step times side by side (paired by index, not by clock), the mean of the
              slowest over the mean step, minus one ("barrier_cost")
  ddp         DistributedDataParallel, gloo's all-reduce (TorchDistributor's path)
  ddp-shm     DDP with spark_dl's shared-memory hook (spark_dl.run(comm_hook="shm"))
  flat-gloo   the flat gradient through gloo's all_reduce
  flat-shm    the flat gradient through the shared-memory all-reduce (fit's AllReduce)
  run-fixed   ddp-shm's loop as a function under spark_dl.run(comm_hook="shm") on local[W]
              (barrier tasks in Spark's Python workers), the same fixed batch
  run-ctx     the same with the context's batches (spark_dl.context().batches(epoch): the
              DataFrame's partition of the shipped digits, float32, 2,000 a process and
              10,000 in all at most, shuffled every epoch)

    .venv/bin/python benchmarks/ddp_step_cost.py [--repeats 3] [--steps 1200] [--no-spark]
        [--world 2] [--modes one,nocomm,...]
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
sys.path.insert(0, str(ROOT))
MODES = ("one", "nocomm", "ddp", "ddp-shm", "flat-gloo", "flat-shm")
SPARK_MODES = ("run-fixed", "run-ctx")
IMAGES = str(ROOT / "data/mnist/t10k-images-idx3-ubyte.gz")
LABELS = str(ROOT / "data/mnist/t10k-labels-idx1-ubyte.gz")


def _time_steps(step, steps: int) -> tuple[float, list[float]]:
    """100 warm-up steps, a barrier, then ``steps`` timed ones: (ms a step, each step's s)."""
    import torch.distributed as dist
    for _ in range(100):
        step()
    dist.barrier()
    t0 = time.perf_counter()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    return (time.perf_counter() - t0) / steps * 1e3, times


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
    ms, times = _time_steps(step, steps)
    queue.put((ms, rank, times))
    dist.barrier()
    if shm is not None:
        shm.close()
    dist.destroy_process_group()


def run_step(steps: int, context: bool) -> float:
    """ddp-shm's loop inside spark_dl.run: ms a step, the slower rank's."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import spark_dl
    from spark_dl.models import build_model
    torch.set_num_threads(1)
    dist.init_process_group("gloo")                  # keeps spark_dl.run's group
    torch.manual_seed(0)
    model = DDP(build_model("cnn"))                  # comm_hook="shm": the hook is on
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    fixed = torch.rand(16, 1, 28, 28), torch.randint(0, 10, (16,))

    def batches():
        epoch = 0
        while True:
            yield from spark_dl.context().batches(epoch)
            epoch += 1
    it = batches() if context else None

    def step():
        x, y = next(it) if context else fixed
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    ms = torch.tensor([_time_steps(step, steps)[0]])
    dist.all_reduce(ms, op=dist.ReduceOp.MAX)
    return float(ms)


def barrier_cost(times: list[list[float]]) -> float:
    """How much slower the processes' steps would be with a barrier after every step: the mean
    of the slowest of their i-th step times over their mean step time, minus one (an estimate:
    the steps are paired by index; 0 for one process)."""
    if len(times) < 2:
        return 0.0
    return sum(map(max, *times)) / (sum(map(sum, times)) / len(times)) - 1


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=1200)
    ap.add_argument("--no-spark", action="store_true", help="leave run-fixed and run-ctx out")
    ap.add_argument("--world", type=int, default=2, help="processes (replicas)")
    ap.add_argument("--modes", default=",".join(MODES + SPARK_MODES))
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/ddp-step-cost.json"))
    args = ap.parse_args(argv)
    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    modes = [m for m in args.modes.split(",") if not (args.no_spark and m in SPARK_MODES)]
    unknown = set(modes) - set(MODES + SPARK_MODES)
    if unknown:
        ap.error(f"unknown modes {sorted(unknown)}: pick from {MODES + SPARK_MODES}")
    W = args.world
    spark = df = None
    if set(modes) & set(SPARK_MODES):
        os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
        os.environ.setdefault("SPARK_CONF_DIR", str(ROOT / "conf/logging"))
        from pyspark import cloudpickle

        import spark_dl
        from spark_dl.data import mnist_file_dataframe
        cloudpickle.register_pickle_by_value(sys.modules[__name__])
        spark = spark_dl.get_session("local", master=f"local[{W}]")
        df = mnist_file_dataframe(spark, IMAGES, LABELS, 0, min(2000 * W, 10000), W).cache()
        df.count()
    ms: dict[str, list[float]] = {m: [] for m in modes}
    barrier: list[float] = []
    for _ in range(args.repeats):                     # interleaved: one of each per repeat
        for mode in modes:
            if mode in SPARK_MODES:
                ms[mode].append(spark_dl.run(
                    run_step, args.steps, mode == "run-ctx", df=df, shape=(1, 28, 28),
                    batch_size=16, comm_hook="shm", device="cpu", log=None, progress=False))
                continue
            world = 1 if mode == "one" else W
            port = _free_port()
            procs = [ctx.Process(target=_worker, args=(r, world, mode, port, args.steps, queue))
                     for r in range(world)]
            for p in procs:
                p.start()
            got = sorted(queue.get() for _ in procs)             # (ms, rank, step times)
            for p in procs:
                p.join()
            ms[mode].append(max(g[0] for g in got))
            if mode == "nocomm":
                barrier.append(barrier_cost([g[2] for g in got]))
        write(args, argv, W, ms, barrier)            # after every repeat: kept if cut short


def write(args, argv, world: int, ms: dict, barrier: list) -> None:
    from _common import write_results
    summary = {m: {"ms_per_step": round(statistics.median(v), 3),
                   "runs": [round(t, 3) for t in v]} for m, v in ms.items() if v}
    if barrier:
        summary["nocomm"]["barrier_cost"] = round(statistics.median(barrier), 3)
        summary["nocomm"]["barrier_cost_runs"] = [round(b, 3) for b in barrier]
    write_results(args.out, "ddp_step_cost.py", argv,
                  {"model": "thesis cnn", "batch": 16, "threads_per_process": 1,
                   "world": world, "steps": args.steps, "repeats": len(next(iter(
                       ms.values()), []))}, summary, {})


if __name__ == "__main__":
    main()
