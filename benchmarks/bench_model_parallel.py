"""Step time of wide FC nets split by columns over F processes, against the cost model.

For each net (784-4096-4096-10 and 784-8192-8192-10, float32, batch 64) and each F, F
processes (1 thread each, gloo on 127.0.0.1) train it for a few steps: the all-gather /
all-reduce layers (model_parallel/layers.py, "collective") and the thesis's master algorithm
(model_parallel/thesis.py, "thesis"). Plain single-process PyTorch with 1 and with F threads on
the same cores is the calibration. Systems run interleaved (A B A B ...), medians of --repeats.

The prediction beside each measurement: compute = (plain 1-thread step) / F, plus the
communication the cost model counts for that algorithm (cost_model.collective_counts /
thesis_counts), priced with T_lat and T_data measured by cost_model.probe in the same run.

    .venv/bin/python benchmarks/bench_model_parallel.py [--repeats 5] [--parts 1,2]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

BATCH, STEPS, WARMUP = 64, 12, 3


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank, world, port, sizes, algorithm, out):
    import torch
    import torch.distributed as dist

    from spark_dl.models import FCNet
    from spark_dl.parallel import cost_model
    from spark_dl.parallel.model_parallel import Comm, ThesisFC, partition_model
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    comm = Comm()
    link = cost_model.probe(comm) if world > 1 else None
    g = torch.Generator().manual_seed(0)
    x = torch.randn(BATCH, sizes[0], generator=g)
    y = torch.randint(0, sizes[-1], (BATCH,), generator=g)
    with torch.device("meta"):
        full = FCNet(sizes)
    if algorithm == "thesis":
        model = ThesisFC(full.to_empty(device="cpu"), comm)
    else:
        model = partition_model(full, comm).to_empty(device="cpu")
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.01)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    times = []
    for step in range(WARMUP + STEPS):
        if step == WARMUP:
            comm.reset()
        dist.barrier()
        t0 = time.perf_counter()
        opt.zero_grad()
        if algorithm == "thesis":
            model.step(x if rank == 0 else None, y if rank == 0 else None, BATCH)
        else:
            torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        times.append(time.perf_counter() - t0)
    counts = torch.tensor([comm.total_messages, comm.total_bytes], dtype=torch.float64)
    dist.all_reduce(counts)
    step_s = torch.tensor([statistics.median(times[WARMUP:])])
    dist.all_reduce(step_s, op=dist.ReduceOp.MAX)
    if rank == 0:
        Path(out).write_text(json.dumps({
            "step_s": float(step_s), "messages_per_step": float(counts[0]) / STEPS,
            "bytes_per_step": float(counts[1]) / STEPS,
            "link": None if link is None else {"t_lat": link.t_lat, "t_data": link.t_data}}))
    dist.destroy_process_group()


def distributed(sizes, F, algorithm):
    import torch.multiprocessing as mp
    out = Path(tempfile.mkdtemp()) / "r.json"
    mp.start_processes(_rank, args=(F, _free_port(), sizes, algorithm, str(out)), nprocs=F,
                       join=True, start_method="spawn")
    return json.loads(out.read_text())


def plain(sizes, threads):
    import torch

    from spark_dl.models import FCNet
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = FCNet(sizes)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(BATCH, sizes[0], generator=g)
    y = torch.randint(0, sizes[-1], (BATCH,), generator=g)
    times = []
    for step in range(WARMUP + STEPS):
        t0 = time.perf_counter()
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        times.append(time.perf_counter() - t0)
    return {"step_s": statistics.median(times[WARMUP:])}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--parts", default="2", help="comma-separated F > 1 to run")
    ap.add_argument("--nets", default="784-4096-4096-10,784-8192-8192-10")
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/model_parallel.json"))
    args = ap.parse_args(argv)
    import torch

    from spark_dl.parallel import cost_model
    parts = [int(f) for f in args.parts.split(",")]
    result = {"date": time.strftime("%Y-%m-%d %H:%M"), "machine": platform.machine(),
              "cpus": os.cpu_count(), "torch": torch.__version__, "batch": BATCH,
              "steps": STEPS, "repeats": args.repeats, "nets": {}}
    for net in args.nets.split(","):
        sizes = [int(w) for w in net.split("-")]
        systems = {"plain-1t": lambda: plain(sizes, 1)}
        for F in parts:
            systems[f"plain-{F}t"] = lambda F=F: plain(sizes, F)
            for alg in ("collective", "thesis"):
                systems[f"{alg}-F{F}"] = lambda F=F, alg=alg: distributed(sizes, F, alg)
        raw = {k: [] for k in systems}
        for _ in range(args.repeats):
            for k, fn in systems.items():                   # interleaved
                raw[k].append(fn())
        base = statistics.median(r["step_s"] for r in raw["plain-1t"])
        rows = {}
        for k, runs in raw.items():
            row = {"step_ms": round(statistics.median(r["step_s"] for r in runs) * 1e3, 2)}
            row["vs_plain_1t"] = round(row["step_ms"] / (base * 1e3), 3)
            if "-F" in k:
                alg, F = k.split("-F")[0], int(k.split("-F")[1])
                link = cost_model.Link(**runs[-1]["link"])
                counts = (cost_model.collective_counts if alg == "collective"
                          else cost_model.thesis_counts)(sizes, F, BATCH, 4)
                comm_s = cost_model.predict_seconds(counts, link)
                row.update(messages_per_step=runs[-1]["messages_per_step"],
                           messages_predicted=counts["messages"],
                           bytes_per_step=runs[-1]["bytes_per_step"],
                           bytes_predicted=counts["bytes"],
                           t_lat_us=round(link.t_lat * 1e6, 1),
                           t_data_ns_per_byte=round(link.t_data * 1e9, 3),
                           predicted_ms=round((base / F + comm_s) * 1e3, 2),
                           predicted_comm_ms=round(comm_s * 1e3, 2))
            rows[k] = row
            print(net, k, json.dumps(row), flush=True)
        result["nets"][net] = {"summary": rows, "raw": raw}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
