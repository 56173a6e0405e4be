"""Column-partitioned layers and the models built from them.

Each rank allocates only its slice: a Linear layer its output units (the columns of the
thesis's W, which is torch's weight transposed), a Conv2d layer its output filters, an LSTM
layer its hidden units (the rows of all four gate matrices that feed them). Everything between
partitioned layers (activations, pooling, the loss) runs replicated on every rank.

An RNN layer is split like the LSTM (one tanh or ReLU "gate"); an SSDA's DenoisingLayer like a
Linear layer whose decoder is the transpose: the encoder's columns (hidden units) are the
decoder's rows, so each rank decodes with its own slice and the partial reconstructions are
summed. A Linear or Conv2d layer narrower than the group (e.g. SRCNN's 1-channel output at
F = 2) is kept whole on every rank: rank 0 owns and trains it, the others receive its values
from rank 0 at each forward pass; its gradient is the same on every rank (its input and the
gradient of its output are replicated), so nothing is lost by training one copy.

``partition_model(model, comm)`` turns an FCNet, ThesisCNN, CharRNN (LSTM or RNN), SSDA, SRCNN
or any model made of those layers into its partitioned form, copying this rank's slice of the
given weights, so that a partitioned model computes what the original computes (the tests
check outputs and gradients to 1e-6 in float64).
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.nn import functional as F

from ..models.ssda import DenoisingLayer
from .comm import Comm
from .mappings import (
    copy_to_partitions,
    gather_from_partitions,
    reduce_from_partitions,
    scatter_to_partitions,
)

__all__ = ["ColumnConv2d", "ColumnDenoisingLayer", "ColumnLSTM", "ColumnLinear", "ColumnRNN",
           "kept_whole", "merge_partitions", "parameter_bytes", "partition_model"]


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
        self.sizes = comm.split(out_features)
        n = self.sizes[comm.rank]
        kw = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.empty(n, in_features, **kw))      # (out/F, in)
        self.bias = nn.Parameter(torch.zeros(n, **kw)) if bias else None

    @classmethod
    def from_linear(cls, layer: nn.Linear, comm: Comm) -> ColumnLinear:
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
        self.in_channels, self.out_channels = conv.in_channels, conv.out_channels  # whole
        self.kernel_size = conv.kernel_size
        self.sizes = comm.split(conv.out_channels)
        rows = _slice(self.sizes, comm.rank)
        self.stride, self.padding, self.dilation = conv.stride, conv.padding, conv.dilation
        self.weight = nn.Parameter(conv.weight.detach()[rows].clone())   # (f/F, C, k, k)
        self.bias = nn.Parameter(conv.bias.detach()[rows].clone()) \
            if conv.bias is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y_p = F.conv2d(copy_to_partitions(x, self.comm), self.weight, self.bias, self.stride,
                       self.padding, self.dilation)                     # (B, f/F, H', W')
        return gather_from_partitions(y_p, self.comm, self.sizes, 1)


class _ColumnRecurrent(nn.Module):
    """A (multi-layer, batch-first) recurrent layer whose hidden units are split over the
    group: rank p holds, for its units, the rows of every gate's input and recurrent matrices
    and of both biases. Each step's outputs are all-gathered, since the next step
    (and the next layer) needs all of h."""

    gates = 1

    def __init__(self, rnn: nn.RNNBase, comm: Comm):
        super().__init__()
        name = type(rnn).__name__
        if not rnn.batch_first or rnn.bidirectional or getattr(rnn, "proj_size", 0) \
                or not rnn.bias or rnn.dropout:
            raise ValueError(f"Column{name} partitions batch-first, unidirectional {name}s with "
                             f"biases, without projections and without dropout between layers")
        self.comm, self.hidden, self.layers = comm, rnn.hidden_size, rnn.num_layers
        self.sizes = comm.split(rnn.hidden_size)
        H, cols, G = rnn.hidden_size, _slice(self.sizes, comm.rank), self.gates

        def rows(w):                           # my units' rows of every gate
            return torch.cat([w[g * H + cols.start:g * H + cols.stop] for g in range(G)])
        # both biases kept (not their sum): an optimizer steps each, as it does torch's layer
        self.w_ih, self.w_hh, self.b_ih, self.b_hh = (nn.ParameterList() for _ in range(4))
        for k in range(rnn.num_layers):
            for mine, key in ((self.w_ih, "weight_ih"), (self.w_hh, "weight_hh"),
                              (self.b_ih, "bias_ih"), (self.b_hh, "bias_hh")):
                mine.append(nn.Parameter(rows(getattr(rnn, f"{key}_l{k}").detach()).clone()))

    def forward(self, x: torch.Tensor, state=None):
        """x (B, T, in) -> out (B, T, H) and the last state, as the torch layer."""
        B, T, _ = x.shape
        cols = _slice(self.sizes, self.comm.rank)
        if state is None:
            zeros = x.new_zeros(self.layers, B, self.hidden)
            state = (zeros, zeros) if self.gates == 4 else zeros
        h0, c0 = (state if self.gates == 4 else (state, None))
        hs, cs = [], []
        for k in range(self.layers):
            h = h0[k]                                           # (B, H), replicated
            c = None if c0 is None else c0[k][:, cols]          # (B, H/F), this rank's units
            pre = F.linear(copy_to_partitions(x, self.comm), self.w_ih[k],
                           self.b_ih[k] + self.b_hh[k])
            outs = []
            for t in range(T):                                  # pre: (B, T, G H/F)
                gates = pre[:, t] + F.linear(copy_to_partitions(h, self.comm), self.w_hh[k])
                h_p, c = self._cell(gates, c)
                h = gather_from_partitions(h_p, self.comm, self.sizes, 1)   # (B, H)
                outs.append(h)
            x = torch.stack(outs, 1)                            # (B, T, H)
            hs.append(h)
            if c is not None:
                cs.append(gather_from_partitions(c, self.comm, self.sizes, 1))
        h_n = torch.stack(hs)
        return x, ((h_n, torch.stack(cs)) if self.gates == 4 else h_n)


class ColumnLSTM(_ColumnRecurrent):
    """An nn.LSTM split by hidden units: rank p holds its units' rows of the input, forget,
    cell and output gate matrices and computes their gates, cell and output at every step."""

    gates = 4

    def _cell(self, gates, c):
        i, f, g, o = gates.split(self.sizes[self.comm.rank], dim=1)     # (B, H/F) each
        c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
        return torch.sigmoid(o) * torch.tanh(c), c


class ColumnRNN(_ColumnRecurrent):
    """An nn.RNN (Elman, tanh or ReLU) split by hidden units: h_t = act(W_ih x_t + W_hh h_{t-1}
    + b), rank p computing its units' rows."""

    def __init__(self, rnn: nn.RNN, comm: Comm):
        super().__init__(rnn, comm)
        self.act = torch.tanh if rnn.nonlinearity == "tanh" else torch.relu

    def _cell(self, gates, c):
        return self.act(gates), None


