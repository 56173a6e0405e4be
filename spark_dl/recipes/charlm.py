"""Character-level RNN/LSTM on a text corpus (thesis §4.3), single process.

The corpus is split into a training head and a held-out tail. Every update batch holds
``batch_size`` random sequences of ``seq_len`` characters, trained by truncated BPTT in chunks
of ``tbptt`` steps with the hidden state carried across chunks (one update per chunk), until
the fixed budget of ``updates``. Validation: mean cross-entropy (nats/char) over the tail,
read in contiguous chunks with the state carried.
"""

from __future__ import annotations

import copy
import dataclasses
import time
from pathlib import Path

import numpy as np
import torch

from ..compat import default_parallelism
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
    weight_decay: float = 0.0       # the optimizer's L2 penalty
    ema: float = 0.0                # > 0: also validate an exponential moving average of the
                                    # weights (this decay per update, e.g. 0.999; lower over
                                    # the first updates: min(ema, (1 + n) / (10 + n)))
    updates: int = 2000             # the fixed budget of optimizer steps
    time_budget_s: float = 0.0      # also stop once training has run this long (0: no limit)
    eval_every: int = 500
    sample_len: int = 300
    temperature: float = 0.8
    strategy: str = "single"        # "single" (this process), "allreduce", "downpour", "gossip"
    replicas: int = 0               # Spark replicas (0: the cluster's task slots / partitions)
    partitions: int = 1             # downpour: each replica's model split over F tasks
    run: RunConfig = RunConfig()

    def __post_init__(self):
        _check(self.kind in ("lstm", "rnn"), "kind", self.kind, "must be 'lstm' or 'rnn'")
        _check(0 < self.val_fraction < 1, "val_fraction", self.val_fraction, "must be in (0, 1)")
        for key in ("hidden", "layers", "seq_len", "tbptt", "batch_size", "updates",
                    "eval_every"):
            _check(getattr(self, key) >= 1, key, getattr(self, key), "must be >= 1")
        _check(0 < self.lr_decay <= 1, "lr_decay", self.lr_decay, "must be in (0, 1]")
        _check(0 <= self.dropout < 1, "dropout", self.dropout, "must be in [0, 1)")
        _check(self.weight_decay >= 0, "weight_decay", self.weight_decay, "must be >= 0")
        _check(0 <= self.ema < 1, "ema", self.ema, "must be in [0, 1) (0: off)")
        _check(self.strategy == "single" or not (self.ema or self.weight_decay), "strategy",
               self.strategy, "runs without weight_decay and ema (the single-process job's); "
               "leave them at 0 or use strategy = 'single'")
        _check(self.tbptt <= self.seq_len, "tbptt", self.tbptt, "must be <= seq_len")
        _check(self.strategy in ("single", "allreduce", "downpour", "gossip"), "strategy",
               self.strategy, "must be 'single', 'allreduce', 'downpour' or 'gossip'")
        _check(self.replicas >= 0, "replicas", self.replicas, "must be >= 0")
        _check(self.partitions >= 1, "partitions", self.partitions, "must be >= 1")
        _check(self.partitions == 1 or self.strategy == "downpour", "partitions",
               self.partitions, "> 1 (model parallelism) needs strategy = 'downpour'")


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
    if cfg.strategy != "single":
        return _train_char_spark(cfg, log, spark)
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
    opt = make_optimizer(cfg.optimizer, model.parameters(), cfg.lr,
                         weight_decay=cfg.weight_decay)
    averaged = None
    if cfg.ema:
        averaged = copy.deepcopy(model)
        averaged.rnn.flatten_parameters()
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
        if averaged is not None:           # the average moves as far as ``chunks`` updates
            with torch.no_grad():
                decay = min(cfg.ema, (1 + before) / (10 + before))  # early: a short memory
                for a, w in zip(averaged.parameters(), model.parameters()):
                    a.lerp_(w, 1 - decay ** chunks)
        if done // cfg.eval_every > before // cfg.eval_every or done >= cfg.updates or \
                out_of_time():
            for group in opt.param_groups:
                group["lr"] *= cfg.lr_decay
            val = _validate(model, val_ids, cfg.tbptt)
            curve.append({"updates": done, "train_loss": loss, "val_loss": val,
                          "seconds": time.perf_counter() - t0})
            if averaged is not None:
                curve[-1]["val_loss_ema"] = _validate(averaged, val_ids, cfg.tbptt)
            log(f"{cfg.kind}: {done} updates, train {loss:.3f}, val {val:.3f} nats/char"
                + (f" (average {curve[-1]['val_loss_ema']:.3f})" if averaged is not None
                   else "") + f", {time.perf_counter() - t0:.0f} s")
    prime = vocab.encode("ROMEO:\n").tolist()
    text_out = vocab.decode(sample(model.cpu(), prime, cfg.sample_len, cfg.temperature,
                                   torch.Generator().manual_seed(cfg.run.seed)))
    return {"kind": cfg.kind, "hidden": cfg.hidden, "layers": cfg.layers,
            "dropout": cfg.dropout, "updates": done,
            "tbptt": cfg.tbptt, "batch_size": cfg.batch_size, "optimizer": cfg.optimizer,
            "lr": cfg.lr, "lr_decay": cfg.lr_decay, "time_budget_s": cfg.time_budget_s,
            "weight_decay": cfg.weight_decay, "ema": cfg.ema,
            "vocab": len(vocab), "val_loss": curve[-1]["val_loss"],
            "train_seconds": time.perf_counter() - t0, "curve": curve,
            "sample": "ROMEO:\n" + text_out}


