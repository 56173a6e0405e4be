"""A PyTorch DDP training function, as written for torchrun, run on a DataFrame's partitions
with spark_dl.run: the thesis CNN on the shipped MNIST digits, rank 0's weights saved.

    spark-submit --properties-file conf/spark/local.conf jobs/run_ddp.py --rows 2000 --epochs 2
    python jobs/run_ddp.py --remote local[2]          # from a Spark Connect client
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
IMAGES = ROOT / "data/mnist/t10k-images-idx3-ubyte.gz"
LABELS = ROOT / "data/mnist/t10k-labels-idx1-ubyte.gz"


def train(lr: float, momentum: float, epochs: int) -> dict:
    """The DDP tutorial's function; its rows come from spark_dl.context() (no sampler)."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    import spark_dl
    from spark_dl.models import build_model

    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    ctx = spark_dl.context()
    torch.manual_seed(0)
    model = DDP(build_model("cnn").to(ctx.device))
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    for epoch in range(epochs):
        total, n = torch.zeros((), device=ctx.device), 0
        for x, y in ctx.batches(epoch):
            x, y = x.to(ctx.device), y.to(ctx.device)
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            total += loss.detach() * len(x)
            n += len(x)
        ctx.log(epoch=epoch + 1, loss=float(total) / max(n, 1))
    dist.destroy_process_group()
    return {k: v.cpu() for k, v in model.module.state_dict().items()}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rows", type=int, default=2000, help="MNIST digits to train on")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--batch-size", type=int, default=16, help="per replica and step")
    p.add_argument("--replicas", type=int, default=None)
    p.add_argument("--comm-hook", choices=("shm", "none"), default="shm")
    p.add_argument("--profile", default=None,
                   help="Spark profile in conf/spark/ (default: spark-submit's settings)")
    p.add_argument("--remote", default=None, metavar="URL",
                   help="a Spark Connect client: 'local[2]' or 'sc://host:15002'")
    p.add_argument("--out", default="runs/run_ddp-model.pt", help="where rank 0's weights go")
    return p.parse_args(argv)


def main(argv=None, spark=None) -> dict:
    import torch

    import spark_dl
    from spark_dl.data import load_mnist, mnist_file_dataframe
    from spark_dl.models import build_model

    args = parse_args(argv)
    spark = spark or spark_dl.get_session(args.profile, remote=args.remote)
    df = mnist_file_dataframe(spark, IMAGES, LABELS, 0, args.rows,
                              args.replicas or 2)
    t0 = time.perf_counter()
    state = spark_dl.run(train, args.lr, 0.9, args.epochs, df=df, replicas=args.replicas,
                         shape=(1, 28, 28), batch_size=args.batch_size,
                         comm_hook=None if args.comm_hook == "none" else args.comm_hook)
    seconds = time.perf_counter() - t0
    net = build_model("cnn")
    net.load_state_dict(state)
    x, y = load_mnist(IMAGES, LABELS)
    with torch.no_grad():
        xt = torch.from_numpy(x[-2000:].reshape(-1, 1, 28, 28) / 255.0).float()
        acc = float((net(xt).argmax(1).numpy() == y[-2000:]).mean())
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    torch.save(state, args.out)
    print(f"trained in {seconds:.1f} s; accuracy on the last 2,000 digits {acc:.4f}; "
          f"weights in {args.out}")
    return {"seconds": seconds, "accuracy": acc}


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
