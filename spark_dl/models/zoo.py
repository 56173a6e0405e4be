"""The models ``fit`` and the job files know by name: ``build_model(name, **config)``.

    "fc"           FCNet: 784-480-160-10, sigmoid (the thesis net)
    "cnn"          ThesisCNN: the thesis CNN on 1×28×28 digits
    "cnn_bn"       ThesisCNN with a BatchNorm after every convolution
    "resnet18"     ResNet18: CIFAR-style (num_classes=10, in_channels=3, width=64)
    "transformer"  TransformerLM: decoder-only (vocab=65, layers=4, width=256, heads=4,
                   context=128, dropout=0.1, tie=False)

``config`` goes to the model's constructor; everything is built from it (no downloads).
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from .cnn import ThesisCNN
from .fc import FCNet
from .resnet import ResNet18
from .transformer import TransformerLM

__all__ = ["MODELS", "build_model"]


MODELS: dict[str, Callable[..., nn.Module]] = {
    "fc": FCNet, "cnn": ThesisCNN, "cnn_bn": lambda **c: ThesisCNN(**{"batch_norm": True, **c}),
    "resnet18": ResNet18, "transformer": TransformerLM}


def build_model(name: str, **config) -> nn.Module:
    """The model ``name`` (one of MODELS), built with ``config`` (its constructor's keywords),
    e.g. ``build_model("resnet18", width=16)`` or ``build_model("transformer", vocab=65,
    layers=2, width=64, heads=2, context=64)``."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; the zoo has {', '.join(MODELS)} (or pass "
                         f"a function that returns an nn.Module)")
    return MODELS[name](**config)
