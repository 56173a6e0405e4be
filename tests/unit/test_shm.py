"""The shared-memory all-reduce on 3 real ranks (127.0.0.1, gloo for the rendezvous): the
one-phase sum of small buffers and the reduce-scatter / all-gather of large ones give the exact
sums (integer-valued float64), bit-identical on every rank, step after step, also for buffers
smaller than the segment (DDP's buckets) and with values that change every step."""

from __future__ import annotations

from .ranks import run_on_ranks


def _reduce(rank, world, name):
    import torch

    from spark_dl.transport.shm import SPLIT_MIN, ShmAllReduce
    n = 3 * SPLIT_MIN + 7                          # columns split unevenly over the ranks
    shm = ShmAllReduce(n, torch.float64, name)
    out = []
    for step, size in enumerate((n, 100, n, SPLIT_MIN, SPLIT_MIN - 1, n)):
        values = torch.arange(size, dtype=torch.float64) * (rank + 1) + 1000 * step
        got = shm(values.clone())
        expect = torch.arange(size, dtype=torch.float64) * sum(range(1, world + 1)) \
            + world * 1000 * step
        out.append({"size": size, "exact": bool(torch.equal(got, expect)),
                    "sum": float(got.sum())})
    shm.close()
    return out


def test_shm_all_reduce_one_phase_and_split_are_exact_and_identical(tmp_path):
    import secrets
    reports = run_on_ranks(_reduce, 3, tmp_path, f"sdl-test-{secrets.token_hex(4)}")
    for r in reports:
        assert all(step["exact"] for step in r), r
    assert all(r == reports[0] for r in reports)     # every rank the same sums