class ColumnDenoisingLayer(nn.Module):
    """An SSDA layer (models.ssda.DenoisingLayer) split by hidden units. The tied weight W
    (hidden, n_in) is cut by rows, so encode is a column-partitioned layer,
    h = gather(σ(x W_pᵀ + b_p)), and decode sums the ranks' partial reconstructions,
    ŷ = σ(Σ_p h_p W_p + b'), b' held (and trained) by rank 0 alone."""

    def __init__(self, layer: nn.Module, comm: Comm):
        super().__init__()
        self.comm, self.spec = comm, layer.spec
        hidden, n_in = layer.weight.shape
        self.sizes = comm.split(hidden)
        rows = _slice(self.sizes, comm.rank)
        self.weight = nn.Parameter(layer.weight.detach()[rows].clone())      # (hidden/F, in)
        self.bias = nn.Parameter(layer.bias.detach()[rows].clone())
        self.bias_out = nn.Parameter(layer.bias_out.detach()[:n_in if comm.rank == 0 else 0]
                                     .clone())                               # rank 0: (in,)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        h_p = torch.sigmoid(F.linear(copy_to_partitions(x, self.comm), self.weight, self.bias))
        return gather_from_partitions(h_p, self.comm, self.sizes, 1)          # (B, hidden)

    def decode(self, h: torch.Tensor) -> torch.Tensor:
        part = scatter_to_partitions(h, self.comm, self.sizes, 1) @ self.weight  # (B, in)
        if self.comm.rank == 0:
            part = part + self.bias_out
        return torch.sigmoid(reduce_from_partitions(part, self.comm))

    def weight_norm2(self) -> torch.Tensor:
        """‖W‖²_F: the value of the whole matrix, the gradient of this rank's slice."""
        mine = (self.weight ** 2).sum()
        if self.comm.size == 1:
            return mine
        total = self.comm.all_reduce(mine.detach().clone(), "weight_norm")
        return mine + (total - mine.detach())

    loss = DenoisingLayer.loss        # eq. 5.3 from the partitioned parts: the same value on
    #                                   every rank, each rank's gradient its slice's


def _keep_whole(module: nn.Module, comm: Comm) -> nn.Module:
    """Keep a layer too narrow to split whole on every rank: rank 0's copy is the trained one,
    the others hold untrained copies that receive rank 0's values before every forward pass."""
    module._spark_dl_kept_whole = True
    if comm.size == 1:
        return module
    if comm.rank != 0:
        for p in module.parameters():
            p.requires_grad_(False)

    def sync(mod, _inputs):
        if not comm.initialized:
            return
        for name, p in list(mod._parameters.items()):
            if p is None:
                continue
            if p.is_meta and not p.requires_grad:   # ranks > 0, built on meta: give it memory
                p = nn.Parameter(torch.empty(p.shape, dtype=p.dtype), requires_grad=False)
                mod._parameters[name] = p
            with torch.no_grad():
                comm.broadcast(p.data, 0, "kept_whole_broadcast")
    module.register_forward_pre_hook(sync)
    return module


def kept_whole(model: nn.Module) -> list[str]:
    """The names of the layers of a partitioned model that are kept whole (too narrow)."""
    return [name for name, m in model.named_modules() if getattr(m, "_spark_dl_kept_whole",
                                                                 False)]


