"""Character-level RNN/LSTM on a text corpus (thesis §4.3), single process.

The corpus is split into a training head and a held-out tail. Every update batch holds
``batch_size`` random sequences of ``seq_len`` characters, trained by truncated BPTT in chunks
of ``tbptt`` steps with the hidden state carried across chunks (one update per chunk), until
the fixed budget of ``updates``. Validation: mean cross-entropy (nats/char) over the tail,
read in contiguous chunks with the state carried.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import numpy as np
import torch

from ..config import _check
from ..data import CharVocab
from ..models import CharRNN, masked_cross_entropy, sample, train_tbptt
from ..train import make_optimizer, seed_everything
from .common import RunConfig, pick_device

__all__ = ["CharConfig", "train_char"]


@dataclasses.dataclass(frozen=True)
class CharConfig:
    corpus: str = "data/text/tinyshakespeare.txt"
    val_fraction: float = 0.1
    kind: str = "lstm"              # "lstm" or "rnn"
    hidden: int = 200
    layers: int = 2
    dropout: float = 0.0            # between recurrent layers
    seq_len: int = 1000
    tbptt: int = 100
    batch_size: int = 32
    optimizer: str = "rmsprop"
    lr: float = 2e-3
    lr_decay: float = 1.0           # multiply the learning rate by this every eval_every updates
    updates: int = 2000             # the fixed budget of optimizer steps
    time_budget_s: float = 0.0      # also stop once training has run this long (0: no limit)
    eval_every: int = 500
    sample_len: int = 300
    temperature: float = 0.8
    run: RunConfig = RunConfig()

    def __post_init__(self):
        _check(self.kind in ("lstm", "rnn"), "kind", self.kind, "must be 'lstm' or 'rnn'")
        _check(0 < self.val_fraction < 1, "val_fraction", self.val_fraction, "must be in (0, 1)")
        for key in ("hidden", "layers", "seq_len", "tbptt", "batch_size", "updates",
                    "eval_every"):
            _check(getattr(self, key) >= 1, key, getattr(self, key), "must be >= 1")
        _check(0 < self.lr_decay <= 1, "lr_decay", self.lr_decay, "must be in (0, 1]")
        _check(0 <= self.dropout < 1, "dropout", self.dropout, "must be in [0, 1)")
        _check(self.tbptt <= self.seq_len, "tbptt", self.tbptt, "must be <= seq_len")


@torch.no_grad()
def _validate(model, ids: torch.Tensor, chunk: int, streams: int = 16) -> float:
    """Nats/char over ``ids`` read as ``streams`` contiguous streams, state carried."""
    model.eval()
    n = (len(ids) - 1) // streams
    x = ids[:n * streams].view(streams, n)
    y = ids[1:n * streams + 1].view(streams, n)
    state, total = None, 0.0
    for t in range(0, n, chunk):
        logits, state = model(x[:, t:t + chunk], state)
        total += float(masked_cross_entropy(logits, y[:, t:t + chunk])) * x[:, t:t + chunk].numel()
    model.train()
    return total / (n * streams)


def train_char(cfg: CharConfig, log=print) -> dict:
    seed_everything(cfg.run.seed)
    device = pick_device(cfg.run)
    text = Path(cfg.corpus).read_text(encoding="utf-8")
    vocab = CharVocab.from_text(text)
    ids = torch.from_numpy(vocab.encode(text))
    split = int(len(ids) * (1 - cfg.val_fraction))
    train_ids, val_ids = ids[:split], ids[split:].to(device)
    if len(train_ids) <= cfg.seq_len + 1:
        raise ValueError(f"the training part of {cfg.corpus} has {len(train_ids)} characters, "
                         f"fewer than seq_len + 1 = {cfg.seq_len + 1}; lower seq_len")
    model = CharRNN(len(vocab), cfg.hidden, cfg.layers, cfg.kind, cfg.dropout).to(device)
    opt = make_optimizer(cfg.optimizer, model.parameters(), cfg.lr)
    gen = torch.Generator().manual_seed(cfg.run.seed)
    curve, done, t0 = [], 0, time.perf_counter()
    def out_of_time():
        return cfg.time_budget_s > 0 and time.perf_counter() - t0 >= cfg.time_budget_s
    while done < cfg.updates and not out_of_time():
        starts = torch.randint(0, len(train_ids) - cfg.seq_len - 1, (cfg.batch_size,),
                               generator=gen)
        window = torch.stack([train_ids[s:s + cfg.seq_len + 1] for s in starts]).to(device)
        chunks = min(cfg.seq_len // cfg.tbptt, cfg.updates - done)
        loss, _ = train_tbptt(model, window[:, :chunks * cfg.tbptt],
                              window[:, 1:chunks * cfg.tbptt + 1], opt, chunk=cfg.tbptt)
        before = done
        done += chunks
        if done // cfg.eval_every > before // cfg.eval_every or done >= cfg.updates or \
                out_of_time():
            for group in opt.param_groups:
                group["lr"] *= cfg.lr_decay
            val = _validate(model, val_ids, cfg.tbptt)
            curve.append({"updates": done, "train_loss": loss, "val_loss": val,
                          "seconds": time.perf_counter() - t0})
            log(f"{cfg.kind}: {done} updates, train {loss:.3f}, val {val:.3f} nats/char, "
                f"{time.perf_counter() - t0:.0f} s")
    prime = vocab.encode("ROMEO:\n").tolist()
    text_out = vocab.decode(sample(model.cpu(), prime, cfg.sample_len, cfg.temperature,
                                   torch.Generator().manual_seed(cfg.run.seed)))
    return {"kind": cfg.kind, "hidden": cfg.hidden, "layers": cfg.layers,
            "dropout": cfg.dropout, "updates": done,
            "tbptt": cfg.tbptt, "batch_size": cfg.batch_size, "optimizer": cfg.optimizer,
            "lr": cfg.lr, "lr_decay": cfg.lr_decay, "time_budget_s": cfg.time_budget_s,
            "vocab": len(vocab), "val_loss": curve[-1]["val_loss"],
            "train_seconds": time.perf_counter() - t0, "curve": curve,
            "sample": "ROMEO:\n" + text_out}
