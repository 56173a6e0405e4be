"""The replicas' buffers: their mean (BatchNorm's running statistics), and the pass that
gives an averaged model BatchNorm statistics of its own. Collectives unless said."""

from __future__ import annotations

import torch
import torch.distributed as dist

from .seeds import replica_seed

__all__ = ["HELD_BYTES", "OwnStatistics", "collective_device", "mean_buffers",
           "own_statistics", "replica_mean", "statistics_batches", "sync_buffers"]


def collective_device(device) -> torch.device:
    """Where small bookkeeping tensors of a collective go: the task's GPU under NCCL, the CPU
    under gloo (whose gather and all_gather take CPU tensors only)."""
    return device if dist.get_backend() == "nccl" else torch.device("cpu")


def replica_mean(flat: torch.Tensor, weight: float | None = None, group=None) -> torch.Tensor:
    """The replicas' mean of ``flat`` (one all-reduce), weighted by ``weight`` (each
    replica's; all 0: this replica's own values). Collective: every rank of ``group`` calls
    it."""
    if weight is None:
        out = flat.detach().clone()
        dist.all_reduce(out, group=group)
        return out.div_(dist.get_world_size(group))
    packed = torch.cat([flat.detach() * weight,
                        torch.tensor([float(weight)], dtype=flat.dtype, device=flat.device)])
    dist.all_reduce(packed, group=group)
    if packed[-1] <= 0:
        return flat.detach().clone()
    return packed[:-1].div_(packed[-1])


def mean_buffers(model: torch.nn.Module, world: int, device,
                 weight: float | None = None) -> dict[str, torch.Tensor]:
    """The model's buffers by name, each floating-point one averaged over the replicas (one
    all-reduce; BatchNorm's running statistics), the others this replica's own (their integer
    counts, e.g. ``num_batches_tracked``, agree when the replicas take the same steps).
    ``weight``: this replica's weight in the mean (the rows its statistics saw; a replica of
    weight 0 contributes nothing; all 0: each keeps its own). Collective: every rank calls
    it."""
    named = dict(model.named_buffers())
    floats = [k for k, b in named.items() if b.is_floating_point()]
    out = {k: b.detach().clone() for k, b in named.items()}
    if floats:
        where = collective_device(device)
        packed = replica_mean(torch.cat([named[k].detach().reshape(-1).to(where, torch.float64)
                                         for k in floats]), weight)
        off = 0
        for k in floats:
            n = named[k].numel()
            out[k] = packed[off:off + n].reshape(named[k].shape).to(named[k].device,
                                                                    named[k].dtype)
            off += n
    return out


def sync_buffers(model, world: int, device, weight: float | None = None) -> None:
    """Every replica's floating-point buffers become their mean over the replicas (BatchNorm's
    running statistics, which each replica keeps from its own shard's batches; they steer
    evaluation only, never a training step), weighted by ``weight`` (mean_buffers).
    Collective: every rank calls it."""
    if world > 1 and any(b.is_floating_point() for b in model.buffers()):
        named = dict(model.named_buffers())
        with torch.no_grad():
            for name, b in mean_buffers(model, world, device, weight).items():
                named[name].copy_(b)


def statistics_batches(cfg, model, world: int, average: float) -> int:
    """How many of its first mini-batches each replica recomputes an averaged model's
    BatchNorm statistics on (spark_dl.optim.average): 0 without an average or BatchNorm."""
    from ..optim.average import STATISTICS_ROWS, batch_norms
    layers = batch_norms(model)
    if not average or not layers or \
            any(isinstance(m, torch.nn.SyncBatchNorm) for m in layers):
        return 0       # (SyncBatchNorm would all-reduce each pass's batch: the replicas'
    return max(1, -(-STATISTICS_ROWS // (world * cfg.batch_size)))    # counts may differ)


def own_statistics(cfg, model, shard, rank: int, world: int, device, dtype,
                   average: float, amp: str | None = None) -> OwnStatistics | None:
    """The pass that gives a replica's averaged models BatchNorm statistics of their own
    (OwnStatistics), or None where none is needed (statistics_batches)."""
    batches = statistics_batches(cfg, model, world, average)
    return OwnStatistics(cfg, shard, batches, rank, world, device, dtype, amp) \
        if batches else None


HELD_BYTES = 64 << 20       # the most an averaged model's BatchNorm rows keep of host memory


class OwnStatistics:
    """Gives a net of averaged weights BatchNorm statistics of its own: each replica's from
    its first ``batches`` mini-batches (the same rows at every call), their mean weighted by
    the rows (spark_dl.optim.average.recompute_statistics). The random generators are left as
    they were (a user's ``transform`` may draw): training goes on as without the passes. The
    first pass keeps its inputs on the host while they take at most ``HELD_BYTES``, and later
    passes reuse them: a stream would otherwise fill a shuffle window at every validation
    (the transform then drew once, for every pass); larger inputs are read again each time.
    Calling it is a collective: every rank calls it."""

    def __init__(self, cfg, shard, batches: int, rank: int, world: int, device,
                 dtype, amp: str | None = None):
        self.cfg, self.shard, self.batches, self.amp = cfg, shard, batches, amp
        self.rank, self.world, self.device, self.dtype = rank, world, device, dtype
        self.held: list[torch.Tensor] | None = None
        self.passes = 0

    def __call__(self, net):
        import random

        import numpy as np

        from ..data.device import model_input
        from ..optim.average import recompute_statistics
        from .amp import autocast
        kept = np.random.get_state(), random.getstate()     # torch's: fork_rng keeps them
        cuda = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=cuda), autocast(self.device, self.amp):
            rows = recompute_statistics(net, (model_input(x, self.device, self.dtype)
                                              for x in self._inputs()))
        np.random.set_state(kept[0])
        random.setstate(kept[1])
        sync_buffers(net, self.world, self.device, weight=rows)
        self.passes += 1
        return net

    def _inputs(self):
        """The first mini-batches' inputs: the held ones, or read from the shard (and held
        when they fit)."""
        if self.held is not None:
            yield from self.held
            return
        import itertools
        cfg, shard = self.cfg, self.shard
        peak = getattr(shard, "peak_buffer_rows", None)     # a stream's, which a pass resets
        every = shard.batches(cfg.batch_size, shuffle=cfg.shuffle, transform=cfg.transform,
                              seed=replica_seed(cfg.seed, self.rank), epoch=0)
        held, size = [], 0
        try:
            for x, _ in itertools.islice(every, self.batches):
                size += x.element_size() * x.nelement()
                if held is not None and size <= HELD_BYTES:
                    held.append(x.clone())     # a copy: a view would keep a stream's window
                else:
                    held = None
                yield x
        finally:
            getattr(every, "close", lambda: None)()      # (a prefetching thread stops here)
            if peak is not None:               # the pass's window is held besides training's
                shard.peak_buffer_rows = max(peak, shard.peak_buffer_rows)
        self.held = held
