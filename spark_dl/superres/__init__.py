"""Super-resolution helpers: luminance images, bicubic resizing, patches, PSNR and SSIM."""

from .images import bicubic, load_y, modcrop, patches, rgb_to_y
from .metrics import psnr, ssim

__all__ = ["bicubic", "load_y", "modcrop", "patches", "psnr", "rgb_to_y", "ssim"]
