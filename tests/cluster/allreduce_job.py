"""spark-submit job for the slow tier: the engines on a real multi-executor cluster.

    spark-submit --properties-file conf/spark/local-cluster.conf allreduce_job.py OUT RUNS \
        [--device auto|cpu|cuda] [--fits clean,faulty] [--epochs 3]
        [--strategy allreduce|downpour|gossip|boosting]
        [--optimizer adam] [--lr 0.003] [--momentum 0] [--lr-decay 1] [--batch-size 32]
        [--model cnn|fc] [--partitions 1] [--replicas N] [--kill-at WORKER:FORWARD]
        [--probe PROBE_OUT] [--gpu-fits auto,resources,cuda] [--resources CPUS]

Trains the thesis CNN on the first 8,000 shipped MNIST digits (two shards of 4,000, built in
the executors from the file) and validates on the last 2,000; one fit per name in --fits,
each in RUNS/<name>. Writes {"fits": {name: {history, info}}} or {"error": ...} to OUT.

--kill-at W:F: in the fit named "faulty", the task of partition W SIGKILLs its own Python
worker at its F-th training forward, in its first attempt only: a kill at a point fixed by
the training itself (mid-step, e.g. while a Boosting worker holds a key's lease), not by
when the test's poll happens to run.

--gpu-fits NAMES: after --fits, GPU scheduling's fits: AllReduce, the FC net, one epoch on
the first 1,000 digits, each on the device its name says ("auto", "cuda"); the one named
"resources" with resources={"cpus": --resources} (its stage's task profile; the GPUs as the
application's) and one torch thread per task (two tasks of CPUS threads would oversubscribe
a small test machine), after which the report adds "app_task_cpus": the cores the tasks of
a plain stage get. A fit of these that raises is reported as {"error": ...} under its name.

--probe PROBE_OUT: first run partition_probe.py's probe (which executor trained which
partition) in this job's session and write its report to PROBE_OUT: one local-cluster
start for all of them.
"""

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

IMAGES = str(ROOT / "data/mnist/t10k-images-idx3-ubyte.gz")
LABELS = str(ROOT / "data/mnist/t10k-labels-idx1-ubyte.gz")


def _still_open(served: dict) -> list[str]:
    """What the fit served (its channel, its parameter server) and still accepts connections."""
    import socket
    open_ = []
    for name, (host, port) in served.items():
        try:
            socket.create_connection((host, port), timeout=1).close()
            open_.append(f"{name} {host}:{port}")
        except OSError:
            pass
    return open_


