"""spark_dl.run on real Spark (local[2]) with real gloo: the PyTorch tutorial's DDP function,
its shard from the context, trains the thesis CNN to fit(strategy=AllReduce())'s weights in
float64 (with and without the shared-memory communication hook); bad input and a failing rank
stop in seconds with nothing left behind."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch

import spark_dl
from spark_dl import AllReduce, ResourceError, TaskError, fit
from spark_dl.data import mnist_file_dataframe

from ..conftest import MNIST_IMAGES, MNIST_LABELS
from .test_allreduce import assert_same_weights, data, frame

LR, MOMENTUM, BATCH = 0.05, 0.9, 16


def ddp_train(lr, momentum, epochs=1):
    """The PyTorch DDP tutorial's function (init from the environment, a DDP-wrapped model,
    its own loop), with the DistributedSampler replaced by the context's shard."""
    import os

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    import spark_dl
    from spark_dl.models import build_model

    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    ctx = spark_dl.context()
    torch.manual_seed(0)
    model = DDP(build_model("cnn").double())
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    for epoch in range(epochs):
        for x, y in ctx.batches(epoch):
            opt.zero_grad()
            loss = F.cross_entropy(model(x.double()), y)
            loss.backward()
            opt.step()
        ctx.log(epoch=epoch + 1, loss=loss.detach())
    dist.destroy_process_group()
    return model.module.state_dict()


@pytest.fixture(scope="module")
def digits(spark):
    return mnist_file_dataframe(spark, MNIST_IMAGES, MNIST_LABELS, 0, 192, 2)


@pytest.fixture(scope="module")
def reference(digits, tmp_path_factory):
    res = fit(digits, "cnn", strategy=AllReduce(), shape=(1, 28, 28), num_classes=10,
              lr=LR, momentum=MOMENTUM, batch_size=BATCH, epochs=1, dtype="float64",
              lr_scaling=None, run_dir=tmp_path_factory.mktemp("fit") / "run", log=None)
    assert res.info["transport"] == "shm"
    return res.model


@pytest.mark.parametrize("hook", [None, "shm"])
def test_the_tutorial_ddp_function_trains_to_allreduce_weights(spark, digits, reference,
                                                                tmp_path, hook):
    lines: list[str] = []
    state = spark_dl.run(ddp_train, LR, MOMENTUM, df=digits, shape=(1, 28, 28),
                         batch_size=BATCH, comm_hook=hook, run_dir=tmp_path / "run",
                         log=lines.append)
    net = spark_dl.models.build_model("cnn").double()
    net.load_state_dict(state)
    assert_same_weights(net, reference, tol=1e-9)
    info = json.loads((tmp_path / "run" / "info.json").read_text())
    assert info["world"] == 2 and info["rows_per_replica"] == [96, 96]
    assert info["comm_hook"] == hook and info["backend"] == "gloo"
    assert info["comm_hook_calls"] == (6 if hook else 0)       # 6 steps, one bucket each
    logged = [json.loads(m) for m in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["epoch"] for m in logged if m.get("type") == "log"] == [1]
    assert any(line.startswith("epoch 1") and "loss" in line for line in lines), lines


def fsdp2_train(lr, momentum):
    """A user's own FSDP2 loop on the group run makes: each of the CNN's layers and then the
    whole model sharded with fully_shard; returns the model gathered whole and the shards'
    shapes on rank 0."""
    import torch
    import torch.nn.functional as F
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.fsdp import fully_shard

    import spark_dl
    from spark_dl.models import build_model

    ctx = spark_dl.context()
    torch.manual_seed(0)                               # the same start on every rank
    model = build_model("cnn").double()
    for layer in [*model.features, model.classifier]:
        if any(True for _ in layer.parameters()):
            fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    for x, y in ctx.batches(0):
        opt.zero_grad()
        F.cross_entropy(model(x.double()), y).backward()   # gradients: the ranks' mean
        opt.step()
    shards = {n: (tuple(p.to_local().shape), tuple(p.shape))
              for n, p in model.named_parameters()}
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                cpu_offload=True))
    return {"state": full, "shards": shards}


