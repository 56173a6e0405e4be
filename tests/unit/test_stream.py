"""The streamed shard (spark_dl.data.stream): a partition spilled to local disk and served per
epoch through a bounded shuffle buffer."""

import os
import signal
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pyarrow as pa
import pytest
import torch

from spark_dl.data import ShardData
from spark_dl.data.stream import StreamShard, open_shard, parse_buffer
from spark_dl.errors import ConfigError, DataError


def _pixels(n, d=16, seed=0):
    """n rows of d uint8 pixels as an Arrow binary column, labels = row id % 10."""
    x = np.random.default_rng(seed).integers(0, 256, (n, d), dtype=np.uint8)
    return x, np.arange(n) % 10


def _binary_batches(x, y, rows_per_batch=37):
    out = []
    for a in range(0, len(x), rows_per_batch):
        xb, yb = x[a:a + rows_per_batch], y[a:a + rows_per_batch]
        col = pa.array([r.tobytes() for r in xb], pa.binary())
        out.append(pa.RecordBatch.from_arrays([col, pa.array(yb, pa.int64())],
                                              ["features", "label"]))
    return out


def _float_batches(x, y, rows_per_batch=50):
    from spark_dl.data import arrays_to_arrow
    return [arrays_to_arrow(x[a:a + rows_per_batch], y[a:a + rows_per_batch])
            for a in range(0, len(x), rows_per_batch)]


def _ids(batches):
    """The row ids an epoch served (labels hold the ids in these tests)."""
    return torch.cat([y for _, y in batches]).tolist()


def test_every_row_once_per_epoch_in_a_new_order_and_the_same_after_a_resume(tmp_path):
    n = 1000
    x = np.random.default_rng(0).integers(0, 256, (n, 8), dtype=np.uint8)
    y = np.arange(n)
    shard = open_shard(_binary_batches(x, y), shape=(8,), data="stream", shuffle_buffer=120,
                       directory=str(tmp_path))
    assert isinstance(shard, StreamShard) and len(shard) == n
    epochs = [_ids(shard.batches(32, seed=5, epoch=e)) for e in range(3)]
    for ids in epochs:
        assert sorted(ids) == list(range(n))              # every row, exactly once
    assert epochs[0] != epochs[1] != epochs[2]
    assert epochs[0] == _ids(shard.batches(32, seed=5, epoch=0))     # (seed, epoch) decide
    assert epochs[0] != _ids(shard.batches(32, seed=6, epoch=0))
    # rows are shuffled across the whole shard, not only inside one buffer-ful
    first = epochs[0][:120]
    assert max(first) - min(first) > 500
    # a retried task skipping k batches gets exactly the rest of the epoch
    for k in (0, 1, 3, 7, 31):
        assert _ids(shard.batches(32, seed=5, epoch=1, skip=k)) == epochs[1][k * 32:]
    assert list(shard.batches(32, seed=5, epoch=1, skip=32)) == []
    # features stay aligned with their labels, uint8 pixels arrive as float32 in [0, 1]
    for xb, yb in shard.batches(32, seed=5, epoch=2):
        assert xb.dtype == torch.float32
        assert torch.equal(xb, torch.from_numpy(x[yb.numpy()]).float() / 255)
    shard.close()


