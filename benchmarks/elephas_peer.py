"""Elephas 7.3's asynchronous mode on the thesis CNN: the peer run by bench_downpour.py.

Runs inside .venv-elephas (benchmarks/setup_elephas.sh: tensorflow-cpu + Elephas, no torch), so
it reads the digits from an .npz the benchmark writes and prints one JSON line:

    .venv-elephas/bin/python benchmarks/elephas_peer.py DATA.npz --epochs 1,5 --frequency epoch

One fit per entry of --epochs, each from the same initial weights in the same Spark session,
so that the difference of two fits' times is the rate of training alone (the job, the
parameter server and the broadcast cost the same in both).

The Keras model is the thesis CNN as spark_dl builds it (conv 5x5x6, mean-pool 2, conv 5x5x12,
mean-pool 2, conv 4x4x12, all ReLU, dense softmax), SGD lr 0.05 momentum 0.9, batch 16, two
workers on Spark local[2]. Timed: the fit alone (Spark start-up, TensorFlow import and model
building are reported apart).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("data")
    ap.add_argument("--epochs", default="1,5", help="comma-separated epochs of each fit")
    ap.add_argument("--frequency", choices=("epoch", "batch"), default="epoch")
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--port", type=int, default=4000)
    args = ap.parse_args(argv)
    t_start = time.perf_counter()
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    os.environ["PYSPARK_PYTHON"] = sys.executable     # not the caller's (torch) interpreter
    import numpy as np
    import tensorflow as tf
    from pyspark.sql import SparkSession

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    from elephas.enums.frequency import Frequency
    from elephas.enums.modes import Mode
    from elephas.spark_model import AsynchronousSparkModel
    from elephas.utils.rdd_utils import to_simple_rdd
    from tensorflow import keras

    d = np.load(args.data)
    x, y, vx, vy = d["x"], d["y"], d["vx"], d["vy"]
    x = x.reshape(-1, 28, 28, 1).astype(np.float32)
    vx = vx.reshape(-1, 28, 28, 1).astype(np.float32)
    spark = (SparkSession.builder.master("local[2]").appName("elephas-peer")
             .config("spark.ui.enabled", "false")
             .config("spark.pyspark.python", sys.executable).getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    def build():
        keras.utils.set_random_seed(0)
        return keras.Sequential([
        keras.Input((28, 28, 1)),
        keras.layers.Conv2D(6, 5, activation="relu"), keras.layers.AveragePooling2D(2),
        keras.layers.Conv2D(12, 5, activation="relu"), keras.layers.AveragePooling2D(2),
        keras.layers.Conv2D(12, 4, activation="relu"), keras.layers.Flatten(),
            keras.layers.Dense(10, activation="softmax")])

    rdd = to_simple_rdd(spark.sparkContext, x, keras.utils.to_categorical(y, 10)).repartition(2)
    rdd.cache().count()
    setup = time.perf_counter() - t_start
    fits = []
    # a first fit of one epoch warms the Python workers (their TensorFlow import, the graph
    # tracing) and is left out, as the torch systems' warm-up fit is
    for epochs in [1] + [int(e) for e in args.epochs.split(",")]:
        model = build()
        model.compile(optimizer=keras.optimizers.SGD(learning_rate=args.lr, momentum=0.9),
                      loss="categorical_crossentropy", metrics=["accuracy"])
        spark_model = AsynchronousSparkModel(model, mode=Mode.ASYNCHRONOUS,
                                             frequency=Frequency(args.frequency),
                                             num_workers=2, batch_size=args.batch,
                                             port=args.port)
        t0 = time.perf_counter()
        spark_model.fit(rdd, epochs=epochs, batch_size=args.batch, verbose=0,
                        validation_split=0.0)
        fit_s = time.perf_counter() - t0
        pred = spark_model.master_network.predict(vx, batch_size=1000, verbose=0)
        fits.append({"epochs": epochs, "fit_seconds": fit_s,
                     "val_accuracy": float(np.mean(np.argmax(pred, 1) == vy))})
    print(json.dumps({"fits": fits[1:], "warmup_seconds": fits[0]["fit_seconds"],
                      "setup_seconds": setup, "rows": len(x),
                      "frequency": args.frequency, "tensorflow": tf.__version__}))
    spark.stop()


if __name__ == "__main__":
    main()
