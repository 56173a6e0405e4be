"""The models users bring, judged against what the machine can do: ResNet-18 and a decoder-only
transformer under every way spark_dl trains them, beside plain PyTorch and the ceiling.

Workloads (``spark_dl.models.build_model``):

  resnet18      the CIFAR-style ResNet-18 (in_channels 1, 10 classes) on extended MNIST: the
                digits distorted on the executors from the first 8,000 shipped ones, padded to
                32x32 and stored as uint8 Parquet (a binary column, 1,024 bytes a row), read
                by the bridge into float32 in [0, 1]; cross-entropy, SGD with momentum;
                held out: the last 2,000 real digits, padded alike
  transformer   the decoder-only language model on tinyshakespeare's characters: windows of
                ``context`` ids (the targets shifted by one) from the first 90 % of the text
                as int Parquet (array<int>, reaching the model as int64);
                sequence_cross_entropy, Adam; held out: windows of the last 10 %

Sizes (``--size``): "full" (ResNet-18 width 64, 11.2M parameters, batch 32; transformer 4
layers, width 256, 4 heads, context 128, 3.2M parameters, batch 16) for throughput; "small"
(width 16; 2 layers, width 128, context 64) for the time to a target (--resnet-target held-out
accuracy, --transformer-target held-out loss in nats per character), validated every quarter
epoch (its time kept out of the clock). ``--set workload.key=value`` overrides one setting
(e.g. ``--set resnet18.width=4``).

Systems, N = --replicas (local[N], one thread a replica):

  plain         one process, all N threads, all the rows (plain PyTorch, no Spark)
  ceiling       N one-thread processes at once, each on its own 1/N of the rows, never
                communicating (started together; samples/s: the sum of theirs); the figure
                every other system is judged against, measured in the same run
  allreduce, downpour, gossip, localsgd
                spark_dl.fit(strategy=..., replicas=N) on the Parquet DataFrame
  allreduce-1   spark_dl.fit with one replica ("small": the reference of the time to target)
  fsdp, fsdp-1  spark_dl.fit(strategy="fsdp") over N replicas and over one (on request: each
                replica's measured peak memory is kept, ``memory_per_replica``)
  run, run+hook spark_dl.run of the DDP function below with the DataFrame, without and with
                comm_hook="shm"
  torchdist     TorchDistributor(num_processes=N, local_mode=False).run of the same DDP
                function, which reads its rank's rows from the Parquet files

Interleaved (every system once, then again, --repeats times); medians. Reported per workload
and system: samples/s (median over the epochs after the first), its ratio to the ceiling of
the same repeat (median over repeats), the wall time from the DataFrame to the model (fit, run,
TorchDistributor), a fit's seconds outside its epochs (the wall time less its epochs' seconds)
and their fraction of the wall time (the raw runs keep where they went: the fit's
``info["phases"]``), and ("small") the training seconds to the target. Results: --out
(benchmarks/results/workloads.json), one entry per workload x system.

    .venv/bin/python benchmarks/bench_workloads.py [--size full|small] [--replicas 2]
        [--repeats 3] [--epochs 2] [--resnet-rows 8000] [--windows 2048]
        [--workloads resnet18,transformer] [--systems plain,ceiling,...] [--set k=v]
        [--label LABEL] [--out ...]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from _common import IMAGES, LABELS, SOURCES, run_torchdistributor, write_results  # noqa: E402

TEXT = str(ROOT / "data/text/tinyshakespeare.txt")
EVERY = 0.25                                  # validations per epoch ("small")

SIZES = {
    "full": {"resnet18": {"width": 64, "batch": 32, "lr": 0.05, "momentum": 0.9},
             "transformer": {"layers": 4, "width": 256, "heads": 4, "context": 128,
                             "dropout": 0.1, "batch": 16, "lr": 1e-3}},
    "small": {"resnet18": {"width": 16, "batch": 32, "lr": 0.05, "momentum": 0.9},
              "transformer": {"layers": 2, "width": 128, "heads": 4, "context": 64,
                              "dropout": 0.1, "batch": 16, "lr": 2e-3}},
}
SYSTEMS = ("plain", "ceiling", "allreduce-1", "allreduce", "downpour", "gossip", "localsgd",
           "fsdp", "fsdp-1",
           "run", "run+hook", "torchdist")
FAILURES: list[str] = []


# -- the data, made once --------------------------------------------------------------------

def make_images(spark, rows: int, parts: int, out: Path, val_rows: int) -> dict:
    """Extended digits padded to 32x32 as uint8 Parquet; the held-out digits as floats."""
    import numpy as np

    from spark_dl.data import extended_mnist, mnist_split, pixels_to_arrow
    (src_x, src_y), (test_x, test_y) = mnist_split(IMAGES, LABELS, SOURCES, 2000)

    def pad(batches):
        from spark_dl.data.bridge import column_to_numpy
        for b in batches:
            x = column_to_numpy(b.column("features"), "features", (28, 28))
            yield pixels_to_arrow(np.pad(x, ((0, 0), (2, 2), (2, 2))),
                                  b.column("label").to_numpy())
    extended_mnist(spark, src_x, src_y, rows, parts, seed=0).mapInArrow(
        pad, "features binary, label long").write.mode("overwrite").parquet(out.as_uri())
    vx = np.pad(test_x[-val_rows:], ((0, 0), (2, 2), (2, 2)))[:, None].astype(np.float32) / 255
    return {"path": str(out), "val": (vx, test_y[-val_rows:].astype(np.int64)),
            "shape": (1, 32, 32), "label_shape": (), "rows": rows}


def make_windows(windows: int, context: int, parts: int, out: Path, val_rows: int) -> dict:
    """Windows of ``context`` character ids from the first 90 % of tinyshakespeare as int
    Parquet (``parts`` files); held out: windows of the last 10 %."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from spark_dl.data import CharVocab, char_windows
    text = Path(TEXT).read_text(encoding="utf-8")
    vocab = CharVocab.from_text(text)
    ids = vocab.encode(text)
    split = int(0.9 * len(ids))
    x, y = char_windows(ids[:split], context, stride=context)
    if windows > len(x):
        raise SystemExit(f"--windows {windows}: the training text holds {len(x)} windows of "
                         f"{context}")
    x, y = x[:windows].astype(np.int32), y[:windows].astype(np.int32)
    out.mkdir(parents=True, exist_ok=True)
    for p in range(parts):
        lo, hi = p * windows // parts, (p + 1) * windows // parts
        off = pa.array(np.arange(0, (hi - lo + 1) * context, context, dtype=np.int32))
        pq.write_table(pa.table({
            "features": pa.ListArray.from_arrays(off, pa.array(x[lo:hi].ravel())),
            "label": pa.ListArray.from_arrays(off, pa.array(y[lo:hi].ravel()))}),
            out / f"part-{p:05d}.parquet")
    vx, vy = char_windows(ids[split:], context, stride=context)
    return {"path": str(out), "val": (vx[:val_rows].astype(np.int64),
                                      vy[:val_rows].astype(np.int64)),
            "shape": (context,), "label_shape": (context,), "rows": windows,
            "vocab": len(vocab)}


