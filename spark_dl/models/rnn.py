"""Character-level RNN and LSTM (thesis §4.3): multi-layer, one-hot inputs, truncated BPTT
with the hidden state carried across chunks, padding + masking for variable-length sequences,
and sampling with temperature.

The LSTM is torch's (input, forget, cell and output gates, no peephole connections, as in
Graves 2012 without peepholes); the RNN uses tanh units.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["CharLM", "CharRNN", "masked_cross_entropy", "pad_sequences", "sample", "train_tbptt"]


class CharRNN(nn.Module):
    """ids (B, T) -> logits (B, T, vocab), state; state carries (h, c) for the LSTM, h for RNN."""

    def __init__(self, vocab_size: int, hidden: int = 200, layers: int = 2, kind: str = "lstm",
                 dropout: float = 0.0):
        super().__init__()
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {vocab_size}: build the vocabulary "
                             f"from a non-empty corpus")
        cells = {"lstm": nn.LSTM, "rnn": nn.RNN}
        if kind not in cells:
            raise ValueError(f"unknown recurrent kind {kind!r}; choose 'lstm' or 'rnn'")
        self.vocab_size, self.kind = vocab_size, kind
        self.rnn = cells[kind](vocab_size, hidden, num_layers=layers, batch_first=True,
                               dropout=dropout if layers > 1 else 0.0)
        self.drop = nn.Dropout(dropout)     # also on the top layer's output (as char-rnn)
        self.head = nn.Linear(hidden, vocab_size)

    def forward(self, ids: torch.Tensor, state=None):
        if ids.dim() != 2:
            raise ValueError(f"CharRNN expects ids (B, T), got shape {tuple(ids.shape)}")
        if ids.numel():                  # one host read of both ends (a GPU waits once)
            lo, hi = torch.stack(torch.aminmax(ids)).tolist()
            if lo < 0 or hi >= self.vocab_size:
                raise ValueError(f"character ids must be in 0..{self.vocab_size - 1}, got "
                                 f"{lo}..{hi}; encode with the model's vocabulary")
        x = F.one_hot(ids, self.vocab_size).to(self.head.weight.dtype)   # (B, T, V)
        out, state = self.rnn(x, state)                                  # (B, T, H)
        return self.head(self.drop(out)), state


class CharLM(nn.Module):
    """A CharRNN for the distributed engines: ids (B, T) (any dtype) -> logits (B, T, vocab).

    ``carry`` = 1: the state starts from zero in every window (whole-window BPTT). ``carry`` =
    k > 1: truncated BPTT across windows, as the single-process job does: in training, the
    state a batch ends with (detached) starts the next batch, and is reset every k batches (a
    sequence of k windows) or when the batch size changes. The data must then come in stream
    order, unshuffled: row j of batch s is window s of stream j (``char_stream_windows``)."""

    def __init__(self, vocab_size: int, hidden: int = 200, layers: int = 2, kind: str = "lstm",
                 dropout: float = 0.0, carry: int = 1):
        super().__init__()
        if carry < 1:
            raise ValueError(f"carry must be >= 1 window, got {carry}")
        self.rnn = CharRNN(vocab_size, hidden, layers, kind, dropout)
        self.carry = carry
        self._state, self._batches = None, 0

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        ids = ids.long()
        if not self.training or self.carry == 1:
            return self.rnn(ids)[0]
        state = self._state
        if state is not None:
            h = state[0] if isinstance(state, tuple) else state          # (layers, B, H)
            if self._batches % self.carry == 0 or h.shape[1] != len(ids):
                state = None
        logits, state = self.rnn(ids, state)
        self._state, self._batches = _detach(state), self._batches + 1
        return logits


def pad_sequences(seqs: Sequence[Sequence[int]], pad: int = 0, max_len: int | None = None):
    """Variable-length id sequences -> ids (B, T_max) int64 and mask (B, T_max) bool."""
    lengths = [len(s) for s in seqs]
    if max_len is not None and lengths and max(lengths) > max_len:
        i = int(np.argmax(lengths))
        raise ValueError(f"sequence {i} has {lengths[i]} steps, longer than the configured "
                         f"max_len={max_len}; raise max_len or split the sequence")
    T = max(lengths, default=0)
    ids = torch.full((len(seqs), T), pad, dtype=torch.long)
    mask = torch.zeros((len(seqs), T), dtype=torch.bool)
    for i, s in enumerate(seqs):
        ids[i, :len(s)] = torch.as_tensor(np.asarray(s, dtype=np.int64))
        mask[i, :len(s)] = True
    return ids, mask


def masked_cross_entropy(logits: torch.Tensor, targets: torch.Tensor,
                         mask: torch.Tensor | None = None) -> torch.Tensor:
    """Mean cross-entropy (nats per character) over the unmasked steps; logits (B, T, V)."""
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                         reduction="none")
    if mask is None:
        return ce.mean()
    m = mask.reshape(-1).to(ce.dtype)
    return (ce * m).sum() / m.sum().clamp_min(1)


def _detach(state):
    if state is None:
        return None
    return tuple(s.detach() for s in state) if isinstance(state, tuple) else state.detach()


def train_tbptt(model: CharRNN, inputs: torch.Tensor, targets: torch.Tensor,
                optimizer: torch.optim.Optimizer, chunk: int = 100,
                mask: torch.Tensor | None = None, clip: float | None = 5.0,
                state=None):
    """Truncated BPTT over sequences (B, L): one optimizer step per chunk of ``chunk`` steps,
    the hidden state carried (detached) from chunk to chunk. Returns (mean loss, state)."""
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    total, weight = 0.0, 0.0
    for t in range(0, inputs.shape[1], chunk):
        m = None if mask is None else mask[:, t:t + chunk]
        if m is not None and not m.any():
            break                                            # only padding is left
        optimizer.zero_grad(set_to_none=True)
        logits, state = model(inputs[:, t:t + chunk], _detach(state))
        loss = masked_cross_entropy(logits, targets[:, t:t + chunk], m)
        loss.backward()
        if clip:
            nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        w = float(m.sum()) if m is not None else float(targets[:, t:t + chunk].numel())
        total, weight = total + loss.item() * w, weight + w
    return total / max(weight, 1), _detach(state)


@torch.no_grad()
def sample(model: CharRNN, prime: Sequence[int], length: int = 300, temperature: float = 1.0,
           generator: torch.Generator | None = None) -> list[int]:
    """Continue ``prime`` (ids) by ``length`` ids drawn from softmax(logits / temperature)."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if len(prime) == 0:
        raise ValueError("prime needs at least one character id")
    model.eval()
    logits, state = model(torch.as_tensor([list(prime)], dtype=torch.long))
    out = []
    for _ in range(length):
        probs = torch.softmax(logits[0, -1].double() / temperature, dim=-1)
        nxt = int(torch.multinomial(probs, 1, generator=generator))
        out.append(nxt)
        logits, state = model(torch.tensor([[nxt]]), state)
    return out
