"""Column-partitioned layers and the models built from them.

Each rank allocates only its slice: a Linear layer its output units (the columns of the
thesis's W, which is torch's weight transposed), a Conv2d layer its output filters, an LSTM
layer its hidden units (the rows of all four gate matrices that feed them). Everything between
partitioned layers (activations, pooling, the loss) runs replicated on every rank.

``partition_model(model, comm)`` turns an FCNet, ThesisCNN or CharRNN into its partitioned form,
copying this rank's slice of the given weights, so that a partitioned model computes what the
original computes (the tests check outputs and gradients to 1e-6 in float64).
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.nn import functional as F

from .comm import Comm, split_sizes
from .mappings import copy_to_partitions, gather_from_partitions

__all__ = ["ColumnLinear", "ColumnConv2d", "ColumnLSTM", "partition_model", "gather_state",
           "parameter_bytes"]


def _slice(sizes, rank):
    a = sum(sizes[:rank])
    return slice(a, a + sizes[rank])


class ColumnLinear(nn.Module):
    """y = x W + b with W's columns (output units) split over the group; x (B, in) replicated,
    y (B, out) gathered on every rank."""

    def __init__(self, in_features: int, out_features: int, comm: Comm, bias: bool = True):
        super().__init__()
        self.comm, self.in_features, self.out_features = comm, in_features, out_features
        self.sizes = split_sizes(out_features, comm.size)
        n = self.sizes[comm.rank]
        self.weight = nn.Parameter(torch.empty(n, in_features))       # (out/F, in)
        self.bias = nn.Parameter(torch.zeros(n)) if bias else None

    @classmethod
    def from_linear(cls, layer: nn.Linear, comm: Comm) -> "ColumnLinear":
        m = cls(layer.in_features, layer.out_features, comm, layer.bias is not None)
        cols = _slice(m.sizes, comm.rank)
        with torch.no_grad():
            m.to(layer.weight.dtype)
            m.weight.copy_(layer.weight[cols])
            if m.bias is not None:
                m.bias.copy_(layer.bias[cols])
        return m

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y_p = F.linear(copy_to_partitions(x, self.comm), self.weight, self.bias)  # (B, out/F)
        return gather_from_partitions(y_p, self.comm, self.sizes, -1)            # (B, out)


class ColumnConv2d(nn.Module):
    """A Conv2d whose output filters are split over the group; x (B, C, H, W) replicated, the
    output (B, filters, H', W') gathered on every rank."""

    def __init__(self, conv: nn.Conv2d, comm: Comm):
        super().__init__()
        if conv.groups != 1:
            raise ValueError("ColumnConv2d splits ordinary convolutions (groups=1)")
        self.comm = comm
        self.sizes = split_sizes(conv.out_channels, comm.size)
        rows = _slice(self.sizes, comm.rank)
        self.stride, self.padding, self.dilation = conv.stride, conv.padding, conv.dilation
        self.weight = nn.Parameter(conv.weight.detach()[rows].clone())   # (f/F, C, k, k)
        self.bias = nn.Parameter(conv.bias.detach()[rows].clone()) \
            if conv.bias is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y_p = F.conv2d(copy_to_partitions(x, self.comm), self.weight, self.bias, self.stride,
                       self.padding, self.dilation)                     # (B, f/F, H', W')
        return gather_from_partitions(y_p, self.comm, self.sizes, 1)


class ColumnLSTM(nn.Module):
    """A (multi-layer, batch-first) LSTM whose hidden units are split over the group: rank p
    holds, for its units, the rows of the input, forget, cell and output gate matrices. At every
    step it computes its units' gates, cell and output; the outputs are all-gathered, since the
    next step (and the next layer) needs all of h."""

    def __init__(self, lstm: nn.LSTM, comm: Comm):
        super().__init__()
        if not lstm.batch_first or lstm.bidirectional or lstm.proj_size:
            raise ValueError("ColumnLSTM partitions batch-first, unidirectional LSTMs without "
                             "projections")
        self.comm, self.hidden, self.layers = comm, lstm.hidden_size, lstm.num_layers
        self.sizes = split_sizes(lstm.hidden_size, comm.size)
        H, cols = lstm.hidden_size, _slice(self.sizes, comm.rank)
        rows = torch.cat([torch.arange(H)[cols] + g * H for g in range(4)])   # i, f, g, o
        self.w_ih, self.w_hh, self.b = nn.ParameterList(), nn.ParameterList(), \
            nn.ParameterList()
        for k in range(lstm.num_layers):
            w_ih = getattr(lstm, f"weight_ih_l{k}").detach()[rows]        # (4H/F, in)
            w_hh = getattr(lstm, f"weight_hh_l{k}").detach()[rows]        # (4H/F, H)
            b = (getattr(lstm, f"bias_ih_l{k}") + getattr(lstm, f"bias_hh_l{k}")).detach()[rows] \
                if lstm.bias else torch.zeros(len(rows), dtype=w_ih.dtype)
            self.w_ih.append(nn.Parameter(w_ih.clone()))
            self.w_hh.append(nn.Parameter(w_hh.clone()))
            self.b.append(nn.Parameter(b.clone()))

    def forward(self, x: torch.Tensor, state=None):
        """x (B, T, in) -> out (B, T, H), (h_n, c_n) each (layers, B, H), as nn.LSTM."""
        B, T, _ = x.shape
        n, cols = self.sizes[self.comm.rank], _slice(self.sizes, self.comm.rank)
        if state is None:
            zeros = x.new_zeros(self.layers, B, self.hidden)
            state = (zeros, zeros)
        h0, c0 = state
        hs, cs = [], []
        for k in range(self.layers):
            h = h0[k]                                           # (B, H), replicated
            c = c0[k][:, cols]                                  # (B, H/F), this rank's units
            x_in = copy_to_partitions(x, self.comm)
            pre = F.linear(x_in, self.w_ih[k], self.b[k])       # (B, T, 4H/F), all steps
            outs = []
            for t in range(T):
                gates = pre[:, t] + F.linear(copy_to_partitions(h, self.comm), self.w_hh[k])
                i, f, g, o = gates.split(n, dim=1)              # (B, H/F) each
                c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
                h_p = torch.sigmoid(o) * torch.tanh(c)
                h = gather_from_partitions(h_p, self.comm, self.sizes, 1)   # (B, H)
                outs.append(h)
            x = torch.stack(outs, 1)                            # (B, T, H)
            hs.append(h)
            cs.append(gather_from_partitions(c, self.comm, self.sizes, 1))
        return x, (torch.stack(hs), torch.stack(cs))


def partition_model(model: nn.Module, comm: Comm) -> nn.Module:
    """A copy of ``model`` with every Linear, Conv2d and LSTM replaced by its column-partitioned
    form holding this rank's slice (FCNet, ThesisCNN, CharRNN and any model made of those)."""
    model = copy.deepcopy(model)

    def swap(module: nn.Module) -> None:
        for name, child in module.named_children():
            if isinstance(child, nn.Linear):
                setattr(module, name, ColumnLinear.from_linear(child, comm))
            elif isinstance(child, nn.Conv2d):
                setattr(module, name, ColumnConv2d(child, comm))
            elif isinstance(child, nn.LSTM):
                setattr(module, name, ColumnLSTM(child, comm))
            elif isinstance(child, (nn.RNN, nn.GRU)):
                raise ValueError(f"{type(child).__name__} has no partitioned form; use an LSTM")
            else:
                swap(child)
    swap(model)
    return model