def read_rows(workload: str, path: str, lo_frac: tuple[int, int] = (0, 1)):
    """(x, y) tensors of the Parquet rows, the ``lo_frac`` = (i, n) i-th of n slices, as the
    model takes them (pixels float32 in [0, 1], ids int64)."""
    import numpy as np
    import pyarrow.parquet as pq
    import torch
    table = pq.read_table(path)
    i, n = lo_frac
    lo, hi = i * table.num_rows // n, (i + 1) * table.num_rows // n
    table = table.slice(lo, hi - lo)
    if workload == "resnet18":
        x = np.frombuffer(b"".join(table.column("features").to_pylist()), np.uint8)
        x = torch.from_numpy(x.reshape(-1, 1, 32, 32).astype(np.float32) / 255)
        return x, torch.from_numpy(table.column("label").to_numpy().astype(np.int64))
    x, y = (np.array(table.column(c).to_pylist(), np.int64) for c in ("features", "label"))
    return torch.from_numpy(x), torch.from_numpy(y)


def make_model(workload: str, cfg: dict):
    from spark_dl.models import build_model
    if workload == "resnet18":
        return build_model("resnet18", width=cfg["width"], in_channels=1, num_classes=10)
    return build_model("transformer", vocab=cfg["vocab"], layers=cfg["layers"],
                       width=cfg["width"], heads=cfg["heads"], context=cfg["context"],
                       dropout=cfg["dropout"])


