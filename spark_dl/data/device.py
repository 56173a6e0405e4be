"""An in-memory shard held on the task's GPU, batched there.

A task on a GPU that draws its batches from host memory pays, every step, a NumPy gather of the
rows, a conversion and a copy from pageable memory, which waits for the GPU's queue to drain:
the GPU idles while the host prepares the next batch. Plain PyTorch loops on a GPU usually
hold the whole data set on the device and index it there. ``on_device`` does the same for a
shard that fits (a quarter of the GPU's free memory at most): its rows go over once, each
epoch's order goes over once, and every batch is a slice and a gather on the GPU, with no
host synchronisation. The batches are the ones ``ShardData.batches`` yields (the same rows in
the same order, uint8 pixels scaled to [0, 1] the same way, other integers as int64), so a
fit on the GPU keeps its trajectory. Shards with a ``transform`` (the user's own decoding),
streamed shards and shards too large stay where they are.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["DeviceShard", "model_input", "on_device"]

FRACTION = 0.25              # of the GPU's free memory a shard may take


def model_input(x: torch.Tensor, device, dtype: torch.dtype,
                non_blocking: bool = False) -> torch.Tensor:
    """A batch's features as the model takes them: on ``device``, floating-point ones in the
    fit's ``dtype``, integer ones (token ids, int64 from the bridge) as they are, exact."""
    return x.to(device=device, dtype=dtype if x.is_floating_point() else None,
                non_blocking=non_blocking)


def on_device(shard, device: torch.device, transform=None, fraction: float = FRACTION):
    """``shard`` itself, or a DeviceShard of it on ``device`` (a CUDA device, an in-memory
    shard, no ``transform``, its rows within ``fraction`` of the device's free memory)."""
    if device.type != "cuda" or transform is not None or getattr(shard, "kind", None) != "memory":
        return shard
    need = shard.features.nbytes + (0 if shard.labels is None else shard.labels.nbytes)
    free, _total = torch.cuda.mem_get_info(device)
    if need > fraction * free:
        return shard
    return DeviceShard(shard, device)


class DeviceShard:
    """The rows of a ShardData copied to ``device`` (again when the shard's arrays are
    replaced: rows moved by the balancer). Everything else is the ShardData's."""

    def __init__(self, base, device: torch.device):
        self.base, self.device = base, device
        self._src: tuple | None = None
        self._x = self._y = None

    def __getattr__(self, name):
        return getattr(self.base, name)

    def __len__(self) -> int:
        return len(self.base)

    def _tensors(self):
        src = (self.base.features, self.base.labels)
        if self._src is None or any(a is not b for a, b in zip(src, self._src)):
            self._x = torch.from_numpy(np.ascontiguousarray(src[0])).to(self.device)
            self._y = None if src[1] is None else \
                torch.from_numpy(np.ascontiguousarray(src[1])).to(self.device)
            self._src = src
        return self._x, self._y

    def batches(self, batch_size: int, shuffle: bool = True, seed: int = 0, epoch: int = 0,
                drop_last: bool = False, skip: int = 0, transform=None):
        """As ShardData.batches, on the device."""
        if transform is not None:
            yield from self.base.batches(batch_size, shuffle, seed, epoch, drop_last, skip,
                                         transform)
            return
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if skip < 0:
            raise ValueError(f"skip must be >= 0, got {skip}")
        x, y = self._tensors()
        n = len(self)
        end = min(n, self.base.num_batches(batch_size, drop_last) * batch_size)
        if shuffle:          # ShardData's order: a permutation, each batch's rows sorted
            order = np.random.default_rng([seed, epoch]).permutation(n)[:end]
            pad = -end % batch_size
            blocks = np.concatenate([order, np.full(pad, n, order.dtype)]) \
                .reshape(-1, batch_size)
            order = np.sort(blocks, axis=1).reshape(-1)[:end]      # the pad (n) sorts last
        else:
            order = np.arange(end)
        index = torch.from_numpy(order).to(self.device)            # once an epoch
        scale, ids = x.dtype == torch.uint8, not x.is_floating_point()
        for start in range(skip * batch_size, end, batch_size):
            rows = index[start:start + batch_size]
            xb = x.index_select(0, rows)
            if scale:
                xb = xb.to(torch.float32).div_(255.0)
            elif ids:
                xb = xb.long()
            yield xb, None if y is None else y.index_select(0, rows)
