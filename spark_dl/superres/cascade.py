"""The noise-resilient super-resolution cascade (thesis ch. 5): SSDA denoiser -> reshape ->
bicubic upscale -> deep CNN (SRCNN), trainable end to end.

``Bicubic`` is the upscaling as a fixed linear layer: Pillow's bicubic resize is separable and
linear, so resizing the unit vectors gives two matrices A_h (H' x H) and A_w (W' x W) with
resize(x) = A_h x A_w^T. The layer applies them with matmuls, so gradients flow through it to
the denoiser, and its output equals Pillow's resize (the tests compare them).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import nn

from ..models.srcnn import SRCNN
from ..models.ssda import SSDA
from .images import bicubic

__all__ = ["Bicubic", "Cascade", "Upscaler", "load_cascade", "resize_matrix", "takes_noisy"]


def takes_noisy(cnn: SRCNN) -> bool:
    """The noisy skip: a CNN with twice its channels as inputs gets the upscaled noisy LR
    beside the upscaled denoised LR (Cascade.cnn_input in training, tiles.super_resolve on
    whole images)."""
    return cnn.inputs == 2 * cnn.channels


def resize_matrix(n_in: int, n_out: int) -> np.ndarray:
    """(n_out, n_in): Pillow's 1-D bicubic resize from n_in to n_out samples, as a matrix."""
    eye = np.eye(n_in, dtype=np.float32)
    return np.stack([bicubic(eye[:, i:i + 1], (n_out, 1))[:, 0] for i in range(n_in)], 1)


class Bicubic(nn.Module):
    """(B, C, H, W) -> (B, C, H', W'): Pillow's bicubic resize as a differentiable layer."""

    def __init__(self, in_size: tuple[int, int], out_size: tuple[int, int]):
        super().__init__()
        self.in_size, self.out_size = tuple(in_size), tuple(out_size)
        self.register_buffer("a_h", torch.from_numpy(resize_matrix(in_size[0], out_size[0])))
        self.register_buffer("a_w", torch.from_numpy(resize_matrix(in_size[1], out_size[1])))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if tuple(x.shape[-2:]) != self.in_size:
            raise ValueError(f"Bicubic was built for {self.in_size} inputs, got "
                             f"{tuple(x.shape[-2:])}")
        a_h, a_w = self.a_h.to(x.dtype), self.a_w.to(x.dtype)
        return a_h @ x @ a_w.T                                  # (H', H) (H, W) (W, W')


class Cascade(nn.Module):
    """noisy LR patch (B, s_lr * s_lr) or (B, 1, s_lr, s_lr) -> HR patch (B, 1, s_hr, s_hr):
    the SSDA denoises the flattened LR patch, the bicubic layer upscales it, the CNN restores
    the detail. The two stages can be trained apart first (``ssda``, ``cnn`` given) and then
    fine-tuned together.

    Noisy skip (not in the thesis): a CNN with two input planes (``SRCNN(inputs=2)``) sees the
    upscaled noisy LR beside the upscaled denoised one, so it can restore detail the SSDA
    smoothed away, and the joint fine-tuning no longer has to pass all of it through the
    denoiser (docs/design/0042-srcnn-noisy-skip.md)."""

    def __init__(self, lr_size: int = 16, scale: int = 2, ssda: SSDA | None = None,
                 cnn: SRCNN | None = None):
        super().__init__()
        self.lr_size, self.hr_size = lr_size, lr_size * scale
        self.ssda = ssda if ssda is not None else SSDA(lr_size * lr_size)
        if self.ssda.n_in != lr_size * lr_size:
            raise ValueError(f"the SSDA takes {self.ssda.n_in} inputs, the LR patch has "
                             f"{lr_size * lr_size} pixels")
        self.up = Bicubic((lr_size, lr_size), (self.hr_size, self.hr_size))
        self.cnn = cnn if cnn is not None else SRCNN()
        if self.cnn.inputs != self.cnn.channels and not takes_noisy(self.cnn):
            raise ValueError(f"the cascade's CNN takes the denoised image (inputs = "
                             f"{self.cnn.channels}) or it and the noisy one (inputs = "
                             f"{2 * self.cnn.channels}), got inputs = {self.cnn.inputs}")

    def denoise(self, lr: torch.Tensor) -> torch.Tensor:
        """(B, ...) noisy LR -> (B, 1, s_lr, s_lr) denoised."""
        return self.ssda(lr.reshape(len(lr), -1)).reshape(len(lr), 1, self.lr_size,
                                                          self.lr_size)

    def cnn_input(self, lr: torch.Tensor) -> torch.Tensor:
        """What the CNN sees: the denoised LR, bicubic-upscaled (and beside it the noisy LR,
        upscaled, with the noisy skip)."""
        up = self.up(self.denoise(lr))
        if not takes_noisy(self.cnn):
            return up
        return torch.cat([up, self.up(lr.reshape(up.shape[0], 1, self.lr_size, self.lr_size))],
                         1)

    def forward(self, lr: torch.Tensor) -> torch.Tensor:
        return self.cnn(self.cnn_input(lr))


class Upscaler(nn.Module):
    """clean LR patch (B, s_lr * s_lr) or (B, 1, s_lr, s_lr) -> HR patch (B, 1, s_hr, s_hr):
    bicubic upscale, then the CNN. An SRCNN trained this way on clean LR patches is trained
    for super-resolution alone, as the published SRCNN: put after a denoiser trained alone it
    is the thesis's "conventional" method."""

    def __init__(self, lr_size: int = 16, scale: int = 2, cnn: SRCNN | None = None):
        super().__init__()
        self.lr_size, self.hr_size = lr_size, lr_size * scale
        self.up = Bicubic((lr_size, lr_size), (self.hr_size, self.hr_size))
        self.cnn = cnn if cnn is not None else SRCNN()

    def forward(self, lr: torch.Tensor) -> torch.Tensor:
        return self.cnn(self.up(lr.reshape(len(lr), 1, self.lr_size, self.lr_size)))


def load_cascade(path) -> Cascade:
    """A Cascade saved whole by the super-resolution job (``<out_dir>/<method>.pt``), loaded
    with ``weights_only=True``: the unpickler builds only the cascade's own module classes and
    tensors, so a file that names anything else is refused, not run."""
    try:
        from torch.serialization import get_unsafe_globals_in_checkpoint, safe_globals
    except ImportError:
        raise ImportError(f"loading a saved cascade safely needs torch >= 2.5 (this is "
                          f"{torch.__version__}); upgrade torch") from None

    from ..models.ssda import DenoisingLayer, LayerSpec
    allowed = [Cascade, Bicubic, SSDA, DenoisingLayer, LayerSpec, SRCNN, nn.ModuleList,
               nn.Sequential, nn.Conv2d, nn.ReLU]
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no saved cascade at {path}: give the out_dir of a finished "
                                f"super-resolution run (it holds conventional.pt, cascade.pt)")
    names = {f"{c.__module__}.{c.__qualname__}" for c in allowed}
    try:
        others = sorted(set(get_unsafe_globals_in_checkpoint(path)) - names)
        if others:
            raise ValueError(f"it names {', '.join(others)}")
        with safe_globals(allowed):
            model = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:                      # torch's UnpicklingError, truncated files, ...
        raise ValueError(f"{path} is not a cascade saved by the super-resolution job "
                         f"({type(e).__name__}: {(str(e).splitlines() or [''])[0]})") from None
    if not isinstance(model, Cascade):
        # a ValueError, as for every other file that is not a saved cascade
        raise ValueError(f"{path} holds a {type(model).__name__}, not a Cascade")  # noqa: TRY004
    return model