def loss_name(workload: str) -> str:
    return "cross_entropy" if workload == "resnet18" else "sequence_cross_entropy"


def make_optimizer(workload: str, cfg: dict, params):
    import torch
    if workload == "resnet18":
        return torch.optim.SGD(params, lr=cfg["lr"], momentum=cfg["momentum"])
    return torch.optim.Adam(params, lr=cfg["lr"])


def reached(evals: list[dict], workload: str, target: float | None) -> float | None:
    """Training seconds of the first validation at the target (accuracy >=, loss <=)."""
    if target is None:
        return None
    if workload == "resnet18":
        hit = (e for e in evals if e.get("val_accuracy", 0) >= target)
    else:
        hit = (e for e in evals if e.get("val_loss", float("inf")) <= target)
    return next((e["train_seconds"] for e in hit), None)


# -- plain PyTorch and the ceiling (processes of their own) --------------------------------

def loop_process(workload, cfg, data, part, threads, epochs, seed, validate, barrier, queue):
    """One process's plain loop over its slice ``part`` = (i, n) of the rows, ``threads``
    torch threads; started at ``barrier``; (epoch seconds, rows, evaluations) to ``queue``."""
    try:
        import torch

        from spark_dl.losses import loss_function, val_metrics
        from spark_dl.runtime.validation import mid_epoch_steps
        torch.set_num_threads(threads)
        x, y = read_rows(workload, data["path"], part)
        val = None
        if validate:
            import numpy as np
            val = tuple(torch.from_numpy(np.asarray(a)) for a in data["val"])
        loss_fn = loss_function(loss_name(workload))
        torch.manual_seed(seed)
        model = make_model(workload, cfg)
        opt = make_optimizer(workload, cfg, model.parameters())
        n, b = len(x), cfg["batch"]
        steps = -(-n // b)
        marks = (mid_epoch_steps(steps, EVERY) | {steps - 1}) if validate else set()
        barrier.wait()
        secs, evals, clock = [], [], 0.0
        for e in range(epochs):
            perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1000 + e))
            t0, epoch_s = time.perf_counter(), 0.0
            for s in range(steps):
                idx = perm[s * b:(s + 1) * b]
                opt.zero_grad()
                loss_fn(model(x[idx]), y[idx]).backward()
                opt.step()
                if s in marks:
                    now = time.perf_counter()
                    clock, epoch_s = clock + now - t0, epoch_s + now - t0
                    evals.append({"epoch": e + (s + 1) / steps, "train_seconds": clock,
                                  **val_metrics(model, val, loss_fn, workload == "resnet18")})
                    model.train()
                    t0 = time.perf_counter()
            epoch_s += time.perf_counter() - t0
            secs.append(epoch_s)
        queue.put({"part": part, "epoch_seconds": secs, "rows": n, "evals": evals})
    except Exception:
        barrier.abort()
        queue.put({"part": part, "error": traceback.format_exc()[-1500:]})


def processes(workload, cfg, data, n, threads, epochs, seed, validate, timeout_s) -> list:
    """``n`` loop processes at once (spawned), each on its 1/n of the rows."""
    import multiprocessing as mp
    ctx = mp.get_context("spawn")
    barrier, queue = ctx.Barrier(n), ctx.Queue()
    procs = [ctx.Process(target=loop_process, args=(workload, cfg, data, (i, n), threads,
                                                    epochs, seed, validate, barrier, queue))
             for i in range(n)]
    for p in procs:
        p.start()
    out = []
    try:
        for _ in procs:
            out.append(queue.get(timeout=timeout_s))
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    errors = [r["error"] for r in out if "error" in r]
    if errors:
        raise RuntimeError(errors[0])
    return out