def _window_frame(spark, corpus: str, vocab_json: str, lo: int, hi: int, T: int,
                  partitions: int, streams: int, carry: int):
    """DataFrame(features array<int>, label array<int>) of characters lo..hi of ``corpus``,
    made in the executors from the file: partition p holds the p-th contiguous part of the
    text, read as ``streams`` contiguous streams, in stream order (row j of step s is window s
    of stream j: T characters, the targets shifted by one), so that consecutive unshuffled
    batches of ``streams`` rows continue each other's text. The windows per stream are cut to
    a multiple of ``carry`` (whole sequences)."""
    import pyarrow as pa

    def make(batches):
        from spark_dl.data import CharVocab
        ids = CharVocab.from_json(vocab_json).encode(
            Path(corpus).read_text(encoding="utf-8"))[lo:hi]
        for b in batches:
            for p in b.column("id").to_numpy():
                a, z = p * len(ids) // partitions, (p + 1) * len(ids) // partitions
                L = (z - a - 1) // streams                      # characters per stream
                n = L // T
                n = n - n % carry if n >= carry else n          # whole sequences of windows
                if n == 0:
                    continue
                starts = a + (np.arange(n)[:, None] * T + np.arange(streams)[None] * L).ravel()
                idx = starts[:, None] + np.arange(T)[None]      # (n * streams, T)
                off = pa.array(np.arange(0, (len(idx) + 1) * T, T, dtype=np.int32))
                yield pa.RecordBatch.from_arrays(
                    [pa.ListArray.from_arrays(off, pa.array(ids[idx].ravel().astype(np.int32))),
                     pa.ListArray.from_arrays(off, pa.array(ids[idx + 1].ravel()
                                                            .astype(np.int32)))],
                    ["features", "label"])
    return spark.range(partitions, numPartitions=partitions).mapInArrow(
        make, "features array<int>, label array<int>")


