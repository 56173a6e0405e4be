"""The README demo: extended-MNIST shards built on Spark, the thesis CNN trained on them for one
pass with Downpour SGD (one worker per task slot, parameter server on the driver); strategy =
"allreduce" uses the synchronous engine, "single" trains in one task.

    spark-submit --properties-file conf/spark/local.conf jobs/demo.py --config conf/jobs/demo.toml
"""

from __future__ import annotations

import argparse
import sys
import time


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--config", default="conf/jobs/demo.toml", help="job TOML (conf/jobs/)")
    p.add_argument("--profile", default=None,
                   help="Spark profile in conf/spark/ (default: spark-submit's settings, else 'local')")
    p.add_argument("--remote", default=None, metavar="URL",
                   help="train from a Spark Connect client: 'local[2]' (pyspark's local Connect "
                        "server) or 'sc://host:15002'")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key, e.g. --set train.model='\"fc\"' --set data.partitions=2")
    return p.parse_args(argv)


def main(argv=None, spark=None) -> dict:
    import spark_dl
    from spark_dl.data import extended_mnist, mnist_split, read_shards, write_shards
    from spark_dl.recipes.cli import parse_overrides
    from spark_dl.single_task import fit_single_task
    from spark_dl.train import evaluate

    args = parse_args(argv)
    cfg = spark_dl.load_toml(spark_dl.DemoConfig, args.config, parse_overrides(args.set))
    spark = spark or spark_dl.get_session(args.profile, remote=args.remote)
    d, t = cfg.data, cfg.train
    (train_x, train_y), (test_x, test_y) = mnist_split(d.images, d.labels, d.n_train_source,
                                                       d.n_test)

    t0 = time.perf_counter()
    df = extended_mnist(spark, train_x, train_y, d.extended_samples, d.partitions, seed=d.seed)
    manifest = write_shards(df, d.shards_dir, mode="overwrite")
    gen_s = time.perf_counter() - t0
    print(f"extended MNIST: {manifest['rows']} distorted digits in {len(manifest['shards'])} "
          f"shards at {d.shards_dir} ({gen_s:.1f} s, {manifest['rows'] / gen_s:.0f} samples/s)")

    shards = read_shards(spark, d.shards_dir)
    if t.strategy != "single":
        res = spark_dl.fit(shards, t.model, strategy=t.make_strategy(), shape=(1, 28, 28),
                           num_classes=10, optimizer=t.optimizer, lr=t.lr, momentum=t.momentum,
                           epochs=t.epochs, batch_size=t.batch_size, **t.fit_options,
                           replicas=t.replicas or None, seed=t.seed)
        if t.strategy == "downpour":
            print(f"staleness histogram (pushes per shard by versions behind): "
                  f"{res.info['staleness_histogram']}")
        model, history = res.model, res.history
    else:
        model, history = fit_single_task(shards, t)
        for e, h in enumerate(history):
            print(f"epoch {e + 1}: train loss {h['loss']:.4f}, {h['samples']} samples, "
                  f"{h['samples'] / h['seconds']:.0f} samples/s")
    result = evaluate(model, test_x.reshape(len(test_x), -1) / 255.0, test_y)
    print(f"test accuracy ({t.model}, last {d.n_test} MNIST digits): "
          f"{100 * result['accuracy']:.2f}%  (loss {result['loss']:.4f})")
    return {"manifest": manifest, "history": history, **result}


if __name__ == "__main__":
    main(sys.argv[1:])
