"""A Downpour worker's overlapped push-and-pull: it travels in a thread of its own while the
worker computes its next step (the rest of a worker's side of the traffic is
spark_dl.strategies.ps_worker).

On a GPU the exchange never stops the worker's stream: the gradient goes to a pinned host
buffer by an asynchronous copy queued behind the backward pass, the thread (not the worker)
waits for that copy before it pushes, and the reply goes back into the model by an
asynchronous copy queued before the next forward pass; the host stays ahead of the GPU."""

from __future__ import annotations

import threading

import torch

__all__ = ["Exchange"]


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
