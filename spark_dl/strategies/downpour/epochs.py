"""A Downpour fit's epochs on the driver: a history row when every worker has reported an
epoch (the workers' training loss, the server's model validated), the checkpoint after it,
the resume from one, and the rows of epochs whose messages were lost."""

from __future__ import annotations

import time
from pathlib import Path

from ...errors import ConfigError
from ...losses import val_metrics

__all__ = ["ServerEpochs", "resume_server"]


class ServerEpochs:
    """The epochs of ``replicas`` workers pushing to ``ps``, whose model ``layout`` loads
    into ``net`` for validation on ``val`` (None: no validation), for the fit ``run``."""

    def __init__(self, run, ps, layout, net, val, replicas: int, partitions: int,
                 history: list[dict]):
        self.run, self.ps, self.layout, self.net, self.val = run, ps, layout, net, val
        self.replicas, self.partitions = replicas, partitions
        self.history = history
        self.reported: dict[int, dict[int, dict]] = {}     # epoch -> worker -> its report
        self.path = run.path / "checkpoint.pt"

    def row(self, epoch: int, rows: list[dict]) -> dict:
        """One history row when every worker has finished ``epoch``: the server's model."""
        ps, job = self.ps, self.run.job
        n = sum(r["samples"] for r in rows)
        row = {"epoch": epoch,
               "loss": sum(r["loss"] * r["samples"] for r in rows) / max(n, 1),
               "samples": n, "seconds": max(r["seconds"] for r in rows),
               "since_start_s": time.perf_counter() - self.run.t_start,
               "samples_per_s": sum(r["samples_per_s"] for r in rows),
               "server_versions": ps.versions,
               "grad_mean_abs": ps.take_gradient_mean_abs(),
               "lr": ps.shards[0].epoch_lr(epoch, ps.epoch_steps)}
        if self.val is not None:
            self.layout.load(ps.parameters().to(job.dtype), ps.buffers())
            row.update(val_metrics(self.net, self.val, job.loss_fn,
                                job.loss_name == "cross_entropy"))
        return row

    def _add(self, epoch: int, rows: list[dict]) -> dict:
        row = self.row(epoch, rows)
        self.history.append(row)
        self.run.job.tracker.epoch(row)
        self.run.record({"type": "server_epoch", **row})
        return row

    def on_message(self, m: dict) -> None:
        """A task's message on the driver channel."""
        run = self.run
        run.record(m)
        if m.get("type") == "epoch":
            # a retried task goes on mid-epoch and reports that epoch again (its part of it):
            # the first report of each worker counts
            rows = self.reported.setdefault(m["epoch"], {})
            if m["worker"] in rows:
                return
            rows[m["worker"]] = m
            if len(rows) == self.replicas:
                self.ps.settle()     # every shard has the epoch's last pushes: then evaluate
                row = self._add(m["epoch"], list(rows.values()))
                self.checkpoint()
                run.epoch_line(row, f", server version {sum(row['server_versions'])}")
        elif m.get("type") == "step" and m["worker"] == 0:
            run.job.tracker.step(m)
            run.step_line(m, f", mean staleness {m.get('staleness', 0.0):.2f} (worker 0)")

    def wait(self, epochs: int, seconds: float = 2.0) -> None:
        """Let the last epoch messages arrive."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and \
                sum(len(v) for v in self.reported.values()) < self.replicas * epochs:
            time.sleep(0.01)

    def fill_lost(self, reports: list[dict], epochs: int) -> None:
        """Rows of the epochs whose messages were lost (the driver channel is best effort):
        from the tasks' ``reports`` and the messages that did arrive. A task Spark retried
        went on past the epochs its earlier attempt finished, so its report has no row for
        them: they are not waited for."""
        for e in range(1, epochs + 1):
            if e in {h["epoch"] for h in self.history}:
                continue
            got = dict(self.reported.get(e, {}))
            for r in reports:
                for h in r["history"]:
                    if h["epoch"] == e:
                        got[r["worker"]] = h
            skipped = {r["worker"] for r in reports
                       if r.get("resumed_at") and r["resumed_at"]["epoch"] > e}
            if got and len(got.keys() | skipped) == self.replicas:
                self._add(e, list(got.values()))

    def checkpoint(self) -> None:
        """The server after an epoch every replica finished, written atomically (the previous
        checkpoint stays until the new one is complete): its values, optimizer states,
        versions and steps, and the history so far. fit(run_dir=...) resumes it."""
        from ...runtime.checkpoint import save_atomic
        epoch = completed_epochs(self.history)
        save_atomic(self.path, {"strategy": "downpour", "epoch": epoch,
                                "replicas": self.replicas, "partitions": self.partitions,
                                "server": self.ps.state_dict(),
                                "history": [h for h in self.history if h["epoch"] <= epoch]})


def completed_epochs(history: list[dict]) -> int:
    """The epochs 1..k all in the history (a lost message can leave a gap)."""
    done = {h["epoch"] for h in history}
    k = 0
    while k + 1 in done:
        k += 1
    return k


def resume_server(ckpt: dict | None, path: Path, ps, replicas: int, log) -> dict | None:
    """The run's Downpour checkpoint (``Run.checkpoint``, read from ``path`` and checked to be
    Downpour's) loaded into the fresh server; None without one."""
    if ckpt is None:
        return None
    try:
        ps.load_state_dict(ckpt["server"], start_epoch=ckpt["epoch"])
    except ValueError as e:
        raise ConfigError(f"{path} does not fit this fit's model: {e}; give a new run_dir, or "
                          f"resume=False to start over in this one") from None
    if ckpt["replicas"] != replicas and log is not None:
        log(f"resuming a fit of {ckpt['replicas']} replicas with {replicas}")
    if log is not None:
        log(f"resumed from the checkpoint of epoch {ckpt['epoch']} ({path})")
    return ckpt
