"""How should the parameter server serve its workers: a thread per connection, or one
event-loop thread (spark_dl/transport/ps/loop.py)? Unlike bench_ps_capacity.py, whose clients
push as fast as they can, the workers here train: K processes each step the thesis CNN (1
thread, batch 16, SGD through the server) and push their gradient and take the server's values
back every step, as Downpour's asynchronous replicas do, on the cores the server shares with
them (as on one machine, `local[K]`). Side by side, interleaved, medians of --repeats runs, at
each K:

  threads   ParameterServer(loop=False): each connection served by its own thread
  loop      ParameterServer(loop=True): one thread serves every worker once its hello is done

Reported per system and K: the workers' samples a second together, the share of a worker's
time in its push round trip and that round trip in µs, and the server's CPU time per push
(user + system from /proc, in clock ticks). The server has the settings `Downpour` picks for
asynchronous replicas (one shard, momentum 0.9 - (1 - 1/K), clip 2, average 0.1).

    .venv/bin/python benchmarks/bench_ps_serving.py [--workers 2,4,8] [--steps 3000]
        [--repeats 3] [--out benchmarks/results/ps-serving.json]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]
BATCH = 16


def _worker(port: int, secret: bytes, worker: int, steps: int, go, done) -> None:
    """One replica: steps the thesis CNN on a fixed batch, pushes and fetches every step."""
    import torch
    torch.set_num_threads(1)
    from spark_dl.models import build_model
    from spark_dl.transport.ps import PSClient
    torch.manual_seed(worker)
    model = build_model("cnn")
    params = list(model.parameters())
    n = sum(p.numel() for p in params)
    client = PSClient(("127.0.0.1", port), secret, worker)
    client.hello(BATCH * steps, BATCH)
    values, grad = torch.empty(n), torch.empty(n)
    x, y = torch.rand(BATCH, 1, 28, 28), torch.randint(0, 10, (BATCH,))
    done.put(("ready", worker, 0.0))
    go.wait()
    t0 = time.perf_counter()
    for _ in range(steps):
        for p in params:
            p.grad = None
        torch.nn.functional.cross_entropy(model(x), y).backward()
        torch.cat([p.grad.reshape(-1) for p in params], out=grad)
        client.push(grad.mul_(BATCH), BATCH, 1, pull_into=values)
        torch.nn.utils.vector_to_parameters(values, params)
    done.put(("done", time.perf_counter() - t0, client.push_seconds))
    client.close()


def run(k: int, system: str, steps: int) -> dict:
    from bench_ps_capacity import SERVER, drive  # its server, serving as ``system``

    from spark_dl.models import build_model
    numel = sum(p.numel() for p in build_model("cnn").parameters())
    ends, _, cpu, applied = drive(SERVER, [str(ROOT), str(k), str(numel), system], _worker,
                                  [(w, steps) for w in range(k)])
    if applied != k * steps:
        raise RuntimeError(f"the server applied {applied} pushes, the workers sent {k * steps}")
    return {"samples_per_s": k * steps * BATCH / max(e[1] for e in ends),
            "push_share": statistics.mean(e[2] / e[1] for e in ends),
            "push_us": statistics.mean(e[2] / steps * 1e6 for e in ends),
            "server_cpu_us_per_push": cpu / applied * 1e6}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--workers", default="2,4,8")
    ap.add_argument("--steps", type=int, default=3000, help="per worker and run")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/ps-serving.json"))
    args = ap.parse_args(argv)
    from _results import write_results
    ks = [int(k) for k in args.workers.split(",")]
    systems = ("threads", "loop")
    runs: dict[str, list] = {f"{s} K={k}": [] for k in ks for s in systems}
    summary: dict = {}
    for repeat in range(args.repeats):
        for k in ks:
            for system in systems:
                got = run(k, system, args.steps)
                runs[f"{system} K={k}"].append(got)
                print(f"repeat {repeat} K={k} {system}: {got['samples_per_s']:,.0f} samples/s, "
                      f"push {got['push_us']:.0f} us ({got['push_share']:.0%} of a step), "
                      f"server {got['server_cpu_us_per_push']:.0f} us CPU a push", flush=True)
        summary = {name: {key: round(statistics.median(r[key] for r in rows), 3)
                          for key in rows[0]} for name, rows in runs.items() if rows}
        for k in ks:
            pairs = list(zip(runs[f"threads K={k}"], runs[f"loop K={k}"]))
            summary[f"K={k} loop / threads"] = {"samples_per_s": round(statistics.median(
                b["samples_per_s"] / a["samples_per_s"] for a, b in pairs), 3)}
        write_results(args.out, "bench_ps_serving.py", argv,
                      {"batch": BATCH, "steps_per_worker": args.steps, "workers": ks,
                       "repeats": args.repeats, "repeats_done": repeat + 1,
                       "server": "1 shard, momentum 0.9 - (1 - 1/K), clip 2, average 0.1, "
                       "async"}, summary, {"runs": runs})


if __name__ == "__main__":
    main()
