"""A push's payload as the server reads it: a tensor over the received bytes, checked to hold
no NaN nor inf."""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["as_tensor", "is_finite", "quiet_numpy"]


def as_tensor(payload, code: int) -> torch.Tensor:
    """The payload's values, no copy (numpy's view where it has the dtype: a torch op's
    dispatch costs more than a small model's values)."""
    if code == 2:                                   # bfloat16: numpy has none
        return torch.frombuffer(payload, dtype=torch.uint8).view(torch.bfloat16)
    return torch.from_numpy(np.frombuffer(payload, np.float32 if code == 0 else np.float64))


def is_finite(grad: torch.Tensor) -> bool:
    """No NaN nor inf in ``grad``: its sum is finite (one pass), or else every value is (a
    finite sum can overflow). Small pushes sum in numpy (cheaper than torch's three ops at
    that size); large ones in torch, whose sum uses every thread."""
    if grad.numel() < 1 << 20 and grad.dtype in (torch.float32, torch.float64):
        a = grad.numpy()
        if np.isfinite(a.sum()):          # the serving threads quiet numpy's overflow warning
            return True                   # (quiet_numpy): a numpy.errstate here would cost
        with np.errstate(over="ignore", invalid="ignore"):    # every push the server's CPU
            return bool(np.isfinite(a).all())
    return bool(torch.isfinite(grad.sum()) or torch.isfinite(grad).all())


def quiet_numpy() -> None:
    """In the calling thread only (numpy keeps its error state per thread, or per context
    from numpy 2): an overflowing sum of a push is a bad push, refused with its own error, not
    a RuntimeWarning in the driver's log."""
    np.seterr(over="ignore", invalid="ignore")
