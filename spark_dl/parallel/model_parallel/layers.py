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

__all__ = ["ColumnLinear", "ColumnConv2d", "ColumnLSTM", "partition_model", "merge_partitions",
           "parameter_bytes"]


def _slice(sizes, rank):
    a = sum(sizes[:rank])
    return slice(a, a + sizes[rank])


class ColumnLinear(nn.Module):
    """y = x W + b with W's columns (output units) split over the group; x (B, in) replicated,
    y (B, out) gathered on every rank."""

    def __init__(self, in_features: int, out_features: int, comm: Comm, bias: bool = True,
                 device=None, dtype=None):
        super().__init__()
        self.comm, self.in_features, self.out_features = comm, in_features, out_features
        self.sizes = split_sizes(out_features, comm.size)
        n = self.sizes[comm.rank]
        kw = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.empty(n, in_features, **kw))      # (out/F, in)
        self.bias = nn.Parameter(torch.zeros(n, **kw)) if bias else None

    @classmethod
    def from_linear(cls, layer: nn.Linear, comm: Comm) -> "ColumnLinear":
        m = cls(layer.in_features, layer.out_features, comm, layer.bias is not None,
                layer.weight.device, layer.weight.dtype)
        cols = _slice(m.sizes, comm.rank)
        with torch.no_grad():
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
        if not lstm.batch_first or lstm.bidirectional or lstm.proj_size or not lstm.bias \
                or lstm.dropout:
            raise ValueError("ColumnLSTM partitions batch-first, unidirectional LSTMs with "
                             "biases, without projections and without dropout between layers")
        self.comm, self.hidden, self.layers = comm, lstm.hidden_size, lstm.num_layers
        self.sizes = split_sizes(lstm.hidden_size, comm.size)
        H, cols = lstm.hidden_size, _slice(self.sizes, comm.rank)

        def rows(w):                           # my units' rows of the i, f, g and o gates
            return torch.cat([w[g * H + cols.start:g * H + cols.stop] for g in range(4)])
        self.w_ih, self.w_hh, self.b = nn.ParameterList(), nn.ParameterList(), \
            nn.ParameterList()
        for k in range(lstm.num_layers):
            w_ih = rows(getattr(lstm, f"weight_ih_l{k}").detach())       # (4H/F, in)
            w_hh = rows(getattr(lstm, f"weight_hh_l{k}").detach())       # (4H/F, H)
            b = rows((getattr(lstm, f"bias_ih_l{k}") + getattr(lstm, f"bias_hh_l{k}")).detach()) \
                if lstm.bias else w_ih.new_zeros(len(w_ih))
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
    for name, m in model.named_modules():
        if isinstance(m, (ColumnLinear, ColumnConv2d, ColumnLSTM)):
            continue
        own = [k for k, _ in m.named_parameters(recurse=False)] + \
            [k for k, _ in m.named_buffers(recurse=False)]
        if own and not any(isinstance(a, (ColumnLinear, ColumnConv2d, ColumnLSTM))
                           for a in _ancestors(model, name)):
            raise ValueError(f"module {name or 'the model'} ({type(m).__name__}) has "
                             f"parameters or buffers {own} that column partitioning does not "
                             f"split; partitioned models are made of Linear, Conv2d and LSTM "
                             f"layers and parameter-free ones (activations, pooling)")
    return model


def _ancestors(model: nn.Module, name: str):
    parts = name.split(".") if name else []
    m = model
    for p in parts[:-1]:
        m = getattr(m, p)
        yield m


def merge_partitions(original: nn.Module, parts: list[nn.Module]) -> dict:
    """The state dict of ``original`` assembled from the F partitioned copies ``parts``
    (``parts[p]`` holding partition p's slices, e.g. cut with Comm.layout(p, F)). No
    communication: the driver uses it on the parameter server's values."""
    out = {}
    modules = [dict(p.named_modules()) for p in parts]
    for name, module in original.named_modules():
        pieces = [m.get(name) for m in modules]
        if isinstance(pieces[0], (ColumnLinear, ColumnConv2d)):
            out[f"{name}.weight"] = torch.cat([q.weight.detach() for q in pieces])
            if pieces[0].bias is not None:
                out[f"{name}.bias"] = torch.cat([q.bias.detach() for q in pieces])
        elif isinstance(pieces[0], ColumnLSTM):
            for k in range(pieces[0].layers):
                for key, attr in (("weight_ih", "w_ih"), ("weight_hh", "w_hh"),
                                  ("bias_ih", "b")):
                    gates = [getattr(q, attr)[k].detach().split(q.sizes[q.comm.rank])
                             for q in pieces]                  # per part: i, f, g, o
                    out[f"{name}.{key}_l{k}"] = torch.cat(
                        [gates[p][g] for g in range(4) for p in range(len(parts))])
                out[f"{name}.bias_hh_l{k}"] = torch.zeros_like(out[f"{name}.bias_ih_l{k}"])
    trained = parts[0].state_dict()            # identical in every part
    for key, value in original.state_dict().items():
        out.setdefault(key, trained.get(key, value))
    return out


def parameter_bytes(model: nn.Module) -> int:
    """Bytes of the parameters this rank holds."""
    return sum(p.numel() * p.element_size() for p in model.parameters())
