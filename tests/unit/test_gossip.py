"""RD-PSGD's gossip round (strategies/gossip/rounds.py) on real processes (gloo on 127.0.0.1,
float64): alpha = 1 is D-PSGD computed by hand, on the ring and on the one-peer exponential
graph, any alpha keeps the replicas' average, every replica draws the same mask, and a round
sends alpha x the model to each neighbour."""

from __future__ import annotations

import pytest
import torch

from spark_dl.strategies.gossip.rounds import (
    Rounds,
    consensus_distance,
    exponential_peers,
    mask_indices,
    ring_peers,
)

from .ranks import run_on_ranks

N, ROUNDS, LR, SEED = 1000, 4, 0.1, 7


def _data(rank):
    """Replica ``rank``'s least-squares problem: A (16, N), b (16,)."""
    g = torch.Generator().manual_seed(100 + rank)
    return (torch.randn(16, N, dtype=torch.float64, generator=g) / N ** 0.5,
            torch.randn(16, dtype=torch.float64, generator=g))


def _grad(x, rank):
    a, b = _data(rank)
    return a.t() @ (a @ x - b) / len(b)               # of 1/2 mean (a x - b)^2


def _start(rank):
    return torch.randn(N, dtype=torch.float64, generator=torch.Generator().manual_seed(rank))


def _rank_main(rank, world, alpha, topology="ring"):
    import torch.distributed as dist
    x = _start(rank)
    gossip = Rounds(x, alpha, SEED, topology=topology)
    report = {"masks": [], "mean_error": 0.0, "trajectory": []}
    for k in range(ROUNDS):
        g = _grad(x, rank)                          # at x_k, before the round (Alg. 2)
        before = x.clone()
        dist.all_reduce(before)
        idx = gossip.round(k)
        after = x.clone()
        dist.all_reduce(after)
        report["mean_error"] = max(report["mean_error"],
                                   float((after - before).abs().max()) / world)
        x.sub_(LR * g)                              # x_k+1 = x_k+1/2 - lr g(x_k)
        report["masks"].append([len(idx), int(idx.sum()), int(idx[:5].sum())])
        report["trajectory"].append(x.tolist())
    report["bytes_sent"] = gossip.bytes_sent
    report["consensus"] = consensus_distance(x)
    return report


def _run(world, alpha, tmp_path):
    return run_on_ranks(_rank_main, world, tmp_path, alpha)


def _w(world):
    """The ring's mixing matrix, built from ring_peers."""
    w = torch.zeros(world, world, dtype=torch.float64)
    for i in range(world):
        peers, own = ring_peers(i, world)
        w[i, i] = own
        for j, wj in peers:
            w[i, j] += wj
    return w


@pytest.mark.parametrize("world", [2, 4])
def test_alpha_one_is_d_psgd_by_hand(world, tmp_path):
    """x_k+1,i = sum_j W_ij x_k,j - lr g_i(x_k,i): the D-PSGD recursion, to 1e-9."""
    reports = _run(world, 1.0, tmp_path)
    w = _w(world)
    assert torch.allclose(w, w.t()) and torch.allclose(w.sum(0), torch.ones(world, dtype=w.dtype))
    x = torch.stack([_start(r) for r in range(world)])
    for k in range(ROUNDS):
        g = torch.stack([_grad(x[r], r) for r in range(world)])
        x = w @ x - LR * g
        for r in range(world):
            got = torch.tensor(reports[r]["trajectory"][k], dtype=torch.float64)
            assert float((got - x[r]).abs().max()) <= 1e-9, (world, k, r)
    for r in reports:                                   # every coordinate, to each neighbour
        assert r["bytes_sent"] == ROUNDS * N * 8 * (1 if world == 2 else 2)


def _w_exponential(world, k):
    """Round k's mixing matrix on the one-peer exponential graph, from exponential_peers."""
    w = torch.zeros(world, world, dtype=torch.float64)
    for i in range(world):
        src, _ = exponential_peers(i, world, k)
        w[i, i] += 0.5
        w[i, src] += 0.5
    return w


