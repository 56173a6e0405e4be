"""Step time of nets split by columns over F processes, against the cost model's planner.

Nets: wide FC nets (784-4096-4096-10 and 784-8192-8192-10, cross-entropy), "cnn" (the thesis
CNN on 1x28x28 inputs, cross-entropy) and "ssda" (the SSDA 256-1280-1280-256 on 256 inputs,
MSE against the input); float32, batch 64. For each net and each F, F processes (1 thread
each, gloo on 127.0.0.1) train it for a few steps: the all-gather / all-reduce layers
(model_parallel/layers.py, "collective") and, for FC nets, the thesis's master algorithm
(model_parallel/master.py, "thesis"). Plain single-process PyTorch with 1 and with F threads
on the same cores is the calibration. Systems run interleaved (A B A B ...), medians of
--repeats.

The prediction beside each measurement: the messages and bytes the planner counts for that
algorithm (cost_model.step_cost, one run on the meta device, for "collective";
cost_model.master_counts for "thesis"), priced with T_lat and T_data measured by
cost_model.probe in the same run, plus the compute, two ways:

    predicted_ms          (plain 1-thread step) / F: the compute the split leaves each process
    predicted_planner_ms  the busiest process's flops (step_cost of the collective layers,
                          for both algorithms) at the matmul rate cost_model.probe_flops
                          measured in that process (1 thread), as Downpour(partitions="auto")
                          prices it; FlopCounterMode counts matmuls and convolutions only,
                          all at the rate of one large matmul

    .venv/bin/python benchmarks/bench_model_parallel.py [--repeats 5] [--parts 1,2]
        [--nets 784-4096-4096-10,784-8192-8192-10,cnn,ssda]
    .venv/bin/python benchmarks/bench_model_parallel.py --plan-from results.json   (add "plan":
        what Downpour(partitions="auto") chooses on max(--parts) slots with that run's link and
        rate)
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


def _net(name):
    """(model factory, one sample's shape, number of classes or None for the SSDA's
    reconstruction) of a --nets entry."""
    from spark_dl.models import FCNet, ThesisCNN
    from spark_dl.models.ssda import SSDA, THESIS_SSDA_LAYERS
    if name == "cnn":
        return ThesisCNN, (1, 28, 28), 10
    if name == "ssda":
        return lambda: SSDA(256, THESIS_SSDA_LAYERS), (256,), None
    sizes = [int(w) for w in name.split("-")]
    return lambda: FCNet(sizes), (sizes[0],), sizes[-1]


def _batch(name):
    """The net's fixed batch x, y and its loss(output): cross-entropy on random labels, or
    the SSDA's MSE against its input (in [0, 1], as its sigmoid outputs; y None)."""
    import torch
    _, shape, classes = _net(name)
    g = torch.Generator().manual_seed(0)
    if classes is None:
        x = torch.rand(BATCH, *shape, generator=g)
        return x, None, lambda out: torch.nn.functional.mse_loss(out, x)
    x = torch.randn(BATCH, *shape, generator=g)
    y = torch.randint(0, classes, (BATCH,), generator=g)
    return x, y, lambda out: torch.nn.functional.cross_entropy(out, y)


def _rank(rank, world, port, net, algorithm, out):
    import torch
    import torch.distributed as dist

    from spark_dl.model_parallel import Comm, MasterBackpropFC, partition_model
    from spark_dl.planning import cost_model
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    comm = Comm()
    link = cost_model.probe(comm) if world > 1 else None
    flops = cost_model.probe_flops()
    x, y, loss = _batch(net)
    with torch.device("meta"):
        full = _net(net)[0]()
    if algorithm == "thesis":
        model = MasterBackpropFC(full.to_empty(device="cpu"), comm)
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
            loss(model(x)).backward()
        opt.step()
        times.append(time.perf_counter() - t0)
    counts = torch.tensor([comm.total_messages, comm.total_bytes], dtype=torch.float64)
    dist.all_reduce(counts)
    step_s = torch.tensor([statistics.median(times[WARMUP:])])
    dist.all_reduce(step_s, op=dist.ReduceOp.MAX)
    if rank == 0:
        Path(out).write_text(json.dumps({
            "step_s": float(step_s), "messages_per_step": float(counts[0]) / STEPS,
            "bytes_per_step": float(counts[1]) / STEPS, "flops_per_s": flops,
            "link": None if link is None else {"t_lat": link.t_lat, "t_data": link.t_data}}))
    dist.destroy_process_group()


