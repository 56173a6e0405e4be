"""Run directories: what every fit leaves behind (config, metrics, history, plot, checkpoint).

    runs/allreduce-20261123-131502-5f3a/
        config.json      the fit's arguments
        metrics.jsonl    every progress and epoch message, as it arrived on the driver
        history.csv      one row per epoch
        loss.png         training loss per step and per epoch, validation per epoch
                         (``loss_figure``; ``FitResult.plot()`` draws the same)
        checkpoint.pt    model, optimizer, epoch, RNG states, the weights' average (written
                         by the tasks every epoch)
        model.pt         the returned model's state dict (written by task 0 where it sees
                         this directory, else by the driver from the task's result)
        workers/         rank-R.json: host, pid, device of each task

While a fit's stage runs, the directory holds ``.spark_dl-driver``: a code made from the
fit's secret (``shared_mark``), by which a task knows that it writes where the driver reads.
"""

from __future__ import annotations

import csv
import hashlib
import hmac
import json
import os
import secrets
import time
from pathlib import Path

__all__ = ["MARK", "loss_figure", "new_run_dir", "plot_history", "read_metrics", "save_figure",
           "sees_driver_dir", "shared_mark", "write_history", "write_json"]

MARK = ".spark_dl-driver"      # the driver's mark in a run directory while its stage runs


def new_run_dir(root: str | Path = "runs", prefix: str = "fit") -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path = Path(root) / f"{prefix}-{stamp}-{secrets.token_hex(2)}"
    path.mkdir(parents=True, exist_ok=False)
    return path.resolve()


def write_json(path: Path, obj) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(obj, indent=1, default=str))
    os.replace(tmp, path)


def shared_mark(path: str | Path, secret: str) -> str:
    """The code the driver writes in run directory ``path`` as ``MARK`` for a fit whose
    tasks hold ``secret`` (an HMAC: the file tells nothing of the secret)."""
    return hmac.new(secret.encode(), str(Path(path)).encode(), hashlib.sha256).hexdigest()


def sees_driver_dir(path: str | Path, secret: str) -> bool:
    """Whether this process (a task) sees the run directory ``path`` the driver writes: it
    holds the driver's mark for ``secret`` (False on an executor whose ``path`` is a local
    directory of its own, or none)."""
    try:
        found = (Path(path) / MARK).read_text()
    except (OSError, UnicodeDecodeError):
        return False
    return hmac.compare_digest(found, shared_mark(path, secret))


def write_history(path: Path, history: list[dict]) -> None:
    keys = list(dict.fromkeys(k for row in history for k in row))
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(history)


def read_metrics(path: str | Path) -> list[dict]:
    """The messages of a run's ``metrics.jsonl`` (none when it is missing); a line cut short
    by a killed driver is skipped."""
    path = Path(path)
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def _step_series(metrics: list[dict]) -> dict[str, tuple[list[float], list[float]]]:
    """Per worker (one series without workers): (fractional epochs, loss of each step).
    A step message carries ``losses``, the loss of each step since the previous message, or
    (older runs) only ``loss``, the epoch's mean so far. A step reported twice (a retried
    task) keeps its last value."""
    points: dict[str, dict[tuple[int, int], float]] = {}
    steps_of: dict[int, int] = {}
    for m in metrics:
        if m.get("type") != "step" or "step" not in m:
            continue
        name = f"worker {m['worker']}" if "worker" in m else "step"
        losses = m.get("losses") or [m.get("loss")]
        first = m["step"] - len(losses) + 1
        steps_of[m["epoch"]] = m["steps"]
        for i, loss in enumerate(losses):
            if loss is not None:
                points.setdefault(name, {})[(m["epoch"], first + i)] = loss
    series = {}
    for name, pts in points.items():
        keys = sorted(pts)
        series[name] = ([e - 1 + s / max(steps_of[e], 1) for e, s in keys],
                        [pts[k] for k in keys])
    return series


def _validation(history: list[dict], metrics: list[dict]) -> list[dict]:
    """The validations at fractional epochs (``eval`` messages), else the history's val_*."""
    evals = {m["epoch"]: m for m in metrics if m.get("type") == "eval" and "epoch" in m}
    if not evals:
        evals = {r["epoch"]: r for r in history if any(k.startswith("val_") for k in r)}
    return [evals[e] for e in sorted(evals)]


def loss_figure(history: list[dict], metrics: list[dict] = (), title: str = ""):
    """The fit's plot as a matplotlib Figure: training loss per step (``metrics``, the run's
    ``metrics.jsonl``) and per epoch (``history``) above, the validation below (its loss on
    the left axis, its other metrics, such as accuracy, on the right), against epochs."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator
    vals = _validation(history, metrics)
    height = 6 if vals else 3.6
    # fixed margins (inches), not a layout engine: one measures every label anew, half the
    # figure's time, which every fit pays for its loss.png
    fig = Figure(figsize=(8, height), dpi=100)
    axes = fig.subplots(2 if vals else 1, 1, sharex=True, squeeze=False)[:, 0]
    ax = axes[0]
    for name, (xs, ys) in _step_series(list(metrics)).items():
        ax.plot(xs, ys, marker=".", markersize=3, linewidth=0.8, alpha=0.7,
                label=f"{name} loss" if name != "step" else "loss per step")
    epochs = [(r["epoch"], r["loss"]) for r in history if r.get("loss") is not None]
    if epochs:
        ax.plot(*zip(*epochs), marker="o", color="black", linewidth=1.5,
                label="loss per epoch (mean)")
    ax.set_ylabel("training loss")
    ax.set_title(title or "training")
    ax.grid(True, alpha=0.3)
    if ax.has_data():
        ax.legend(loc="upper right", fontsize="small")
    if vals:
        va = axes[1]
        handles = []
        keys = [k for k in dict.fromkeys(k for r in vals for k in r)
                if k.startswith("val_") and isinstance(vals[0].get(k), (int, float))]
        left = ["val_loss"] if "val_loss" in keys else keys[:1]
        right = [k for k in keys if k not in left]
        for axis, names, colors in ((va, left, ("tab:orange",)),
                                    (va.twinx() if right else None, right,
                                     ("tab:green", "tab:red", "tab:purple", "tab:brown"))):
            for i, k in enumerate(names):
                pts = [(r["epoch"], r[k]) for r in vals if isinstance(r.get(k), (int, float))]
                handles += axis.plot(*zip(*pts), marker="o", color=colors[i % len(colors)],
                                     label=k[4:])
            if names:
                axis.set_ylabel(", ".join(k[4:] for k in names))
        va.set_title("validation")
        va.grid(True, alpha=0.3)
        va.legend(handles=handles, loc="best", fontsize="small")
    axes[-1].set_xlabel("epoch")
    axes[-1].xaxis.set_major_locator(MaxNLocator(integer=True))
    twin = bool(vals) and bool(right)
    fig.subplots_adjust(left=0.8 / 8, right=1 - (0.8 if twin else 0.2) / 8,
                        bottom=0.55 / height, top=1 - 0.35 / height, hspace=0.3)
    return fig


def save_figure(fig, path: str | Path) -> None:
    """A PNG whose bytes depend on the figure only (no software or date stamp)."""
    fig.savefig(path, format="png", metadata={"Software": None})


def plot_history(path: Path, history: list[dict], title: str = "",
                 metrics: list[dict] = ()) -> None:
    """Write ``loss_figure`` to ``path`` (a run's ``loss.png``)."""
    save_figure(loss_figure(history, metrics, title), path)