def steady(rows: int, secs: list[float]) -> float:
    """Samples/s of the epochs after the first (of the one epoch when there is one)."""
    return rows / statistics.median(secs[1:] or secs)


def plain(workload, cfg, data, args, seed) -> dict:
    r, = processes(workload, cfg, data, 1, args.replicas, args.epochs, seed,
                   args.size == "small", args.timeout)
    return {"samples_per_s": steady(r["rows"], r["epoch_seconds"]), "evals": r["evals"]}


def ceiling(workload, cfg, data, args, seed) -> dict:
    rs = processes(workload, cfg, data, args.replicas, 1, args.epochs, seed, False,
                   args.timeout)
    return {"samples_per_s": sum(steady(r["rows"], r["epoch_seconds"]) for r in rs),
            "per_process": [round(steady(r["rows"], r["epoch_seconds"]), 2) for r in rs]}


# -- spark_dl.fit ---------------------------------------------------------------------------

def fit_system(spark, workload, cfg, data, strategy, replicas, args, seed, runs) -> dict:
    from spark_dl import fit
    from spark_dl.strategies import make_strategy
    small = args.size == "small"
    t0 = time.perf_counter()
    df = spark.read.parquet(Path(data["path"]).as_uri())
    res = fit(df, lambda: make_model(workload, cfg), strategy=make_strategy(strategy),
              shape=data["shape"], label_shape=data["label_shape"],
              num_classes=10 if workload == "resnet18" else None, loss=loss_name(workload),
              optimizer="sgd" if workload == "resnet18" else "adam", lr=cfg["lr"],
              momentum=cfg.get("momentum", 0.0), epochs=args.epochs, batch_size=cfg["batch"],
              replicas=replicas, threads=1, device="cpu", seed=seed,
              validation=data["val"] if small else None, validate_every=EVERY,
              run_dir=runs / f"{workload}-{strategy}-{replicas}-{time.time()}", log=None,
              progress=False)
    wall = time.perf_counter() - t0
    rates = [h["samples_per_s"] for h in res.history]
    epochs_s = sum(h["seconds"] for h in res.history)
    return {"samples_per_s": statistics.median(rates[1:] or rates), "wall_s": wall,
            "outside_epochs_s": wall - epochs_s, "outside_epochs_fraction": 1 - epochs_s / wall,
            "phases": res.info.get("phases"), "evals": res.info.get("evals", []),
            "final_loss": res.history[-1]["loss"],
            "val": {k: v for k, v in res.history[-1].items() if k.startswith("val_")},
            **({"memory_per_replica": res.info["memory_per_replica"]}
               if "memory_per_replica" in res.info else {})}


# -- the DDP function: spark_dl.run and TorchDistributor ------------------------------------

