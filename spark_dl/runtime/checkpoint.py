"""A fit's checkpoint files: written atomically, the one before kept beside it, and a corrupt
one set aside for the previous good one when a fit resumes."""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import torch

from ..errors import ConfigError

__all__ = ["load_checkpoint", "previous", "save_atomic"]


def previous(path: Path) -> Path:
    """Where the checkpoint before ``path`` is kept (checkpoint.pt -> checkpoint.prev.pt)."""
    return path.with_name(f"{path.stem}.prev{path.suffix}")


def save_atomic(path: Path, obj: dict) -> None:
    """Atomic: write a temporary file next to it, then rename; the file it replaces stays as
    ``previous(path)`` (a hard link: no copy) until the next save."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    torch.save(obj, tmp)
    if path.exists():
        keep = path.with_name(f".{previous(path).name}.tmp-{os.getpid()}")
        try:
            os.link(path, keep)
        except OSError:                    # no hard links on this file system
            shutil.copyfile(path, keep)
        os.replace(keep, previous(path))
    os.replace(tmp, path)


def load_checkpoint(path: Path, say: Callable[[str], None]) -> dict | None:
    """The checkpoint at ``path`` (None without one), on the CPU. A corrupt one (a truncated
    write, a full disk) is set aside as ``<name>.corrupt-<time>`` and the previous good one
    takes its place, with a message; a ConfigError when there is none."""
    if not path.exists():
        return None
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        reason = f"{type(e).__name__}: {str(e)[:200]}"
    prev, ckpt = previous(path), None
    if prev.exists():
        try:
            ckpt = torch.load(prev, map_location="cpu", weights_only=True)
        except Exception:
            ckpt = None
    if ckpt is None:
        raise ConfigError(f"the checkpoint {path} cannot be read ({reason}) and there is no "
                          f"good previous one ({prev.name}): start over with resume=False, or "
                          f"give a new run_dir")
    aside = path.with_name(f"{path.name}.corrupt-{time.strftime('%Y%m%d-%H%M%S')}")
    os.replace(path, aside)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    shutil.copyfile(prev, tmp)             # the tasks read checkpoint.pt
    os.replace(tmp, path)
    say(f"the checkpoint {path} cannot be read ({reason}); it is kept as {aside.name}, and "
        f"the fit resumes from the previous one ({prev.name}, epoch {ckpt.get('epoch')})")
    return ckpt
