"""How many pushes a second can Downpour's parameter server take? Its push round trip (op
"pushpull": the gradient in, the shard's values after the step back) for the thesis CNN's
4,414 parameters, with the server settings `Downpour` picks for asynchronous replicas (one
shard, server momentum 0.9 - (1 - 1/K), clip 2, average 0.1), K client processes pushing as
fast as they can, each N times. With a model this small a push is all fixed cost (Python,
torch's per-op dispatch, two socket calls), and one server, which serializes the pushes under
its locks and the GIL, is what caps Downpour's replicas: 16 replicas of one thread each need
16 x (plain PyTorch's steps a second) pushes a second. The server serves as `Downpour`'s
does: a thread per connection below 8 clients, one event-loop thread from 8 on (LOOP_FROM in
spark_dl/transport/ps/server.py; a --baseline before f24e1dd has threads only).

Side by side, interleaved, medians of --repeats runs:
  plain-1t       single-process PyTorch, 1 thread, the thesis CNN at batch 16 (random digits):
                 the steps a second one replica would push (the demand of K replicas: K x it)
  server@<rev>   the server of that commit (--baseline, a temporary git worktree), in a
                 process of its own; the clients are this checkout's (the wire is the same)
  server@HEAD    this checkout's server

Per server and K: pushes a second (all clients together), the server process's CPU time per
push (user + system, /proc), and the pushes a second over the demand of 16 replicas. The
server's CPU per push is the figure that carries to another machine; pushes a second here
share 2 cores with the clients.

    .venv/bin/python benchmarks/bench_ps_capacity.py [--clients 1,4,16] [--pushes 1500]
        [--repeats 5] [--baseline REV] [--out benchmarks/results/ps-capacity.json]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
NUMEL, BATCH = 4414, 16

SERVER = """
import os, sys
sys.path.insert(0, sys.argv[1])
import torch
torch.set_num_threads(1)
from spark_dl.transport.ps import ParameterServer
k = int(sys.argv[2])
# argv[4], when given: "loop" or "threads" forces how it serves (bench_ps_serving.py); without
# it the server picks, and a --baseline checkout older than that switch runs this as well
serving = {"loop": True} if sys.argv[4:] == ["loop"] else \
    {"loop": False} if sys.argv[4:] == ["threads"] else {}
step = dict(optimizer="momentum", lr=0.001, momentum=max(0.0, 0.9 - (1 - 1 / k)),
            average=0.1, clip=2.0)
try:                                  # the server's step as one rule (rule.py: StepRule)
    from spark_dl.transport.ps import StepRule
    step = {"rule": StepRule(**step)}
except ImportError:                   # a --baseline from before it: the same as keywords
    pass
ps = ParameterServer(torch.zeros(int(sys.argv[3])), bytes.fromhex(os.environ["PS_SECRET"]),
                     "127.0.0.1", shards=1, mode="async", workers=k, **step, **serving)
print(ps.address[1], flush=True)
sys.stdin.read()                                   # until the benchmark closes it
print(ps.pushes, flush=True)
ps.close()
"""


def _client(port: int, secret: bytes, worker: int, pushes: int, go, done) -> None:
    """One client: hello, says it is ready, waits for ``go``, pushes, says it is done."""
    import torch
    torch.set_num_threads(1)
    from spark_dl.transport.ps import PSClient
    client = PSClient(("127.0.0.1", port), secret, worker)
    client.hello(BATCH * pushes, BATCH)
    grad = torch.randn(NUMEL, generator=torch.Generator().manual_seed(worker)) * 0.01
    values = torch.empty(NUMEL)
    done.put(("ready", worker))
    go.wait()
    for _ in range(pushes):
        client.push(grad, BATCH, 1, pull_into=values)
    client.close()
    done.put(("done", worker))


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def drive(server: str, argv: list[str], client, clients_args: list[tuple]) -> tuple:
    """Run the ``server`` snippet (``python -c server *argv``: it prints its port, serves until
    its stdin closes, then prints the pushes it applied) and one spawned process per
    ``clients_args`` running ``client(port, secret, *args, go, done)``, which puts a ready
    message on ``done``, waits for ``go`` and puts a finished one. Returns (the finished
    messages, and from go to the last of them the seconds and the server's CPU seconds, the
    pushes applied)."""
    secret = os.urandom(32)
    proc = subprocess.Popen([sys.executable, "-c", server, *argv], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PS_SECRET": secret.hex()})
    try:
        port = int(proc.stdout.readline())
        ctx = mp.get_context("spawn")
        go, done = ctx.Event(), ctx.Queue()
        procs = [ctx.Process(target=client, args=(port, secret, *args, go, done))
                 for args in clients_args]
        for p in procs:
            p.start()
        for _ in procs:                              # every client imported and said hello
            done.get(timeout=600)
        cpu0, t0 = _cpu_seconds(proc.pid), time.perf_counter()
        go.set()
        ends = [done.get(timeout=600) for _ in procs]
        wall, cpu = time.perf_counter() - t0, _cpu_seconds(proc.pid) - cpu0
        for p in procs:
            p.join()
        proc.stdin.close()
        applied = int(proc.stdout.readline())
    finally:
        if proc.poll() is None:                      # a failure before the server closed
            proc.kill()
        proc.wait()
    return ends, wall, cpu, applied


def server_run(root: Path, k: int, pushes: int) -> dict:
    """K clients x ``pushes`` against the server of ``root``: pushes/s and its CPU per push."""
    _, wall, cpu, applied = drive(SERVER, [str(root), str(k), str(NUMEL)], _client,
                                  [(w, pushes) for w in range(k)])
    if applied != k * pushes:
        raise RuntimeError(f"the server applied {applied} pushes, the clients sent {k * pushes}")
    return {"pushes_per_s": k * pushes / wall, "server_cpu_us_per_push": cpu / applied * 1e6}


def plain_steps_per_s(seconds: float = 3.0) -> float:
    """Steps a second of the thesis CNN at batch 16, one thread (in a fresh process, as a
    replica would run)."""
    code = f"""
