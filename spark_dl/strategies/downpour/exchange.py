"""A Downpour worker's side of the parameter traffic: its parameters and gradients as one flat
vector each (what the server's shards hold, in the same order), and the push-and-pull that
travels in a thread of its own while the worker computes its next step."""

from __future__ import annotations

import threading

import torch

__all__ = ["Exchange", "flat_parameters"]


class Exchange:
    """One push-and-pull at a time in a thread of its own, so that it travels (and the server
    applies it) while the worker computes its next step on the parameters it holds."""

    def __init__(self, client, numel: int, dtype: torch.dtype, shards=None):
        self.client, self.shards = client, shards
        self.send, self.recv = torch.empty(numel, dtype=dtype), torch.empty(numel, dtype=dtype)
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
                samples, steps, versions, buffers = self.job
                self.result = self.client.push(self.send, samples, steps, pull_into=self.recv,
                                               shards=self.shards, versions=versions,
                                               buffers=buffers)
            except BaseException as e:                # raised again in the worker
                self.error = e
            self.done.set()

    def start(self, grad: torch.Tensor, samples: int, steps: int, versions: list[int],
              buffers: torch.Tensor | None = None) -> None:
        """Push ``grad`` (and report ``buffers``, copied) in the thread."""
        self.send.copy_(grad)
        self.job = (samples, steps, versions, None if buffers is None else buffers.clone())
        self.pushed = True
        self.done.clear()
        self.go.set()

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