@pytest.mark.parametrize("world", [3, 4])
def test_the_exponential_graph_is_d_psgd_by_hand(world, tmp_path):
    """Round k: x_i <- (x_i + x_(i - 2^(k mod h))) / 2, then the local step; to 1e-9, one
    peer's worth of bytes a round."""
    reports = run_on_ranks(_rank_main, world, tmp_path, 1.0, "exponential")
    x = torch.stack([_start(r) for r in range(world)])
    for k in range(ROUNDS):
        w = _w_exponential(world, k)
        ones = torch.ones(world, dtype=w.dtype)
        assert torch.allclose(w.sum(0), ones) and torch.allclose(w.sum(1), ones)
        g = torch.stack([_grad(x[r], r) for r in range(world)])
        x = w @ x - LR * g
        for r in range(world):
            got = torch.tensor(reports[r]["trajectory"][k], dtype=torch.float64)
            assert float((got - x[r]).abs().max()) <= 1e-9, (world, k, r)
    for r in reports:
        assert r["bytes_sent"] == ROUNDS * N * 8


def test_the_exponential_graph_averages_exactly_in_log2_rounds():
    """For a power of two, h = log2(n) rounds in a row make the exact average (from any
    round on); a ring of 8 is far from it after as many rounds. Sender and receiver agree."""
    for world in (2, 4, 8, 16):
        h = world.bit_length() - 1
        for start in (0, 1, 5):
            prod = torch.eye(world, dtype=torch.float64)
            for k in range(start, start + h):
                prod = _w_exponential(world, k) @ prod
            assert torch.allclose(prod, torch.full_like(prod, 1 / world)), (world, start)
        for k in range(h):
            for i in range(world):
                _, dst = exponential_peers(i, world, k)
                assert exponential_peers(dst, world, k)[0] == i
    ring = torch.linalg.matrix_power(_w(8), 3)
    assert float((ring - 1 / 8).abs().max()) > 0.1
    assert exponential_peers(0, 1, 3) == (0, 0)
    with pytest.raises(ValueError, match="rank 4 is not in a graph of 4"):
        exponential_peers(4, 4, 0)


@pytest.mark.parametrize("alpha", [0.5, 0.1])
def test_any_alpha_keeps_the_average_with_one_mask_for_all(alpha, tmp_path):
    reports = _run(3, alpha, tmp_path)
    for r in reports:
        assert r["mean_error"] <= 1e-12                 # a round leaves the average as it was
        assert r["masks"] == reports[0]["masks"]        # the same mask on every replica
        # alpha x N values to each of the 2 neighbours, every round
        sent = sum(m[0] for m in r["masks"]) * 8 * 2
        assert r["bytes_sent"] == sent
    assert len({m[1] for m in reports[0]["masks"]}) == ROUNDS   # a new mask every round
    assert reports[0]["consensus"] > 0                  # only some coordinates mixed


def test_the_mask_selects_alpha_of_the_coordinates():
    """About alpha x N coordinates (within 2% for a million), sorted and distinct, the same
    for the same (seed, round), another for the next round; alpha = 1 takes them all."""
    n = 1_000_000
    for alpha in (0.5, 0.1, 0.05):
        idx = mask_indices(n, alpha, seed=3, round_=0)
        assert abs(len(idx) / (alpha * n) - 1) < 0.02, (alpha, len(idx))
        assert idx.dtype == torch.int64 and int(idx[0]) >= 0 and int(idx[-1]) < n
        assert bool((idx[1:] > idx[:-1]).all())
        assert torch.equal(idx, mask_indices(n, alpha, seed=3, round_=0))
        assert not torch.equal(idx[:100], mask_indices(n, alpha, seed=3, round_=1)[:100])
        # each coordinate equally likely: the two halves hold half of the selection each
        assert abs(int((idx < n // 2).sum()) / len(idx) - 0.5) < 0.01
    assert torch.equal(mask_indices(10, 1.0, 0, 5), torch.arange(10))
    assert len(mask_indices(3, 0.001, 0, 0)) <= 3


def test_bad_alpha_and_rings():
    for alpha in (0, -0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match=r"alpha .* must be in \(0, 1\]"):
            mask_indices(10, alpha, 0, 0)
    with pytest.raises(ValueError, match="rank 3 is not in a ring of 3"):
        ring_peers(3, 3)
    assert ring_peers(0, 1) == ([], 1.0)
    assert ring_peers(0, 5) == ([(4, 1 / 3), (1, 1 / 3)], 1 / 3)
    with pytest.raises(ValueError, match="topology must be one of 'ring', 'exponential', got "
                                         "'torus'"):
        Rounds(torch.zeros(3), 0.5, 0, rank=0, world=2, topology="torus")
