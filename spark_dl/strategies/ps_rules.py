"""The rules Downpour and Boosting share for the parameter server on the driver: where a
fit's momentum goes under a staleness rule (the server, the workers), the server's rate,
optimizer, averaging span, clip and learning-rate schedule.

With R workers pushing in turn every push lands about R - 1 versions after the values it
was computed on; a staleness rule says how the fit allows for it:

    "dana"     fit's momentum at the workers, each reporting it, the server stepping plain
               SGD at dana_rate and sending every worker the look-ahead of the momentum
               steps to come (DANA-Zero, Hakimi et al. 2019); the default of both.
    "halfway"  the server keeps the momentum, lowered to the mean of the two asynchrony
               rules below (for losses where a delayed full step overshoots).
    "lr"       a push computed tau >= 2 versions ago steps lr / tau (Zhang et al. 2016).
    "none"     every push a plain step.

Which rules are kept and the measurements behind them: docs/guides/downpour.md, "Staleness
rule"."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError
from ..optim.average import DEFAULT_AVERAGE
from .base import Job, check_choice

__all__ = ["CLIP", "STALENESS_RULES", "StalenessPlan", "check_clip", "check_staleness",
           "dana_rate", "looks_ahead", "lr_schedule", "plan_staleness", "server_average",
           "server_clip", "server_momentum", "server_optimizer_for", "worker_momentum",
           "worker_rule"]

STALENESS_RULES = ("halfway", "lr", "none", "dana")
_USE_DANA = "'dana' (the default: fit's momentum at the workers, with the look-ahead)"
REMOVED_RULES = {
    "worker": _USE_DANA,
    "worker+short": _USE_DANA,
    "step": f"'halfway' (the server's momentum between 'step' and 'momentum') or {_USE_DANA}",
    "momentum": f"'halfway' (the server's momentum between 'step' and 'momentum') or "
                f"{_USE_DANA}",
    "lr+momentum": "'lr' (lr / tau for a push tau >= 2 versions old) or 'halfway'",
}
CLIP = 2.0        # the default cap on a push (docs/guides/downpour.md, "Clipped pushes")


def check_staleness(staleness) -> None:
    """A ConfigError for a removed or unknown rule, naming what to use instead."""
    if isinstance(staleness, str) and staleness in REMOVED_RULES:
        raise ConfigError(f"staleness={staleness!r} was removed; use "
                          f"{REMOVED_RULES[staleness]} (docs/guides/downpour.md, "
                          f"\"Staleness rule\")")
    check_choice("staleness", staleness, STALENESS_RULES)


@dataclass(frozen=True)
class StalenessPlan:
    """What a staleness rule makes of fit's momentum for a fit's replicas: the server's
    momentum, the momentum each worker carries over its pushes, the server's rate as a
    multiple of fit's, whether the server sends the look-ahead and divides a stale push's
    step by its staleness."""

    server_momentum: float
    worker_momentum: float
    rate: float
    look_ahead: bool
    staleness_lr: bool


def plan_staleness(staleness: str, momentum: float, replicas: int, mode: str,
                   server_optimizer: str, overlapped: bool = False) -> StalenessPlan:
    """The plan of ``staleness`` for ``replicas`` pushing in ``mode`` to a ``server_optimizer``
    server, with fit's ``momentum``; ``overlapped``: each push overlaps the worker's next
    step (a version more late)."""
    carried = worker_momentum(momentum, replicas, mode, staleness, server_optimizer)
    carried, rate = worker_rule(carried, replicas, overlapped, staleness)
    return StalenessPlan(server_momentum(momentum, replicas, mode, staleness, overlapped),
                         carried, rate, looks_ahead(staleness, carried),
                         mode == "async" and staleness == "lr")


def worker_momentum(momentum: float, replicas: int, mode: str, staleness: str,
                    server_optimizer: str) -> float:
    """The momentum each worker carries over its pushes: fit's under "dana" with several
    asynchronous replicas and a momentum SGD server, else 0 (nothing to move)."""
    carried = mode == "async" and replicas > 1 and staleness == "dana" and \
        server_optimizer == "momentum"
    return momentum if carried else 0.0


def worker_rule(carried: float, replicas: int, overlapped: bool,
                staleness: str) -> tuple[float, float]:
    """(the momentum each worker carries, the server's rate as a multiple of fit's): under
    "dana" with momentum at the workers, that momentum at dana_rate (of twice the replicas
    where the pushes overlap the next step); else fit's rate."""
    if looks_ahead(staleness, carried):
        return carried, dana_rate(replicas * (2 if overlapped else 1))
    return carried, 1.0