def gather_state(model: nn.Module, original: nn.Module, comm: Comm) -> dict:
    """The unpartitioned state dict of ``original``'s layout, assembled from every rank's
    slices (collective). Replicated parameters are taken from this rank."""
    out = {}
    parts = dict(model.named_modules())
    for name, module in original.named_modules():
        p = parts.get(name)
        if isinstance(p, (ColumnLinear, ColumnConv2d)):
            out[f"{name}.weight"] = gather_from_partitions(p.weight.detach(), comm, p.sizes, 0)
            if p.bias is not None:
                out[f"{name}.bias"] = gather_from_partitions(p.bias.detach(), comm, p.sizes, 0)
        elif isinstance(p, ColumnLSTM):
            H = p.hidden
            for k in range(p.layers):
                for key, w in (("weight_ih", p.w_ih[k]), ("weight_hh", p.w_hh[k]),
                               ("bias_ih", p.b[k])):
                    n = p.sizes[comm.rank]
                    gates = w.detach().split(n, 0)                 # i, f, g, o of my units
                    full = torch.cat([gather_from_partitions(g.contiguous(), comm, p.sizes, 0)
                                      for g in gates], 0)         # (4H, ...)
                    out[f"{name}.{key}_l{k}"] = full
                out[f"{name}.bias_hh_l{k}"] = torch.zeros(4 * H, dtype=p.b[k].dtype)
    for key, value in original.state_dict().items():
        out.setdefault(key, dict(model.state_dict()).get(key, value))
    return out


def parameter_bytes(model: nn.Module) -> int:
    """Bytes of the parameters this rank holds."""
    return sum(p.numel() * p.element_size() for p in model.parameters())
