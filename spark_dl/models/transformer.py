"""A decoder-only (GPT-style) language model: token and learned position embeddings,
``layers`` pre-norm blocks (causal self-attention, then a 4× GELU MLP, each added to its
input), a final LayerNorm and a linear head over the vocabulary, optionally tied to the token
embedding. It takes token ids (B, T), T <= ``context``, and gives next-token logits
(B, T, vocab): what ``loss="sequence_cross_entropy"`` takes against (B, T) target ids."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["TransformerLM"]


class _Block(nn.Module):
    def __init__(self, width: int, heads: int, dropout: float):
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.ln1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.ln2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(),
                                 nn.Linear(4 * width, width), nn.Dropout(dropout))
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, D = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(B, T, 3, self.heads, D // self.heads) \
            .permute(2, 0, 3, 1, 4)                              # 3 x (B, heads, T, D/heads)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        x = x + self.drop(self.proj(a.transpose(1, 2).reshape(B, T, D)))
        return x + self.mlp(self.ln2(x))


class TransformerLM(nn.Module):
    """ids (B, T) integer token ids in 0..vocab-1, T <= context -> logits (B, T, vocab).

    vocab: the tokens; layers: blocks; width: d_model; heads: attention heads (dividing
    width); context: the longest sequence (positions learned up to it); dropout: on the
    embeddings, the attention weights and each block's outputs; tie: the head shares the
    token embedding's weights (no head matrix of its own)."""

    def __init__(self, vocab: int = 65, layers: int = 4, width: int = 256, heads: int = 4,
                 context: int = 128, dropout: float = 0.1, tie: bool = False):
        super().__init__()
        for name, v in (("vocab", vocab), ("layers", layers), ("width", width),
                        ("heads", heads), ("context", context)):
            if int(v) != v or v < 1:
                raise ValueError(f"TransformerLM's {name} must be a positive integer, "
                                 f"got {v!r}")
        if width % heads:
            raise ValueError(f"TransformerLM's width {width} must be a multiple of heads "
                             f"{heads} (each head takes width / heads)")
        if not 0 <= dropout < 1:
            raise ValueError(f"TransformerLM's dropout must be in [0, 1), got {dropout!r}")
        self.vocab, self.context = int(vocab), int(context)
        self.tok = nn.Embedding(self.vocab, width)
        self.pos = nn.Embedding(self.context, width)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.Sequential(*(_Block(width, heads, dropout) for _ in range(layers)))
        self.ln = nn.LayerNorm(width)
        self.head = nn.Linear(width, self.vocab, bias=False)
        if tie:
            self.head.weight = self.tok.weight
        self.apply(self._init)

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.dim() != 2 or ids.is_floating_point() or ids.is_complex():
            raise ValueError(
                f"TransformerLM takes integer token ids (B, T), got a {ids.dtype} tensor of "
                f"shape {tuple(ids.shape)}: keep the ids in an integer column (array<int>), "
                f"which reaches the model as int64, with fit's shape=(T,)")
        if ids.device.type == "cpu" and ids.numel():   # (a GPU's gather asserts by itself)
            lo, hi = torch.stack(torch.aminmax(ids)).tolist()
            if lo < 0 or hi >= self.vocab:
                raise ValueError(f"token ids must be in 0..{self.vocab - 1}, got {lo}..{hi}: "
                                 f"build the model with vocab= the vocabulary's size")
        T = ids.shape[1]
        if T > self.context:
            raise ValueError(f"TransformerLM was built for sequences of at most context="
                             f"{self.context} tokens, got {T}: cut the windows or build it "
                             f"with context={T}")
        x = self.tok(ids) + self.pos(torch.arange(T, device=ids.device))
        return self.head(self.ln(self.blocks(self.drop(x))))