def test_the_shuffle_buffer_never_holds_more_than_its_bound(tmp_path):
    n = 2000
    x, _ = _pixels(n, 8)
    shard = open_shard(_binary_batches(x, np.arange(n)), shape=(8,), data="stream",
                       shuffle_buffer=100, directory=str(tmp_path))
    for batch_size in (1, 7, 64, 100):
        sizes = [len(b) for b, _ in shard.batches(batch_size, seed=1, epoch=0)]
        assert sum(sizes) == n and all(s == batch_size for s in sizes[:-1])
        assert 0 < shard.peak_buffer_rows <= 100
    assert [len(b) for b, _ in shard.batches(64, drop_last=True)] == [64] * (n // 64)
    with pytest.raises(ConfigError, match="fewer than batch_size 101"):
        next(shard.batches(101))
    # a size in bytes: 8 pixel bytes + an 8-byte label a row
    sized = open_shard(_binary_batches(x, np.arange(n)), shape=(8,), data="stream",
                       shuffle_buffer="1KB", directory=str(tmp_path))
    assert sized.buffer_rows == 64
    list(sized.batches(16))
    assert sized.peak_buffer_rows <= 64
    shard.close()
    sized.close()


def test_a_buffer_holding_the_shard_serves_the_in_memory_batches(tmp_path):
    x = np.random.default_rng(1).random((300, 6), dtype=np.float32)
    y = np.arange(300)
    memory = open_shard(_float_batches(x, y), data="memory")
    stream = open_shard(_float_batches(x, y), data="stream", shuffle_buffer=300,
                        directory=str(tmp_path))
    assert isinstance(memory, ShardData) and isinstance(stream, StreamShard)
    for shuffle in (True, False):
        for skip in (0, 3):
            a = list(memory.batches(32, shuffle, seed=4, epoch=2, skip=skip))
            b = list(stream.batches(32, shuffle, seed=4, epoch=2, skip=skip))
            assert len(a) == len(b) == 10 - skip
            for (xa, ya), (xb, yb) in zip(a, b):
                assert torch.equal(xa, xb) and torch.equal(ya, yb)
    stream.close()


def test_auto_keeps_a_small_partition_in_memory_and_streams_a_large_one(tmp_path):
    x, y = _pixels(500, 16)
    small = open_shard(_binary_batches(x, y), shape=(16,), directory=str(tmp_path),
                       memory_budget=1 << 20)
    large = open_shard(_binary_batches(x, y), shape=(16,), directory=str(tmp_path),
                       memory_budget=2000)
    assert small.kind == "memory" and large.kind == "stream"
    assert small.features.dtype == np.uint8                    # 4x fewer bytes in memory too
    assert len(large) == 500 and large.spilled_bytes == 500 * (16 + 8)
    for (xa, ya), (xb, yb) in zip(small.batches(50, seed=2), large.batches(50, seed=2)):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    large.close()


def test_uint8_rows_stay_uint8_on_disk_and_floats_stay_float32(tmp_path):
    x, y = _pixels(256, 784)
    shard = open_shard(_binary_batches(x, y), shape=(1, 28, 28), data="stream",
                       directory=str(tmp_path))
    assert shard.spec()[:2] == ((1, 28, 28), np.uint8)
    assert shard.spilled_bytes == 256 * 784 + 256 * 8          # one byte a pixel
    xb, _yb = next(shard.batches(256, shuffle=False))
    assert xb.shape == (256, 1, 28, 28) and xb.dtype == torch.float32
    assert torch.equal(xb, torch.from_numpy(x.reshape(256, 1, 28, 28)).float() / 255)
    shard.close()
    f = np.random.default_rng(0).random((100, 5), dtype=np.float32)
    fshard = open_shard(_float_batches(f, np.arange(100)), data="stream",
                        directory=str(tmp_path))
    assert fshard.spilled_bytes == 100 * 5 * 4 + 100 * 8
    fshard.close()


def test_transform_runs_on_the_storage_rows(tmp_path):
    x, y = _pixels(100, 4)
    seen = []

    def transform(xb, yb):
        seen.append((xb.dtype, threading.current_thread().name))
        return torch.from_numpy(xb.astype(np.float32) - 128), torch.from_numpy(yb)
    shard = open_shard(_binary_batches(x, y), shape=(4,), data="stream",
                       directory=str(tmp_path))
    got = list(shard.batches(10, shuffle=False, transform=transform))
    assert torch.equal(torch.cat([b for b, _ in got]), torch.from_numpy(x).float() - 128)
    assert {s[0] for s in seen} == {np.dtype(np.uint8)}
    assert {s[1] for s in seen} == {"spark_dl-prefetch"}       # off the training thread
    shard.close()


def test_the_prefetch_thread_ends_when_the_consumer_stops_early(tmp_path):
    x, y = _pixels(2000, 8)
    shard = open_shard(_binary_batches(x, y), shape=(8,), data="stream", shuffle_buffer=200,
                       directory=str(tmp_path))
    before = threading.active_count()
    it = shard.batches(10, prefetch=2)
    next(it)
    assert threading.active_count() == before + 1
    it.close()
    assert threading.active_count() == before
    shard.close()


def test_bad_rows_are_named_with_their_row_across_batches(tmp_path):
    x = np.zeros((120, 3), np.float32)
    x[97, 1] = np.nan
    with pytest.raises(DataError, match="row 97 of the partition 3 holds NaN"):
        open_shard(_float_batches(x, np.zeros(120, np.int64)), data="stream",
                   where="partition 3", directory=str(tmp_path))
    bad = _binary_batches(*_pixels(40, 8))
    bad.append(pa.RecordBatch.from_arrays([pa.array([b"\x00" * 7], pa.binary()),
                                           pa.array([1], pa.int64())], ["features", "label"]))
    with pytest.raises(DataError, match="row 40 of the partition has 7 bytes, expected 8"):
        open_shard(bad, shape=(8,), data="stream", directory=str(tmp_path))
    with pytest.raises(DataError, match=r"row 10 of the partition has label 10, outside 0..9"):
        open_shard(_binary_batches(*_pixels(20, 8)[:1], np.arange(20)), shape=(8,),
                   num_classes=10, data="stream", directory=str(tmp_path))
    with pytest.raises(DataError, match=r"column\(s\) \['pixels'\] not found"):
        open_shard(_binary_batches(*_pixels(5, 8)), features="pixels", data="stream",
                   directory=str(tmp_path))
    assert os.listdir(tmp_path) == []                 # nothing left by the failed reads


def test_bad_options_are_refused():
    for value in (0, -3, "lots", "0MB", 1.5, True):
        with pytest.raises(ConfigError, match="shuffle_buffer"):
            parse_buffer(value)
    assert parse_buffer("1MB", 1024) == 1024 and parse_buffer("2g", 1 << 20) == 2048
    with pytest.raises(ConfigError, match="data must be one of auto, memory, stream"):
        open_shard([], data="disk")


def test_an_empty_partition_gives_no_batches(tmp_path):
    shard = open_shard([], shape=(4,), data="stream", directory=str(tmp_path))
    assert len(shard) == 0 and list(shard.batches(8)) == []
    assert shard.empty_batch()[0].shape == (0, 4)


# One child process for both tests below (a fresh interpreter imports torch: seconds): first a
# full local disk (a file size limit it then lifts), then a spill it holds until killed.
_CHILD = textwrap.dedent("""
    import resource, signal, sys, time
    import numpy as np, pyarrow as pa
    from spark_dl.data.stream import open_shard
    from spark_dl.errors import ResourceError
    full, held = sys.argv[1:3]
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)     # writes past the limit fail with EFBIG
    hard = resource.getrlimit(resource.RLIMIT_FSIZE)[1]
    resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, hard))
    x = np.zeros((1000, 64), np.uint8)
    batch = pa.RecordBatch.from_arrays(
        [pa.array([r.tobytes() for r in x], pa.binary()), pa.array(np.zeros(1000, np.int64))],
        ["features", "label"])
    try:
        open_shard([batch] * 4, shape=(64,), data="stream", directory=full,
                   where="partition 2")
        print("no error")
    except ResourceError as e:
        print(str(e).replace("\\n", " "))
    resource.setrlimit(resource.RLIMIT_FSIZE, (hard, hard))
    x = np.zeros((4096, 1024), np.uint8)
    batch = pa.RecordBatch.from_arrays(
        [pa.array([r.tobytes() for r in x], pa.binary()), pa.array(np.zeros(4096, np.int64))],
        ["features", "label"])
    shard = open_shard([batch] * 8, shape=(1024,), data="stream", directory=held)
    assert shard.spilled_bytes == 8 * 4096 * (1024 + 8)
    print("spilled", flush=True)
    time.sleep(120)
""")


@pytest.fixture(scope="module")
def child(tmp_path_factory):
    """The child, its two directories and its first line (what the full disk said), once it
    holds its spill."""
    full, held = tmp_path_factory.mktemp("full"), tmp_path_factory.mktemp("held")
    proc = subprocess.Popen([sys.executable, "-c", _CHILD, str(full), str(held)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        said, spilled = proc.stdout.readline().rstrip("\n"), proc.stdout.readline().strip()
        assert spilled == "spilled", (said, spilled, proc.stderr.read() if proc.poll() else "")
        yield proc, full, held, said
    finally:
        proc.kill()
        proc.wait(30)


def test_spill_files_are_gone_after_success_and_after_a_killed_task(tmp_path, child):
    x, y = _pixels(300, 64)
    shard = open_shard(_binary_batches(x, y), shape=(64,), data="stream",
                       directory=str(tmp_path))
    # the spill exists only behind the task's descriptors: no name in the directory
    assert os.listdir(tmp_path) == []
    links = [os.readlink(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd")
             if os.path.exists(f"/proc/self/fd/{fd}")]
    spills = [link for link in links if link.startswith(str(tmp_path))]
    assert len(spills) == 2 and all(link.endswith("(deleted)") for link in spills)
    assert sum(os.fstat(fd).st_size for fd in (shard._x.fd, shard._y.fd)) == 300 * 72
    shard.close()
    links = [os.readlink(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd")
             if os.path.exists(f"/proc/self/fd/{fd}")]
    assert not [link for link in links if link.startswith(str(tmp_path))]

    # a task killed with SIGKILL (no finally runs): the kernel drops the file with it
    proc, _, held_dir, _ = child
    held = [os.readlink(f"/proc/{proc.pid}/fd/{fd}") for fd in os.listdir(f"/proc/{proc.pid}/fd")]
    assert any(h.startswith(str(held_dir)) and h.endswith("(deleted)") for h in held)
    assert os.listdir(held_dir) == []
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    assert not os.path.exists(f"/proc/{proc.pid}") and os.listdir(held_dir) == []


def test_a_full_local_disk_is_a_clear_error(child):
    _, full, _, msg = child
    assert msg.startswith("the local disk is full: spilling the partition 2 to " + str(full))
    assert "needs at least 64,000 more bytes" in msg and "spark.local.dir" in msg
    assert os.listdir(full) == []
