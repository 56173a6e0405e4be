"""FC net and thesis CNN on (extended) MNIST, single process: the reference the engines match.

Training data: the first ``n_train_source`` real digits plus ``extended_samples`` distorted
ones made from them (the same generator the executors run); test: the last ``n_test`` digits.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import torch

from ..config import DataConfig, TrainConfig, _check
from ..data import ShardData, distort_range, mnist_split
from ..models import FCNet, build_model
from ..train import evaluate, make_optimizer, seed_everything, train_loop
from .common import RunConfig, pick_device

__all__ = ["MnistJobConfig", "train_mnist"]


@dataclasses.dataclass(frozen=True)
class MnistJobConfig:
    data: DataConfig = DataConfig()
    train: TrainConfig = TrainConfig()
    run: RunConfig = RunConfig()
    include_originals: bool = True      # train on the real source digits too
    max_iter: int = 3                   # iterations per step of the closure optimizers (cg, lbfgs)
    lr_decay: float = 1.0               # multiply the learning rate by this after every epoch

    def __post_init__(self):
        _check(self.max_iter >= 1, "max_iter", self.max_iter, "must be >= 1")
        _check(0 < self.lr_decay <= 1, "lr_decay", self.lr_decay, "must be in (0, 1]")


def _to(device, batches):
    for x, y in batches:
        yield x.to(device, non_blocking=True), y.to(device, non_blocking=True)


def train_mnist(cfg: MnistJobConfig, log=print, spark=None) -> dict:
    if cfg.train.strategy != "single":
        return _train_mnist_spark(cfg, log, spark)
    d, t = cfg.data, cfg.train
    seed_everything(t.seed)
    device = pick_device(cfg.run)
    (src_x, src_y), (test_x, test_y) = mnist_split(d.images, d.labels, d.n_train_source,
                                                   d.n_test)
    t0 = time.perf_counter()
    parts_x, parts_y = [], []
    for lo in range(0, d.extended_samples, 20000):
        x, y = distort_range(src_x, src_y, lo, min(lo + 20000, d.extended_samples), d.seed)
        parts_x.append(x)
        parts_y.append(y)
    if cfg.include_originals:
        parts_x.append(src_x.reshape(len(src_x), -1).astype(np.float32) / 255)
        parts_y.append(src_y)
    shard = ShardData(np.concatenate(parts_x), np.concatenate(parts_y))
    gen_s = time.perf_counter() - t0
    log(f"training set: {len(shard)} digits ({d.extended_samples} distorted, generated in "
        f"{gen_s:.1f} s); test set: the last {d.n_test} digits; device {device}")

    model = _model_fn(t)().to(device)
    opt = make_optimizer(t.optimizer, model.parameters(), t.lr, t.momentum,
                         max_iter=cfg.max_iter, nesterov=t.nesterov)
    sched = torch.optim.lr_scheduler.ExponentialLR(opt, cfg.lr_decay)
    test_xt = torch.from_numpy(test_x.reshape(len(test_x), -1).astype(np.float32) / 255)
    test_yt = torch.from_numpy(test_y)

    def evaluate_fn(m):
        return evaluate(m, test_xt.to(device), test_yt.to(device))
    t0 = time.perf_counter()
    history = train_loop(model, lambda e: _to(device, shard.batches(t.batch_size, seed=t.seed,
                                                                    epoch=e)),
                         opt, t.epochs, evaluate_fn=evaluate_fn,
                         checkpoint=f"{cfg.run.out_dir}/{t.model}-{t.optimizer}.pt", log=log,
                         scheduler=sched)
    return {"model": t.model, "optimizer": t.optimizer, "lr": t.lr, "batch_size": t.batch_size,
            "epochs": t.epochs, "train_samples": len(shard), "train_seconds":
            time.perf_counter() - t0, "test_accuracy": history[-1]["val_accuracy"],
            "best_test_accuracy": max(h["val_accuracy"] for h in history), "history": history}


def _model_fn(t):
    """The job's model factory: the thesis CNN, or the FC net with ``fc_hidden`` widths."""
    if t.model == "fc":
        sizes = (784, *t.fc_hidden, 10)
        return lambda: FCNet(sizes)
    return lambda: build_model(t.model)


def _train_mnist_spark(cfg: MnistJobConfig, log, spark) -> dict:
    """The same training set, generated in the executors, trained with a distributed engine
    (``train.strategy``: "allreduce", "downpour", "gossip" or a [train.strategy] table)."""
    import pyarrow as pa  # noqa: F401  (the executors' generator needs it)

    from ..compat import broadcast, default_parallelism
    from ..data import extended_mnist, pixels_to_arrow
    from ..data.mnist import PIXEL_SCHEMA
    from ..fit import fit
    from ..session import get_session
    d, t = cfg.data, cfg.train
    spark = spark or get_session()
    (src_x, src_y), (test_x, test_y) = mnist_split(d.images, d.labels, d.n_train_source,
                                                   d.n_test)
    slots = default_parallelism(spark)
    if t.partitions == "auto":            # the planner picks F and R inside fit
        replicas, shards = t.replicas or None, slots
    else:
        replicas = t.replicas or max(slots // t.partitions, 1)
        shards = replicas * t.partitions
    df = extended_mnist(spark, src_x, src_y, d.extended_samples, shards, seed=d.seed)
    if cfg.include_originals:
        originals = broadcast(spark, (src_x, src_y))

        def _originals(batches):
            x, y = originals.value
            for _ in batches:
                yield pixels_to_arrow(x.reshape(len(x), -1), y)
        df = df.union(spark.range(1, numPartitions=1).mapInArrow(_originals, PIXEL_SCHEMA))
    res = fit(df, _model_fn(t), strategy=t.make_strategy(), shape=(1, 28, 28), num_classes=10,
              optimizer=t.optimizer, lr=t.lr, lr_decay=cfg.lr_decay, momentum=t.momentum,
              **t.fit_options, max_iter=cfg.max_iter,
              epochs=t.epochs, batch_size=t.batch_size, replicas=replicas, seed=t.seed,
              device=cfg.run.device, threads=cfg.run.threads,
              validation=(test_x.reshape(len(test_x), -1).astype(np.float32) / 255, test_y),
              run_dir=f"{cfg.run.out_dir}/{t.model}-{t.optimizer}-{t.strategy}", log=log,
              track=cfg.run.track)
    history = res.history
    return {"model": t.model, "optimizer": t.optimizer, "lr": t.lr, "batch_size": t.batch_size,
            "strategy": t.strategy, "replicas": res.info["world"],
            "global_batch": res.info["world"] * t.batch_size, "epochs": t.epochs,
            "train_samples": res.info["total_rows"], "train_seconds": res.info["train_seconds"],
            "wall_seconds": res.info["wall_seconds"],
            "test_accuracy": history[-1]["val_accuracy"],
            "best_test_accuracy": max(h["val_accuracy"] for h in history), "history": history,
            "info": res.info}
