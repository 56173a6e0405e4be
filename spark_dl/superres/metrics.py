"""Image quality: PSNR and SSIM on float images in [0, 1] (Y channel, border shaved)."""

from __future__ import annotations

import numpy as np

__all__ = ["psnr", "ssim"]


def _shave(a: np.ndarray, border: int) -> np.ndarray:
    return a[border:a.shape[0] - border, border:a.shape[1] - border] if border else a


def psnr(x: np.ndarray, ref: np.ndarray, border: int = 0, peak: float = 1.0) -> float:
    """10·log10(peak² / MSE) over the image with ``border`` pixels shaved on each side."""
    if x.shape != ref.shape:
        raise ValueError(f"psnr needs images of one shape, got {x.shape} and {ref.shape}")
    d = _shave(x.astype(np.float64), border) - _shave(ref.astype(np.float64), border)
    mse = float(np.mean(d ** 2))
    return float("inf") if mse == 0 else 10.0 * np.log10(peak ** 2 / mse)


def _gaussian_window(size: int = 11, sigma: float = 1.5) -> np.ndarray:
    t = np.arange(size) - (size - 1) / 2
    g = np.exp(-(t ** 2) / (2 * sigma ** 2))
    g /= g.sum()
    return np.outer(g, g)


def ssim(x: np.ndarray, ref: np.ndarray, border: int = 0, peak: float = 1.0,
         k1: float = 0.01, k2: float = 0.03) -> float:
    """Mean SSIM (Wang et al. 2004): 11×11 Gaussian window (σ = 1.5), k1 = 0.01, k2 = 0.03,
    computed over the valid region of the shaved images."""
    import torch
    import torch.nn.functional as F
    if x.shape != ref.shape:
        raise ValueError(f"ssim needs images of one shape, got {x.shape} and {ref.shape}")
    a, b = _shave(x.astype(np.float64), border), _shave(ref.astype(np.float64), border)
    w = torch.from_numpy(_gaussian_window())[None, None]             # (1, 1, 11, 11)

    def filt(img):                                                    # valid-region filtering
        return F.conv2d(torch.from_numpy(np.ascontiguousarray(img))[None, None], w)[0, 0].numpy()
    c1, c2 = (k1 * peak) ** 2, (k2 * peak) ** 2
    mu_a, mu_b = filt(a), filt(b)
    var_a = filt(a * a) - mu_a ** 2
    var_b = filt(b * b) - mu_b ** 2
    cov = filt(a * b) - mu_a * mu_b
    s = ((2 * mu_a * mu_b + c1) * (2 * cov + c2)) / ((mu_a ** 2 + mu_b ** 2 + c1) *
                                                     (var_a + var_b + c2))
    return float(s.mean())
