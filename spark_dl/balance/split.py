"""The split of a synchronous step's global batch |B| over the replicas.

Each replica's speed s_p(b) (samples/s at batch b) is measured before training (speed.py),
which fits t_p(b) = a_p + c_p b; the global batch is then split with |B_p| ∝ s_p(|B_p|) (a
fixed point: the batch sizes at which every replica's step takes as long), rounded by largest
remainders and capped by what each task's memory holds (``split``). ``balance="adaptive"``
re-splits after every epoch from the epoch's own step times (LB-BSP): a replica that slows
down mid-fit is followed. The gradients are summed weighted by samples, so every step's
gradient is the mean over the whole global batch, whatever the split.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from ..errors import ConfigError, ResourceError

__all__ = ["BALANCE_MODES", "check_balance", "equal_time_split", "split"]

BALANCE_MODES = (None, "speed", "adaptive")


def check_balance(balance, replicas: int | None = None) -> None:
    """ConfigError unless ``balance`` is None, "speed", "adaptive" or a sequence of positive
    finite shares (one per replica when ``replicas`` is known)."""
    if balance in BALANCE_MODES:
        return
    if isinstance(balance, str) or not isinstance(balance, Sequence):
        raise ConfigError(f"balance must be None, 'speed', 'adaptive' or a list of each "
                          f"replica's share of the global batch (e.g. [2, 1]), got {balance!r}")
    bad = [w for w in balance if isinstance(w, bool) or not isinstance(w, (int, float))
           or not math.isfinite(w) or w <= 0]
    if bad or not balance:
        raise ConfigError(f"balance shares must be positive finite numbers, got "
                          f"{list(balance)!r}")
    if replicas is not None and len(balance) != replicas:
        raise ConfigError(f"balance gives {len(balance)} shares but the fit has {replicas} "
                          f"replicas: give one share per replica")


def _check_speeds(speeds: Sequence[float]) -> None:
    for p, s in enumerate(speeds):
        if not (isinstance(s, (int, float)) and math.isfinite(s) and s > 0):
            raise ResourceError(
                f"replica {p}'s measured speed is {s!r} samples/s: it cannot be given a share "
                f"of the batch (a stalled or broken task, or a profile of zero steps); check "
                f"that task's executor, or use balance=None")


def split(total: int, speeds: Sequence[float], caps: Sequence[int] | None = None) -> list[int]:
    """``total`` rows split ∝ ``speeds`` by largest remainders, no share above its cap.

    A share whose proportional quota exceeds its cap is set to the cap and the rest is split
    over the others ∝ their speeds (water filling). Every replica gets at least one row when
    ``total`` allows, so its speed can still be measured. ResourceError when a cap is below one
    sample or the caps together hold less than ``total``."""
    n = len(speeds)
    _check_speeds(speeds)
    caps = [int(c) for c in caps] if caps is not None else [total] * n
    if len(caps) != n:
        raise ValueError(f"{n} speeds but {len(caps)} caps")
    for p, c in enumerate(caps):
        if c < 1:
            raise ResourceError(f"replica {p}'s memory holds {c} samples per step, less than "
                                f"one: give its executor more memory, or use a smaller model")
    if sum(caps) < total:
        raise ResourceError(f"the global batch of {total} rows does not fit the replicas' "
                            f"memory (at most {caps} rows per step each, {sum(caps)} in all): "
                            f"lower batch_size or give the executors more memory")
    fixed: dict[int, int] = {}
    while True:                               # water filling: shares over their cap are capped
        free = [p for p in range(n) if p not in fixed]
        left = total - sum(fixed.values())
        weight = sum(speeds[p] for p in free)
        quota = {p: left * speeds[p] / weight for p in free}
        over = [p for p in free if quota[p] > caps[p]]
        if not over:
            break
        for p in over:
            fixed[p] = caps[p]
    shares = {**fixed, **{p: math.floor(quota[p]) for p in free}}
    order = sorted(free, key=lambda p: (-(quota[p] - math.floor(quota[p])), p))
    rest = total - sum(shares.values())
    for p in order:                           # largest remainders first, within the caps
        if rest == 0:
            break
        if shares[p] < caps[p]:
            shares[p] += 1
            rest -= 1
    out = [shares[p] for p in range(n)]
    if total >= n:                            # nobody starves: its speed stays measurable
        for p in range(n):
            if out[p] == 0:
                donor = max(range(n), key=lambda q: (out[q], -q))
                out[donor] -= 1
                out[p] = 1
    return out


def equal_time_split(total: int, step_time: Sequence[Callable[[float], float]],
                     caps: Sequence[int] | None = None, rounds: int = 9) -> list[int]:
    """Shares ∝ each replica's speed at its own share, s_p(b_p) = b_p / t_p(b_p): the fixed
    point of ``split`` where every replica's step takes as long (starting from equal shares;
    a share of 0 is timed as 1 row)."""
    n = len(step_time)
    shares = [total / n] * n
    for _ in range(rounds):
        sizes = [max(b, 1) for b in shares]
        shares = split(total, [b / max(t(b), 1e-12) for b, t in zip(sizes, step_time)], caps)
    return shares