def ddp_workload(workload: str, cfg: dict, path: str, epochs: int, seed: int) -> dict:
    """Runs in every replica: the workload's model in DistributedDataParallel, its optimizer,
    its own loop, 1 thread. Its rows: under spark_dl.run the context's shard (the DataFrame's
    partition); under TorchDistributor (no DataFrame reaches it) the rank's slice of the same
    Parquet rows. Returns the epochs' own seconds and the rows of rank 0's shard."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from spark_dl.losses import loss_function
    torch.set_num_threads(1)
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        import spark_dl
        batches = spark_dl.context().batches
    except RuntimeError:                               # not under spark_dl.run: the files
        x, y = read_rows(workload, path, (rank, world))

        def batches(epoch):
            perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(epoch))
            for i in range(0, len(x), cfg["batch"]):
                idx = perm[i:i + cfg["batch"]]
                yield x[idx], y[idx]
    torch.manual_seed(seed)
    model = DDP(make_model(workload, cfg))
    opt = make_optimizer(workload, cfg, model.parameters())
    loss_fn = loss_function(loss_name(workload))
    secs, rows = [], 0
    for epoch in range(epochs):
        t0, rows = time.perf_counter(), 0
        for xb, yb in batches(epoch):
            opt.zero_grad()
            loss_fn(model(xb), yb).backward()
            opt.step()
            rows += len(xb)
        secs.append(time.perf_counter() - t0)
    return {"epoch_seconds": secs, "rows": rows, "world": world}


def run_system(spark, workload, cfg, data, hook: bool, args, seed, runs) -> dict:
    import spark_dl
    t0 = time.perf_counter()
    df = spark.read.parquet(Path(data["path"]).as_uri())
    out = spark_dl.run(ddp_workload, workload, cfg, data["path"], args.epochs, seed, df=df,
                       replicas=args.replicas, device="cpu", shape=data["shape"],
                       label_shape=data["label_shape"], batch_size=cfg["batch"], seed=seed,
                       comm_hook="shm" if hook else None, log=None, progress=False,
                       run_dir=runs / f"run-{time.time()}")
    return {"samples_per_s": out["world"] * steady(out["rows"], out["epoch_seconds"]),
            "wall_s": time.perf_counter() - t0}


def torchdist_system(spark, workload, cfg, data, args, seed) -> dict:
    out, wall, error = run_torchdistributor(spark, ddp_workload, workload, cfg, data["path"],
                                            args.epochs, seed, timeout_s=args.timeout,
                                            processes=args.replicas)
    if out is None:
        raise RuntimeError(error)
    return {"samples_per_s": out["world"] * steady(out["rows"], out["epoch_seconds"]),
            "wall_s": wall}


# -- the run ---------------------------------------------------------------------------------

def summarise(results: dict, workloads, systems, targets: dict) -> dict:
    """One entry per workload x system: medians over the repeats that ran."""
    def med(v):
        v = [x for x in v if x is not None]
        return round(statistics.median(v), 3) if v else None
    entries = []
    for w in workloads:
        ceil = results[w].get("ceiling", [])
        for s in systems:
            runs = results[w][s]
            ok = [r for r in runs if "error" not in r]
            ratios = [r["samples_per_s"] / c["samples_per_s"] for r, c in zip(runs, ceil)
                      if "error" not in r and "error" not in c]
            entry = {"workload": w, "system": s, "runs_ok": f"{len(ok)}/{len(runs)}",
                     "samples_per_s": med([r["samples_per_s"] for r in ok]),
                     "ratio_to_ceiling": med(ratios)}
            for key in ("wall_s", "outside_epochs_s", "outside_epochs_fraction", "final_loss"):
                if any(key in r for r in ok):
                    entry[key] = med([r.get(key) for r in ok])
            if any("memory_per_replica" in r for r in ok):     # the largest replica's peak
                entry["peak_rss_mb"] = med([max(m["peak_rss_mb"] for m in r["memory_per_replica"])
                                            for r in ok if "memory_per_replica" in r])
            if targets.get(w) is not None and any(r.get("evals") for r in ok):
                times = [reached(r["evals"], w, targets[w]) for r in ok]
                entry["target"] = targets[w]
                entry["time_to_target_s"] = med(times)
                entry["reached"] = f"{sum(t is not None for t in times)}/{len(ok)}"
            entries.append(entry)
    by = {(e["workload"], e["system"]): e for e in entries}
    ratios = {}
    for w in workloads:
        one, many = by.get((w, "allreduce-1")), by.get((w, "allreduce"))
        if one and many and one.get("time_to_target_s") and many.get("time_to_target_s"):
            ratios[w] = round(many["time_to_target_s"] / one["time_to_target_s"], 3)
    return {"entries": entries, "allreduce_time_to_target_vs_one_replica": ratios,
            "failures": FAILURES}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=tuple(SIZES), default="full")
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--resnet-rows", type=int, default=8000)
    ap.add_argument("--windows", type=int, default=2048)
    ap.add_argument("--val-rows", type=int, default=2000)
    ap.add_argument("--resnet-target", type=float, default=0.95)
    ap.add_argument("--transformer-target", type=float, default=2.4)
    ap.add_argument("--workloads", default="resnet18,transformer")
    ap.add_argument("--systems", default=None,
                    help=f"of {', '.join(SYSTEMS)} (default: all but fsdp; allreduce-1 only "
                         "'small')")
    ap.add_argument("--set", action="append", default=[], metavar="WORKLOAD.KEY=VALUE")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds a run may take")
    ap.add_argument("--label", default=None, help="e.g. 'smoke': stored with the results")
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/workloads.json"))
    args = ap.parse_args(argv)
    workloads = args.workloads.split(",")
    systems = args.systems.split(",") if args.systems else \
        [s for s in SYSTEMS if (s != "allreduce-1" or args.size == "small")
         and not s.startswith("fsdp")]
    unknown = [s for s in systems if s not in SYSTEMS] + \
        [w for w in workloads if w not in SIZES["full"]]
    if unknown:
        ap.error(f"unknown system(s) or workload(s): {unknown}")
    if "ceiling" not in systems:
        systems.insert(0, "ceiling")               # every ratio needs it
    cfgs = {w: dict(SIZES[args.size][w]) for w in workloads}
    for item in args.set:
        key, _, value = item.partition("=")
        w, _, k = key.partition(".")
        if w not in cfgs or k not in cfgs[w]:
            ap.error(f"--set {item}: expected WORKLOAD.KEY=VALUE with a key of {cfgs}")
        cfgs[w][k] = type(cfgs[w][k])(value)
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("SPARK_CONF_DIR", str(ROOT / "conf/logging"))
    os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT / "benchmarks"), str(ROOT)])
    import torch

    from spark_dl import get_session
    tmp = Path(tempfile.mkdtemp(prefix="bench-workloads-"))
    runs = tmp / "runs"
    spark = get_session("local", master=f"local[{args.replicas}]")
    t0 = time.perf_counter()
    data = {}
    if "resnet18" in workloads:
        data["resnet18"] = make_images(spark, args.resnet_rows, args.replicas, tmp / "images",
                                       args.val_rows)
    if "transformer" in workloads:
        data["transformer"] = make_windows(args.windows, cfgs["transformer"]["context"],
                                           args.replicas, tmp / "windows", args.val_rows)
        cfgs["transformer"]["vocab"] = data["transformer"]["vocab"]
    prep_s = time.perf_counter() - t0
    targets = {"resnet18": args.resnet_target, "transformer": args.transformer_target} \
        if args.size == "small" else {}
    params = {w: sum(p.numel() for p in make_model(w, cfgs[w]).parameters()) for w in workloads}

    def system(w, s, seed):
        cfg, d = cfgs[w], data[w]
        if s == "plain":
            return plain(w, cfg, d, args, seed)
        if s == "ceiling":
            return ceiling(w, cfg, d, args, seed)
        if s in ("run", "run+hook"):
            return run_system(spark, w, cfg, d, s == "run+hook", args, seed, runs)
        if s == "torchdist":
            return torchdist_system(spark, w, cfg, d, args, seed)
        name, _, one = s.partition("-")
        return fit_system(spark, w, cfg, d, name, 1 if one else args.replicas, args, seed,
                          runs)

    results = {w: {s: [] for s in systems} for w in workloads}
    for i in range(args.repeats):                  # interleaved: every system, then again
        for w in workloads:
            for s in systems:
                t = time.perf_counter()
                try:
                    r = system(w, s, i)
                except Exception as e:
                    r = {"error": f"{type(e).__name__}: {str(e)[-600:]}"}
                    FAILURES.append(f"repeat {i + 1} {w} {s}: {r['error']}")
                r["seconds"] = time.perf_counter() - t
                results[w][s].append(r)
                print(f"repeat {i + 1} {w} {s}: " + (r.get("error") or
                      f"{r['samples_per_s']:.1f} samples/s") + f" ({r['seconds']:.0f} s)",
                      flush=True)
        write_results(args.out, "bench_workloads.py", argv,
                      {"label": args.label, "torch": torch.__version__,
                       "pyspark": spark.version, "size": args.size, "replicas": args.replicas,
                       "epochs": args.epochs, "repeats": args.repeats, "repeats_done": i + 1,
                       "configs": cfgs, "parameters": params,
                       "rows": {w: data[w]["rows"] for w in workloads},
                       "data_prep_s": round(prep_s, 1)},
                      summarise(results, workloads, systems, targets), results)
    spark.stop()


if __name__ == "__main__":
    main()
