"""Pieces every recipe shares: device choice, seeding, timing, results files."""

from __future__ import annotations

import dataclasses
import json
import platform
import time
from pathlib import Path

import torch

from ..errors import ConfigError

__all__ = ["RunConfig", "pick_device", "write_result"]


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """Where a run writes and what it runs on."""

    out_dir: str = "runs/latest"
    device: str = "auto"            # "auto" (CUDA when present), "cpu" or "cuda"
    seed: int = 0
    threads: int = 0                # torch CPU threads; 0 keeps torch's default
    track: tuple = ()               # Spark fits: also log to "tensorboard" and/or "mlflow"

    def __post_init__(self):
        if self.device not in ("auto", "cpu", "cuda"):
            raise ConfigError(f"'run.device' must be 'auto', 'cpu' or 'cuda', got {self.device!r}")
        from ..tracking import TRACKERS
        track = (self.track,) if isinstance(self.track, str) else tuple(self.track)
        bad = [t for t in track if t not in TRACKERS]
        if bad:
            raise ConfigError(f"'run.track' must list trackers among {list(TRACKERS)}, got "
                              f"{list(track)}; e.g. track = [\"tensorboard\"] in [run]")
        object.__setattr__(self, "track", track)


def pick_device(run: RunConfig) -> torch.device:
    if run.threads:
        torch.set_num_threads(run.threads)
    if run.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("'run.device' is 'cuda' but torch sees no CUDA device; set "
                          "device = 'auto' or 'cpu' in [run]")
    if run.device == "cpu" or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda")


def write_result(run: RunConfig, name: str, result: dict) -> Path:
    """Write ``result`` (plus machine facts) to ``<out_dir>/<name>.json``; returns the path."""
    out = Path(run.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor()
    result = {"date": time.strftime("%Y-%m-%d %H:%M"), "torch": torch.__version__,
              "device": device or platform.machine(), "threads": torch.get_num_threads(),
              **result}
    path = out / f"{name}.json"
    path.write_text(json.dumps(result, indent=1))
    return path
