"""Ray Train on Ray-on-Spark: the peer bench_run.py runs beside TorchDistributor and
spark_dl.run. Runs inside .venv-ray (benchmarks/setup_ray.sh) as a long-lived process with
its own Spark session (local[2]) and a Ray cluster on it (ray.util.spark.setup_ray_cluster:
two worker nodes of 1 CPU, Spark's local mode having no stage scheduling), started once and timed apart; then, for every line read on stdin,
one TorchTrainer fit of _common.ddp_train on 2 workers, printed as one JSON line
({"steady_samples_per_s", "wall_s"} or {"error"}).

    .venv-ray/bin/python benchmarks/ray_peer.py ROWS EPOCHS BATCH LR MOMENTUM
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from _common import IMAGES, LABELS  # noqa: E402


def main(argv):
    rows, epochs, batch = (int(a) for a in argv[:3])
    lr, momentum = float(argv[3]), float(argv[4])
    os.environ["PYSPARK_PYTHON"] = sys.executable
    # Ray-on-Spark starts its nodes with the `ray` script found on PATH: this venv's
    os.environ["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), os.environ["PATH"]])
    # Ray's worker processes start under Spark's, which start under this one: they import
    # _common (and spark_dl) from here
    os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT / "benchmarks"), str(ROOT)])
    os.environ.setdefault("SPARK_CONF_DIR", str(ROOT / "conf/logging"))
    t0 = time.perf_counter()
    import ray
    from _common import ddp_train
    from pyspark.sql import SparkSession
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer
    from ray.util.spark import setup_ray_cluster, shutdown_ray_cluster

    spark = (SparkSession.builder.master("local[2]").appName("ray-peer")
             .config("spark.ui.enabled", "false")
             .config("spark.task.maxFailures", "1").getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    # local mode has no stage scheduling: a Ray worker node per Spark task of 1 core
    setup_ray_cluster(max_worker_nodes=2, min_worker_nodes=2,
                      object_store_memory_worker_node=256 << 20)
    ray.init(ignore_reinit_error=True)
    startup = time.perf_counter() - t0
    print(json.dumps({"ready": True, "startup_s": startup, "ray": ray.__version__}),
          flush=True)

    def loop(config):
        import ray.train
        out_file = config.pop("out_file")
        out = ddp_train(**config)
        if ray.train.get_context().get_world_rank() == 0:   # (Ray 2.60 keeps no metrics
            Path(out_file).write_text(json.dumps(            # reported without a checkpoint)
                {"epoch_seconds": out["epoch_seconds"],
                 "samples_per_rank": out["samples_per_rank"]}))
        ray.train.report({"epoch_seconds": out["epoch_seconds"],
                          "samples_per_rank": out["samples_per_rank"]})

    for line in sys.stdin:
        if line.strip() == "quit":
            break
        t = time.perf_counter()
        out_file = Path("/tmp") / f"ray-peer-{os.getpid()}-{time.time_ns()}.json"
        try:
            trainer = TorchTrainer(
                loop, train_loop_config={"images": IMAGES, "labels": LABELS, "rows": rows,
                                         "epochs": epochs, "batch": batch, "lr": lr,
                                         "momentum": momentum, "out_file": str(out_file)},
                scaling_config=ScalingConfig(num_workers=2, use_gpu=False,
                                             resources_per_worker={"CPU": 1}),
                run_config=RunConfig(storage_path=str(Path("/tmp") / "ray-peer-results")))
            trainer.fit()
            secs = json.loads(out_file.read_text())["epoch_seconds"]
            out_file.unlink()
            print(json.dumps({"steady_samples_per_s": rows / statistics.median(secs[1:]),
                              "wall_s": time.perf_counter() - t}), flush=True)
        except Exception as e:
            print(json.dumps({"error": f"{type(e).__name__}: {str(e)[:500]}",
                              "wall_s": time.perf_counter() - t}), flush=True)
    shutdown_ray_cluster()
    spark.stop()


if __name__ == "__main__":
    main(sys.argv[1:])
