"""The two communication steps of column partitioning, as paired autograd Functions.

Every rank of a model-parallel group holds the same layer inputs (replicated activations) and
its own columns of each weight matrix. A partitioned layer is

    y = gather_from_partitions(f(copy_to_partitions(x), W[:, cols_p]))

    copy_to_partitions       forward: nothing (x is already on every rank);
                             backward: sum the ranks' contributions to dE/dx (all-reduce)
    gather_from_partitions   forward: all-gather the column slices into the full output;
                             backward: keep this rank's slice of dE/dy

which is the thesis's distributed backpropagation (§3.2) with the master's gather + broadcast
fused into one all-gather and its reduce + broadcast of the δ contributions into one
all-reduce. A layer split by its input rows (the decoder of a tied-weight autoencoder, whose
weight is the encoder's transpose) uses the other pair:

    scatter_to_partitions    forward: keep this rank's slice of x (replicated);
                             backward: all-gather the slices of dE/dx
    reduce_from_partitions   forward: sum the ranks' partial outputs (all-reduce);
                             backward: nothing (dE/dy is replicated)

Collective: every rank of the group must run the same layers in the same order.
"""

from __future__ import annotations

import torch

from .comm import Comm

__all__ = ["copy_to_partitions", "gather_from_partitions", "reduce_from_partitions",
           "scatter_to_partitions"]


class _CopyToPartitions(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm: Comm):
        ctx.comm = comm
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return ctx.comm.all_reduce(grad.contiguous().clone(), "backward_all_reduce"), None


def _all_gather(y_p: torch.Tensor, comm: Comm, sizes: tuple, dim: int, kind: str):
    shape = list(y_p.shape)
    chunks = []
    for n in sizes:
        shape[dim] = n
        chunks.append(torch.empty(shape, dtype=y_p.dtype, device=y_p.device))
    comm.all_gather(chunks, y_p.contiguous(), kind)
    return torch.cat(chunks, dim)


class _GatherFromPartitions(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y_p, comm: Comm, sizes: tuple, dim: int):
        ctx.comm, ctx.dim = comm, dim
        ctx.offset, ctx.size = sum(sizes[:comm.rank]), sizes[comm.rank]
        return _all_gather(y_p, comm, sizes, dim, "forward_all_gather")

    @staticmethod
    def backward(ctx, grad):
        return grad.narrow(ctx.dim, ctx.offset, ctx.size).contiguous(), None, None, None


class _ReduceFromPartitions(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y_p, comm: Comm):
        return comm.all_reduce(y_p.contiguous().clone(), "forward_all_reduce")

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterToPartitions(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm: Comm, sizes: tuple, dim: int):
        ctx.comm, ctx.sizes, ctx.dim = comm, sizes, dim
        return x.narrow(dim, sum(sizes[:comm.rank]), sizes[comm.rank]).contiguous()

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, ctx.comm, ctx.sizes, ctx.dim, "backward_all_gather"), None, \
            None, None


def copy_to_partitions(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    """forward: identity (x replicated on every rank); backward: all-reduce (sum) of dE/dx.
    Collective in backward."""
    if comm.size == 1:
        return x
    return _CopyToPartitions.apply(x, comm)


def gather_from_partitions(y_p: torch.Tensor, comm: Comm, sizes, dim: int = -1) -> torch.Tensor:
    """forward: all-gather the ranks' slices of ``dim`` (sizes[p] each) into the full tensor;
    backward: keep this rank's slice of the gradient. Collective in forward."""
    if comm.size == 1:
        return y_p
    return _GatherFromPartitions.apply(y_p, comm, tuple(sizes), dim % y_p.dim())


def reduce_from_partitions(y_p: torch.Tensor, comm: Comm) -> torch.Tensor:
    """forward: all-reduce (sum) of the ranks' partial outputs; backward: identity."""
    if comm.size == 1:
        return y_p
    return _ReduceFromPartitions.apply(y_p, comm)


def scatter_to_partitions(x: torch.Tensor, comm: Comm, sizes, dim: int = -1) -> torch.Tensor:
    """forward: this rank's slice of ``dim`` of the replicated x; backward: all-gather of the
    slices of the gradient. Collective in backward."""
    if comm.size == 1:
        return x
    return _ScatterToPartitions.apply(x, comm, tuple(sizes), dim % x.dim())