def test_a_users_fsdp2_function_shards_the_cnn_and_trains_to_allreduce_weights(
        spark, digits, reference, tmp_path):
    out = spark_dl.run(fsdp2_train, LR, MOMENTUM, df=digits, shape=(1, 28, 28),
                       batch_size=BATCH, run_dir=tmp_path / "run", log=None)
    net = spark_dl.models.build_model("cnn").double()
    net.load_state_dict(out["state"])
    assert_same_weights(net, reference, tol=1e-9)
    assert out["shards"].keys() == dict(net.named_parameters()).keys()
    for local, whole in out["shards"].values():        # rank 0's half of every parameter
        assert local == (-(-whole[0] // 2), *whole[1:])


def env_and_value(tag):
    import os

    import torch.distributed as dist

    import spark_dl
    dist.init_process_group()                          # keeps the group that is up
    ctx = spark_dl.context()
    t = torch.tensor([float(ctx.rank + 1)])
    dist.all_reduce(t)
    return {"tag": tag, "sum": t.item(), "is_init": dist.is_initialized(),
            "env": {k: os.environ[k] for k in ("MASTER_ADDR", "MASTER_PORT", "RANK",
                                               "WORLD_SIZE", "LOCAL_RANK")}}


@pytest.mark.compat
def test_without_data_rank_zero_returns_and_torchrun_variables_are_set(spark, tmp_path):
    out = spark_dl.run(env_and_value, "x", run_dir=tmp_path / "run", log=None)
    assert out["tag"] == "x" and out["sum"] == 3.0 and out["is_init"]
    env = out["env"]
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"]) == ("0", "2", "0")
    assert env["MASTER_ADDR"] and int(env["MASTER_PORT"]) > 0
    assert "RANK" not in os.environ                    # the driver's environment is its own
    with pytest.raises(RuntimeError, match="only available inside a function run by"):
        spark_dl.context()


# -- bad input: clear errors, in seconds, nothing left running ----------------------------


def _spill_files() -> list[str]:
    """Spill files still open in any process of this user."""
    found = []
    for fd in Path("/proc").glob("[0-9]*/fd/*"):
        try:
            if "spark_dl-spill" in os.readlink(fd):
                found.append(str(fd))
        except OSError:
            pass
    return found


def _listening_ports() -> set[int]:
    """The ports this (the driver's) process listens on: the run's channel among them."""
    mine = set()
    for fd in Path("/proc/self/fd").iterdir():
        try:
            link = os.readlink(fd)
        except OSError:
            continue
        if link.startswith("socket:["):
            mine.add(link[8:-1])
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in mine:     # LISTEN, ours
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def test_an_unpicklable_function_and_too_many_replicas_are_refused_at_once(spark, digits,
                                                                           tmp_path):
    import threading
    lock = threading.Lock()

    def holds_a_lock():
        return lock.locked()

    t0 = time.perf_counter()
    with pytest.raises(TypeError, match=r"the function .*holds_a_lock cannot be pickled.*"
                                        r"create locks, sockets"):
        spark_dl.run(holds_a_lock, run_dir=tmp_path / "a", log=None)
    with pytest.raises(TypeError, match=r"keyword argument 'sock' \(socket\) cannot be "):
        import socket
        with socket.socket() as s:
            spark_dl.run(env_and_value, "x", sock=s, run_dir=tmp_path / "b", log=None)
    with pytest.raises(ResourceError, match=r"replicas=3 but the cluster runs 2 task\(s\) at "
                                            r"once.*use replicas <= 2"):
        spark_dl.run(ddp_train, LR, MOMENTUM, df=digits, replicas=3, run_dir=tmp_path / "c",
                     log=None)
    assert time.perf_counter() - t0 < 5
    assert not any((tmp_path / d).exists() for d in "abc")       # nothing was started


def fails_on_rank_one(marks):
    import torch.distributed as dist

    import spark_dl
    ctx = spark_dl.context()
    for _ in ctx.batches(0):
        pass
    if ctx.rank == 1:
        with open(marks, "a") as f:                    # one line per attempt
            f.write("attempt\n")
        raise KeyError("no such column on rank 1")
    dist.barrier()                                     # rank 0 waits for rank 1, forever
    return "unreachable"


def test_a_function_raising_on_rank_one_stops_the_run_in_seconds(spark, tmp_path):
    x, y = data(96)
    df = frame(spark, x, y, [48, 48])
    spark_dl.run(env_and_value, "warm", log=None)     # time the failure, not workers starting
    before = _listening_ports()
    t0 = time.perf_counter()
    with pytest.raises(TaskError) as info:
        spark_dl.run(fails_on_rank_one, str(tmp_path / "marks"), df=df, data="stream",
                     timeout_s=300, run_dir=tmp_path / "run", log=None)
    seconds = time.perf_counter() - t0
    e = info.value
    assert isinstance(e, KeyError) and e.task == 1 and e.remote_type == "KeyError"
    assert "task 1 failed" in str(e) and "no such column on rank 1" in str(e)
    assert "fails_on_rank_one" in e.remote_traceback
    # rank 0 is stopped when rank 1 fails, not when the run's timeout ends (a few seconds on
    # a quiet machine; the bound is loose for a loaded one, and tells either case apart)
    assert seconds < 150 and "timed out" not in str(e).lower(), f"took {seconds:.1f} s: {e}"
    assert (tmp_path / "marks").read_text() == "attempt\n"      # not retried
    deadline = time.monotonic() + 10                  # the cancelled stage winds down
    while spark.sparkContext.statusTracker().getActiveStageIds() and \
            time.monotonic() < deadline:
        time.sleep(0.2)
    assert not spark.sparkContext.statusTracker().getActiveStageIds()
    time.sleep(0.5)
    assert not _spill_files()
    assert not (_listening_ports() - before)          # the channel and the store are closed
    assert not [f for f in os.listdir("/dev/shm") if f.startswith("sdl-")]
    # the session still works: not retried, nothing stuck
    assert spark_dl.run(env_and_value, "again", log=None)["sum"] == 3.0
