import sys, time, os, json, statistics
from pathlib import Path
sys.path.insert(0, "/work/main/benchmarks"); sys.path.insert(0, "/work/main")
os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
os.environ.setdefault("SPARK_CONF_DIR", "/work/main/conf/logging")
import bench_scaling as bs
from spark_dl import get_session, fit
from spark_dl.strategies import make_strategy
name, reps, seed0, epochs, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]), sys.argv[5]
spark = get_session("local", master="local[2]")
data = Path("/tmp/s68/data/extended")
val = bs.make_data(spark, 48000, data)
df = spark.read.parquet(data.as_uri())
rows = []
for i in range(reps):
    seed = seed0 + i
    for mode in (("old", "new") if i % 2 == 0 else ("new", "old")):
        open("/tmp/s68/mode", "w").write(mode)
        for r in (1, 2):
            res = fit(df, "cnn", strategy=make_strategy(name), shape=(1,28,28), num_classes=10, optimizer="sgd", lr=0.02, lr_decay=0.5,
                      momentum=0.9, epochs=int(epochs), batch_size=16, replicas=r, threads=1, validation=val, seed=seed, device="cpu",
                      validate_every=0.25, run_dir=Path(f"/tmp/s68/runs/{name}-{r}-{time.time()}"), log=None, progress=False)
            ev = res.info["evals"]
            t98 = bs.first_at(ev, 0.98)
            e98 = next((e["epoch"] for e in ev if e.get("val_accuracy", 0) >= 0.98), None)
            row = {"seed": seed, "mode": mode, "replicas": r, "sps": statistics.median(h["samples_per_s"] for h in res.history),
                   "task_s": [w["task_seconds"] for w in res.info["workers"]], "t98": t98, "e98": e98,
                   "final": res.history[-1].get("val_accuracy"), "time": time.strftime("%H:%M:%S")}
            rows.append(row); print(json.dumps(row), flush=True)
            json.dump(rows, open(out, "w"), indent=1)
for r in (1, 2):
    for mode in ("old", "new"):
        x = [z for z in rows if z["replicas"] == r and z["mode"] == mode]
        print(r, mode, "sps median", round(statistics.median(z["sps"] for z in x)), "t98 median", statistics.median([z["t98"] or 99 for z in x]))
