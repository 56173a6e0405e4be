"""The DDP training function bench_run.py runs under every launcher: the thesis CNN wrapped in
DistributedDataParallel, SGD with momentum, its own loop, torch 1 thread per process.

Its rows: under ``spark_dl.run``, the context's shard (the DataFrame's partition); under
TorchDistributor and Ray Train (no DataFrame reaches their functions), the rank's slice of
the same digits read from the shipped IDX files, as the DataFrame's partitions hold them.
The loop is the same either way; the epoch's own loop time is measured."""

from __future__ import annotations


def ddp_train(images: str, labels: str, rows: int, epochs: int, batch: int, lr: float,
              momentum: float) -> dict:
    import os
    import time

    import numpy as np
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    from spark_dl.models import build_model

    torch.set_num_threads(1)
    if not dist.is_initialized():                      # Ray Train has made it already
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        import spark_dl
        ctx = spark_dl.context()
        batches = ctx.batches
    except RuntimeError:                               # not under spark_dl.run: the files
        from spark_dl.data import load_mnist
        lo, hi = rank * rows // world, (rank + 1) * rows // world
        x, y = load_mnist(images, labels)
        x = torch.from_numpy(x[lo:hi].reshape(hi - lo, 1, 28, 28).astype(np.float32) / 255)
        y = torch.from_numpy(y[lo:hi].astype(np.int64))

        def batches(epoch):
            perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(epoch))
            for i in range(0, len(x), batch):
                idx = perm[i:i + batch]
                yield x[idx], y[idx]
    torch.manual_seed(0)
    model = DDP(build_model("cnn"))
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    secs, samples = [], 0
    for epoch in range(epochs):
        t0, n = time.perf_counter(), 0
        for xb, yb in batches(epoch):
            opt.zero_grad()
            F.cross_entropy(model(xb), yb).backward()
            opt.step()
            n += len(xb)
        secs.append(time.perf_counter() - t0)
        samples = n
    out = {"epoch_seconds": secs, "samples_per_rank": samples, "world": world,
           "pid": os.getpid()}
    if rank == 0:
        out["state"] = {k: v.detach().clone() for k, v in model.module.state_dict().items()}
    return out
