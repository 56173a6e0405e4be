"""The model a synchronous fit validates and returns, averaged over its last steps.

With ``average`` = a > 0 the replicas train their model x as before, and alongside keep its
exponential moving average over about a epochs of steps, the rule of the parameter server's
averaged shards (spark_dl/transport/ps/shard.py, "Averaged parameters"):

    x̄ <- x̄ + (x - x̄) / (a E_t)   after every step,   E_t = min(E, t)

for the t steps taken so far of an epoch of E (x̄ = x while a E_t <= 1). In the first epoch
the average covers the last fraction a of the trajectory so far, not the initial values and
the steep first steps; after the first epoch, the last a E steps. Training reads x only:
the average changes no step, only what is validated, checkpointed alongside and returned.

Why: SGD's iterates wander around the descent by the noise of their mini-batches; their
average over a short window sits closer to its middle (Polyak and Juditsky, 1992; the
measurements: docs/design/0004-averaged-weights.md). The buffers (BatchNorm's running
statistics) are not averaged: they belong to the live weights. ``recompute_statistics``
gives the averaged weights their own, from forward passes over training rows (SWA's
``update_bn``); AllReduce does so whenever its averaged model is read (validated, returned),
on ``STATISTICS_ROWS`` rows (docs/design/0022-batchnorm-statistics-of-the-average.md).

Sparse updates: a lerp is a pass over the weights' memory, which on a CPU costs a sizeable
part of a small-batch step of a fully connected net. So the average takes the live values every ``interval`` steps, k at once,
k = a E_t / 32 (at least 1: the window keeps at least 32 updates), with the weight of k
steps, k / (a E_t), and folds in the steps still pending whenever it is read. Over a window
of W >= 32 steps this differs from the update of every step only in what the skipped
iterates are taken to be: the next one taken (docs/guides/fit.md, "Averaged weights").
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable

import torch
from torch import nn

__all__ = ["DEFAULT_AVERAGE", "STATISTICS_ROWS", "AveragedModel", "WeightAverage",
           "batch_norms", "check_average", "copy_model", "interval", "kept_modes",
           "recompute_statistics", "remake", "weight"]

DEFAULT_AVERAGE = 0.1        # the synchronous strategies' default span, in epochs
UPDATES_PER_WINDOW = 32      # the sparse updates' least number over a window (module doc)
STATISTICS_ROWS = 1024       # rows (all replicas') an averaged model's BatchNorm statistics see


def check_average(average) -> None:
    """A ConfigError unless ``average`` is None or a number >= 0."""
    from ..errors import ConfigError
    if average is not None and (isinstance(average, bool) or not isinstance(
            average, (int, float)) or not average >= 0 or average == float("inf")):
        raise ConfigError(f"average must be a number >= 0 (the fraction of an epoch the "
                          f"validated and returned model averages over; 0: the last values), "
                          f"got {average!r}")


def weight(span: float, epoch_steps: int, steps: int, k: int = 1) -> float:
    """The lerp weight of the newest values in the average over ``span`` epochs of
    ``epoch_steps`` steps, after ``steps`` steps of which the last ``k`` just came in one
    update (a push of k mini-batches on the server, one step on a replica): k / (span E_t),
    1.0 (the newest values alone) while span E_t <= k."""
    window = span * min(epoch_steps, steps)
    return k / window if window > k else 1.0


def interval(span: float, epoch_steps: int, steps: int) -> int:
    """Every how many steps the average takes the live values, after ``steps`` steps (the
    module doc's sparse updates): the window over ``UPDATES_PER_WINDOW``, at least 1."""
    return max(1, int(span * min(epoch_steps, steps)) // UPDATES_PER_WINDOW)


class WeightAverage:
    """The tensors ``live`` (a model's parameters, Gossip's flat buffer, a server shard's
    values) averaged over the last ``span`` epochs of ``epoch_steps`` steps each (see the
    module doc); ``steps`` already taken (a resumed fit). The average is held in ``into``
    (tensors shaped as ``live``: an averaged copy's parameters, set to the live values here)
    or in clones; read it with ``current()``, which folds in the steps pending."""

    def __init__(self, live, span: float, epoch_steps: int, steps: int = 0, into=None):
        if not span > 0 or epoch_steps < 0:
            raise ValueError(f"span must be > 0 and epoch_steps >= 0, got {span}, "
                             f"{epoch_steps}")
        self.span, self.epoch_steps, self.steps = span, epoch_steps, steps
        self.pending = 0                   # steps taken since the values were last taken
        # the tensors themselves, detached at each use: a parameter whose .data is rebound
        # later (a max-norm constraint written p.data = p.data.renorm(...)) is followed
        self._live = list(live)
        if into is None:
            self._values = [t.detach().clone() for t in self._live]
        else:
            self._values = [t.detach() for t in into]
            torch._foreach_copy_(self._values, self._sources())

    def update(self, steps: int = 1, epoch_steps: int | None = None) -> None:
        """After each optimizer step (a server's push: its ``steps`` mini-batch steps, in
        epochs of ``epoch_steps``, which a server learns from its pushes)."""
        if epoch_steps is not None:
            self.epoch_steps = epoch_steps
        self.steps += steps
        self.pending += steps
        if self.pending >= interval(self.span, self.epoch_steps, self.steps):
            self._fold()

    def _sources(self) -> list[torch.Tensor]:
        return [t.detach() for t in self._live]

    @torch.no_grad()
    def _fold(self) -> None:
        w = weight(self.span, self.epoch_steps, self.steps, self.pending)
        self.pending = 0
        if w < 1.0:
            torch._foreach_lerp_(self._values, self._sources(), w)
        else:
            torch._foreach_copy_(self._values, self._sources())

    def current(self) -> list[torch.Tensor]:
        """The average as of the last step (the steps pending folded in: so when it is read
        moves the fold points a little, and a fit reads it at the same steps every time)."""
        if self.pending:
            self._fold()
        return self._values

    def state_dict(self) -> dict:
        """The average (on the CPU, for a checkpoint) and the steps it has seen."""
        return {"values": [v.detach().to("cpu", copy=True) for v in self.current()],
                "steps": self.steps}

    @torch.no_grad()
    def load_state_dict(self, state: dict | None) -> None:
        """A checkpoint's average (None: one without: the average starts from the live
        values)."""
        self.pending = 0
        if state is None:
            torch._foreach_copy_(self._values, self._sources())
            return
        torch._foreach_copy_(self._values, [v.to(a.device) for v, a in
                                            zip(state["values"], self._values)])
        self.steps = int(state["steps"])


class AveragedModel:
    """A copy of ``model`` whose parameters are their ``WeightAverage`` (arguments as there)
    and whose buffers are the live model's when it is read (AllReduce then gives BatchNorm
    statistics of the averaged weights: ``recompute_statistics``). ``make``: a maker of the
    model (fit's model_fn), for models a deep copy cannot copy (``copy_model``)."""

    def __init__(self, model: nn.Module, span: float, epoch_steps: int, steps: int = 0,
                 make: Callable[[], nn.Module] | None = None):
        self.live = model
        self.model = copy_model(model, make).requires_grad_(False)
        # a deep copy's RNN weights need not be cuDNN's one chunk: made so (a no-op off CUDA
        # or where they are) before the average aliases them, or every forward of the copy
        # could warn and compact them again
        for m in self.model.modules():
            if isinstance(m, nn.RNNBase):
                m.flatten_parameters()
        self.average = WeightAverage(model.parameters(), span, epoch_steps, steps,
                                     into=self.model.parameters())
        self.update = self.average.update
        self.state_dict, self.load_state_dict = (self.average.state_dict,
                                                 self.average.load_state_dict)

    @torch.no_grad()
    def read(self) -> nn.Module:
        """The averaged model, with the live model's buffers and train/eval mode."""
        self.average.current()
        for mine, live in zip(self.model.buffers(), self.live.buffers()):
            mine.copy_(live)
        return self.model.train(self.live.training)


def copy_model(model: nn.Module, make: Callable[[], nn.Module] | None = None) -> nn.Module:
    """A copy of ``model``: a deep copy, or where one fails (a tensor attribute that is not a
    leaf, as torch.nn.utils.weight_norm's computed weight, or spectral_norm's after a
    forward) ``make()``'s model, built without drawing from torch's random numbers, moved to
    the model's device and dtype, with its state dict."""
    try:
        return copy.deepcopy(model)
    except RuntimeError:
        if make is None:
            raise
    return remake(model, make)


def remake(model: nn.Module, make: Callable[[], nn.Module]) -> nn.Module:
    """``make()``'s model (one like ``model``), built without drawing from torch's random
    numbers (a resumed fit trains as an uninterrupted one), on ``model``'s device and dtype,
    with its state (frozen parameters too) and every module's mode."""
    with torch.random.fork_rng(devices=[]):
        twin = make()
    first = next(model.parameters(), None)
    if first is not None:
        twin = twin.to(device=first.device, dtype=first.dtype)
    twin.load_state_dict(model.state_dict())
    for mine, its in zip(twin.modules(), model.modules()):
        mine.training = its.training
    return twin


@contextlib.contextmanager
def kept_modes(model: nn.Module):
    """Every module's training flag as it was when the block ends (set flag by flag: no
    ``train()`` override of the model's runs)."""
    modes = [(m, m.training) for m in model.modules()]
    try:
        yield modes
    finally:
        for m, training in modes:
            m.training = training


def batch_norms(model: nn.Module) -> list[nn.Module]:
    """The model's BatchNorm layers that keep running statistics and that the model's own
    ``train()`` puts in training mode (a model that keeps a pretrained BatchNorm in evaluation
    mode, overriding ``train``, keeps that layer's statistics). Every module's mode is left as
    it was."""
    with kept_modes(model):
        model.train()
        return [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)
                and m.track_running_stats and m.training]


@torch.no_grad()
def recompute_statistics(model: nn.Module, inputs) -> int:
    """BatchNorm's running statistics for ``model``'s present weights: reset, then the plain
    mean over forward passes of ``inputs`` (an iterable of batches on the model's device),
    the BatchNorm layers in training mode and the rest in evaluation mode (no dropout, so the
    statistics are those the evaluated network sees, and no random numbers drawn); the
    BatchNorm layers of ``batch_norms`` only, so a layer the model keeps in evaluation mode
    keeps its statistics. The layers' momentum, ``num_batches_tracked`` and every module's
    mode are restored. Returns the rows seen (0: the statistics are reset ones)."""
    layers = batch_norms(model)
    if not layers:
        return 0
    kept = [(m.momentum, m.num_batches_tracked.clone()) for m in layers]
    rows = 0
    with kept_modes(model) as modes:
        for m, _ in modes:                      # each module's own flag: no train() override
            m.training = False                  # runs, none of its children is touched
        for m in layers:
            m.reset_running_stats()
            m.momentum = None                   # the cumulative mean over the batches
            m.training = True
        try:
            with torch.no_grad():               # (a live model's forward keeps no graph)
                for x in inputs:
                    model(x)
                    rows += len(x)
        finally:
            for m, (momentum, tracked) in zip(layers, kept):
                m.momentum = momentum
                m.num_batches_tracked.copy_(tracked)
    return rows
