"""Which modules of a model FSDP shards as units of their own (``wrap``): checked on the
driver, applied in every task. A unit's parameters are gathered whole only while it runs."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from ...errors import ConfigError

__all__ = ["check_wrap", "describe_wrap", "wrap_units"]

CONTAINERS = (nn.ModuleList, nn.ModuleDict)     # no forward of their own: never a unit
STACKS = (*CONTAINERS, nn.Sequential)           # the default takes their elements


def check_wrap(wrap) -> tuple[str, ...] | Callable | None:
    """``wrap`` as FSDP keeps it (a tuple of class names, a callable or None), or a
    ConfigError."""
    if wrap is None or callable(wrap):
        return wrap
    if isinstance(wrap, str):
        wrap = [wrap]
    if isinstance(wrap, (list, tuple)) and wrap and all(isinstance(n, str) and n
                                                        for n in wrap):
        return tuple(wrap)
    raise ConfigError(f"wrap must be None (each block of the model that holds parameters), a "
                      f"list of module class names (e.g. ['TransformerEncoderLayer']) or a "
                      f"function module -> bool, got {wrap!r}")


def describe_wrap(wrap) -> str | list | None:
    """``wrap`` for config.json."""
    if callable(wrap):
        return getattr(wrap, "__qualname__", repr(wrap))
    return list(wrap) if wrap is not None else None


def _holds_parameters(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None


def _default(model: nn.Module, prefix: str = "") -> list[str]:
    """Each direct child that holds parameters; a Sequential's, ModuleList's or ModuleDict's
    elements in its place (a transformer's blocks, a CNN's layers), recursively."""
    names = []
    for name, child in model.named_children():
        full = f"{prefix}{name}"
        if isinstance(child, STACKS):
            names += _default(child, f"{full}.")
        elif _holds_parameters(child):
            names.append(full)
    return names


def _untied(model: nn.Module, names: list[str]) -> list[str]:
    """``names`` less the modules that share a parameter with another of them (tied weights:
    the root holds those)."""
    modules = dict(model.named_modules())
    seen: dict[int, list[str]] = {}
    for name in names:
        for p in modules[name].parameters():
            seen.setdefault(id(p), []).append(name)
    tied = {n for owners in seen.values() if len(owners) > 1 for n in owners}
    return [n for n in names if n not in tied]


def wrap_units(model: nn.Module, wrap) -> list[str]:
    """The names of the modules ``fully_shard`` wraps before the root, each before the
    modules that hold it. ConfigErrors: a model without parameters, a class name the model
    does not hold (the message lists the ones it does), a policy that matches no module with
    parameters or matches a ModuleList, a parameter shared by two units of a policy (the
    default leaves tied modules to the root)."""
    if not _holds_parameters(model):
        raise ConfigError(f"FSDP shards the model's parameters, and {type(model).__name__} has "
                          f"none: give a model with parameters to train")
    named = [(n, m) for n, m in model.named_modules() if n]
    if wrap is None:
        units = _untied(model, _default(model))
    else:
        if callable(wrap):
            match = wrap
        else:
            classes = sorted({type(m).__name__ for _, m in model.named_modules()})
            unknown = [n for n in wrap if n not in classes]
            if unknown:
                raise ConfigError(f"wrap names {', '.join(map(repr, unknown))}, which "
                                  f"{type(model).__name__} does not hold; its module classes: "
                                  f"{', '.join(classes)}")
            match = lambda m: type(m).__name__ in wrap          # noqa: E731
        chosen = [(n, m) for n, m in named if match(m)]
        lists = [f"{n} ({type(m).__name__})" for n, m in chosen if isinstance(m, CONTAINERS)]
        if lists:
            raise ConfigError(f"wrap matches {', '.join(lists)}, which has no forward of its "
                              f"own: wrap its elements' class instead")
        units = [n for n, m in chosen if _holds_parameters(m)]
        if not units:
            raise ConfigError(f"wrap={describe_wrap(wrap)!r} matches no module of "
                              f"{type(model).__name__} that holds parameters: name the blocks "
                              f"to shard (e.g. its layers' class), or wrap=None for each block")
    modules = dict(named)
    _check_tied(model, [modules[n] for n in units], units)
    order = {n: i for i, (n, _) in enumerate(named)}
    return sorted(units, key=lambda n: -order[n])      # the inner before the outer


def _check_tied(model: nn.Module, modules: list[nn.Module], names: list[str]) -> None:
    """A parameter in two units that do not hold one another would be sharded twice."""
    owner: dict[int, str] = {}
    for name, module in sorted(zip(names, modules), key=lambda t: -t[0].count(".")):
        for p in module.parameters():
            other = owner.get(id(p))
            if other is not None and not other.startswith(f"{name}."):
                raise ConfigError(f"{type(model).__name__} shares a parameter between {other} "
                                  f"and {name} (tied weights), which FSDP would shard twice: "
                                  f"give wrap= a policy that keeps them in one unit, or "
                                  f"wrap=None, which leaves tied modules to the root")
            owner.setdefault(id(p), name)