def _train_char_spark(cfg: CharConfig, log, spark) -> dict:
    """Truncated BPTT on Spark replicas (all-reduce, or Downpour with ``partitions`` tasks per
    replica): each task's part of the training head is read as parallel streams of windows of
    ``tbptt`` characters, and the state is carried from one window of a stream to the next
    over sequences of ``seq_len`` characters, as in the single-process job. The budget of
    ``updates`` steps per replica becomes whole epochs; ``lr_decay`` applies once per epoch.
    ``val_loss`` is measured as in the single-process job (the tail read with the state
    carried)."""
    from ..data import char_windows
    from ..fit import fit
    from ..models import CharLM
    from ..session import get_session
    if cfg.time_budget_s:
        log(f"note: time_budget_s is not applied by the {cfg.strategy} strategy")
    spark = spark or get_session()
    text = Path(cfg.corpus).read_text(encoding="utf-8")
    vocab = CharVocab.from_text(text)
    ids = vocab.encode(text)
    split = int(len(ids) * (1 - cfg.val_fraction))
    F = cfg.partitions
    replicas = cfg.replicas or max(default_parallelism(spark) // F, 1)
    T, carry = cfg.tbptt, max(cfg.seq_len // cfg.tbptt, 1)
    streams = max(cfg.batch_size // F, 1)        # per task: a replica's batch is batch_size
    tasks = replicas * F
    steps_per_epoch = (split // tasks - 1) // streams // T
    steps_per_epoch -= steps_per_epoch % carry if steps_per_epoch >= carry else 0
    if steps_per_epoch < 1:
        raise ValueError(f"{cfg.corpus}'s training part is too short for {tasks} tasks x "
                         f"{streams} streams of {T}-character windows; lower batch_size, "
                         f"tbptt or replicas")
    epochs = max(1, -(-cfg.updates // steps_per_epoch))
    df = _window_frame(spark, str(Path(cfg.corpus).resolve()), vocab.to_json(), 0, split, T,
                       tasks, streams, carry)
    vx, vy = char_windows(ids[split:], T)
    V, hidden, layers, kind, dropout = len(vocab), cfg.hidden, cfg.layers, cfg.kind, cfg.dropout
    from ..strategies import make_strategy
    strategy = make_strategy(cfg.strategy, **({"partitions": F} if F > 1 else {}))
    res = fit(df, lambda: CharLM(V, hidden, layers, kind, dropout, carry=carry), shape=(T,),
              label_shape=(T,), loss="sequence_cross_entropy", strategy=strategy,
              optimizer=cfg.optimizer, lr=cfg.lr, lr_decay=cfg.lr_decay, epochs=epochs,
              batch_size=streams, shuffle=False, replicas=replicas, seed=cfg.run.seed,
              device=cfg.run.device, threads=cfg.run.threads, validation=(vx, vy),
              run_dir=f"{cfg.run.out_dir}/char-{kind}-{cfg.strategy}"
                      + (f"-{replicas}x{F}" if F > 1 else ""),
              log=log, track=cfg.run.track)
    model = res.model.rnn
    val = _validate(model, torch.from_numpy(ids[split:]), cfg.tbptt)
    prime = vocab.encode("ROMEO:\n").tolist()
    text_out = vocab.decode(sample(model.cpu(), prime, cfg.sample_len, cfg.temperature,
                                   torch.Generator().manual_seed(cfg.run.seed)))
    world = res.info["world"]
    return {"kind": kind, "hidden": hidden, "layers": layers, "dropout": dropout,
            "strategy": cfg.strategy, "replicas": world, "partitions": F,
            "updates": steps_per_epoch * epochs, "epochs": epochs, "tbptt": T,
            "carried_windows": carry, "batch_size": streams * F,
            "global_batch": world * streams * F if cfg.strategy == "allreduce" else streams * F,
            "optimizer": cfg.optimizer, "lr": cfg.lr, "lr_decay": cfg.lr_decay,
            "vocab": V, "val_loss": val, "val_loss_per_window": res.history[-1]["val_loss"],
            "train_seconds": res.info["train_seconds"], "history": res.history,
            "curve": [{"updates": h["epoch"] * steps_per_epoch, "train_loss": h["loss"],
                       "val_loss": h["val_loss"]} for h in res.history],
            "sample": "ROMEO:\n" + text_out}
