"""Try every bad input and fault we know of against spark_dl.fit on local[2], and write what the
user gets (the exception, its message, the seconds it took, what was left) to
docs/bad_inputs.md.

    .venv/bin/python scripts/bad_inputs.py [--out docs/bad_inputs.md] [--only SUBSTRING]

Each case builds its own small DataFrame (12 features, labels 0..2, two partitions) and run
directory; "nothing lost" is checked where something could be: a run directory's checkpoint
and config are byte-for-byte what they were before the failing call.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SCHEMA = "features array<float>, label long"


def _data(n=48, seed=0):
    g = np.random.default_rng(seed)
    x = g.normal(size=(n, 12)).astype(np.float32)
    return x, x[:, :3].argmax(1).astype(np.int64)


def _frame(spark, x, y, parts=2, schema=SCHEMA, rows=None):
    """``parts`` partitions of (x, y) as array<float> rows (or ``rows(x, y)`` -> pyarrow)."""
    from spark_dl.data import arrays_to_arrow
    bounds = np.linspace(0, len(x), parts + 1).astype(int)
    make = rows or arrays_to_arrow

    def gen(batches):
        for b in batches:
            for i in b.column("id").to_numpy():
                lo, hi = bounds[i], bounds[i + 1]
                if hi > lo:
                    yield make(x[lo:hi], y[lo:hi])
    return spark.range(parts, numPartitions=parts).mapInArrow(gen, schema)


def _ragged(x, y):
    import pyarrow as pa
    feats = [list(r[: 12 if i % 5 else 7]) for i, r in enumerate(x)]
    return pa.RecordBatch.from_pydict({"features": feats, "label": y.tolist()},
                                      schema=pa.schema([("features", pa.list_(pa.float32())),
                                                        ("label", pa.int64())]))


def _nulls(x, y):
    import pyarrow as pa
    feats = [None if i == 3 else list(r) for i, r in enumerate(x)]
    return pa.RecordBatch.from_pydict({"features": feats, "label": y.tolist()},
                                      schema=pa.schema([("features", pa.list_(pa.float32())),
                                                        ("label", pa.int64())]))


def _fc(out=3):
    from spark_dl.models.fc import FCNet
    return lambda: FCNet((12, 9, out))


def _task1_step_is(model, at: int) -> bool:
    """Counts ``model``'s training forwards in task 1 (``model.calls``): True at the ``at``-th."""
    from pyspark import TaskContext
    ctx = TaskContext.get()
    if not (model.training and ctx is not None and ctx.partitionId() == 1):
        return False
    model.calls += 1
    return model.calls == at


