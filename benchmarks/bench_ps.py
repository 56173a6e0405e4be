"""Parameter-server transport: push + pull round trip of a 10M-parameter model on loopback.

Side by side, interleaved, medians of --repeats runs:
  socket      the bound: a plain TCP socket sends the same bytes to an echo thread and reads
              them back (sendall / recv_into), no framing, no checks, no optimizer
  ps-1shard   spark_dl's parameter server: one push of the float32 gradient (framed, MAC'd
              headers, NaN check, SGD step on the server) + one pull of the parameters
  ps-4shards  the same with the parameters cut into 4 shards (4 frames each way)
  ps-bf16     1 shard, gradients and parameters sent as bfloat16 (half the bytes)
GB/s counts the float32 bytes moved both ways (2 x 40 MB), so bf16 shows its effective rate.

    .venv/bin/python benchmarks/bench_ps.py [--params 10000000] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from spark_dl.transport.ps import ParameterServer, PSClient, StepRule  # noqa: E402

SECRET = os.urandom(32)


def echo_server():
    srv = socket.create_server(("127.0.0.1", 0))

    def serve():
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            with conn:
                n = int.from_bytes(conn.recv(8), "big")
                buf = memoryview(bytearray(n))
                while True:
                    got = 0
                    while got < n:
                        k = conn.recv_into(buf[got:], n - got)
                        if k == 0:
                            break
                        got += k
                    if got < n:
                        break
                    conn.sendall(buf)
    threading.Thread(target=serve, daemon=True).start()
    return srv


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--params", type=int, default=10_000_000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3, help="round trips per timed run")
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/ps.json"))
    args = ap.parse_args(argv)
    n = args.params
    torch.set_num_threads(1)
    grad = torch.randn(n) * 1e-6
    nbytes = 2 * 4 * n

    srv = echo_server()
    sock = socket.create_connection(srv.getsockname())
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.sendall((4 * n).to_bytes(8, "big"))
    send = grad.numpy().tobytes()
    back = memoryview(bytearray(4 * n))

    def plain():
        sock.sendall(send)
        got = 0
        while got < 4 * n:
            got += sock.recv_into(back[got:], 4 * n - got)

    servers, clients = {}, {}
    for name, shards, wire in (("ps-1shard", 1, torch.float32), ("ps-4shards", 4, torch.float32),
                               ("ps-bf16", 1, torch.bfloat16)):
        servers[name] = ParameterServer(torch.zeros(n), SECRET, shards=shards,
                                        rule=StepRule(optimizer="sgd", lr=0.01))
        c = PSClient(servers[name].address, SECRET, 0, dtype=wire)
        c.hello(rows=1, batch_size=1)
        clients[name] = (c, torch.empty(n, dtype=wire))

    def ps(name):
        c, out = clients[name]
        c.push(grad, samples=1)
        c.pull(out)

    systems = {"socket": plain, **{k: (lambda k=k: ps(k)) for k in servers}}
    for fn in systems.values():
        fn()
    secs = {k: [] for k in systems}
    for _ in range(args.repeats):
        for k, fn in systems.items():
            t0 = time.perf_counter()
            for _ in range(args.rounds):
                fn()
            secs[k].append((time.perf_counter() - t0) / args.rounds)
    gbps = {k: nbytes / statistics.median(v) / 1e9 for k, v in secs.items()}
    result = {"date": time.strftime("%Y-%m-%d %H:%M"), "machine": platform.machine(),
              "cpus": os.cpu_count(), "params": n, "bytes_per_round_trip_f32": nbytes,
              "repeats": args.repeats, "rounds_per_run": args.rounds,
              "gb_per_s": {k: round(v, 3) for k, v in gbps.items()},
              "ratio_vs_socket": {k: round(v / gbps["socket"], 3) for k, v in gbps.items()},
              "round_trip_seconds": secs}
    for c, _ in clients.values():
        c.close()
    for s in servers.values():
        s.close()
    print(json.dumps({k: v for k, v in result.items() if k != "round_trip_seconds"}))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