_PARTITIONED = (ColumnLinear, ColumnConv2d, _ColumnRecurrent, ColumnDenoisingLayer)
_SUPPORTED = "Linear, Conv2d, LSTM, RNN, SSDA DenoisingLayer and BatchNorm"


def partition_model(model: nn.Module, comm: Comm) -> nn.Module:
    """A copy of ``model`` with every Linear, Conv2d, LSTM, RNN and DenoisingLayer replaced by
    its column-partitioned form holding this rank's slice; a Linear or Conv2d narrower than the
    group is kept whole (``kept_whole`` lists them), and so is every BatchNorm (it normalises
    gathered activations, the same on every rank). Other layers must be parameter-free."""
    model = copy.deepcopy(model)

    def narrow(width: int, name: str, kind: str):
        if width < comm.size:
            raise ValueError(f"layer {name} ({kind}) has {width} units, fewer than "
                             f"partitions={comm.size}: use partitions <= {width}")

    def swap(module: nn.Module, prefix: str) -> None:
        for name, child in module.named_children():
            full = f"{prefix}{name}"
            kind = type(child).__name__
            if isinstance(child, nn.Linear):
                setattr(module, name, ColumnLinear.from_linear(child, comm)
                        if child.out_features >= comm.size else _keep_whole(child, comm))
            elif isinstance(child, nn.Conv2d):
                setattr(module, name, ColumnConv2d(child, comm)
                        if child.out_channels >= comm.size else _keep_whole(child, comm))
            elif isinstance(child, (nn.LSTM, nn.RNN)):
                narrow(child.hidden_size, full, kind)
                setattr(module, name, (ColumnLSTM if isinstance(child, nn.LSTM)
                                       else ColumnRNN)(child, comm))
            elif isinstance(child, nn.modules.batchnorm._BatchNorm):
                # normalises the gathered (replicated) activations: whole on every rank,
                # rank 0's copy trained, its running statistics the ones kept
                setattr(module, name, _keep_whole(child, comm))
            elif isinstance(child, DenoisingLayer):
                narrow(child.weight.shape[0], full, kind)
                setattr(module, name, ColumnDenoisingLayer(child, comm))
            elif isinstance(child, (nn.RNNBase, nn.modules.conv._ConvNd)) or \
                    type(child) in (nn.Bilinear, nn.MultiheadAttention):
                raise ValueError(f"layer {full} ({kind}) has no column-partitioned form; "
                                 f"partitioned models are made of {_SUPPORTED} layers and "
                                 f"parameter-free ones")
            else:
                swap(child, f"{full}.")
    swap(model, "")
    for name, m in model.named_modules():
        if isinstance(m, _PARTITIONED) or getattr(m, "_spark_dl_kept_whole", False):
            continue
        own = [k for k, _ in m.named_parameters(recurse=False)] + \
            [k for k, _ in m.named_buffers(recurse=False)]
        if own and not any(isinstance(a, _PARTITIONED) or
                           getattr(a, "_spark_dl_kept_whole", False)
                           for a in _ancestors(model, name)):
            raise ValueError(f"module {name or 'the model'} ({type(m).__name__}) has "
                             f"parameters or buffers {own} that column partitioning does not "
                             f"split; partitioned models are made of {_SUPPORTED} layers and "
                             f"parameter-free ones (activations, pooling)")
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
    for name, _module in original.named_modules():
        pieces = [m.get(name) for m in modules]
        if isinstance(pieces[0], (ColumnLinear, ColumnConv2d)):
            out[f"{name}.weight"] = torch.cat([q.weight.detach() for q in pieces])
            if pieces[0].bias is not None:
                out[f"{name}.bias"] = torch.cat([q.bias.detach() for q in pieces])
        elif isinstance(pieces[0], ColumnDenoisingLayer):
            out[f"{name}.weight"] = torch.cat([q.weight.detach() for q in pieces])
            out[f"{name}.bias"] = torch.cat([q.bias.detach() for q in pieces])
            out[f"{name}.bias_out"] = pieces[0].bias_out.detach()
        elif isinstance(pieces[0], _ColumnRecurrent):
            G = pieces[0].gates
            for k in range(pieces[0].layers):
                for key, attr in (("weight_ih", "w_ih"), ("weight_hh", "w_hh"),
                                  ("bias_ih", "b_ih"), ("bias_hh", "b_hh")):
                    gates = [getattr(q, attr)[k].detach().split(q.sizes[q.comm.rank])
                             for q in pieces]                  # per part: its gates' rows
                    out[f"{name}.{key}_l{k}"] = torch.cat(
                        [gates[p][g] for g in range(G) for p in range(len(parts))])
    trained = parts[0].state_dict()     # replicated and kept-whole layers: partition 0's
    for key, value in original.state_dict().items():
        out.setdefault(key, trained.get(key, value))
    return out


def parameter_bytes(model: nn.Module) -> int:
    """Bytes of the parameters this rank holds."""
    return sum(p.numel() * p.element_size() for p in model.parameters())
