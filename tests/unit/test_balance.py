"""The speed-proportional split of a synchronous step's global batch (spark_dl.balance):
largest-remainder rounding, memory caps, the equal-time fixed point, wrap-around batches, and
rows moved between replicas (over a real gloo group) so that shards follow the split."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from spark_dl.balance import (
    activation_bytes,
    balanced_batches,
    check_balance,
    equal_time_split,
    move_plan,
    move_rows,
    rebatch,
    row_targets,
    split,
)
from spark_dl.data.bridge import ShardData
from spark_dl.data.stream import StreamShard
from spark_dl.errors import ConfigError, ResourceError

from .ranks import run_on_ranks


def test_split_is_proportional_with_largest_remainders():
    # quotas 42.86, 28.57, 28.57: floors 42 + 28 + 28 = 98, the two largest remainders get a row
    assert split(100, [3, 2, 2]) == [43, 29, 28]
    assert split(128, [2, 1]) == [85, 43]
    assert split(10, [1, 1, 1]) == [4, 3, 3]          # ties: the lower replica first
    assert split(7, [1.0]) == [7]


@pytest.mark.parametrize("seed", range(20))
def test_split_sums_to_the_batch_and_never_exceeds_a_cap(seed):
    g = np.random.default_rng(seed)
    n = int(g.integers(1, 6))
    speeds = list(g.uniform(0.1, 10, n))
    caps = [int(c) for c in g.integers(1, 80, n)]
    total = int(g.integers(n, sum(caps) + 1))
    shares = split(total, speeds, caps)
    assert sum(shares) == total
    assert all(1 <= s <= c for s, c in zip(shares, caps))
    # the shares below their cap are the proportional quotas of what the capped ones left
    free = [p for p in range(n) if shares[p] < caps[p]]
    left = total - sum(shares[p] for p in range(n) if p not in free)
    weight = sum(speeds[p] for p in free)
    for p in free:
        assert abs(shares[p] - left * speeds[p] / weight) < 1 + 1e-9, (shares, speeds, caps)


def test_a_cap_moves_the_rest_to_the_others():
    assert split(128, [2, 1], caps=[50, 200]) == [50, 78]
    assert split(5, [1000, 1, 1]) == [3, 1, 1]         # nobody starves


def test_memory_caps_and_speeds_that_cannot_be_split_are_clear_errors():
    with pytest.raises(ResourceError, match=r"replica 1's memory holds 0 samples.*more memory"):
        split(10, [1, 1], caps=[10, 0])
    with pytest.raises(ResourceError, match=r"does not fit the replicas' memory.*lower batch_size"):
        split(100, [1, 1], caps=[30, 40])
    for bad in (0.0, math.nan, -1.0, math.inf):
        with pytest.raises(ResourceError, match="replica 1's measured speed"):
            split(10, [1.0, bad])


def test_bad_balance_options_name_the_choices():
    check_balance(None), check_balance("speed"), check_balance("adaptive"), check_balance([2, 1])
    with pytest.raises(ConfigError, match="'speed', 'adaptive' or a list"):
        check_balance("fast")
    with pytest.raises(ConfigError, match="positive finite"):
        check_balance([1, 0])
    with pytest.raises(ConfigError, match="3 shares but the fit has 2 replicas"):
        check_balance([1, 1, 1], replicas=2)


def test_equal_time_split_makes_the_steps_take_as_long():
    # replica 1 is twice as slow per row, both pay 1 ms a step
    times = [lambda b: 1e-3 + 1e-4 * b, lambda b: 1e-3 + 2e-4 * b]
    shares = equal_time_split(128, times)
    assert shares == [85, 43]
    t = [f(b) for f, b in zip(times, shares)]
    assert abs(t[0] - t[1]) <= 2e-4                     # within one row of the slow replica


def test_rebatch_cuts_exact_sizes_across_batches():
    parts = [(torch.arange(i * 5, i * 5 + 5), torch.arange(i * 5, i * 5 + 5) * 10)
             for i in range(3)]
    out = list(rebatch(parts, 4))
    assert [x.tolist() for x, _ in out] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    assert all(torch.equal(y, x * 10) for x, y in out)


def test_balanced_batches_wrap_around_with_a_new_order_per_pass():
    x = np.arange(10, dtype=np.float32)[:, None]
    shard = ShardData(x, np.arange(10))
    got = [b[1].tolist() for b in balanced_batches(shard, 4, 5, shuffle=True, seed=3,
                                                   epoch=2)]
    assert [len(b) for b in got] == [4] * 5
    rows = [r for b in got for r in b]
    assert sorted(rows[:10]) == list(range(10)) and sorted(rows[10:20]) == list(range(10))
    first = [r for b in shard.batches(4, shuffle=True, seed=3, epoch=2) for r in b[1].tolist()]
    assert rows[:10] == first                          # pass 0 is the unbalanced epoch's order
    assert rows[10:20] != first                        # the next pass is shuffled anew
    assert list(balanced_batches(shard, 0, 5, shuffle=True, seed=3, epoch=2)) == []
    empty = ShardData(np.zeros((0, 1), np.float32), np.zeros(0, np.int64))
    assert list(balanced_batches(empty, 4, 5, shuffle=True, seed=3, epoch=2)) == []


def test_activation_bytes_counts_what_backward_keeps():
    model = torch.nn.Sequential(torch.nn.Linear(20, 30), torch.nn.ReLU(), torch.nn.Linear(30, 5))
    loss = torch.nn.functional.cross_entropy
    x, y = torch.randn(16, 20), torch.randint(0, 5, (16,))
    small, big = activation_bytes(model, x[:8], y[:8], loss), activation_bytes(model, x, y, loss)
    assert 1.8 < big / small < 2.2                     # grows with the batch, not with weights
    assert big >= 16 * (20 + 30) * 4                   # at least the inputs of both layers


def test_column_widths_follow_the_shares():
    from spark_dl.model_parallel import split_sizes
    assert split_sizes(10, 4) == [3, 3, 2, 2]                      # even, as before
    assert split_sizes(10, 2, (2, 1)) == [7, 3]
    assert split_sizes(3, 3, (100, 1, 1)) == [1, 1, 1]             # one column each at least


def test_partition_speeds_are_the_median_over_replicas():
    from spark_dl.planning.cost_model import partition_speeds
    # tasks r F + p: 3 replicas x 2 partitions; partition 1 is slower on every replica
    assert partition_speeds([4.0, 2.0, 5.0, 1.0, 3.0, 2.5], 2) == [4.0, 2.0]


def test_row_targets_follow_the_batches_by_largest_remainders():
    assert row_targets(96, [8, 24]) == [24, 72]
    assert row_targets(8000, [183, 73]) == [5719, 2281]
    assert row_targets(10, [1, 1, 1]) == [4, 3, 3]
    assert row_targets(50, [3, 0, 2]) == [30, 0, 20]           # no batch, no rows


@pytest.mark.parametrize("seed", range(30))
def test_move_plan_turns_holdings_into_targets(seed):
    rng = np.random.default_rng(seed)
    have = [int(v) for v in rng.integers(0, 50, rng.integers(1, 6))]
    want = row_targets(sum(have), [int(b) + 1 for b in rng.integers(0, 9, len(have))]) \
        if sum(have) else [0] * len(have)
    plan = move_plan(have, want)
    got = list(have)
    for src, dst, k in plan:
        assert k > 0
        got[src] -= k
        got[dst] += k
    assert got == want
    senders, receivers = {s for s, _, _ in plan}, {d for _, d, _ in plan}
    assert not senders & receivers                     # a replica only lends or only borrows
    assert [s for s, _, _ in plan] == sorted(s for s, _, _ in plan)
    assert [d for _, d, _ in plan] == sorted(d for _, d, _ in plan)
    with pytest.raises(ValueError, match="cannot move rows"):
        move_plan([1, 2], [2, 2])


def _shard(kind, lo, n, tmp):
    x = np.arange(lo, lo + n, dtype=np.float32)[:, None].repeat(3, 1)
    y = np.arange(lo, lo + n, dtype=np.int64)
    if kind == "memory":
        return ShardData(x, y)
    s = StreamShard("test shard", (3,), np.float32, ((), np.int64), buffer=64, directory=tmp)
    for i in range(0, n, 7):                            # appended in pieces, as from Arrow
        s.append(x[i:i + 7], y[i:i + 7])
    return s


def _group_body(rank, world, sizes, targets, tmp):
    """Both kinds of shard moving rows, then a borrower short of memory, one after the other
    in one group of ranks (each spawned rank imports torch anew: seconds)."""
    import torch
    lo = sum(sizes[:rank])
    out = {}
    for kind in ("memory", "stream"):
        shard = _shard(kind, lo, sizes[rank], tmp)
        moved = move_rows(shard, move_plan(sizes, targets), rank, torch.device("cpu"))
        # a second re-split back to the original sizes (adaptive mode moves again)
        back = move_rows(shard, move_plan(targets, sizes), rank, torch.device("cpu"))
        # ... and forth once more, then the rows this replica holds, in its order
        move_rows(shard, move_plan(sizes, targets), rank, torch.device("cpu"))
        ys = [int(v) for _, y in shard.batches(1000, shuffle=False) for v in y]
        xs = np.concatenate([x.numpy() for x, _ in shard.batches(1000, shuffle=False)])
        out[kind] = {"moved": moved, "back": back, "rows": len(shard), "labels": ys,
                     "features_match": bool((xs == np.asarray(ys, np.float32)[:, None]).all())}
    out["short"] = _short(rank)
    return out


_GROUP: dict = {}


def _group(tmp_path_factory) -> list[dict]:
    """The 3 ranks' reports of _group_body, run once for the tests that read them."""
    if not _GROUP:
        tmp = tmp_path_factory.mktemp("ranks")
        _GROUP["reports"] = run_on_ranks(_group_body, 3, tmp, [40, 40, 40],
                                         row_targets(120, [10, 30, 20]), str(tmp))
    return _GROUP["reports"]


