"""A parameter-server worker's half, whatever the strategy (Downpour, Boosting): its device,
its model's parameters and gradients as one flat vector each (what the server's shards hold,
in the same order), the pull into them, a mini-batch's forward and backward into the summed
gradient it pushes, fp16's loss scale, the momentum it carries (staleness "dana"), the buffers
it reports and the report it ends with. The strategies' loops (which steps push, which rows a
push trains on) are their task.py; the rules they share on the driver are ps_rules.py."""

from __future__ import annotations

import dataclasses
import time

import torch

from spark_dl.data.device import model_input
from spark_dl.runtime.amp import MixedPrecision
from spark_dl.runtime.stage import peak_memory_mb

__all__ = ["MOMENTUM_RAMP", "TORCH_DTYPES", "CarriedMomentum", "PSTask", "PSWorker",
           "WorkerPlan",
           "carried_report", "carry_momentum", "flat_parameters", "ramp_length", "ramped",
           "reported_momentum"]

TORCH_DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}

# staleness "dana": a worker's momentum grows from 0 to fit's over its first this many
# mini-batches, at most a tenth of its fit: the first pushes' large gradients, carried for
# ~1 / (1 - momentum) pushes each and landing late, would otherwise blow up normalized
# convolutions' weights (docs/guides/downpour.md, "Staleness rule")
MOMENTUM_RAMP = 50


@dataclasses.dataclass(frozen=True)
class WorkerPlan:
    """What the driver worked out for its parameter-server workers, whatever the strategy:
    the wire's dtype, the autocast, the (name, shape) of the buffers they report
    (transport/ps/buffers.py), and the staleness rule's worker half: the momentum a worker
    carries ("dana"), ramped over ``momentum_ramp`` mini-batches (None: ramp_length of the
    worker's own steps to go), and whether it reports it for the server's look-ahead."""

    wire_dtype: str = "float32"
    amp: str | None = None
    buffers: tuple = ()
    worker_momentum: float = 0.0
    look_ahead: bool = False
    momentum_ramp: int | None = None


@dataclasses.dataclass(frozen=True)
class PSTask:
    """What every parameter-server worker task gets from the driver: fit's stage settings
    (StageConfig), the strategy object with the values its driver resolved, the WorkerPlan,
    the FitParts, the server's secret and address, the driver channel's address."""

    cfg: object
    options: object
    plan: WorkerPlan
    parts: object
    secret: bytes
    ps_address: tuple
    channel: tuple | None


