"""What an FSDP replica holds, estimated on the driver from the model built on the meta device,
and the check of that against a task's Python worker (``spark.executor.pyspark.memory`` over
the executor's cores) before any task starts.

Per replica, in the fit's dtype (s bytes a number), for P parameters, k optimizer slots
(``OPTIMIZER_SLOTS``) and R replicas:

    shards    s (2 + k) P_R        its shard of every parameter, of its gradient and of the
                                   optimizer's state (P_R: replica 0's, the largest shard,
                                   ceil(rows / R) of every parameter)
    step      shards + s (root + 3 U) + A    the root's own parameters (kept gathered through
                                   the step) and the largest unit U three times: gathered, its
                                   gradient before the reduce-scatter, the next unit's
                                   parameters prefetched (with reshard_after_forward=False
                                   every unit stays gathered until its backward: s (P + U));
                                   A: what a step of batch_size rows keeps for backward,
                                   counted on the meta device (0 when fit has no shape=)
    result    s P_R + s (P + B)    replica 0 at the end: its parameter shards and the whole
                                   model (B: its buffers) gathered onto the CPU, which it
                                   writes into the run directory for the driver (the
                                   gradients and the optimizer's state are freed first;
                                   where it does not reach the driver's run directory, the
                                   model's bytes travel through Spark: s (P + B) more)
    need      max(step, result) + MARGIN   (the worker itself before the model: Python,
                                   torch, pyarrow, gloo's threads, the shard of rows; each
                                   replica's ``start_vm_mb`` in info measures it)
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import nn

from ...errors import ResourceError
from .units import wrap_units

__all__ = ["MARGIN", "OPTIMIZER_SLOTS", "Estimate", "check_memory", "estimate", "explain",
           "model_estimate", "optimizer_slots", "verdict"]

MARGIN = 9 << 28                 # bytes (2.25 GiB): a Python worker's address space before
                                 # the model (1.9-2.0 GiB measured on local-cluster)
OPTIMIZER_SLOTS = {"sgd": 0, "adam": 2, "rmsprop": 1, "adagrad": 1}   # states per parameter


def optimizer_slots(optimizer: str, momentum: float = 0.0) -> int:
    """Tensors of a parameter's size that ``optimizer`` keeps per parameter: SGD's momentum
    buffer (with momentum > 0), Adam's two moments, RMSprop's and Adagrad's running sum."""
    if optimizer not in OPTIMIZER_SLOTS:
        raise ValueError(f"no state slots known for optimizer {optimizer!r}; FSDP trains with "
                         f"{', '.join(OPTIMIZER_SLOTS)}")
    return OPTIMIZER_SLOTS[optimizer] + (optimizer == "sgd" and momentum > 0)


def _mib(n: float) -> str:
    return f"{n / 2**20:,.0f} MiB"


