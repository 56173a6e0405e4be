"""Distributed backpropagation through a master for fully-connected nets, message by message:
the algorithm of D. Shrivastava, "Large-Scale Distributed Deep Learning using Apache Spark"
(M.Tech. thesis, IIT Delhi, 2016; §3.2, message counts §3.3). ``model_parallel="master"``.

F processes, rank 0 the master; every layer's weight matrix split by columns (output units).
One training step on a mini-batch of B examples (x and the labels start on the master):

    init      the master sends each process x and the one-hot label columns of its output
              units: F - 1 messages                               (thesis eq. 3.6: N1)
    forward   for each hidden layer i: every process computes its units' activations and an
              all-to-all broadcast in a hypercube (recursive doubling; a ring when F is not a
              power of two) gives everyone a^i: F log2 F messages  (eq. 3.7: N2)
    output    every process computes its output units' logits; the softmax normaliser needs
              all of them: each process sends the master (max, sum of exp, logit of the true
              class) per example, the master returns log Z: 2 (F - 1) messages
    backward  top layer: each process has δ of its output units. For each hidden layer i, top
              down: every process sends the master its contribution W_p δ_p to δ^i, the master
              sums them, multiplies by σ'(a^i) and sends each process the δ^i of its units:
              2 (F - 1) messages                                   (eq. 3.8: N3)
    update    each process steps its own slice (no messages)

Where this differs from the thesis's published counts (the cost model gives both):
  * the softmax output adds 2 (F - 1) messages per step (the thesis's count fits an output
    loss that separates over units, e.g. squared error on sigmoid outputs);
  * the hypercube all-gather moves (F - 1) S(b_i) per layer in all, not F log2 F S(b_i / F):
    recursive doubling doubles the message in every round (the two agree for F = 2);
  * a process's contribution to δ^i has all b_i entries (W_p δ_p spans every row); what is
    1/F-sized is the δ^i slice the master sends back. The thesis writes S(δ^{i+1}) for the
    first; the sizes here are S(δ^i) and S(δ^i / F).
"""

from __future__ import annotations

import torch
from torch import nn

from .comm import Comm, split_sizes

__all__ = ["MasterBackpropFC", "fc_activation"]

_DERIVATIVE = {"sigmoid": lambda a: a * (1 - a), "tanh": lambda a: 1 - a * a,
               "relu": lambda a: (a > 0).to(a.dtype)}


