"""A Downpour worker's side of the parameter traffic: its parameters and gradients as one flat
vector each (what the server's shards hold, in the same order), and the push-and-pull that
travels in a thread of its own while the worker computes its next step.

On a GPU the exchange never stops the worker's stream: the gradient goes to a pinned host
buffer by an asynchronous copy queued behind the backward pass, the thread (not the worker)
waits for that copy before it pushes, and the reply goes back into the model by an
asynchronous copy queued before the next forward pass; the host stays ahead of the GPU."""

from __future__ import annotations

import threading

import torch

__all__ = [
    "MOMENTUM_RAMP",
    "CarriedMomentum",
    "Exchange",
    "carried_report",
    "carry_momentum",
    "flat_parameters",
    "ramp_length",
    "ramped",
    "reported_momentum",
]

# staleness "dana": a worker's momentum grows from 0 to fit's over its first this many
# mini-batches, at most a tenth of its fit: the first pushes' large gradients, carried for
# ~1 / (1 - momentum) pushes each and landing late, would otherwise blow up normalized
# convolutions' weights (docs/guides/downpour.md, "Staleness rule")
MOMENTUM_RAMP = 50


class Exchange:
    """One push-and-pull at a time in a thread of its own, so that it travels (and the server
    applies it) while the worker computes its next step on the parameters it holds."""

    def __init__(self, client, numel: int, dtype: torch.dtype, shards=None,
                 device: torch.device | None = None):
        self.client, self.shards = client, shards
        pin = device is not None and device.type == "cuda"
        self.send = torch.empty(numel, dtype=dtype, pin_memory=pin)
        self.recv = torch.empty(numel, dtype=dtype, pin_memory=pin)
        self.copied = None                 # CUDA event: ``send`` holds the gradient
        self.job, self.result, self.error, self.pushed = None, [], None, False
        self.go, self.done = threading.Event(), threading.Event()
        self.done.set()
        self.thread = threading.Thread(target=self._run, name="spark_dl-push", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            self.go.wait()
            self.go.clear()
            if self.job is None:
                return
            try:
                samples, steps, versions, buffers, momentum = self.job
                if self.copied is not None:   # the gradient's copy (and the last reply's
                    self.copied.synchronize()  # copy out of recv, queued before it) is done
                self.result = self.client.push(self.send, samples, steps, pull_into=self.recv,
                                               shards=self.shards, versions=versions,
                                               buffers=buffers, momentum=momentum)
            except BaseException as e:                # raised again in the worker
                self.error = e
            self.done.set()

    def start(self, grad: torch.Tensor, samples: int, steps: int, versions: list[int],
              buffers: torch.Tensor | None = None, momentum: float | None = None) -> None:
        """Push ``grad`` (and report ``buffers``, copied, and ``momentum``) in the thread. A
        CUDA ``grad`` is copied asynchronously: the caller may zero it at once on the same
        stream."""
        self.send.copy_(grad, non_blocking=grad.is_cuda)
        if grad.is_cuda:
            self.copied = torch.cuda.Event()
            self.copied.record()
        self.job = (samples, steps, versions, None if buffers is None else buffers.clone(),
                    momentum)
        self.pushed = True
        self.done.clear()
        self.go.set()

    def land(self, flat: torch.Tensor) -> None:
        """The reply of the push that ended into ``flat`` (the model's parameters); to a GPU
        asynchronously, ordered on the stream before the next step's forward pass."""
        flat.copy_(self.recv, non_blocking=flat.is_cuda)

    def wait(self) -> list[int]:
        """The staleness of the push in flight (none: []), once its reply is in ``recv``."""
        self.done.wait()
        if self.error is not None:
            raise self.error
        result, self.result = self.result, []
        return result

    def close(self) -> list[int]:
        result = self.wait()
        self.job = None
        self.go.set()
        self.thread.join()
        return result


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