def _kills_itself(model: str, victim: int, at: int):
    """A factory of ``model`` whose forward SIGKILLs its own process at the ``at``-th training
    forward of partition ``victim``'s first task attempt (a no-op on the driver)."""
    def factory():
        from spark_dl.models import build_model
        net = build_model(model)
        calls = [0]

        def hook(module, inputs):
            import os
            import signal

            from pyspark import TaskContext
            ctx = TaskContext.get()
            if not module.training or ctx is None or ctx.partitionId() != victim or \
                    ctx.attemptNumber() != 0:
                return
            calls[0] += 1
            if calls[0] == at:
                os.kill(os.getpid(), signal.SIGKILL)
        net.register_forward_pre_hook(hook)
        return net
    return factory


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("runs")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--fits", default="clean")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--strategy", default="allreduce")
    ap.add_argument("--optimizer", default="adam")
    ap.add_argument("--lr", type=float, default=0.003)
    ap.add_argument("--momentum", type=float, default=0.0)
    ap.add_argument("--lr-decay", type=float, default=1.0)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--model", default="cnn")
    ap.add_argument("--partitions", type=int, default=1)
    ap.add_argument("--replicas", type=int, default=None)
    ap.add_argument("--staleness", default=None, help="downpour: the server's staleness rule")
    ap.add_argument("--data", default="auto", help="fit's data: auto, memory or stream")
    ap.add_argument("--kill-at", default=None, help="W:F, see the module's docstring")
    ap.add_argument("--probe", default=None, help="partition_probe.py's report, written first")
    ap.add_argument("--gpu-fits", default="", help="GPU scheduling's fits, after --fits")
    ap.add_argument("--resources", type=int, default=2,
                    help="the 'resources' GPU fit's cores per task")
    args = ap.parse_args()

    from spark_dl import fit, get_session
    from spark_dl.data import load_mnist, mnist_file_dataframe
    from spark_dl.strategies import make_strategy
    spark = get_session()
    if args.probe:
        # run_path: a module outside sys.modules, so that its task is pickled by value
        import runpy
        probe = runpy.run_path(str(Path(__file__).with_name("partition_probe.py")),
                               run_name="partition_probe")["probe"]
        probe(spark, args.probe)
    x, y = load_mnist(IMAGES, LABELS)
    validation = (x[-2000:].reshape(2000, -1) / 255.0, y[-2000:])
    report = {"master": spark.sparkContext.master, "fits": {}}

    def one_fit(name, strategy, model, arch, rows, **kw):
        res = fit(mnist_file_dataframe(spark, IMAGES, LABELS, 0, rows), model,
                  strategy=strategy, shape=(1, 28, 28) if arch == "cnn" else (784,),
                  num_classes=10, optimizer=args.optimizer, lr=args.lr,
                  batch_size=args.batch_size, validation=validation,
                  run_dir=Path(args.runs) / name, **kw)
        report["fits"][name] = {"history": res.history, "info": res.info,
                                "still_open": _still_open(res.info["served"])}

    try:
        for name in args.fits.split(","):
            options = {} if args.partitions == 1 else {"partitions": args.partitions}
            if args.staleness is not None:
                options["staleness"] = args.staleness
            strategy = make_strategy(args.strategy, **options)    # e.g. Downpour(partitions=2)
            model = args.model
            if args.kill_at and name == "faulty":
                victim, at = map(int, args.kill_at.split(":"))
                model = _kills_itself(args.model, victim, at)
            one_fit(name, strategy, model, args.model, 8000, epochs=args.epochs,
                    replicas=args.replicas, momentum=args.momentum, lr_decay=args.lr_decay,
                    device=args.device, data=args.data)
            if args.strategy in ("downpour", "boosting"):
                versions = [json.loads(line) for line in
                            (Path(args.runs) / name / "metrics.jsonl").read_text().splitlines()]
                report["fits"][name]["server_versions_per_epoch"] = [
                    sum(m["server_versions"]) for m in versions
                    if m.get("type") == "server_epoch"]
    except Exception as e:                      # reported to the test, which asserts on it
        report["error"] = f"{type(e).__name__}: {e}"
    for name in args.gpu_fits.split(",") if args.gpu_fits and "error" not in report else ():
        profile = name == "resources"
        try:
            one_fit(name, "allreduce", "fc", "fc", 1000, epochs=1,
                    device="auto" if profile else name,
                    resources={"cpus": args.resources} if profile else None,
                    threads=1 if profile else 0)
        except Exception as e:                  # the test asserts on it
            report["fits"][name] = {"error": f"{type(e).__name__}: {e}"}
        if profile:                 # the application's own task profile, after the fit
            report["app_task_cpus"] = [r.cpus for r in spark.range(2, numPartitions=2)
                                       .mapInArrow(_task_cpus, "cpus int").collect()]
    Path(args.out).write_text(json.dumps(report))
    spark.stop()


def _task_cpus(batches):
    """One row per task: the cores its TaskContext has (a stage of the application's profile,
    run by the Python workers that the fits' stages started)."""
    import pyarrow as pa
    from pyspark import TaskContext
    for _ in batches:
        pass
    yield pa.RecordBatch.from_pylist([{"cpus": TaskContext.get().cpus()}],
                                     schema=pa.schema([("cpus", pa.int32())]))


if __name__ == "__main__":
    main()
