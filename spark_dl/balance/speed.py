"""A replica measured for the split: its step time t(b) = a + c b, timed on its own rows at two
batch sizes, the bytes a row keeps for backward, and the rows per step its memory holds."""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import torch

from ..data.device import model_input
from ..data.memory import memory_headroom

__all__ = ["activation_bytes", "measure", "memory_cap", "profile"]


def activation_bytes(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor,
                     loss_fn: Callable) -> int:
    """Bytes that one forward of the batch ``x`` keeps for backward (the tensors autograd
    saves, the parameters themselves not counted), plus the batch itself."""
    params = {p.data_ptr() for p in model.parameters()}
    seen: dict[tuple, int] = {}

    def pack(t):
        if t.data_ptr() not in params:
            seen[(t.data_ptr(), t.numel(), t.dtype)] = t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss_fn(model(x), y)
    return sum(seen.values()) + x.numel() * x.element_size()


def memory_cap(bytes_per_sample: float, device: torch.device, fraction: float = 0.5) -> int:
    """Rows per step that fit ``fraction`` of what this task may still allocate (the GPU's
    free memory, or the process's headroom on the CPU: its address-space limit under
    spark.executor.pyspark.memory, else its share of the machine's available memory)."""
    room = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else memory_headroom()
    return int(room * fraction // max(bytes_per_sample, 1.0))


def profile(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor], loss_fn: Callable,
            sizes: tuple[int, int], repeats: int = 3, autocast=None,
            sync: Callable[[], None] = lambda: None, min_seconds: float = 0.3) -> dict:
    """Time forward + backward of this replica's own rows at two batch sizes, alternately,
    after one warm-up each, at least ``repeats`` times each and for at least ``min_seconds`` in
    all (a core shared with another process is shared by time slices of a few ms: a short
    window would see a whole slice or none) -> {"sizes", "seconds" (mean per step), "a",
    "c", "bytes_per_sample"}: t(b) = a + c·b. The gradients are zeroed after: nothing is
    trained."""
    import contextlib
    x, y = batch
    parts = [(x[:b], y[:b]) for b in sizes]
    spent, counts = [0.0] * len(parts), [0] * len(parts)

    def step(xb, yb) -> float:
        sync()
        t0 = time.perf_counter()
        with autocast() if autocast else contextlib.nullcontext():
            loss = loss_fn(model(xb), yb)
        loss.backward()
        sync()
        return time.perf_counter() - t0

    for xb, yb in parts:
        step(xb, yb)                                     # warm-up
    t_start = time.perf_counter()
    while min(counts) < repeats or time.perf_counter() - t_start < min_seconds:
        for i, (xb, yb) in enumerate(parts):
            spent[i] += step(xb, yb)
            counts[i] += 1
    model.zero_grad(set_to_none=False)
    out = {"sizes": [len(xb) for xb, _ in parts],
           "seconds": [t / n for t, n in zip(spent, counts)], "steps": counts}
    (b1, b2), (t1, t2) = out["sizes"], out["seconds"]
    c = (t2 - t1) / (b2 - b1) if b2 != b1 else t2 / max(b2, 1)
    c = max(c, 1e-3 * t2 / max(b2, 1))       # noise must not make rows free
    xb, yb = parts[-1]
    out.update(a=max(t2 - c * b2, 0.0), c=c,
               bytes_per_sample=activation_bytes(model, xb, yb, loss_fn) / max(len(xb), 1))
    model.zero_grad(set_to_none=False)
    return out


def measure(mode, *, model, loss_fn, shard, batch_size: int, device, dtype,
            max_batch: int | None = None, profile_steps: int = 3, transform=None,
            autocast=None) -> list[float]:
    """This replica's [a, c, bytes per sample, cap] for a split: its step time t(b) = a + c b
    profiled on its own first rows ("speed", "adaptive"; NaN for fixed shares), the bytes a
    row keeps for backward and the rows per step its memory holds (at most ``max_batch``).
    An empty shard gives [NaN, NaN, NaN, 0]. Draws no random numbers of the fit."""
    if not len(shard):
        return [math.nan, math.nan, math.nan, 0.0]
    rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    buffers = [b.detach().clone() for b in model.buffers()]     # BatchNorm's running stats
    b2 = max(1, min(2 * batch_size, len(shard)))
    x, y = next(iter(shard.batches(b2, shuffle=False, transform=transform)))
    x = model_input(x, device, dtype)
    y = y.to(device=device, dtype=dtype if y.is_floating_point() else y.dtype)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    if mode in ("speed", "adaptive"):
        prof = profile(model, (x, y), loss_fn, (max(1, b2 // 4), b2), profile_steps, autocast,
                       sync)
    else:
        prof = {"a": math.nan, "c": math.nan,
                "bytes_per_sample": activation_bytes(model, x[:batch_size], y[:batch_size],
                                                     loss_fn) / len(x[:batch_size])}
        model.zero_grad(set_to_none=False)
    cap = memory_cap(prof["bytes_per_sample"], device)
    if max_batch is not None:
        cap = min(cap, max_batch)
    torch.set_rng_state(rng)
    if cuda_rng is not None:
        torch.cuda.set_rng_state(cuda_rng, device)
    with torch.no_grad():
        for b, saved in zip(model.buffers(), buffers):
            b.copy_(saved)
    return [prof["a"], prof["c"], prof["bytes_per_sample"], float(cap)]