@dataclasses.dataclass(frozen=True)
class Estimate:
    """The figures of the module doc's rule; ``shapes``: every trainable parameter's shape
    (a tied one once), for the shards of replica 0."""
    shapes: tuple[tuple[int, ...], ...]
    buffers: int                       # numbers in the model's buffers
    root: int                          # parameters of the root's own (not in a unit)
    largest: int                       # the largest unit's parameters
    itemsize: int
    slots: int
    reshard_after_forward: bool = True
    activations: int = 0               # bytes a step keeps for backward
    margin: int = MARGIN

    @property
    def parameters(self) -> int:
        return sum(math.prod(s) for s in self.shapes)

    def shard(self, replicas: int) -> int:
        """Parameters in replica 0's shards (fully_shard splits each on its first dim)."""
        total = 0
        for shape in self.shapes:
            rows, rest = (shape[0], math.prod(shape[1:])) if shape else (1, 1)
            total += -(-rows // replicas) * rest
        return total

    def parts(self, replicas: int) -> dict:
        """Bytes per replica at R = ``replicas``: shards, step, result, need."""
        s, P = self.itemsize, self.parameters
        shards = s * (2 + self.slots) * self.shard(replicas)
        gathered = s * (P + self.largest) if not self.reshard_after_forward \
            else s * (self.root + 3 * self.largest)
        step = shards + gathered + self.activations
        result = s * self.shard(replicas) + s * (P + self.buffers)
        return {"shards": shards, "gathered": gathered, "activations": self.activations,
                "step": step, "result": result, "margin": self.margin,
                "need": max(step, result) + self.margin}

    def need(self, replicas: int) -> int:
        return self.parts(replicas)["need"]

    def replicas_needed(self, limit: int, most: int = 1 << 12) -> int | None:
        """The fewest replicas (up to ``most``) whose need fits ``limit``; None if none."""
        if self.need(most) > limit:
            return None
        lo, hi = 1, most              # need falls as R grows (the shards only shrink)
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (mid + 1, hi) if self.need(mid) > limit else (lo, mid)
        return lo

    def floor(self) -> str:
        """What no number of replicas divides (the larger of the two), in words."""
        parts = self.parts(1 << 12)
        if parts["result"] >= parts["gathered"] + parts["activations"]:
            return "replica 0 gathers the whole model to return it"
        return ("every replica gathers the largest unit whole and holds a step's activations "
                "(smaller units, wrap=, or a smaller batch_size divide those)")

    def describe(self, replicas: int, limit: int | None) -> dict:
        """For info.json, in MiB."""
        return {**{f"{k}_mb": v / 2**20 for k, v in self.parts(replicas).items()},
                "limit_mb": limit / 2**20 if limit is not None else None,
                "optimizer_slots": self.slots}


def estimate(model: nn.Module, units: list[str], itemsize: int, slots: int,
             reshard_after_forward: bool = True, activations: int = 0,
             margin: int = MARGIN) -> Estimate:
    """The Estimate of ``model`` (on the meta device is enough) sharded as ``units``
    (wrap_units's names): each parameter counts for the innermost unit that holds it, or the
    root; a tied parameter once."""
    modules = dict(model.named_modules())
    deepest = sorted(units, key=lambda n: -n.count("."))
    owner: dict[int, str] = {}
    for name in deepest:
        for p in modules[name].parameters():
            owner.setdefault(id(p), name)
    sizes = dict.fromkeys(units, 0)
    root, shapes = 0, []
    for p in model.parameters():              # (each shared parameter once)
        if not p.requires_grad:
            continue
        shapes.append(tuple(p.shape))
        unit = owner.get(id(p))
        if unit is None:
            root += p.numel()
        else:
            sizes[unit] += p.numel()
    buffers = sum(b.numel() for b in model.buffers())
    return Estimate(tuple(shapes), buffers, root, max(sizes.values(), default=0), itemsize,
                    slots, reshard_after_forward, activations, margin)


def model_estimate(model: nn.Module, wrap, dtype: torch.dtype, optimizer: str,
                   momentum: float, reshard_after_forward: bool = True, shape: tuple = (),
                   batch_size: int = 1, margin: int = MARGIN) -> tuple[list[str], Estimate]:
    """``model`` (built on the meta device, else the CPU) sharded by ``wrap``: its units
    (wrap_units) and their Estimate in ``dtype`` for ``optimizer``; the activations of a step
    of ``batch_size`` rows of ``shape`` (one row's; () for none known) are counted on the
    meta device, with int64 inputs for a model that takes token ids."""
    from ...planning.cost_model import saved_activation_bytes
    units = wrap_units(model, wrap)
    activations = 0
    if shape:
        model = model.to(dtype)
        for inputs in (dtype, torch.long):
            try:
                activations = saved_activation_bytes(model, tuple(shape), batch_size, dtype,
                                                     inputs)
                break
            except Exception:     # (the model's own error is fit's preflight's to report)
                continue
    return units, estimate(model, units, dtype.itemsize, optimizer_slots(optimizer, momentum),
                           reshard_after_forward, activations, margin)


def verdict(est: Estimate, replicas: int, limit: int) -> str:
    """Whether FSDP over ``replicas`` fits ``limit``, in a few words (the planner's)."""
    need = est.need(replicas)
    said = f"FSDP over {replicas} replicas would hold {_mib(need)} a replica"
    if need <= limit:
        return f"{said}: it fits"
    fewest = est.replicas_needed(limit)
    return f"{said}: it does not fit" + (
        f" (it would over {fewest})" if fewest else
        f" at any number of replicas ({est.floor()})")


def explain(est: Estimate, replicas: int) -> str:
    """The need at ``replicas`` and what it is made of, in words."""
    parts = est.parts(replicas)
    return (f"{_mib(parts['need'])} a replica over {replicas}: the larger of a step "
            f"({_mib(parts['shards'])} of shards of the parameters, gradients and optimizer "
            f"state, {_mib(parts['gathered'])} of units gathered, "
            f"{_mib(parts['activations'])} of activations) and the end on replica 0 "
            f"({_mib(parts['result'])}: the whole model gathered to return it), plus "
            f"{_mib(parts['margin'])} for the worker itself")


def check_memory(est: Estimate, replicas: int, limit: int, slots: int) -> None:
    """A ResourceError when a replica's need at ``replicas`` exceeds ``limit`` (bytes a
    task's Python worker may use): the bytes needed, the limit and the fewest replicas that
    fit (``slots``: how many the cluster runs at once)."""
    if est.need(replicas) <= limit:
        return
    said = (f"FSDP needs about {explain(est, replicas)}; a task's Python worker may use "
            f"{_mib(limit)} (spark.executor.pyspark.memory over the executor's cores)")
    fewest = est.replicas_needed(limit)
    if fewest is None:
        raise ResourceError(
            f"{said}. No number of replicas fits: {est.floor()}, which needs "
            f"{_mib(est.need(1 << 12))} with the worker at any number: give the Python workers "
            f"more memory (spark.executor.pyspark.memory)")
    where = f"the cluster runs {slots} task(s) at once" + (
        "" if fewest <= slots else ": add executors or cores, or give the Python workers "
                                   "more memory")
    raise ResourceError(f"{said}. It fits over {fewest} replicas ({_mib(est.need(fewest))} "
                        f"a replica): pass replicas={fewest} or more ({where})")
