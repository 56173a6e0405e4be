"""The speed-proportional split of a synchronous step's global batch (spark_dl.parallel.balance):
largest-remainder rounding, memory caps, the equal-time fixed point, wrap-around batches."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from spark_dl.data.bridge import ShardData
from spark_dl.errors import ConfigError, ResourceError
from spark_dl.parallel.balance import (
    activation_bytes,
    balanced_batches,
    check_balance,
    equal_time_split,
    rebatch,
    split,
)


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
    from spark_dl.parallel.model_parallel import split_sizes
    assert split_sizes(10, 4) == [3, 3, 2, 2]                      # even, as before
    assert split_sizes(10, 2, (2, 1)) == [7, 3]
    assert split_sizes(3, 3, (100, 1, 1)) == [1, 1, 1]             # one column each at least


def test_partition_speeds_are_the_median_over_replicas():
    from spark_dl.parallel.cost_model import partition_speeds
    # tasks r F + p: 3 replicas x 2 partitions; partition 1 is slower on every replica
    assert partition_speeds([4.0, 2.0, 5.0, 1.0, 3.0, 2.5], 2) == [4.0, 2.0]
