"""What every training task of a fit needs to know, whatever the engine (plain values only:
the configs travel to the executors in the task closure)."""

from __future__ import annotations

import dataclasses

__all__ = ["StageConfig"]


@dataclasses.dataclass(frozen=True)
class StageConfig:
    """The data, the loop and the task's resources (see ``spark_dl.fit`` for their meaning)."""

    features: str = "features"
    label: str = "label"
    shape: tuple = ()
    label_shape: tuple = ()
    num_classes: int | None = None
    loss: str = "cross_entropy"
    epochs: int = 1
    batch_size: int = 64
    shuffle: bool = True
    seed: int = 0
    dtype: str = "float32"
    device: str = "auto"
    threads: int = 0
    timeout_s: float = 300.0
    progress_every_s: float = 2.0