class _Explodes:
    """A model factory whose model raises ``exc`` in training step ``at`` of task 1."""

    def __init__(self, exc, at=3):
        self.exc, self.at = exc, at

    def __call__(self):
        import torch

        from spark_dl.models.fc import FCNet
        exc, at = self.exc, self.at

        class M(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.net, self.calls = FCNet((12, 9, 3)), 0

            def forward(self, x):
                if _task1_step_is(self, at):
                    raise exc("raised by the user's model")
                return self.net(x)
        return M()


def _bn_fc(reshape_at=None):
    """FC 12-9-3 with a BatchNorm (running statistics and an int64 num_batches_tracked);
    ``reshape_at``: at that training step of task 1 the model replaces its running_var with
    one of another shape (a buffer that changes shape mid-fit)."""
    def make():
        import torch

        class M(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.net = torch.nn.Sequential(torch.nn.Linear(12, 9), torch.nn.BatchNorm1d(9),
                                               torch.nn.ReLU(), torch.nn.Linear(9, 3))
                self.calls = 0

            def forward(self, x):
                if reshape_at and _task1_step_is(self, reshape_at):
                    bn = self.net[1]
                    bn.track_running_stats = False
                    bn.running_var = torch.ones(4)
                return self.net(x)
        return M()
    return make


def _locked_fc():
    """A model factory that holds a lock (which pickle refuses)."""
    import threading
    lock, make = threading.Lock(), _fc()

    def locked_fc():
        with lock:
            return make()
    return locked_fc


def _bad_loss(out, y):
    raise ValueError("the user's loss refused this batch")


def _bad_transform(x, y):
    raise KeyError("the user's transform looked up a missing key")


def cases(spark, tmp: Path):
    """(name, what it is, call) for every case; call(run_dir) -> anything."""
    from spark_dl import AllReduce, Boosting, Downpour, Gossip, fit
    x, y = _data()
    df = _frame(spark, x, y)
    fc = _fc()
    kw = dict(log=None, progress=False, batch_size=8, timeout_s=60)

    def f(**more):
        return lambda rd: fit(more.pop("df", df), more.pop("model", fc), run_dir=rd,
                              **{**kw, **more})

    def made(rd, **more):                # a finished run in ``rd`` to resume or protect
        fit(df, fc, run_dir=rd, **{**kw, **more})

    def corrupt(prev: bool):
        def prepare(rd):
            made(rd, epochs=2)
            (rd / "checkpoint.pt").write_bytes(b"truncated")
            if not prev:
                (rd / "checkpoint.prev.pt").write_bytes(b"also bad")
        return prepare

    empty = df.limit(0)
    yield "unknown fit() argument", "fit(..., epochz=3)", f(epochz=3)
    yield "a strategy's option given to fit", "fit(..., n_push=4)", f(n_push=4)
    yield "unknown strategy name", "strategy='ring'", f(strategy="ring")
    yield "unknown strategy option", "Downpour(n_pushes=4)", \
        lambda rd: fit(df, fc, strategy=Downpour(n_pushes=4), run_dir=rd, **kw)
    yield "bad strategy option value", "Downpour(mode='fast')", \
        lambda rd: fit(df, fc, strategy=Downpour(mode="fast"), run_dir=rd, **kw)
    yield "gossip alpha out of (0, 1]", "Gossip(alpha=0)", \
        lambda rd: fit(df, fc, strategy=Gossip(alpha=0), run_dir=rd, **kw)
    yield "gossip of one replica", "Gossip(), replicas=1", \
        f(strategy=Gossip(), replicas=1)
    yield "gossip with model parallelism", "Gossip with partitions=2", \
        f(strategy="gossip", partitions=2)
    yield "amp with float64", "AllReduce(amp='bf16'), dtype='float64'", \
        f(strategy=AllReduce(amp="bf16"), dtype="float64")
    yield "unknown balance", "AllReduce(balance='fastest')", \
        lambda rd: fit(df, fc, strategy=AllReduce(balance="fastest"), run_dir=rd, **kw)
    yield "balance shares for other replicas", "AllReduce(balance=[1, 1, 1]), 2 replicas", \
        f(strategy=AllReduce(balance=[1, 1, 1]))
    yield "unknown balance_rows", "AllReduce(balance='speed', balance_rows='shuffle')", \
        lambda rd: fit(df, fc, strategy=AllReduce(balance="speed", balance_rows="shuffle"),
                       run_dir=rd, **kw)
    yield "boosting key of no batches", "Boosting(n_push=0)", \
        lambda rd: fit(df, fc, strategy=Boosting(n_push=0), run_dir=rd, **kw)
    yield "boosting: fewer keys than workers", \
        "Boosting(n_push=6), 1 partition of 48 rows = 1 key, replicas=2", \
        f(df=df.coalesce(1), strategy=Boosting(n_push=6), replicas=2)
    yield "unknown optimizer", "optimizer='sgdd'", f(optimizer="sgdd")
    yield "L-BFGS under Downpour", "optimizer='lbfgs', strategy='downpour'", \
        f(optimizer="lbfgs", strategy="downpour")
    yield "learning rate <= 0", "lr=0", f(lr=0)
    yield "momentum of 1 or more", "momentum=1", f(momentum=1)
    yield "unknown lr_scaling", "lr_scaling='cubic'", f(lr_scaling="cubic")
    yield "negative warmup", "warmup_epochs=-1", f(warmup_epochs=-1)
    yield "warmup longer than the fit", "warmup_epochs=3, epochs=2", \
        f(warmup_epochs=3, epochs=2)
    yield "negative gradient clip", "grad_clip=-1", f(grad_clip=-1)
    yield "Nesterov without momentum", "nesterov=True, momentum=0", \
        f(nesterov=True, momentum=0)
    yield "Nesterov under Downpour", "nesterov=True, momentum=0.9, strategy='downpour'", \
        f(nesterov=True, momentum=0.9, strategy="downpour")
    yield "negative average", "AllReduce(average=-1)", \
        lambda rd: fit(df, fc, strategy=AllReduce(average=-1), run_dir=rd, **kw)
    yield "zero epochs", "epochs=0", f(epochs=0)
    yield "zero batch size", "batch_size=0", f(batch_size=0)
    yield "bad dtype", "dtype='float16'", f(dtype="float16")
    yield "bad device", "device='tpu'", f(device="tpu")
    yield "bad data mode", "data='disk'", f(data="disk")
    yield "bad shuffle buffer", "shuffle_buffer='lots'", f(shuffle_buffer="lots")
    yield "unknown loss", "loss='hinge'", f(loss="hinge")
    yield "transform not callable", "transform=3", f(transform=3)
    yield "missing feature column", "features='pixels'", f(features="pixels")
    yield "missing label column", "label='target'", f(label="target")
    yield "more replicas than task slots", "replicas=8 on local[2]", f(replicas=8)
    yield "replicas 0", "replicas=0", f(replicas=0)
    yield "unknown tracker", "track='wandb'", f(track="wandb")
    yield "stage resources of an unknown kind", "resources={'cores': 4}", \
        f(resources={"cores": 4})
    yield "stage resources in local mode", "resources={'cpus': 2} on local[2]", \
        f(resources={"cpus": 2})
    yield "unknown model name", "model='resnet'", f(model="resnet")
    yield "model factory returns no module", "model=lambda: {'w': 1}", \
        f(model=lambda: {"w": 1})
    yield "model factory raises", "model=lambda: FCNet((12, 1 // 0))", \
        f(model=lambda: 1 // 0)
    yield "model factory that cannot be pickled", "a factory holding a threading.Lock", \
        f(model=_locked_fc())
    yield "model takes other rows", "FCNet((12, ...)) with shape=(3, 5)", f(shape=(3, 5))
    yield "model outputs != num_classes", "2 outputs, num_classes=3", \
        f(model=_fc(2), num_classes=3)
    yield "validation labels beyond outputs", "2 outputs, validation labels 0..2", \
        f(model=_fc(2), validation=(x, y))
    yield "training labels beyond outputs", "2 outputs, labels 0..2, no num_classes", \
        f(model=_fc(2))
    yield "training labels beyond outputs (Downpour)", "as above, strategy='downpour'", \
        f(model=_fc(2), strategy="downpour")
    yield "labels beyond num_classes", "num_classes=2, labels 0..2", \
        f(model=_fc(2), num_classes=2, shape=(12,))
    yield "validation rows of another shape", "validation x (3, 4), shape=(12,)", \
        f(shape=(12,), validation=(np.zeros((3, 4)), y[:3]))
    yield "validation x and y lengths differ", "validation (48 rows, 47 labels)", \
        f(validation=(x, y[:-1]))
    yield "NaN in validation", "validation x with a NaN", \
        f(validation=(np.where(np.arange(x.size).reshape(x.shape) == 5, np.nan, x), y))
    yield "validation not a pair", "validation=x", f(validation=x)
    yield "empty DataFrame", "df.limit(0)", f(df=empty)
    yield "NaN in the training rows", "one feature NaN", \
        f(df=_frame(spark, np.where(np.arange(x.size).reshape(x.shape) == 40, np.nan, x), y))
    yield "ragged rows", "every 5th row has 7 features, not 12", \
        f(df=_frame(spark, x, y, rows=_ragged))
    yield "null feature row", "row 3's features null", \
        f(df=_frame(spark, x, y, rows=_nulls))
    yield "string features", "features column of strings", \
        f(df=df.selectExpr("cast(features as string) as features", "label"))
    yield "float labels for cross_entropy", "label 0.5, 1.5 ...", \
        f(df=df.selectExpr("features", "label + 0.5 as label"))
    yield "double labels that are not whole", "labels 0.5, 1.5, 2.5 as doubles", \
        f(df=df.selectExpr("features", "cast(label as double) + 0.5 as label"))
    yield "double labels beyond num_classes", "labels 0.0..2.0 as doubles, num_classes=2", \
        f(df=df.selectExpr("features", "cast(label as double) as label"), model=_fc(2),
          num_classes=2)
    yield "string labels", "labels 'c0', 'c1', 'c2'", \
        f(df=df.selectExpr("features", "concat('c', cast(label as string)) as label"))
    yield "unwritable run directory", "run_dir under a file", \
        lambda rd: fit(df, fc, run_dir=tmp / "a-file" / "run", **kw)
    yield "run directory of another model", "resume a run of FC 12-9-3 with FC 12-9-4", \
        f(model=_fc(4)), made
    yield "run directory of another strategy", "resume an allreduce run with gossip", \
        f(strategy="gossip"), made
    yield "truncated checkpoint, previous good", "checkpoint.pt cut, then resume", \
        f(epochs=3), corrupt(True)
    yield "truncated checkpoint, no good previous", "both checkpoints unreadable", \
        f(epochs=3), corrupt(False)
    for name, strategy in (("allreduce", "allreduce"), ("downpour", "downpour"),
                           ("gossip", Gossip(alpha=0.5))):
        yield f"model raises mid-fit ({name})", "ZeroDivisionError at step 3 of task 1", \
            f(model=_Explodes(ZeroDivisionError), strategy=strategy, epochs=2)
    yield "buffers not floating point (parameter server)", \
        "BatchNorm (int64 num_batches_tracked), strategy='downpour', 2 replicas", \
        f(model=_bn_fc(), strategy="downpour", epochs=2)
    yield "a buffer that changes shape mid-fit (parameter server)", \
        "task 1 replaces running_var by 4 values at step 3, strategy='downpour'", \
        f(model=_bn_fc(reshape_at=3), strategy="downpour", epochs=2)
    yield "user loss raises", "loss=function raising ValueError", f(loss=_bad_loss)
    yield "user transform raises", "transform=function raising KeyError", \
        f(transform=_bad_transform)


def _snapshot(rd: Path) -> dict:
    if not rd.exists():
        return {}
    return {p.name: p.read_bytes() for p in rd.iterdir()
            if p.name in ("checkpoint.pt", "checkpoint.prev.pt", "config.json")}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default=str(ROOT / "docs" / "bad_inputs.md"))
    ap.add_argument("--only", default="")
    args = ap.parse_args(argv)
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("SPARK_CONF_DIR", str(ROOT / "conf/logging"))
    from spark_dl import TaskError, get_session
    load = os.getloadavg()[0]
    spark = get_session("local", master="local[2]",
                        conf={"spark.sql.shuffle.partitions": "2",
                              "spark.default.parallelism": "2"})
    tmp = Path(tempfile.mkdtemp(prefix="bad-inputs-"))
    (tmp / "a-file").write_text("not a directory")
    rows = []
    for i, (name, what, call, *prepare) in enumerate(cases(spark, tmp)):
        if args.only and args.only not in name:
            continue
        rd = tmp / f"case-{i}"
        for p in prepare:
            p(rd)
        before = _snapshot(rd)
        t0 = time.perf_counter()
        try:
            res = call(rd)
            outcome, message = "completed", (
                f"history epochs {[h['epoch'] for h in res.history]}" if res else "")
        except Exception as e:
            outcome, message = type(e).__name__, str(e).split("\n")[0]
            if isinstance(e, TaskError):                 # raised in a task
                outcome += " (TaskError)"
        secs = time.perf_counter() - t0
        if before and outcome != "completed":           # a refused resume keeps the run
            kept = _snapshot(rd) == before
            message += "" if kept else " [THE RUN DIRECTORY CHANGED]"
        rows.append((name, what, outcome, message, secs))
        print(f"{secs:6.1f} s  {name}: {outcome}: {message[:160]}", flush=True)
    spark.stop()
    lines = ["# Bad inputs and faults: what the user gets", "",
             (f"`scripts/bad_inputs.py` on local[2] "
              f"(load average {load:.1f} on {os.cpu_count()} cores at the start): "
              f"{len(rows)} cases, each a fit on 48 rows of 12 features in two partitions. "
              "\"seconds\" is from the call to the exception or the end of the fit (the run "
              "directories to resume were made before the clock started); where a run "
              "directory was refused, its checkpoints and config.json are checked unchanged "
              "byte for byte (a change would be flagged in the message). Worker and executor kills are in "
              "the cluster tests (`tests/cluster/test_clusters.py`): Spark retries them and the "
              "fit resumes from its checkpoint."), "",
             "| # | input or fault | how | outcome | message (first line) | seconds |",
             "| ---: | --- | --- | --- | --- | ---: |"]
    for i, (name, what, outcome, message, secs) in enumerate(rows, 1):
        message = message.replace("|", "\\|")
        if len(message) > 400:
            message = message[:400] + " …"
        lines.append(f"| {i} | {name} | `{what}` | {outcome} | {message} | "
                     f"{secs:.1f} |")
    slow = [r for r in rows if r[4] > 15 and r[2] != "completed"]
    lines += ["", f"Slower than 15 s: {len(slow)}" + (
        ": " + ", ".join(r[0] for r in slow) if slow else "."), ""]
    if not args.only:
        Path(args.out).write_text("\n".join(lines))
    return 0 if not slow else 1


if __name__ == "__main__":
    sys.exit(main())
