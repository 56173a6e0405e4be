"""A model's buffers through the parameter server: BatchNorm's running statistics and any
other registered buffer, which no gradient moves.

The parameters travel as gradients; a buffer is the workers' own state (each worker's
running mean and variance follow the batches it trains on), so every worker reports its
buffers' current values with each push, with the number n_w of mini-batches its model has
trained so far (in this task), and the server keeps the latest report of each worker. The
model the driver validates, checkpoints and returns takes their mean weighted by n_w:

    b = sum_w n_w b_w / sum_w n_w     (over the workers w that reported; none: model_fn()'s)

which for BatchNorm is the statistics of the whole data set's recent batches, as one
process training on all of it would keep them (its momentum, 0.1 by default, spans the
last ~10 mini-batches of each worker). The weights matter when the workers have trained
unequally: a worker that joined late (the data-key scheduler gave the first keys to the
other), or a retried task that started again from ``model_fn()``'s buffers, still holds
much of the initial values (BatchNorm: (1 - momentum)^n of them after n batches); with
equal weights its report would pull the mean towards zeros and ones (docs/guides/
downpour.md, "Buffers").

The rule for the buffers that cannot be averaged: only floating-point buffers travel, in
the shapes ``model_fn()`` gives them on the driver (``buffer_spec``). A buffer that is not
floating point (BatchNorm's ``num_batches_tracked``) is skipped: the model returned keeps
``model_fn()``'s value (BatchNorm with its default momentum never reads it outside
training). A buffer a worker has replaced by one of another shape (or removed) is not
reported by that worker: its slice travels as NaN, which the server reads as "no value",
so the mean is over the workers that have one, and the value stays ``model_fn()``'s when
none has.
"""

from __future__ import annotations

import threading

import torch

__all__ = ["BufferMean", "buffer_spec", "load_buffers", "read_buffers", "spec_numel"]


def buffer_spec(model: torch.nn.Module) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """The buffers that travel: (name, shape) of every floating-point buffer of ``model``,
    in ``named_buffers()`` order (plain values: the tasks' closures carry them)."""
    return tuple((name, tuple(b.shape)) for name, b in model.named_buffers()
                 if b.is_floating_point())


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def spec_numel(spec) -> int:
    return sum(_numel(shape) for _, shape in spec)


def read_buffers(model: torch.nn.Module, spec, out: torch.Tensor) -> torch.Tensor:
    """``model``'s buffers of ``spec`` into the flat ``out`` (their values, cast to its dtype);
    a buffer missing, of another shape or not floating point: NaN (not reported)."""
    found = dict(model.named_buffers())
    off = 0
    for name, shape in spec:
        n = _numel(shape)
        b = found.get(name)
        if b is not None and tuple(b.shape) == tuple(shape) and b.is_floating_point():
            out[off:off + n].copy_(b.detach().reshape(-1))
        else:
            out[off:off + n].fill_(float("nan"))
        off += n
    return out


def load_buffers(model: torch.nn.Module, spec, flat: torch.Tensor) -> None:
    """The flat values of ``spec``'s buffers into ``model`` (cast to each buffer's dtype)."""
    found = dict(model.named_buffers())
    off = 0
    with torch.no_grad():
        for name, shape in spec:
            n = _numel(shape)
            b = found.get(name)
            if b is not None and tuple(b.shape) == tuple(shape):
                b.copy_(flat[off:off + n].reshape(shape))
            off += n


class BufferMean:
    """The server's side: each worker's latest report, and their mean (see the module doc).
    Thread-safe: the workers' connections report concurrently."""

    def __init__(self, initial: torch.Tensor):
        self.initial = initial.detach().reshape(-1).clone()
        self.latest: dict[int, torch.Tensor] = {}
        self.trained: dict[int, int] = {}       # worker -> the mini-batches its report holds
        self.reports = 0
        self._lock = threading.Lock()

    @property
    def numel(self) -> int:
        return self.initial.numel()

    def report(self, worker: int, values: torch.Tensor, trained: int = 1) -> None:
        """``worker``'s buffers after ``trained`` mini-batches of training (its weight; a
        report of 0 counts as 1)."""
        with self._lock:
            self.trained[worker] = max(int(trained), 1)
            mine = self.latest.get(worker)
            if mine is None:
                self.latest[worker] = values.to(self.initial.dtype).clone()
            else:
                mine.copy_(values)
            self.reports += 1

    def mean(self) -> torch.Tensor:
        """The mean of the workers' latest values weighted by the mini-batches each has
        trained (NaN: not reported); model_fn()'s values where no worker reported."""
        with self._lock:
            if not self.latest:
                return self.initial.clone()
            workers = list(self.latest)
            stacked = torch.stack([self.latest[w] for w in workers])       # (workers, n)
            weight = torch.tensor([float(self.trained[w]) for w in workers],
                                  dtype=stacked.dtype)[:, None]
        have = ~torch.isnan(stacked)
        mass = torch.where(have, weight, torch.zeros_like(stacked)).sum(0)
        total = torch.where(have, stacked * weight, torch.zeros_like(stacked)).sum(0)
        return torch.where(mass > 0, total / mass.clamp(min=1e-30), self.initial)

    def load(self, values: torch.Tensor) -> None:
        """A restored checkpoint's mean becomes the starting value; the reports start over."""
        if values.numel() != self.numel:
            raise ValueError(f"the saved server has {values.numel()} buffer values, this one "
                             f"{self.numel}: a different model")
        with self._lock:
            self.initial.copy_(values.reshape(-1))
            self.latest.clear()
            self.trained.clear()