class _Columns(nn.Module):
    """One layer's columns: weight (b_i/F, b_i-1) then bias, the parameter order of the
    all-gather layers (ColumnLinear), so that both share one parameter-server layout."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor):
        super().__init__()
        self.weight, self.bias = nn.Parameter(weight), nn.Parameter(bias)


_ACTIVATIONS = {nn.Sigmoid: "sigmoid", nn.Tanh: "tanh", nn.ReLU: "relu"}


def fc_activation(net: nn.Module) -> str:
    """The hidden activation of an FC net (one of sigmoid, tanh, relu), or a ValueError
    naming what the master algorithm cannot run."""
    found = set()
    for name, m in net.named_modules():
        if isinstance(m, nn.Linear) or (not m._parameters and list(m.children())):
            continue
        if type(m) in _ACTIVATIONS:
            found.add(_ACTIVATIONS[type(m)])
        elif name:
            raise ValueError(f"layer {name} ({type(m).__name__}): the master algorithm runs FC "
                             f"nets of Linear layers with sigmoid, tanh or relu between them")
    if len(found) > 1:
        raise ValueError(f"the master algorithm needs one hidden activation, the net has "
                         f"{sorted(found)}")
    return found.pop() if found else "sigmoid"


class MasterBackpropFC(nn.Module):
    """This rank's columns of an FCNet (hidden activation sigmoid, tanh or relu; softmax
    cross-entropy output), trained by distributed backpropagation through a master (the
    thesis's §3.2, above)."""

    def __init__(self, net: nn.Module, comm: Comm, act: str = "sigmoid"):
        super().__init__()
        if act not in _DERIVATIVE:
            raise ValueError(f"unknown activation {act!r}; choose one of {sorted(_DERIVATIVE)}")
        linears = [m for m in net.modules() if isinstance(m, nn.Linear)]
        if not linears:
            raise ValueError("MasterBackpropFC partitions a net of Linear layers; this one has "
                             "none")
        self.comm, self.act, self.d_act = comm, getattr(torch, act), _DERIVATIVE[act]
        self.widths = [linears[0].in_features] + [m.out_features for m in linears]
        self.splits = [None] + [split_sizes(b, comm.size) for b in self.widths[1:]]
        self.layers = nn.ModuleList()
        for i, m in enumerate(linears, start=1):
            cols = self._cols(i, comm.rank)
            self.layers.append(_Columns(m.weight.detach()[cols].clone(),      # (b_i/F, b_i-1)
                                        m.bias.detach()[cols].clone()))

    @property
    def weight(self) -> list[nn.Parameter]:
        return [m.weight for m in self.layers]

    @property
    def bias(self) -> list[nn.Parameter]:
        return [m.bias for m in self.layers]

    @staticmethod
    def _set_grad(p: nn.Parameter, g: torch.Tensor, scale: float | None) -> None:
        if scale is None or p.grad is None:
            p.grad = g if scale is None else g * scale
        else:
            p.grad.add_(g, alpha=scale)

    def _cols(self, layer: int, rank: int) -> slice:
        sizes = self.splits[layer]
        a = sum(sizes[:rank])
        return slice(a, a + sizes[rank])

    def _all_gather(self, a_p: torch.Tensor, layer: int) -> torch.Tensor:
        c = self.comm
        chunks = [a_p.new_empty(a_p.shape[0], n) for n in self.splits[layer]]
        if c.size & (c.size - 1) == 0:
            c.hypercube_all_gather(chunks, a_p, "forward_hypercube")
        else:
            c.all_gather(chunks, a_p, "forward_ring")
        return torch.cat(chunks, 1)                           # (B, b_i)

    def step(self, x: torch.Tensor | None, y: torch.Tensor | None, batch: int,
             grad_scale: float | None = None) -> float | None:
        """Forward and backward of one mini-batch: fills the ``.grad`` of this rank's slices
        (replacing them; with ``grad_scale`` s, adding s x the mean gradient to them, as
        ``(loss * s).backward()`` would) and returns the mean cross-entropy on the master
        (None elsewhere). ``x`` (B, b_0) and ``y`` (B,) class ids are given on the master;
        other ranks pass None and the batch size. Collective: every rank calls it."""
        c, n_layers = self.comm, len(self.weight)
        master, dtype, dev = c.rank == 0, self.weight[0].dtype, self.weight[0].device
        B, b0, out_sizes = batch, self.widths[0], self.splits[-1]
        # init: x and this process's one-hot label columns, one message per process
        if master:
            x = x.reshape(B, b0).to(device=dev, dtype=dtype)
            onehot = torch.zeros(B, self.widths[-1], dtype=dtype, device=dev)
            onehot[torch.arange(B, device=dev), y.to(dev)] = 1
            for p in range(1, c.size):
                c.send(torch.cat([x.reshape(-1), onehot[:, self._cols(n_layers, p)].reshape(-1)]),
                       p, "init")
            y_p = onehot[:, self._cols(n_layers, 0)]
        else:
            buf = c.recv(torch.empty(B * (b0 + out_sizes[c.rank]), dtype=dtype, device=dev), 0)
            x, y_p = buf[:B * b0].view(B, b0), buf[B * b0:].view(B, out_sizes[c.rank])
        # forward: hidden layers, all-to-all broadcast of every layer's activations
        acts = [x]                                            # a^0 .. a^{n-2}, full
        with torch.no_grad():
            for i in range(n_layers - 1):
                a_p = self.act(acts[-1] @ self.weight[i].T + self.bias[i])   # (B, b_i/F)
                acts.append(self._all_gather(a_p, i + 1))
            z_p = acts[-1] @ self.weight[-1].T + self.bias[-1]              # (B, b_out/F)
            # softmax normaliser through the master
            m_p = z_p.max(1).values
            stats = torch.stack([m_p, (z_p - m_p[:, None]).exp().sum(1), (z_p * y_p).sum(1)])
            loss = None
            if master:
                parts = [stats] + [c.recv(torch.empty_like(stats), p) for p in range(1, c.size)]
                allst = torch.stack(parts)                    # (F, 3, B)
                top = allst[:, 0].max(0).values
                log_z = top + (allst[:, 1] * (allst[:, 0] - top).exp()).sum(0).log()
                loss = float((log_z - allst[:, 2].sum(0)).mean())
                for p in range(1, c.size):
                    c.send(log_z, p, "softmax")
            else:
                c.send(stats, 0, "softmax")
                log_z = c.recv(torch.empty(B, dtype=dtype, device=dev), 0)
            delta = ((z_p - log_z[:, None]).exp() - y_p) / B                # (B, b_out/F)
            # backward, top down
            for i in range(n_layers - 1, -1, -1):
                self._set_grad(self.weight[i], delta.T @ acts[i], grad_scale)  # (b_i+1/F, b_i)
                self._set_grad(self.bias[i], delta.sum(0), grad_scale)
                if i == 0:
                    break
                contrib = delta @ self.weight[i]              # (B, b_i): W_p δ_p
                if master:
                    for p in range(1, c.size):
                        contrib += c.recv(torch.empty_like(contrib), p)
                    full = contrib * self.d_act(acts[i])      # δ^i (B, b_i)
                    for p in range(1, c.size):
                        c.send(full[:, self._cols(i, p)].contiguous(), p, "backward_delta")
                    delta = full[:, self._cols(i, 0)]
                else:
                    c.send(contrib, 0, "backward_contribution")
                    delta = c.recv(torch.empty(B, self.splits[i][c.rank], dtype=dtype,
                                               device=dev), 0)
        return loss

    def full_state(self) -> dict:
        """The unpartitioned FCNet weights ("net.{2k}.weight" / ".bias"), on every rank.
        Collective."""
        out = {}
        for i, (w, b) in enumerate(zip(self.weight, self.bias)):
            ws = [w.new_empty(n, w.shape[1]) for n in self.splits[i + 1]]
            bs = [b.new_empty(n) for n in self.splits[i + 1]]
            self.comm.all_gather(ws, w.detach(), "state")
            self.comm.all_gather(bs, b.detach(), "state")
            out[f"net.{2 * i}.weight"], out[f"net.{2 * i}.bias"] = torch.cat(ws), torch.cat(bs)
        return out
