"""The GPU-side pieces a CPU can check: a shard batched on its device yields ShardData's
batches exactly, and co-located GPU tasks get gloo instead of NCCL (placements as the tasks
report them)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from spark_dl.data.bridge import ShardData
from spark_dl.data.device import DeviceShard, on_device
from spark_dl.transport.rendezvous import choose_backend


def _shard(n=103, pixels=True, labels=True):
    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, (n, 1, 4, 4), dtype=np.uint8) if pixels else \
        rng.standard_normal((n, 5)).astype(np.float32)
    return ShardData(x, rng.integers(0, 10, n).astype(np.int64) if labels else None)


@pytest.mark.parametrize("pixels,labels", [(True, True), (False, True), (False, False)])
@pytest.mark.parametrize("shuffle,drop_last,skip,batch",
                         [(True, False, 0, 16), (True, True, 0, 16), (False, False, 2, 10),
                          (True, False, 3, 7), (True, False, 0, 200)])
def test_device_batches_are_shard_batches(pixels, labels, shuffle, drop_last, skip, batch):
    base = _shard(pixels=pixels, labels=labels)
    dev = DeviceShard(base, torch.device("cpu"))
    kw = dict(shuffle=shuffle, seed=5, epoch=2, drop_last=drop_last, skip=skip)
    want, got = list(base.batches(batch, **kw)), list(dev.batches(batch, **kw))
    assert len(want) == len(got) > 0
    for (wx, wy), (gx, gy) in zip(want, got):
        assert gx.dtype == wx.dtype and torch.equal(gx, wx)
        assert (wy is None and gy is None) or torch.equal(gy, wy)


def test_device_shard_follows_rows_moved_by_the_balancer():
    base = _shard(n=40)
    dev = DeviceShard(base, torch.device("cpu"))
    assert sum(len(x) for x, _ in dev.batches(8)) == 40
    dev.truncate(30)                                   # the ShardData's own method
    assert len(dev) == 30 and sum(len(x) for x, _ in dev.batches(8)) == 30
    assert dev.kind == "memory" and dev.num_batches(8) == 4


def test_on_device_leaves_cpu_and_transformed_shards_alone():
    base = _shard()
    assert on_device(base, torch.device("cpu")) is base
    assert on_device(base, torch.device("cuda", 0), transform=lambda x, y: (x, y)) is base
    with pytest.raises(ValueError, match="batch_size"):
        next(DeviceShard(base, torch.device("cpu")).batches(0))


def _status(machine, device):
    return {"machine": machine, "device": device}


def test_backend_for_placements():
    assert choose_backend([_status("a", "cpu")] * 3)[0] == "gloo"
    assert choose_backend([_status("a", "cuda:0"), _status("a", "cuda:1")]) == \
        ("nccl", "nccl: one GPU per task")
    # the same GPU index on two machines is two GPUs
    assert choose_backend([_status("a", "cuda:0"), _status("b", "cuda:0")])[0] == "nccl"
    backend, why = choose_backend([_status("a", "cuda:0"), _status("a", "cuda:1"),
                                   _status("a", "cuda:0")])
    assert backend == "gloo" and "2 tasks share cuda:0" in why and "NCCL" in why
    assert choose_backend([_status("a", "cuda:0"), _status("a", "cpu")])[0] == "gloo"


def test_faults_a_retry_would_meet_again_are_not_transient():
    from spark_dl.runtime.failures import _with_fix, fix_for, is_transient
    dup = torch.distributed.DistBackendError(
        "NCCL error in: ProcessGroupNCCL.cpp:1883, invalid usage (run with NCCL_DEBUG=WARN "
        "for details), NCCL version 2.27.3\nncclInvalidUsage: Duplicate GPU detected : rank 1 "
        "and rank 0 both on CUDA device 1000")
    assert not is_transient(dup) and "spark.task.resource.gpu.amount=1" in fix_for(dup)
    oom = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    assert not is_transient(oom) and "batch_size" in _with_fix(oom)
    assert _with_fix(oom).startswith("CUDA out of memory. Tried to allocate 2.00 GiB")
    conv = ("Input type (torch.cuda.FloatTensor) and weight type (torch.FloatTensor) should "
            "be the same")
    linear = ("Expected all tensors to be on the same device, but found at least two devices, "
              "cuda:0 and cpu!")
    for text in (conv, linear):
        moved = RuntimeError(text)                   # a CPU model fed the task's GPU batches
        assert not is_transient(moved) and "model.to(ctx.device)" in fix_for(moved)
        assert _with_fix(moved).startswith(text) and "device='cpu'" in _with_fix(moved)
    assert fix_for(RuntimeError("Input type (double) and bias type (float) should be the "
                                "same")) is None
    # what a retry can get past stays transient
    lost = RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error "
                        "[127.0.0.1]:1234: Connection reset by peer")
    assert is_transient(lost) and fix_for(lost) is None
    assert is_transient(torch.distributed.DistBackendError("NCCL communicator was aborted"))