def test_rows_move_between_replicas_and_none_is_lost_or_doubled(tmp_path_factory):
    targets = row_targets(120, [10, 30, 20])                          # [20, 60, 40]
    reports = _group(tmp_path_factory)
    for kind in ("memory", "stream"):
        out = [r[kind] for r in reports]
        assert [r["rows"] for r in out] == targets, kind
        assert [r["moved"] for r in out] == [20, 20, 0]
        assert [r["back"] for r in out] == [20, 20, 0]
        assert all(r["features_match"] for r in out)
        assert sorted(v for r in out for v in r["labels"]) == list(range(120))
        assert out[0]["labels"] == list(range(20))          # the lender keeps the head
        assert out[1]["labels"][:40] == list(range(40, 80))  # the borrower's own rows first
        assert out[2]["labels"] == list(range(80, 120))


def test_shard_tail_truncate_extend_agree_for_both_kinds(tmp_path):
    for kind in ("memory", "stream"):
        s = _shard(kind, 0, 30, str(tmp_path))
        tail = list(s.tail(12, chunk_bytes=5 * 20))          # 5 rows of 12 + 8 bytes
        assert [len(x) for x, _ in tail] == [5, 5, 2]
        assert [int(v) for _, y in tail for v in y] == list(range(18, 30))
        s.truncate(18)
        s.extend([(np.full((2, 3), 99, np.float32), np.array([99, 98]))])
        assert len(s) == 20
        assert [int(v) for _, y in s.batches(100, shuffle=False) for v in y] == \
            [*range(18), 99, 98]
        s.close()


