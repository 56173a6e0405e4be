"""The shared-memory all-reduce on 3 real ranks (127.0.0.1, gloo for the rendezvous): the
one-phase sum of small buffers and the reduce-scatter / all-gather of large ones give the exact
sums (integer-valued float64), bit-identical on every rank, step after step, also for buffers
smaller than the segment (DDP's buckets) and with values that change every step; the
segment never reaches Python's resource tracker and is gone from /dev/shm afterwards."""

from __future__ import annotations

from .ranks import run_on_ranks


def _reduce(rank, world, name):
    from multiprocessing import resource_tracker

    import torch

    from spark_dl.transport.shm import SPLIT_MIN, ShmAllReduce
    calls = []                                     # what Python's resource tracker is told

    def spy(method):
        real = getattr(resource_tracker, method)
        setattr(resource_tracker, method,
                lambda rname, rtype: (calls.append([method, rtype]), real(rname, rtype)))
    spy("register")
    spy("unregister")
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
    return {"steps": out, "tracker": [c for c in calls if c[1] == "shared_memory"]}


def test_shm_all_reduce_one_phase_and_split_are_exact_and_identical(tmp_path):
    import secrets
    from pathlib import Path
    name = f"sdl-test-{secrets.token_hex(4)}"
    reports = run_on_ranks(_reduce, 3, tmp_path, name)
    for r in reports:
        assert all(step["exact"] for step in r["steps"]), r
    assert all(r == reports[0] for r in reports)     # every rank the same sums
    # the segment is kept out of the resource tracker the spawned ranks share (each rank
    # unregistering the one name it holds made it print a KeyError traceback), and rank 0
    # unlinked it: nothing left in /dev/shm
    assert reports[0]["tracker"] == [], reports[0]["tracker"]
    assert not (Path("/dev/shm") / name).exists()