class PSWorker:
    """One worker task's side of the parameter traffic (the module doc). ``cfg``: fit's stage
    settings (StageConfig: device, threads, dtype, timeout_s ...); ``plan``: its WorkerPlan;
    ``ctx``: its TaskContext."""

    def __init__(self, cfg, plan: WorkerPlan, ctx, rank: int):
        from spark_dl.transport.rendezvous import task_device
        self.cfg, self.plan, self.ctx, self.rank = cfg, plan, ctx, rank
        self.t_start = time.perf_counter()
        gpus = list(ctx.resources()["gpu"].addresses) if "gpu" in ctx.resources() else []
        self.device, self.note = task_device(cfg.device, gpus, rank)
        torch.set_num_threads(cfg.threads or int(ctx.cpus() or 1))
        self.dtype = TORCH_DTYPES[cfg.dtype]
        self.precision = MixedPrecision(plan.amp, self.device)
        self.carrier = self.buffers = None

    def connect(self, ps_address, secret: bytes):
        """The client of the driver's parameter server (its hello is the caller's)."""
        from spark_dl.transport.ps import PSClient
        self.client = PSClient(ps_address, secret, self.rank,
                               TORCH_DTYPES[self.plan.wire_dtype], self.cfg.timeout_s)
        return self.client

    def hold(self, model: torch.nn.Module, numel: int, ramp: int,
             reports_buffers: bool = True) -> None:
        """Make ``model``'s parameters and gradients views of ``flat`` and ``grad`` (a pull
        lands in the model, backward sums the pushed gradient in place, nothing is copied
        when the wire carries the model's dtype on the CPU); the momentum carried, ramped
        over ``ramp`` mini-batches; the buffers reported."""
        from spark_dl.transport.ps.buffers import spec_numel
        plan = self.plan
        self.model = model
        self.flat, self.grad = flat_parameters(model, numel, self.device, self.dtype)
        self.direct = self.flat.dtype == self.client.dtype and self.flat.device.type == "cpu"
        self.wire = self.flat if self.direct else \
            torch.empty(self.flat.numel(), dtype=self.client.dtype)
        if plan.worker_momentum:
            self.carrier = CarriedMomentum(self.grad, plan.worker_momentum, ramp)
        if plan.buffers and reports_buffers:
            self.buffers = torch.empty(spec_numel(plan.buffers), dtype=torch.float64
                                       if self.dtype == torch.float64 else torch.float32)

    def landed(self) -> None:
        """The pulled values (in the wire buffer) into the model."""
        if not self.direct:
            self.flat.copy_(self.wire)

    def pull(self, shards=None) -> None:
        self.client.pull(self.wire, shards)
        self.landed()

    def on_device(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A mini-batch on the worker's device, in its dtype (integer features and labels
        stay so)."""
        x = model_input(x, self.device, self.dtype)
        y = y.to(device=self.device)
        return x, y.to(self.dtype) if y.is_floating_point() else y

    def backward(self, x: torch.Tensor, y: torch.Tensor, loss_fn) -> tuple[torch.Tensor, int]:
        """(the mean loss of the mini-batch, its rows); ``grad`` += its per-sample gradient
        sum (scaled under fp16)."""
        x, y = self.on_device(x, y)
        with self.precision.autocast():
            loss = loss_fn(self.model(x), y)
        self.precision.scale_loss(loss * len(x)).backward()
        return loss, len(x)

    def unscaled(self) -> bool:
        """``grad`` unscaled for its push; False (and ``grad`` zeroed) where fp16 overflowed:
        the push then carries nothing."""
        if self.precision.unscale(self.grad):
            return True
        self.grad.zero_()
        return False

    def carry(self, samples: int, batches: int) -> None:
        """Staleness "dana": the push's gradient sum into the carried momentum."""
        if self.carrier is not None and samples:
            self.carrier.carry(self.grad, samples, batches)

    def momentum(self) -> float | None:
        """The momentum the next push reports (staleness "dana" with the look-ahead)."""
        return reported_momentum(self.carrier, self.plan.look_ahead)

    def reported_buffers(self) -> torch.Tensor | None:
        """The model's buffers the server averages (None: none reported)."""
        from spark_dl.transport.ps.buffers import read_buffers
        return None if self.buffers is None else \
            read_buffers(self.model, self.plan.buffers, self.buffers)

    def outgoing(self) -> torch.Tensor:
        """The gradient as the client sends it (on the host)."""
        return self.grad if self.grad.device.type == "cpu" else self.grad.cpu()

    def report(self) -> dict:
        """What every worker's report holds, whatever the strategy."""
        client = self.client
        return {"device": str(self.device), "note": self.note, **carried_report(self.carrier),
                "amp_skipped_pushes": self.precision.skipped,
                "push_seconds": client.push_seconds, "pull_seconds": client.pull_seconds,
                "bytes_sent": client.conn.bytes_sent,
                "bytes_received": client.conn.bytes_received,
                "task_seconds": time.perf_counter() - self.t_start,
                "attempt": self.ctx.attemptNumber(), **peak_memory_mb()}