def _short(rank):
    """Rank 0 lends 2 of its 8 rows of 256 KiB to rank 1 (4 rows), whose address space has 1
    MiB left: the ResourceError of each rank, and the rows it still holds."""
    import resource

    import torch

    from spark_dl.data.memory import proc_status_kib
    x = np.zeros((8, 64, 1024), np.float32)                # 256 KiB a row
    n = (8, 4, 0)[rank]
    shard = ShardData(x[:n], np.zeros(n, np.int64))
    if rank == 1:                  # the borrower may map 1 MiB more: 6 rows do not fit
        size = proc_status_kib("VmSize") * 1024
        resource.setrlimit(resource.RLIMIT_AS, (size + (1 << 20), resource.RLIM_INFINITY))
    try:
        move_rows(shard, move_plan([8, 4, 0], [6, 6, 0]), rank, torch.device("cpu"))
    except ResourceError as e:
        return {"error": str(e), "rows": len(shard)}
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY,) * 2)
    return {"error": None, "rows": len(shard)}


def test_a_borrower_without_memory_stops_every_rank_before_a_row_moves(tmp_path_factory):
    out = [r["short"] for r in _group(tmp_path_factory)]
    assert [r["rows"] for r in out] == [8, 4, 0]               # nothing moved, nothing lost
    for r in out:
        assert r["error"] and "replica 1 cannot take its share of rows" in r["error"]
        assert "balance_rows='wrap'" in r["error"] and "data='stream'" in r["error"]
