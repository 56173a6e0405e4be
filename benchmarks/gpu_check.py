"""The GPU issue's checks on one GPU machine, side by side, into one results file.

Sections (``--sections``, in this order; each one's figures are written as soon as it ends, a
failing case is recorded with its error and the others go on):

  one      one replica on the GPU against plain PyTorch on the same GPU, rows and optimizer
           (a loop over a GPU tensor: the usual hand-written baseline), interleaved
           (plain, AllReduce, Downpour, Downpour(overlap=False), plain, ...), --repeats
           times: the thesis CNN at batch 128 on the first 8,000 shipped digits, and SRCNN
           9-5-5 on 33x33 patches at batch 128 (synthetic patches: throughput only). Steady
           samples/s = the median over the epochs after the first.
  amp      float32 / bf16 / fp16 autocast (AllReduce(amp=...)), one replica, on the
           matmul-bound FC 784-4096-4096-10 at batch 256 and SRCNN at batch 256; plain PyTorch
           float32 and bf16 beside them; TF32 stays off (PyTorch's default).
  shared   two replicas on the one GPU in every strategy (AllReduce, Gossip, Downpour,
           Boosting, Downpour(partitions=2)): whether it runs, the backend and transport the
           fit chose and why, the devices every task reports, accuracy.
  lstm     the character-level LSTM on tinyshakespeare (issue 3's leftover): the
           LSTM_CONFIGS side by side, one process each, each time-boxed (--lstm-seconds):
           held-out nats/char (of the weights and of their moving average) and the curves.

    python benchmarks/gpu_check.py [--sections one,amp,shared,lstm] [--repeats 3]
        [--out benchmarks/results/gpu.json]

benchmarks/gpu_check.sh runs it (and bench_scaling's 16-core case) from the offline bundle.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

IMAGES = str(ROOT / "data/mnist/t10k-images-idx3-ubyte.gz")
LABELS = str(ROOT / "data/mnist/t10k-labels-idx1-ubyte.gz")
LR, MOMENTUM = 0.01, 0.9
DEVICE, SCALE = "cuda", 1       # --device cpu --quick: a dry run of the script on a CPU


def fc4096():
    from torch import nn
    return nn.Sequential(nn.Flatten(), nn.Linear(784, 4096), nn.ReLU(),
                         nn.Linear(4096, 4096), nn.ReLU(), nn.Linear(4096, 10))


def srcnn():
    from spark_dl.models import SRCNN
    return SRCNN()


def cnn():
    from spark_dl.models import ThesisCNN
    return ThesisCNN()


def mnist(rows: int, copies: int = 1):
    import numpy as np

    from spark_dl.data import load_mnist
    x, y = load_mnist(IMAGES, LABELS)
    x = x[:rows].astype(np.float32).reshape(rows, 1, 28, 28) / 255
    y = y[:rows].astype(np.int64)
    return np.concatenate([x] * copies), np.concatenate([y] * copies)


def patches(rows: int):
    """Synthetic 33x33 patches and targets (a blurred copy): throughput only."""
    import numpy as np
    rng = np.random.default_rng(0)
    x = rng.random((rows, 1, 33, 33), dtype=np.float32)
    y = (x + np.roll(x, 1, axis=2) + np.roll(x, 1, axis=3)) / 3
    return x, y.astype(np.float32)


def frame(spark, x, y, path: Path, parts: int = 1):
    """(x, y) as a Parquet-backed DataFrame of flat float arrays (and int or array labels)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq
    flat = pa.FixedSizeListArray.from_arrays(pa.array(x.reshape(-1)), int(np.prod(x.shape[1:])))
    lab = pa.array(y) if y.ndim == 1 else \
        pa.FixedSizeListArray.from_arrays(pa.array(y.reshape(-1)), int(np.prod(y.shape[1:])))
    path.mkdir(parents=True, exist_ok=True)
    per = -(-len(x) // parts)
    for i in range(parts):
        sl = slice(i * per, (i + 1) * per)
        pq.write_table(pa.table({"features": flat[sl], "label": lab[sl]}), path / f"p{i}.parquet")
    return spark.read.parquet(str(path))


def plain(model_fn, x, y, batch: int, epochs: int, loss: str, amp: str | None = None):
    """The hand-written loop: rows on the GPU, a permutation per epoch, SGD with momentum."""
    import torch
    torch.manual_seed(0)
    dev = torch.device(DEVICE)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    xs, ys = torch.from_numpy(x).to(dev), torch.from_numpy(y).to(dev)
    model = model_fn().to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    lf = torch.nn.functional.cross_entropy if loss == "cross_entropy" else \
        torch.nn.functional.mse_loss
    dt = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(amp)
    rates = []
    for _ in range(epochs):
        sync()
        t0 = time.perf_counter()
        perm = torch.randperm(len(xs), device=dev)
        for i in range(0, len(xs), batch):
            idx = perm[i:i + batch]
            opt.zero_grad(set_to_none=True)
            with torch.autocast(dev.type, dtype=dt, enabled=dt is not None):
                out = lf(model(xs[idx]), ys[idx])
            out.backward()
            opt.step()
        sync()
        rates.append(len(xs) / (time.perf_counter() - t0))
    return statistics.median(rates[1:])


def fitted(spark, df, model_fn, strategy, batch, epochs, loss, shape, label_shape, runs,
           replicas=1, validation=None):
    from spark_dl import fit
    t0 = time.perf_counter()
    res = fit(df, model_fn, strategy=strategy, shape=shape, label_shape=label_shape,
              num_classes=10 if loss == "cross_entropy" else None, loss=loss, optimizer="sgd",
              lr=LR, momentum=MOMENTUM, epochs=epochs, batch_size=batch, replicas=replicas,
              device=DEVICE, lr_scaling=None, validation=validation,
              run_dir=runs / f"r{time.time_ns()}", log=None, progress=False)
    rates = [h["samples_per_s"] for h in res.history]
    return res, {"steady_samples_per_s": statistics.median(rates[1:] or rates),
                 "wall_s": round(time.perf_counter() - t0, 2)}


def section_one(spark, runs, repeats, out):
    from spark_dl import AllReduce, Downpour
    cases = [("thesis-cnn", cnn, mnist(8000 // SCALE), 128, "cross_entropy", (1, 28, 28), ()),
             ("srcnn-9-5-5", srcnn, patches(8192 // SCALE), 128, "mse", (1, 33, 33), (1, 33, 33))]
    for name, fn, (x, y), batch, loss, shape, lshape in cases:
        df = frame(spark, x, y, runs / f"data-{name}").cache()
        df.count()
        keys = ("allreduce", "downpour", "downpour-no-overlap")
        row = {"net": name, "batch": batch, "rows": len(x), "epochs": 4, "plain": [],
               **{k: [] for k in keys}, "info": {}}
        for _ in range(repeats):                       # interleaved
            row["plain"].append(plain(fn, x, y, batch, 4, loss))
            for key, strat in zip(keys, (AllReduce(), Downpour(), Downpour(overlap=False))):
                try:
                    res, fig = fitted(spark, df, fn, strat, batch, 4, loss, shape, lshape, runs)
                    row[key].append(fig["steady_samples_per_s"])
                    row["info"][key] = {k: res.info.get(k) for k in (
                        "devices", "notes", "transport", "backend", "backend_why",
                        "overlap")}
                except Exception as e:                  # recorded, the others go on
                    row["info"][key] = {"error": f"{type(e).__name__}: {str(e)[:600]}"}
        med = {k: statistics.median(row[k]) if row[k] else None for k in ("plain", *keys)}
        row["median_samples_per_s"] = {k: v and round(v) for k, v in med.items()}
        row["ratio_to_plain"] = {k: med[k] and round(med[k] / med["plain"], 3) for k in keys}
        row["ratio_to_plain_per_repeat"] = {
            k: [round(a / p, 3) for a, p in zip(row[k], row["plain"])] for k in keys}
        out.setdefault("one_replica", []).append(row)
        save(out)
        df.unpersist()


def section_amp(spark, runs, repeats, out, nets=("fc", "srcnn")):
    from spark_dl import AllReduce
    cases = [("fc-784-4096-4096-10", fc4096, mnist(8000 // SCALE, 4), 256, "cross_entropy",
              (1, 28, 28), ()),
             ("srcnn-9-5-5", srcnn, patches(8192 // SCALE), 256, "mse", (1, 33, 33), (1, 33, 33))]
    for name, fn, (x, y), batch, loss, shape, lshape in cases:
        if name.split("-")[0] not in nets:
            continue
        df = frame(spark, x, y, runs / f"amp-{name}").cache()
        df.count()
        row = {"net": name, "batch": batch, "rows": len(x), "epochs": 3,
               **{k: [] for k in ("plain-fp32", "plain-bf16", "fp32", "bf16", "fp16")},
               "errors": {}}
        for _ in range(repeats):
            row["plain-fp32"].append(plain(fn, x, y, batch, 3, loss))
            row["plain-bf16"].append(plain(fn, x, y, batch, 3, loss, "bf16"))
            for key, amp in (("fp32", None), ("bf16", "bf16"), ("fp16", "fp16")):
                try:
                    _, fig = fitted(spark, df, fn, AllReduce(amp=amp), batch, 3, loss, shape,
                                    lshape, runs)
                    row[key].append(fig["steady_samples_per_s"])
                except Exception as e:
                    row["errors"][key] = f"{type(e).__name__}: {str(e)[:600]}"
        med = {k: statistics.median(row[k]) if row[k] else None
               for k in ("plain-fp32", "plain-bf16", "fp32", "bf16", "fp16")}
        row["median_samples_per_s"] = {k: v and round(v) for k, v in med.items()}
        row["speedup_vs_fp32"] = {k: med[k] and med["fp32"] and round(med[k] / med["fp32"], 3)
                                  for k in ("bf16", "fp16")}
        row["plain_bf16_vs_fp32"] = round(med["plain-bf16"] / med["plain-fp32"], 3)
        row["fp32_vs_plain"] = med["fp32"] and round(med["fp32"] / med["plain-fp32"], 3)
        out.setdefault("amp", []).append(row)
        save(out)
        df.unpersist()


def section_shared(spark, runs, out):
    from spark_dl import AllReduce, Boosting, Downpour, Gossip
    x, y = mnist(8000 // SCALE)
    df = frame(spark, x, y, runs / "shared", parts=2)
    vx, vy = (a[8000:] for a in mnist(10000))
    cases = [("allreduce", AllReduce(), cnn, (1, 28, 28), 2),
             ("gossip", Gossip(), cnn, (1, 28, 28), 2),
             ("downpour", Downpour(), cnn, (1, 28, 28), 2),
             ("boosting", Boosting(), cnn, (1, 28, 28), 2),
             # one replica of two model-parallel tasks, both on the GPU
             ("downpour-partitions-2", Downpour(partitions=2), "fc", (784,), 1),
             ("downpour-partitions-2-thesis", Downpour(partitions=2, model_parallel="master"),
              "fc", (784,), 1)]
    for name, strat, fn, shape, replicas in cases:
        row = {"strategy": name, "replicas": replicas, "tasks": 2}
        try:
            res, fig = fitted(spark, df, fn, strat, 64, 2, "cross_entropy", shape, (), runs,
                              replicas=replicas, validation=(vx.reshape(len(vx), *shape), vy))
            row.update(ok=True, **fig, val_accuracy=res.history[-1].get("val_accuracy"),
                       **{k: res.info.get(k) for k in ("devices", "notes", "transport",
                                                      "backend", "backend_why", "world")})
            if res.info.get("workers"):
                row["devices"] = [w.get("device") for w in res.info["workers"]]
                row["notes"] = [w.get("note") for w in res.info["workers"]]
        except Exception as e:
            row.update(ok=False, error=f"{type(e).__name__}: {str(e)[:1500]}",
                       trace=traceback.format_exc()[-1500:])
        out.setdefault("shared_gpu", []).append(row)
        save(out)


# issue 3's leftover: 2x512 with dropout 0.5 reached 1.471 at 2,500 updates, then overfitted
# (gpu.json's char_lstm); these try more regularisation and a weight average side by side
LSTM_CONFIGS = {
    "2x512-d0.5-ema": dict(hidden=512, layers=2, dropout=0.5, ema=0.999),
    "3x512-d0.5-ema": dict(hidden=512, layers=3, dropout=0.5, ema=0.999),
    "2x1024-d0.65-ema": dict(hidden=1024, layers=2, dropout=0.65, ema=0.999),
    "2x768-d0.6-wd-ema": dict(hidden=768, layers=2, dropout=0.6, weight_decay=1e-6, ema=0.999),
}


def lstm_one(name: str, seconds: float, path: str) -> None:
    """One configuration of LSTM_CONFIGS, time-boxed, its result into ``path``."""
    from spark_dl.recipes.charlm import CharConfig, train_char
    from spark_dl.recipes.common import RunConfig
    cfg = CharConfig(corpus=str(ROOT / "data/text/tinyshakespeare.txt"), seq_len=1000,
                     tbptt=100, batch_size=128, optimizer="adam", lr=2e-3, lr_decay=0.95,
                     updates=10**6, time_budget_s=seconds, eval_every=250,
                     run=RunConfig(device=DEVICE), **LSTM_CONFIGS[name])
    res = train_char(cfg, log=lambda m: print(f"[{name}] {m}", flush=True))
    res["config"] = name
    res["best_val_loss"] = min(min(c["val_loss"], c.get("val_loss_ema", c["val_loss"]))
                               for c in res["curve"])
    Path(path).write_text(json.dumps(res, default=str))


def section_lstm(seconds, out, names=None):
    """The configurations at once, one process each (the GPU is far from full with one)."""
    import subprocess
    names = names or list(LSTM_CONFIGS)
    tmp = Path(tempfile.mkdtemp(prefix="lstm-"))
    procs = {n: subprocess.Popen([sys.executable, __file__, "--lstm-one", n, "--lstm-seconds",
                                  str(seconds), "--device", DEVICE, "--out", str(tmp / n)])
             for n in names}
    results = {}
    for n, proc in procs.items():
        rc = proc.wait()
        f = tmp / n
        results[n] = json.loads(f.read_text()) if f.exists() else {"error": f"exit {rc}"}
    ok = {n: r for n, r in results.items() if "best_val_loss" in r}
    best = min(ok, key=lambda n: ok[n]["best_val_loss"]) if ok else None
    out["char_lstm_configs"] = {"parallel_processes": len(names), "seconds_each": seconds,
                                "results": results, "best": best}
    if best:
        out["char_lstm"] = ok[best]
    save(out)


OUT: Path | None = None


def save(out):
    OUT.parent.mkdir(parents=True, exist_ok=True)
    tmp = OUT.with_suffix(".tmp")
    tmp.write_text(json.dumps(out, indent=1, default=str))
    os.replace(tmp, OUT)


def main(argv=None):
    global OUT, DEVICE, SCALE  # noqa: PLW0603 (a script's settings)
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--sections", default="one,amp,shared,lstm")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--lstm-seconds", type=float, default=120.0)
    ap.add_argument("--amp-nets", default="fc,srcnn")
    ap.add_argument("--lstm-configs", default="", help="names in LSTM_CONFIGS (default: all)")
    ap.add_argument("--lstm-one", default="", help=argparse.SUPPRESS)
    ap.add_argument("--master", default="local[4]")
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/gpu.json"))
    ap.add_argument("--append", action="store_true", help="add to --out's sections")
    ap.add_argument("--device", default="cuda", help="cpu: a dry run of this script")
    ap.add_argument("--quick", action="store_true", help="an eighth of the rows (dry runs)")
    args = ap.parse_args(argv)
    DEVICE, SCALE = args.device, 8 if args.quick else 1
    if args.lstm_one:                             # a child process of section_lstm
        lstm_one(args.lstm_one, args.lstm_seconds, args.out)
        return
    OUT = Path(args.out)
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("SPARK_CONF_DIR", str(ROOT / "conf/logging"))
    import torch
    if DEVICE == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu_check needs a CUDA device: torch sees none here")
    out = json.loads(OUT.read_text()) if OUT.exists() and args.append else {}
    out.update({"date": time.strftime("%Y-%m-%d %H:%M"),
                "device": torch.cuda.get_device_name(0) if DEVICE == "cuda" else "cpu",
                "torch": torch.__version__, "cpus": os.cpu_count(), "repeats": args.repeats,
                "command": "benchmarks/gpu_check.py " + " ".join(argv or sys.argv[1:]),
                "sections_done": out.get("sections_done", []), "section_errors": {}})
    runs = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    spark = None
    for section in args.sections.split(","):
        t0 = time.perf_counter()
        try:
            if section == "lstm":
                section_lstm(args.lstm_seconds, out,
                             args.lstm_configs.split(",") if args.lstm_configs else None)
                continue
            if spark is None:
                from spark_dl import get_session
                spark = get_session("local", master=args.master)
            if section == "one":
                section_one(spark, runs, args.repeats, out)
            elif section == "amp":
                section_amp(spark, runs, args.repeats, out, args.amp_nets.split(","))
            elif section == "shared":
                section_shared(spark, runs, out)
            else:
                raise SystemExit(f"unknown section {section!r}")
        except Exception as e:
            out["section_errors"][section] = traceback.format_exc()[-3000:]
            print(f"section {section} failed: {e}", flush=True)
        finally:
            out["sections_done"].append({"section": section,
                                         "seconds": round(time.perf_counter() - t0, 1)})
            save(out)
            print(f"section {section}: {time.perf_counter() - t0:.0f} s", flush=True)
    print(json.dumps(out, default=str)[:6000])


if __name__ == "__main__":
    main()