def flat_parameters(model: torch.nn.Module, numel: int, device, dtype
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Make every trainable parameter and its gradient a view into one flat vector each, in
    ``model.parameters()`` order, on ``device``. Parameters on the meta device are replaced by
    views (no other memory is allocated); others are copied in. Buffers go to ``device``."""
    entries = [(m, name, p) for m in model.modules() for name, p in m._parameters.items()
               if p is not None and p.requires_grad]
    unique = {id(p): p for _, _, p in entries}        # a tied parameter counts once
    if sum(p.numel() for p in unique.values()) != numel:
        raise RuntimeError(f"the model has {sum(p.numel() for p in unique.values())} trainable "
                           f"parameters, the parameter server {numel}: model_fn must build "
                           f"the same model in every task")
    flat = torch.empty(numel, dtype=dtype, device=device)
    grad = torch.zeros_like(flat)
    off, done = 0, {}
    for module, name, p in entries:
        if id(p) in done:                             # tied: the same view everywhere
            setattr(module, name, done[id(p)])
            continue
        original = id(p)
        n = p.numel()
        view = flat[off:off + n].view(p.shape)
        if p.is_meta:
            p = torch.nn.Parameter(view)
            setattr(module, name, p)
        else:
            view.copy_(p.detach())
            p.data = view
        p.grad = grad[off:off + n].view(p.shape)
        done[original] = p
        off += n
    for module in model.modules():            # buffers (a split model's kept-whole ones too)
        for key, b in module._buffers.items():
            if b is not None and b.device != flat.device:
                module._buffers[key] = b.to(flat.device)
    return flat, grad


def ramp_length(total: float) -> int:
    """The ramp of a worker that trains ``total`` mini-batches in its fit: MOMENTUM_RAMP, or
    a tenth of them where that is shorter (a short fit would otherwise spend itself
    ramping), at least 1."""
    return max(1, min(MOMENTUM_RAMP, int(total) // 10))


def ramped(momentum: float, batches: int, ramp: int = MOMENTUM_RAMP) -> float:
    """The momentum a worker carries after ``batches`` mini-batches of its own: ``momentum``
    x batches / ``ramp`` up to ``ramp``, then ``momentum``."""
    return momentum * min(1.0, batches / ramp)


def carry_momentum(velocity: torch.Tensor, grad: torch.Tensor, samples: int,
                   momentum: float) -> None:
    """Staleness rule "dana" (Downpour's and Boosting's workers): ``velocity`` <- momentum
    x velocity + the mean gradient (the ``samples``' gradient sum ``grad`` / samples; torch's
    SGD buffer, whose first value is the first gradient), and ``grad`` becomes the sum the
    server takes for it (velocity x samples): the server steps the buffer as a plain SGD
    step."""
    velocity.mul_(momentum).add_(grad, alpha=1.0 / samples)
    torch.mul(velocity, samples, out=grad)


class CarriedMomentum:
    """Staleness rule "dana": a worker's momentum buffer over its pushes' mean gradients,
    shaped like ``like`` and empty at first, its momentum ramped from 0 to ``momentum`` over
    its first ``ramp`` mini-batches (ramp_length)."""

    def __init__(self, like: torch.Tensor, momentum: float, ramp: int):
        self.velocity = torch.zeros_like(like)
        self.momentum, self.ramp, self.carried = momentum, ramp, 0

    def carry(self, grad: torch.Tensor, samples: int, batches: int) -> None:
        """A push of ``batches`` mini-batches (``samples`` rows, their gradient sum ``grad``)
        into the buffer; ``grad`` becomes what the server steps (carry_momentum)."""
        carry_momentum(self.velocity, grad, samples,
                       ramped(self.momentum, self.carried, self.ramp))
        self.carried += batches

    @property
    def next_momentum(self) -> float:
        """The momentum of the next push (ramped)."""
        return ramped(self.momentum, self.carried, self.ramp)


def reported_momentum(carrier: CarriedMomentum | None, look_ahead: bool) -> float | None:
    """Staleness rule "dana": the momentum of the worker's next push, for the server's
    look-ahead (None: no look-ahead, or no momentum carried)."""
    return carrier.next_momentum if look_ahead and carrier is not None else None


def carried_report(carrier: CarriedMomentum | None) -> dict:
    """A worker's report of its buffer: its norm at the end and its ramp (None: it carried
    none)."""
    if carrier is None:
        return {"velocity_norm": None, "momentum_ramp": None}
    return {"velocity_norm": float(carrier.velocity.norm()), "momentum_ramp": carrier.ramp}
