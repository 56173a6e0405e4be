"""Bring your own loop: the same DDP function (benchmarks/_common.py's ddp_train: the thesis CNN, SGD with
momentum, batch B per replica, --epochs epochs, 1 thread per process) under three launchers on
this machine's Spark (local[N], N = --replicas replicas, 2 by default), interleaved, medians of
--repeats runs:

  torchdist     pyspark.ml.torch.distributor.TorchDistributor(num_processes=N,
                local_mode=False).run(ddp_train, ...): the function reads its rows from files
  ray           Ray Train's TorchTrainer on Ray-on-Spark (benchmarks/ray_peer.py in
                .venv-ray, benchmarks/setup_ray.sh; the Ray cluster started once, apart)
  spark_dl      spark_dl.run(ddp_train, ..., df=digits): the rows from the DataFrame's
                partitions through spark_dl.context()
  spark_dl+hook the same with comm_hook="shm": DDP's gradients through shared memory
  plain-1t      the calibration: the same loop in this process, no DDP, 1 thread, all rows
                (the limit of N replicas on N cores is N x its samples/s)

Steady = samples/s of epochs 2 on (the loop's own time); wall = seconds from the call with a
DataFrame (or, for the peers, the files) to rank 0's trained model on the driver.

    .venv/bin/python benchmarks/bench_run.py [--repeats 5] [--rows 4000] [--no-ray]
        [--replicas 2] [--epochs 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import _common  # noqa: E402
from _common import IMAGES, LABELS, ddp_train, plain_rate, run_torchdistributor  # noqa: E402

LR, MOMENTUM = 0.01, 0.9
EPOCHS, REPLICAS = 3, 2                   # --epochs, --replicas


def _steady(rows: int, out: dict) -> float:
    return rows / statistics.median(out["epoch_seconds"][1:])


def torchdist(spark, rows, batch, timeout_s=180):
    """One TorchDistributor run: (steady samples/s, wall s), or (None, wall) when it failed
    or hung (cancelled after ``timeout_s``)."""
    r, wall, error = run_torchdistributor(spark, ddp_train, IMAGES, LABELS, rows, EPOCHS, batch,
                                          LR, MOMENTUM, timeout_s=timeout_s,
                                          processes=REPLICAS)
    if r is None:
        FAILURES.append("torchdist: " + error)
        return None, wall
    return _steady(rows, r), wall


def plain(rows, batch):
    """ddp_train's loop without DDP, one thread, in this process (the same rows, lr,
    momentum and epochs): (steady samples/s, wall)."""
    import torch
    threads = torch.get_num_threads()
    try:
        return plain_rate("cnn", rows, batch, 1, epochs=EPOCHS, lr=LR, momentum=MOMENTUM)
    finally:
        torch.set_num_threads(threads)


def spark_dl_run(spark, rows, batch, hook, runs: Path):
    import spark_dl
    from spark_dl.data import mnist_file_dataframe
    t0 = time.perf_counter()
    df = mnist_file_dataframe(spark, IMAGES, LABELS, 0, rows, REPLICAS)
    out = spark_dl.run(ddp_train, IMAGES, LABELS, rows, EPOCHS, batch, LR, MOMENTUM, df=df,
                       device="cpu", shape=(1, 28, 28), batch_size=batch, shuffle=True,
                       comm_hook="shm" if hook else None, log=None,
                       run_dir=runs / f"{time.time()}")
    return _steady(rows, out), time.perf_counter() - t0


class RayPeer:
    """benchmarks/ray_peer.py in .venv-ray: one fit per request."""

    def __init__(self, rows, batch):
        py = ROOT / ".venv-ray/bin/python"
        self.proc = subprocess.Popen(
            [str(py), str(ROOT / "benchmarks/ray_peer.py"), str(rows), str(EPOCHS), str(batch),
             str(LR), str(MOMENTUM)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            text=True, cwd=ROOT, env={**os.environ, "PYSPARK_PYTHON": str(py)})
        self.ready = self._line()

    def _line(self) -> dict:
        while True:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError("the Ray peer exited (see its stderr above)")
            if line.startswith("{"):
                return json.loads(line)

    def __call__(self):
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        r = self._line()
        if "error" in r:
            FAILURES.append("ray: " + r["error"])
            return None, r["wall_s"]
        return r["steady_samples_per_s"], r["wall_s"]

    def close(self):
        try:
            self.proc.stdin.write("quit\n")
            self.proc.stdin.flush()
            self.proc.wait(60)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()


FAILURES: list[str] = []


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--rows", type=int, default=4000)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--no-ray", action="store_true", help="leave the Ray peer out")
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/run.json"))
    args = ap.parse_args(argv)
    global EPOCHS, REPLICAS
    EPOCHS, REPLICAS = args.epochs, args.replicas
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("SPARK_CONF_DIR", str(ROOT / "conf/logging"))
    os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT / "benchmarks"), str(ROOT)])
    import tempfile

    import torch
    from pyspark import cloudpickle

    from spark_dl import get_session
    cloudpickle.register_pickle_by_value(_common)     # the executors get it with the call
    runs = Path(tempfile.mkdtemp(prefix="bench-run-"))
    t0 = time.perf_counter()
    spark = get_session("local", master=f"local[{REPLICAS}]")
    spark.range(REPLICAS, numPartitions=REPLICAS).count()
    startup = time.perf_counter() - t0
    rows, batch = args.rows, args.batch
    systems = {"plain-1t": lambda: plain(rows, batch),
               "torchdist": lambda: torchdist(spark, rows, batch),
               "spark_dl": lambda: spark_dl_run(spark, rows, batch, False, runs),
               "spark_dl+hook": lambda: spark_dl_run(spark, rows, batch, True, runs)}
    ray_note, peer = None, None
    if not args.no_ray:
        if REPLICAS != 2:
            ray_note = "not run: benchmarks/ray_peer.py runs 2 workers on local[2]"
        elif not (ROOT / ".venv-ray/bin/python").exists():
            ray_note = "not run: .venv-ray missing (benchmarks/setup_ray.sh)"
        else:
            try:
                peer = RayPeer(rows, batch)
                systems = {"plain-1t": systems["plain-1t"], "torchdist": systems["torchdist"],
                           "ray": peer, **{k: v for k, v in systems.items()
                                           if k not in ("plain-1t", "torchdist")}}
                ray_note = peer.ready
            except Exception as e:
                ray_note = f"not run: {type(e).__name__}: {e}"
    spark_dl_run(spark, rows, batch, True, runs)                 # warm the workers
    rate = {k: [] for k in systems}
    wall = {k: [] for k in systems}

    def report(done: int):
        """The summary of the repeats so far, written after each (a run cut short keeps them)."""
        def med(v):
            ok = [x for x in v if x is not None]
            return statistics.median(ok) if ok else None
        ok = {k: [i for i, r in enumerate(rate[k]) if r is not None] for k in systems}
        steady = {k: med(v) for k, v in rate.items()}
        walls = {k: med([w for i, w in enumerate(wall[k]) if i in ok[k]]) for k in systems}

        def ratio(a, b, table, scale=1.0):
            pairs = [scale * table[a][i] / table[b][i] for i in ok[a] if i in ok[b]]
            return round(statistics.median(pairs), 3) if pairs else None
        summary = {"steady_samples_per_s": {k: v and round(v) for k, v in steady.items()},
                   "wall_s": {k: v and round(v, 2) for k, v in walls.items()},
                   "runs_ok": {k: f"{len(ok[k])}/{done}" for k in systems},
                   "hook_vs_torchdist_steady": ratio("spark_dl+hook", "torchdist", rate),
                   "hook_vs_torchdist_wall": ratio("spark_dl+hook", "torchdist", wall),
                   "plain_vs_torchdist_steady": ratio("spark_dl", "torchdist", rate),
                   "hook_vs_plain_steady": ratio("spark_dl+hook", "spark_dl", rate),
                   "fraction_of_limit": {k: ratio(k, "plain-1t", rate, 1 / REPLICAS)
                                         for k in systems if k != "plain-1t"},
                   "ray": ray_note}
        if "ray" in systems:
            summary["hook_vs_ray_steady"] = ratio("spark_dl+hook", "ray", rate)
            summary["hook_vs_ray_wall"] = ratio("spark_dl+hook", "ray", wall)
        summary["failures"] = FAILURES
        _common.write_results(args.out, "bench_run.py", argv,
                      {"torch": torch.__version__, "pyspark": spark.version, "rows": rows,
                       "batch_per_replica": batch, "epochs": EPOCHS, "replicas": REPLICAS,
                       "repeats": args.repeats, "repeats_done": done,
                       "spark_startup_s": round(startup, 2)},
                      summary, {"samples_per_s": rate, "wall_s": wall})

    try:
        for i in range(args.repeats):                      # interleaved A B C D A B C D ...
            for k, fn in systems.items():
                r, w = fn()
                rate[k].append(r)
                wall[k].append(w)
                print(f"run {i + 1} {k}: {r and round(r)} samples/s, {w:.1f} s", flush=True)
            report(i + 1)
    finally:
        if peer is not None:
            peer.close()

    spark.stop()


if __name__ == "__main__":
    main()
