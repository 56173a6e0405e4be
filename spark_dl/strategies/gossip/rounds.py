"""RD-PSGD: randomized decentralized parallel SGD (seed 003, Algorithm 2), the gossip round.

Every replica i keeps its own parameters x_i (one flat vector). Round k, before the local SGD
step on the gradient g_i computed at x_k,i:

    a_k      a Bernoulli(α) mask over the N coordinates, the same on every replica (drawn from
             the fit's seed and k, so nobody has to send it)
    x_k+½,i(s) = Σ_j W_ji x_k,j(s)   for s with a_k(s) = 1   (eq. 5-6: only these are sent)
    x_k+½,i(s) = x_k,i(s)            otherwise
    x_k+1,i  = x_k+½,i − γ g_i(x_k,i)   (the optimizer's step: momentum, weight decay)

W is symmetric and doubly stochastic, so a round leaves the replicas' average unchanged on
every coordinate; α = 1 is D-PSGD (Algorithm 1). A replica sends α·N values to each
neighbour instead of N. On a ring of n ≥ 3 replicas W gives 1/3 to itself and 1/3 to each
neighbour; with n = 2 both ring edges join the same pair: 1/3 itself, 2/3 the other.

The one-peer exponential graph (Ying et al., 2021, "Exponential graph is provably efficient
for decentralized deep training") changes its edges every round: round k of n replicas,
with h = ceil(log2 n) and s = 2^(k mod h), replica i takes half its own value and half that
of replica i − s, and sends its own to replica i + s (mod n). Each round's W is doubly
stochastic (a permutation averaged with the identity), so the average is kept; for n a power
of two, h consecutive rounds of α = 1 leave every replica at the exact average (a ring needs
on the order of n² rounds), and a replica sends to one peer a round instead of two.

The mask is drawn as its gaps (eq. 22): the distance between consecutive selected
coordinates is Geometric(α), so a round draws about α·N random numbers instead of N, and the
values go out by one index_select and come back by one index_copy_ (no loop over
coordinates). Point-to-point messages over torch.distributed (gloo isend/irecv on CPU), or,
when every replica shares one host (CPU), the rows of a shared-memory segment
(spark_dl/transport/shm.py): loopback TCP costs about a millisecond a message, as much as a
small model's step.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from spark_dl.runtime.buffers import replica_mean

__all__ = ["TOPOLOGIES", "Rounds", "average_and_distance", "consensus_distance",
           "exponential_peers", "mask_indices", "ring_peers"]

_ROUND_STRIDE = 1_000_003            # seed, round -> one generator seed (a prime stride)
TOPOLOGIES = ("ring", "exponential")


def check_alpha(alpha: float) -> None:
    if not (isinstance(alpha, (int, float)) and 0 < alpha <= 1):
        raise ValueError(f"alpha (the fraction of coordinates a gossip round averages) must be "
                         f"in (0, 1], got {alpha!r}; 1 is D-PSGD, the paper's 0.1 sends a "
                         f"tenth of the bytes")


def mask_indices(numel: int, alpha: float, seed: int, round_: int) -> torch.Tensor:
    """The sorted coordinates (int64) that round ``round_`` averages: each one selected with
    probability ``alpha``, the same on every replica for the same (seed, round)."""
    check_alpha(alpha)
    if alpha == 1:
        return torch.arange(numel)
    g = torch.Generator().manual_seed((seed * _ROUND_STRIDE + round_) % (1 << 63))
    log_q = math.log1p(-alpha)
    gaps, covered = [], 0
    while covered < numel:                  # usually once: 10% more gaps than expected
        n = int(1.1 * alpha * (numel - covered)) + 16
        u = torch.rand(n, generator=g, dtype=torch.float64)
        # P(gap = m) = (1 - α)^(m-1) α on m = 1, 2, ...: the inverse of its distribution
        gap = (torch.log1p(-u) / log_q).floor_().clamp_(max=numel) + 1
        gaps.append(gap.to(torch.int64))
        covered += int(gaps[-1].sum())
    idx = torch.cat(gaps).cumsum_(0) - 1
    return idx[:int(torch.searchsorted(idx, numel))]


def ring_peers(rank: int, world: int) -> tuple[list[tuple[int, float]], float]:
    """([(neighbour, its weight W_ji)], own weight W_ii) of ``rank`` on a ring of ``world``."""
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"rank {rank} is not in a ring of {world} replicas")
    if world == 1:
        return [], 1.0
    if world == 2:
        return [(1 - rank, 2 / 3)], 1 / 3
    return [((rank - 1) % world, 1 / 3), ((rank + 1) % world, 1 / 3)], 1 / 3


def exponential_peers(rank: int, world: int, round_: int) -> tuple[int, int]:
    """(the replica ``rank`` takes half its value from, the one it sends its own to) in round
    ``round_`` of the one-peer exponential graph of ``world`` replicas."""
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"rank {rank} is not in a graph of {world} replicas")
    if world == 1:
        return rank, rank
    shift = 1 << (round_ % math.ceil(math.log2(world)))
    return (rank - shift) % world, (rank + shift) % world


class Rounds:
    """The gossip rounds of one replica over ``flat`` (its parameters, updated in place),
    in the current torch.distributed group (or ``group``), on ``topology`` ("ring" or
    "exponential")."""

    def __init__(self, flat: torch.Tensor, alpha: float, seed: int, rank: int | None = None,
                 world: int | None = None, group=None, shm=None, topology: str = "ring"):
        check_alpha(alpha)
        if flat.dim() != 1:
            raise ValueError(f"Rounds needs the parameters as one flat vector, got shape "
                             f"{tuple(flat.shape)}")
        if topology not in TOPOLOGIES:
            raise ValueError(f"topology must be one of {', '.join(map(repr, TOPOLOGIES))}, "
                             f"got {topology!r}")
        self.flat, self.alpha, self.seed, self.group = flat, float(alpha), int(seed), group
        self.rank = dist.get_rank(group) if rank is None else rank
        self.world = dist.get_world_size(group) if world is None else world
        self.topology = topology
        # the ring's edges are fixed; the exponential graph has one peer a round, which changes
        self._ring = ring_peers(self.rank, self.world)
        self.neighbours = len(self._ring[0]) if topology == "ring" else min(self.world - 1, 1)
        self.shm = shm              # a ShmAllReduce of the group when it shares one host
        self.transport = "shm" if shm is not None else \
            dist.get_backend(group) if self.world > 1 else "none"
        self.bytes_sent = 0
        self.rounds = 0

    def round(self, k: int) -> torch.Tensor:
        """Round ``k``: average the masked coordinates with the neighbours; returns the mask."""
        idx = mask_indices(self.flat.numel(), self.alpha, self.seed, k).to(self.flat.device)
        mine = self.flat.index_select(0, idx)
        if self.neighbours:
            peers, own, targets = self._edges(k)
            if self.shm is not None:                 # one host: every row in shared memory
                rows = self.shm.gather(mine)         # host memory: to this replica's device
                theirs = [rows[p].to(mine.device) for p, _ in peers]
            else:
                theirs = [torch.empty_like(mine) for _ in peers]
                reqs = [dist.irecv(buf, self._global(p), group=self.group)
                        for (p, _), buf in zip(peers, theirs)]
                reqs += [dist.isend(mine, self._global(p), group=self.group) for p in targets]
                for r in reqs:
                    r.wait()
            mixed = mine * own
            for (_, w), buf in zip(peers, theirs):
                mixed.add_(buf, alpha=w)
            self.flat.index_copy_(0, idx, mixed)
            self.bytes_sent += mine.numel() * mine.element_size() * len(targets)
        self.rounds += 1
        return idx

    def _edges(self, k: int) -> tuple[list[tuple[int, float]], float, list[int]]:
        """Round ``k``'s ([(replica taken from, its weight W_ji)], own weight W_ii, [replicas
        sent to])."""
        if self.topology == "exponential":
            src, dst = exponential_peers(self.rank, self.world, k)
            return [(src, 0.5)], 0.5, [dst]
        peers, own = self._ring
        return peers, own, [p for p, _ in peers]

    def _global(self, rank: int) -> int:
        return rank if self.group is None else dist.get_global_rank(self.group, rank)


def consensus_distance(flat: torch.Tensor, group=None) -> float:
    """Mean over the replicas of ‖x_i − x̄‖², the same value on every replica."""
    return average_and_distance(flat, group)[1]


def average_and_distance(flat: torch.Tensor, group=None) -> tuple[torch.Tensor, float]:
    """(x̄, mean over the replicas of ‖x_i − x̄‖²), the same on every replica: two
    all-reduces."""
    mean = replica_mean(flat, group=group)
    d = ((flat.detach() - mean) ** 2).sum().to(torch.float64).reshape(1)
    dist.all_reduce(d, group=group)
    return mean, float(d) / dist.get_world_size(group)
