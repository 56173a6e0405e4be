"""Seed 002's study on our engines: a synchronous parameter server (Downpour(mode="sync"):
every round the server averages the N workers' gradients) against ring all-reduce
(AllReduce(transport="process_group"): gloo's ring, each worker sends 2 (N - 1) / N of the
gradient) and spark_dl's default all-reduce (shared memory on one host), training MCNN on
synthetic counting scenes made in the executors, with 1, 2 and 4 workers.

Per system and N: images/s (the last epoch's), bytes per worker per step (PS: what the server
received and sent, per worker and round; ring: 2 (N - 1) / N x the gradient, what a ring
sends; shared memory: none over a network), the driver's CPU seconds during the fit (the
server's threads live there), and the step's breakdown (seconds in communication against the
rest, per worker). Systems in turn (A B C A B C ...), ``--repeats`` runs, medians; N = 1 and 2
on ``local[2]``, N = 4 on ``local-cluster[4,1,1024]`` (4 one-core executors on this machine's 2
cores: oversubscribed, reported as such).

    .venv/bin/python benchmarks/bench_counting.py --repeats 5
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def engine(spark, df, n, args, strategy, runs, seed):
    from spark_dl import fit
    from spark_dl.models.mcnn import MCNN
    from spark_dl.recipes.counting import DensityLoss
    side = args.size // 4
    cpu0, t0 = _cpu(), time.perf_counter()
    res = fit(df, lambda: MCNN(3, "pool"), strategy=strategy, shape=(3, args.size, args.size),
              label_shape=(1, side, side), loss=DensityLoss(100.0), optimizer="adam", lr=1e-3,
              epochs=args.epochs, batch_size=args.batch, replicas=n, seed=seed,
              run_dir=runs / f"{time.time()}", log=None)
    wall, cpu = time.perf_counter() - t0, _cpu() - cpu0
    info, last = res.info, res.history[-1]
    params = sum(p.numel() for p in res.model.parameters())
    out = {"images_per_s": last["samples_per_s"], "fit_wall_s": wall, "driver_cpu_s": cpu,
           "parameters": params}
    if "server" in info:                                   # the parameter server
        s, workers = info["server"], info["workers"]
        rounds = s["versions"][0]                          # sync: one version a round
        out["bytes_per_worker_step"] = (s["bytes_in"] + s["bytes_out"]) / (n * rounds)
        comm = statistics.mean(w["push_seconds"] + w["pull_seconds"] for w in workers)
        total = statistics.mean(w["task_seconds"] for w in workers)
    else:
        out["bytes_per_worker_step"] = 2 * (n - 1) / n * params * 4 \
            if info["transport"] != "shm" else 0.0
        t = info["timings_rank0"]
        comm, total = t["allreduce_s"], t["train_s"]
    out["communication_s"], out["other_s"] = comm, total - comm
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--scenes", type=int, default=512)
    ap.add_argument("--size", type=int, default=32)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--batch", type=int, default=8, help="per worker")
    ap.add_argument("--workers", default="1,2,4")
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/counting.json"))
    args = ap.parse_args(argv)
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("SPARK_CONF_DIR", str(ROOT / "conf/logging"))
    from _common import write_results

    from spark_dl import AllReduce, Downpour, get_session
    from spark_dl.data.counting import counting_scenes
    systems = {"ps-sync": lambda: Downpour(mode="sync"),
               "ring": lambda: AllReduce(transport="process_group"),
               "allreduce-shm": AllReduce}
    raw: dict = {}
    for master, ns in (("local[2]", [n for n in map(int, args.workers.split(",")) if n <= 2]),
                       ("local-cluster[4,1,1024]", [n for n in map(int, args.workers.split(","))
                                                    if n > 2])):
        if not ns:
            continue
        spark = get_session("local", master=master)
        runs = Path(tempfile.mkdtemp(prefix="bench-counting-"))
        for n in ns:
            path = str(runs / f"scenes-{n}")
            counting_scenes(spark, args.scenes, args.size, n, seed=0).write.parquet(path)
            df = spark.read.parquet(path)
            engine(spark, df, n, args, AllReduce(), runs, 0)        # warm the workers
            for i in range(args.repeats):
                for name, make in systems.items():
                    if n == 1 and name != "ps-sync" and name != "allreduce-shm":
                        continue                   # one worker: no ring to speak of
                    r = engine(spark, df, n, args, make(), runs, i)
                    raw.setdefault(f"{name} x{n}", []).append({**r, "master": master})
                    print(f"run {i + 1} {name} x{n}: {r['images_per_s']:.0f} images/s, "
                          f"{r['bytes_per_worker_step']:.0f} B/worker/step, driver CPU "
                          f"{r['driver_cpu_s']:.1f} s", flush=True)
        spark.stop()
    summary = {k: {m: round(statistics.median(r[m] for r in rs), 3) for m in
                   ("images_per_s", "bytes_per_worker_step", "driver_cpu_s", "communication_s",
                    "other_s", "fit_wall_s")} | {"master": rs[0]["master"]}
               for k, rs in raw.items()}
    for k, s in summary.items():
        if k.startswith("ring"):
            ps = summary.get(k.replace("ring", "ps-sync"))
            if ps:
                s["images_per_s_vs_ps"] = round(s["images_per_s"] / ps["images_per_s"], 3)
    write_results(args.out, "bench_counting.py", argv,
                  {"scenes": args.scenes, "size": args.size, "epochs": args.epochs,
                   "batch_per_worker": args.batch, "repeats": args.repeats}, summary, raw)


if __name__ == "__main__":
    main()