def distributed(net, F, algorithm):
    import torch.multiprocessing as mp
    out = Path(tempfile.mkdtemp()) / "r.json"
    for attempt in range(3):  # noqa: B007 - read after the loop
        try:
            mp.start_processes(_rank, args=(F, _free_port(), net, algorithm, str(out)),
                               nprocs=F, join=True, start_method="spawn")
            break
        except mp.ProcessExitedException as e:
            # gloo sometimes aborts a rank in its teardown ("terminate called without an
            # active exception") after a long series of runs; the run is repeated, and counted
            print(f"{net} {algorithm}-F{F}: a rank died ({e}); run again", flush=True)
    else:
        raise RuntimeError(f"{net} {algorithm}-F{F}: a rank died in 3 attempts")
    return {**json.loads(out.read_text()), "attempts": attempt + 1}


def _plan(net, raw, parts):
    """What Downpour(partitions="auto") would choose on max(parts) slots with this run's link and
    matmul rate (Downpour's push and fetch included, memory no limit): F and the predicted
    samples/s of every candidate."""
    from spark_dl.planning import cost_model
    model_fn, shape, _ = _net(net)
    F = max(parts)
    runs = raw[f"collective-F{F}"]
    cluster = cost_model.Cluster(F, 1 << 40, cost_model.Link(**runs[-1]["link"]),
                                 statistics.median(r["flops_per_s"] for r in runs))
    model = [int(w) for w in net.split("-")] if net not in ("cnn", "ssda") else model_fn
    p = cost_model.plan(model, BATCH, cluster, input_shape=None if isinstance(model, list)
                        else shape, candidates=[1, *parts])
    return {"slots": F, "partitions": p.partitions, "replicas": p.replicas,
            "samples_per_s": {r["F"]: round(r["samples_per_s"]) for r in p.table}}


def plain(net, threads):
    import torch
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = _net(net)[0]()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, _, loss = _batch(net)
    times = []
    for _step in range(WARMUP + STEPS):
        t0 = time.perf_counter()
        opt.zero_grad()
        loss(model(x)).backward()
        opt.step()
        times.append(time.perf_counter() - t0)
    return {"step_s": statistics.median(times[WARMUP:])}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--parts", default="2", help="comma-separated F > 1 to run")
    ap.add_argument("--nets", default="784-4096-4096-10,784-8192-8192-10,cnn,ssda")
    ap.add_argument("--plan-from", default=None, metavar="JSON",
                    help="measure nothing: add the planner's choice to that run's results")
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/model_parallel.json"))
    args = ap.parse_args(argv)
    import torch

    from spark_dl.planning import cost_model
    parts = [int(f) for f in args.parts.split(",")]
    if args.plan_from:
        result = json.loads(Path(args.plan_from).read_text())
        for net, entry in result["nets"].items():
            entry["plan"] = _plan(net, entry["raw"], parts)
            print(net, json.dumps(entry["plan"]))
        Path(args.plan_from).write_text(json.dumps(result, indent=1))
        return
    result = {"date": time.strftime("%Y-%m-%d %H:%M"), "machine": platform.machine(),
              "cpus": os.cpu_count(), "torch": torch.__version__, "batch": BATCH,
              "steps": STEPS, "repeats": args.repeats, "nets": {}}
    for net in args.nets.split(","):
        model_fn, shape, _ = _net(net)
        fc = net not in ("cnn", "ssda")
        systems = {"plain-1t": lambda net=net: plain(net, 1)}
        for F in parts:
            systems[f"plain-{F}t"] = lambda F=F, net=net: plain(net, F)
            for alg in ("collective", "thesis") if fc else ("collective",):
                systems[f"{alg}-F{F}"] = lambda F=F, alg=alg, net=net: distributed(net, F, alg)
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
                cost = cost_model.step_cost(model_fn, shape, F, BATCH)
                counts = {"messages": cost.messages, "bytes": cost.bytes} \
                    if alg == "collective" else cost_model.master_counts(
                        [int(w) for w in net.split("-")], F, BATCH, 4)
                comm_s = cost_model.predict_seconds(counts, link)
                rate = statistics.median(r["flops_per_s"] for r in runs)
                row.update(messages_per_step=runs[-1]["messages_per_step"],
                           messages_predicted=counts["messages"],
                           bytes_per_step=runs[-1]["bytes_per_step"],
                           bytes_predicted=counts["bytes"],
                           t_lat_us=round(link.t_lat * 1e6, 1),
                           t_data_ns_per_byte=round(link.t_data * 1e9, 3),
                           predicted_ms=round((base / F + comm_s) * 1e3, 2),
                           predicted_comm_ms=round(comm_s * 1e3, 2),
                           predicted_planner_ms=round((cost.flops / rate + comm_s) * 1e3, 2),
                           flops_per_step=cost.flops,
                           flop_rate_gflops=round(rate / 1e9, 2))
            rows[k] = row
            print(net, k, json.dumps(row), flush=True)
        result["nets"][net] = {"summary": rows, "raw": raw, "plan": _plan(net, raw, parts)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
