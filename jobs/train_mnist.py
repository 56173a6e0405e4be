"""Train the thesis FC net or CNN on extended MNIST, in one process (the engines' reference) or
with a distributed strategy on Spark: --set train.strategy=allreduce, downpour or gossip
[--set train.replicas=N --set train.strategy.n_push=.. --set train.strategy.mode=..].

    python jobs/train_mnist.py --config conf/jobs/cnn.toml [--set train.optimizer=adam ...]
"""
import sys

from spark_dl.recipes.cli import run_job
from spark_dl.recipes.mnist import MnistJobConfig, train_mnist

if __name__ == "__main__":
    run_job(__doc__, MnistJobConfig, train_mnist, "conf/jobs/cnn.toml",
            lambda c: f"mnist-{c.train.model}-{c.train.optimizer}"
            + ("" if c.train.strategy == "single" else f"-{c.train.strategy}"), sys.argv[1:])
