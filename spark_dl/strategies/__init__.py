"""How the replicas of a fit share what they learn: one module per strategy, each with its
options and its driver half (driver.py) and task half (task.py); what they share on the
driver is base.py, on the tasks spark_dl.runtime (the replica loop, loop.py), and the transports (rendezvous, shared
memory, the authenticated channel, the parameter server) are in spark_dl.transport.

    fit(df, model, strategy=Downpour(n_push=4, mode="sync"))
    fit(df, model, strategy="gossip")                  # a name: the strategy's defaults

A new strategy is a folder here (its options, its driver's plan, its replica loop hooks) and
one line in STRATEGIES.
"""

from __future__ import annotations

from collections.abc import Mapping

from ..errors import ConfigError
from .allreduce import AllReduce
from .base import FitResult, Job, Strategy
from .boosting import Boosting
from .downpour import Downpour
from .fsdp import FSDP
from .gossip import Gossip
from .localsgd import LocalSGD

__all__ = ["FSDP", "STRATEGIES", "AllReduce", "Boosting", "Downpour", "FitResult", "Gossip",
           "Job", "LocalSGD", "Strategy", "make_strategy"]

STRATEGIES: dict[str, type[Strategy]] = {
    "allreduce": AllReduce,
    "downpour": Downpour,
    "gossip": Gossip,
    "boosting": Boosting,
    "localsgd": LocalSGD,
    "fsdp": FSDP,
}


def make_strategy(spec, **options) -> Strategy:
    """A Strategy from a Strategy (returned as is), a name (its defaults, or ``options``) or
    a mapping {"name": ..., **options} (a job file's [train.strategy] table)."""
    if isinstance(spec, Strategy):
        if options:
            raise ConfigError(f"options {sorted(options)} given beside the strategy object "
                              f"{spec!r}: set them on the object")
        return spec
    if isinstance(spec, Mapping):
        options = {**{k: v for k, v in spec.items() if k != "name"}, **options}
        spec = spec.get("name")
    if spec not in STRATEGIES:
        raise ConfigError(f"unknown strategy {spec!r}; choose one of {', '.join(STRATEGIES)} "
                          f"(or pass a strategy object, e.g. Downpour(n_push=4))")
    return STRATEGIES[spec](**options)


def option_owner(name: str) -> str | None:
    """The strategy one of whose options is called ``name`` (for fit's error messages)."""
    import dataclasses
    for cls in STRATEGIES.values():
        if name in {f.name for f in dataclasses.fields(cls)}:
            return cls.__name__
    return None
