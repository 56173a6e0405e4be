"""Hidden-unit activations by name, for the nets that take ``act=``."""

from __future__ import annotations

from torch import nn

__all__ = ["ACTIVATIONS", "activation"]

ACTIVATIONS = {"sigmoid": nn.Sigmoid, "tanh": nn.Tanh, "relu": nn.ReLU}


def activation(name: str) -> nn.Module:
    if name not in ACTIVATIONS:
        raise ValueError(f"unknown activation {name!r}; choose one of {sorted(ACTIVATIONS)}")
    return ACTIVATIONS[name]()