def dana_rate(replicas: int) -> float:
    """Rule "dana": the server's rate as a multiple of fit's, 1 up to 4 replicas, 4 / R from
    there, not below 1/2 (docs/guides/downpour.md, "Look-ahead")."""
    return min(1.0, max(0.5, 4.0 / replicas))


def looks_ahead(staleness: str, carried: float) -> bool:
    """Whether the workers report their momentum and the server returns the look-ahead of
    their steps to come: rule "dana" with momentum at the workers."""
    return staleness == "dana" and carried > 0


def server_momentum(momentum: float, replicas: int, mode: str, staleness: str,
                    overlapped: bool = False) -> float:
    """The server's momentum (async with several replicas; otherwise ``momentum``): 0 under
    "dana" (the workers keep it); under "halfway" the mean of m' with lr / (1 - m') = lr /
    (1 - momentum) / D, D the replicas (twice them when the pushes overlap), not below 0 (a
    push lands D - 1 versions late, and the step that stays stable falls about as 1 / D),
    and momentum - (1 - 1/R), not below 0 (asynchrony on R workers adds momentum 1 - 1/R of
    itself: Mitliagkas et al. 2016); "lr" and "none" keep ``momentum``."""
    if mode != "async" or replicas <= 1:
        return momentum
    if staleness == "dana":
        return 0.0
    if staleness == "halfway":
        delay = replicas * (2 if overlapped else 1)
        by_step = max(0.0, 1.0 - delay * (1.0 - momentum))
        by_asynchrony = max(0.0, momentum - (1.0 - 1.0 / replicas))
        return (by_step + by_asynchrony) / 2
    return momentum


def server_optimizer_for(optimizer: str, momentum: float) -> str:
    """The server's optimizer for fit's ``optimizer``: SGD with momentum is "momentum"."""
    if optimizer == "sgd":
        return "momentum" if momentum else "sgd"
    return optimizer


def server_average(average: float | None, mode: str) -> float:
    """The server's averaging span in epochs: ``average``, or by default DEFAULT_AVERAGE in
    async mode (whatever the replicas) and 0 in the others (sync, sequential: rounds that
    follow one trajectory)."""
    if average is not None:
        return float(average)
    return DEFAULT_AVERAGE if mode == "async" else 0.0


def check_clip(clip, applies: bool) -> None:
    """``clip``: None (the default), 0 (off) or a number > 0, in a mode whose server steps
    pushes one by one (``applies``)."""
    if clip is None:
        return
    if isinstance(clip, bool) or not isinstance(clip, (int, float)) or not clip >= 0:
        raise ConfigError(f"clip must be None (the default), 0 (off) or a number > 0 (a "
                          f"push's step gradient at most that many times the running mean "
                          f"norm; e.g. 2), got {clip!r}")
    if clip and not applies:
        raise ConfigError("clip cuts single pushes: it needs mode='async' or 'sequential' "
                          "(a sync round averages the replicas' gradients, got mode='sync')")


def server_clip(clip: float | None, replicas: int, mode: str) -> float | None:
    """The server's cap on a push (see check_clip): ``clip``, or by default CLIP with several
    asynchronous replicas (pushes a version old, the delay that makes momentum unstable)
    and off otherwise; 0: off."""
    if clip is None:
        return CLIP if mode == "async" and replicas > 1 else None
    return float(clip) or None


def lr_schedule(job: Job, replicas: int, mode: str, rate: float = 1.0):
    """The server's rate: in sync mode an update averages a round of every replica's
    mini-batch (k = replicas, the fit's scaling rule and warmup); asynchronous and sequential
    pushes are each applied as they come, a push of n mini-batches stepping f(n) times their
    mean (the server's push_scaling), so k = 1 there; fit's lr times ``rate``."""
    from ..optim.schedule import LRSchedule
    t = job.train
    return LRSchedule(t["lr"] * rate, replicas if mode == "sync" else 1, t["lr_scaling"],
                      t["warmup_epochs"], t["lr_decay"], job.stage["epochs"])
