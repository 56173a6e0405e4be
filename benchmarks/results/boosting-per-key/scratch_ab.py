"""The A/B of README.md, as run (2026-11-29 13:14-13:17): Boosting's per-key code before
("old") and after ("new"), seed by seed in turns, 1 and 2 workers on local[2]. It needs the
scratch edit of the task that README.md describes (not in the repository): the tasks read
/tmp/s68/mode at start. Arguments: strategy, repeats, first seed, epochs, output file."""
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]          # the repository
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))
os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
os.environ.setdefault("SPARK_CONF_DIR", str(ROOT / "conf/logging"))
import bench_scaling as bs  # noqa: E402

from spark_dl import fit, get_session  # noqa: E402
from spark_dl.strategies import make_strategy  # noqa: E402

name, reps, seed0, epochs, out = (sys.argv[1], int(sys.argv[2]), int(sys.argv[3]),
                                  float(sys.argv[4]), sys.argv[5])
spark = get_session("local", master="local[2]")
data = Path("/tmp/s68/data/extended")
val = bs.make_data(spark, 48000, data)
df = spark.read.parquet(data.as_uri())
rows = []
for i in range(reps):
    seed = seed0 + i
    for mode in (("old", "new") if i % 2 == 0 else ("new", "old")):
        with open("/tmp/s68/mode", "w") as f:
            f.write(mode)
        for r in (1, 2):
            res = fit(df, "cnn", strategy=make_strategy(name), shape=(1, 28, 28),
                      num_classes=10, optimizer="sgd", lr=0.02, lr_decay=0.5, momentum=0.9,
                      epochs=int(epochs), batch_size=16, replicas=r, threads=1,
                      validation=val, seed=seed, device="cpu", validate_every=0.25,
                      run_dir=Path(f"/tmp/s68/runs/{name}-{r}-{time.time()}"), log=None,
                      progress=False)
            ev = res.info["evals"]
            row = {"seed": seed, "mode": mode, "replicas": r,
                   "sps": statistics.median(h["samples_per_s"] for h in res.history),
                   "task_s": [w["task_seconds"] for w in res.info["workers"]],
                   "t98": bs.first_at(ev, 0.98),
                   "e98": next((e["epoch"] for e in ev if e.get("val_accuracy", 0) >= 0.98),
                               None),
                   "final": res.history[-1].get("val_accuracy"),
                   "time": time.strftime("%H:%M:%S")}
            rows.append(row)
            print(json.dumps(row), flush=True)
            with open(out, "w") as f:
                json.dump(rows, f, indent=1)
for r in (1, 2):
    for mode in ("old", "new"):
        x = [z for z in rows if z["replicas"] == r and z["mode"] == mode]
        print(r, mode, "samples/s median", round(statistics.median(z["sps"] for z in x)),
              "time to 98% median", statistics.median([z["t98"] or 99 for z in x]))
