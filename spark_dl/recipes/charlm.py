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
    strategy: str = "single"        # "single" (this process) or "allreduce" (Spark replicas)
    replicas: int = 0               # allreduce: replicas (0: the cluster's task slots)
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
        _check(self.strategy in ("single", "allreduce"), "strategy", self.strategy,
               "must be 'single' or 'allreduce'")
        _check(self.replicas >= 0, "replicas", self.replicas, "must be >= 0")


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


def train_char(cfg: CharConfig, log=print, spark=None) -> dict:
    if cfg.strategy == "allreduce":
        return _train_char_allreduce(cfg, log, spark)
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


def _window_frame(spark, corpus: str, vocab_json: str, lo: int, hi: int, T: int,
                  partitions: int):
    """DataFrame(features array<int>, label array<int>): the windows of characters lo..hi of
    ``corpus`` (stride T, targets shifted by one), made in the executors from the file."""
    import pyarrow as pa

    def make(batches):
        from spark_dl.data import CharVocab, char_windows
        ids = CharVocab.from_json(vocab_json).encode(
            Path(corpus).read_text(encoding="utf-8"))[lo:hi]
        x, y = char_windows(ids, T)
        for b in batches:
            for p in b.column("id").to_numpy():
                a, z = p * len(x) // partitions, (p + 1) * len(x) // partitions
                if z > a:
                    off = pa.array(np.arange(0, (z - a + 1) * T, T, dtype=np.int32))
                    yield pa.RecordBatch.from_arrays(
                        [pa.ListArray.from_arrays(off, pa.array(x[a:z].ravel().astype(np.int32))),
                         pa.ListArray.from_arrays(off, pa.array(y[a:z].ravel().astype(np.int32)))],
                        ["features", "label"])
    return spark.range(partitions, numPartitions=partitions).mapInArrow(
        make, "features array<int>, label array<int>")


def _train_char_allreduce(cfg: CharConfig, log, spark) -> dict:
    """Whole windows of ``tbptt`` characters (state reset per window) on Spark replicas; the
    budget of ``updates`` steps becomes whole epochs over the training head's windows, and
    ``lr_decay`` applies once per epoch. ``val_loss`` is measured as in the single-process
    job (the tail read with the state carried)."""
    from ..data import char_windows
    from ..fit import fit
    from ..models import CharLM
    from ..session import get_session
    if cfg.time_budget_s:
        log("note: time_budget_s is not applied by the allreduce strategy")
    spark = spark or get_session()
    text = Path(cfg.corpus).read_text(encoding="utf-8")
    vocab = CharVocab.from_text(text)
    ids = vocab.encode(text)
    split = int(len(ids) * (1 - cfg.val_fraction))
    replicas = cfg.replicas or spark.sparkContext.defaultParallelism
    T = cfg.tbptt
    windows = (split - 1 - T) // T + 1
    steps_per_epoch = -(-windows // replicas // cfg.batch_size)
    epochs = max(1, -(-cfg.updates // steps_per_epoch))
    df = _window_frame(spark, str(Path(cfg.corpus).resolve()), vocab.to_json(), 0, split, T,
                       replicas)
    vx, vy = char_windows(ids[split:], T)
    V, hidden, layers, kind, dropout = len(vocab), cfg.hidden, cfg.layers, cfg.kind, cfg.dropout
    res = fit(df, lambda: CharLM(V, hidden, layers, kind, dropout), shape=(T,),
              label_shape=(T,), loss="sequence_cross_entropy", optimizer=cfg.optimizer,
              lr=cfg.lr, lr_decay=cfg.lr_decay, epochs=epochs, batch_size=cfg.batch_size,
              replicas=replicas, seed=cfg.run.seed, device=cfg.run.device,
              threads=cfg.run.threads, validation=(vx, vy),
              run_dir=f"{cfg.run.out_dir}/char-{kind}-allreduce", log=log,
              track=cfg.run.track)
    model = res.model.rnn
    val = _validate(model, torch.from_numpy(ids[split:]), cfg.tbptt)
    prime = vocab.encode("ROMEO:\n").tolist()
    text_out = vocab.decode(sample(model.cpu(), prime, cfg.sample_len, cfg.temperature,
                                   torch.Generator().manual_seed(cfg.run.seed)))
    return {"kind": kind, "hidden": hidden, "layers": layers, "dropout": dropout,
            "strategy": "allreduce", "replicas": res.info["world"],
            "updates": steps_per_epoch * epochs, "epochs": epochs, "tbptt": T,
            "batch_size": cfg.batch_size, "global_batch": res.info["world"] * cfg.batch_size,
            "optimizer": cfg.optimizer, "lr": cfg.lr, "lr_decay": cfg.lr_decay,
            "vocab": V, "val_loss": val, "val_loss_per_window": res.history[-1]["val_loss"],
            "train_seconds": res.info["train_seconds"], "history": res.history,
            "curve": [{"updates": h["epoch"] * steps_per_epoch, "train_loss": h["loss"],
                       "val_loss": h["val_loss"]} for h in res.history],
            "sample": "ROMEO:\n" + text_out}