import sys, time, torch
sys.path.insert(0, {str(ROOT)!r})
torch.set_num_threads(1)
from spark_dl.models import build_model
model = build_model("cnn")
opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
x, y = torch.rand({BATCH}, 1, 28, 28), torch.randint(0, 10, ({BATCH},))
def step():
    opt.zero_grad(); torch.nn.functional.cross_entropy(model(x), y).backward(); opt.step()
for _ in range(50): step()
n, t0 = 0, time.perf_counter()
while time.perf_counter() - t0 < {seconds}: step(); n += 1
print(n / (time.perf_counter() - t0))
"""
    return float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                check=True).stdout)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--clients", default="1,4,16")
    ap.add_argument("--pushes", type=int, default=1500, help="per client and run")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--baseline", default=None,
                    help="a commit whose server runs side by side with this checkout's")
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/ps-capacity.json"))
    args = ap.parse_args(argv)
    from _common import write_results
    ks = [int(k) for k in args.clients.split(",")]
    roots = {"HEAD": ROOT}
    tree = None
    if args.baseline:
        rev = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", args.baseline],
                             capture_output=True, text=True, check=True).stdout.strip()
        tree = Path(tempfile.mkdtemp(prefix="ps-baseline-")) / rev
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q",
                        str(tree), rev], check=True)
        roots = {rev: tree, **roots}
    runs: dict[str, list] = {"plain-1t": []}
    runs |= {f"server@{name} K={k}": [] for name in roots for k in ks}
    summary: dict = {}

    def report(done: int) -> dict:
        """The summary of the repeats so far, written after each (a run cut short keeps them)."""
        plain = statistics.median(r["steps_per_s"] for r in runs["plain-1t"])
        summary = {"plain-1t": {"steps_per_s": round(plain),
                                "demand_16_replicas": round(16 * plain)}}
        for name, rows in runs.items():
            if name == "plain-1t" or not rows:
                continue
            rate = statistics.median(r["pushes_per_s"] for r in rows)
            cpu = statistics.median(r["server_cpu_us_per_push"] for r in rows)
            summary[name] = {"pushes_per_s": round(rate), "server_cpu_us_per_push": round(cpu, 1),
                             "of_16_replicas_demand": round(rate / (16 * plain), 3),
                             "capacity_one_core_pushes_per_s": round(1e6 / cpu)}
        for k in ks:
            pairs = list(zip(*(runs[f"server@{n} K={k}"] for n in roots)))
            if len(roots) == 2 and pairs:
                summary[f"K={k} HEAD / baseline"] = {
                    "pushes_per_s": round(statistics.median(
                        y["pushes_per_s"] / x["pushes_per_s"] for x, y in pairs), 3),
                    "server_cpu_per_push": round(statistics.median(
                        y["server_cpu_us_per_push"] / x["server_cpu_us_per_push"]
                        for x, y in pairs), 3)}
        write_results(args.out, "bench_ps_capacity.py", argv,
                      {"params": NUMEL, "batch": BATCH, "pushes_per_client": args.pushes,
                       "clients": ks, "repeats": args.repeats, "repeats_done": done,
                       "baseline": args.baseline, "server": "1 shard, momentum 0.9 - (1 - 1/K), "
                       "clip 2, average 0.1, async"}, summary, {"runs": runs})
        return summary

    try:
        for repeat in range(args.repeats):
            runs["plain-1t"].append({"steps_per_s": plain_steps_per_s()})
            for k in ks:
                for name, root in roots.items():
                    got = server_run(root, k, args.pushes)
                    runs[f"server@{name} K={k}"].append(got)
                    print(f"repeat {repeat} K={k} server@{name}: {got['pushes_per_s']:,.0f} "
                          f"pushes/s, {got['server_cpu_us_per_push']:.0f} us CPU a push",
                          flush=True)
            summary = report(repeat + 1)
    finally:
        if tree is not None:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force",
                            str(tree)], check=False)
    for name, row in summary.items():
        print(name, row)


if __name__ == "__main__":
    main()
