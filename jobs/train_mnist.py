"""Train the thesis FC net or CNN on extended MNIST, in one process (the engines' reference) or
with the all-reduce engine on Spark (--set train.strategy=allreduce [--set train.replicas=N]).

    python jobs/train_mnist.py --config conf/jobs/cnn.toml [--set train.optimizer=adam ...]
"""
import sys

from spark_dl.recipes.cli import run_job
from spark_dl.recipes.mnist import MnistJobConfig, train_mnist

if __name__ == "__main__":
    run_job(__doc__, MnistJobConfig, train_mnist, "conf/jobs/cnn.toml",
            lambda c: f"mnist-{c.train.model}-{c.train.optimizer}"
            + ("-allreduce" if c.train.strategy == "allreduce" else ""), sys.argv[1:])
