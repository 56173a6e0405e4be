"""A Boosting fit's epochs on the driver: the workers' key reports summed per epoch, and a
thread that validates and checkpoints each epoch's server state as the key scheduler ends it
(the server keeps that state when the epoch's last key is applied)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from ...losses import val_metrics

__all__ = ["KeyEpochs"]


class KeyEpochs:
    """The epochs ``start_epoch + 1 ..`` of the fit ``run``: ``leases`` (the server's
    KeyLeases) give each epoch's state, ``scheduler`` its keys per worker; ``n_keys`` keys an
    epoch; validated on ``val`` (None: no validation) through ``layout`` into ``net``."""

    def __init__(self, run, ps, leases, scheduler, n_keys: int, start_epoch: int,
                 history: list[dict], layout, net, val):
        self.run, self.ps, self.leases, self.scheduler = run, ps, leases, scheduler
        self.n_keys, self.start_epoch, self.history = n_keys, start_epoch, history
        self.layout, self.net, self.val = layout, net, val
        self.path = run.path / "checkpoint.pt"
        self.losses: dict[int, list[float]] = {}   # epoch -> [loss sum, samples, keys reported]
        self._lock = threading.Condition()
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._watch, name="spark_dl-boosting-epochs",
                                       daemon=True)

    def on_message(self, m: dict) -> None:
        """A task's message on the driver channel: a key's loss is summed into its epoch."""
        run = self.run
        run.record(m)
        if m.get("type") != "key":
            return
        with self._lock:
            acc = self.losses.setdefault(m["epoch"], [0.0, 0, 0])
            acc[0] += m["loss"] * m["samples"]
            acc[1] += m["samples"]
            acc[2] += 1
            self._lock.notify_all()
        if run.job.progress:
            run.live.update(f"  epoch {m['epoch']}/{run.job.stage['epochs']} key "
                            f"{min(acc[2], self.n_keys)}/{self.n_keys} loss "
                            f"{m['loss']:.4f} (worker {m['worker']})")

    def start(self) -> None:
        self.thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        self.stopped.set()
        self.thread.join(timeout=timeout_s)

    def _watch(self) -> None:
        """Validate and checkpoint each epoch's server state as the scheduler ends it."""
        t_epoch = time.perf_counter()
        for epoch in range(self.start_epoch + 1, self.run.job.stage["epochs"] + 1):
            state = None
            while state is None and not self.stopped.is_set():
                state = self.leases.next_epoch_state(epoch, 0.5)
            if state is None:
                return
            row, t_epoch = self._row(epoch, state, t_epoch)
            self.history.append(row)
            self.run.job.tracker.epoch(row)
            self.run.record({"type": "server_epoch", **row})
            _checkpoint(self.path, state, self.history, epoch)
            self.run.epoch_line(row, f", keys per worker {row['keys_per_worker']}")

    def _row(self, epoch: int, state: dict, t_epoch: float) -> tuple[dict, float]:
        """(the history row of ``epoch``, begun at ``t_epoch``, whose server state is
        ``state``; the time it ended)."""
        job = self.run.job
        with self._lock:                     # the epoch's last key reports (best effort)
            self._lock.wait_for(
                lambda: self.losses.get(epoch, [0, 0, 0])[2] >= self.n_keys, 2.0)
            loss, n, _ = self.losses.pop(epoch, [0.0, 0, 0])
        now = time.perf_counter()
        seconds = now - t_epoch
        served = self.scheduler.state()["keys_per_worker"][epoch - 1 - self.start_epoch]
        row = {"epoch": epoch, "loss": loss / max(n, 1), "samples": n,
               "seconds": seconds, "since_start_s": now - self.run.t_start,
               "samples_per_s": n / max(seconds, 1e-9),
               "server_versions": list(state["versions"]), "keys_per_worker": served,
               "lr": self.ps.shards[0].epoch_lr(epoch, self.ps.epoch_steps)}
        if self.val is not None:
            kept = state["averages"][0]          # the averaged server's, if any
            self.layout.load((state["values"][0] if kept is None else kept).to(job.dtype),
                             state["buffers"])
            row.update(val_metrics(self.net, self.val, job.loss_fn,
                                   job.loss_name == "cross_entropy"))
        return row, now


def _checkpoint(path: Path, state: dict, history: list[dict], epoch: int) -> None:
    from ...runtime.checkpoint import save_atomic
    save_atomic(path, {"strategy": "boosting", "epoch": epoch, "server": state,
                       "history": [h for h in history if h["epoch"] <= epoch]})
