"""How far a one-version delay cuts the learning rate heavy-ball momentum tolerates.

Two asynchronous workers that push in turn (what the ships job's staleness histograms show:
91-98% of pushes one version old) apply every gradient one server step after the values it
was taken on. On a quadratic of curvature lam the server's momentum SGD (torch's form,
v <- m v + g, x <- x - lr v) is then a linear recurrence in (x_t, x_t-1, x_t-2, v_t); it is
stable while the spectral radius of its matrix is below 1. This script finds, for each
momentum m, the largest stable h = lr * lam for:

  sync    the gradient taken on the current values (one process, or a synchronous round)
  delay   taken one step back, g = lam x_t-1 (asynchronous pushes in turn)
  look c  taken one step back at values moved on by c of the last step,
          g = lam (x_t-1 + c (x_t-1 - x_t-2)): lookahead / weight prediction (c = 1: the
          server's momentum step, x - lr v, as SpecTrain and DANA predict)

and writes them to benchmarks/results/delay_stability.json (docs/quality.md, "Lookahead").

    python benchmarks/delay_stability.py
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

OUT = Path(__file__).resolve().parent / "results" / "delay_stability.json"


def step_matrix(m: float, h: float, where: np.ndarray) -> np.ndarray:
    """The map (x_t, x_t-1, x_t-2, v_t) -> the next, lr = 1, the gradient h * (where . state)."""
    a = np.zeros((4, 4))
    a[3] = m * np.array([0, 0, 0, 1.0]) + h * where       # v_t+1 = m v_t + g
    a[0] = np.array([1.0, 0, 0, 0]) - a[3]                 # x_t+1 = x_t - v_t+1
    a[1, 0] = a[2, 1] = 1.0
    return a


def largest_stable(m: float, where: np.ndarray, top: float = 5.0, tol: float = 1e-4) -> float:
    """The largest h in (0, top] below which the recurrence is stable (scanned, then bisected:
    the stable set of h is an interval from 0 for these maps)."""
    def stable(h: float) -> bool:
        return float(max(abs(np.linalg.eigvals(step_matrix(m, h, where))))) < 1.0
    hs = np.linspace(tol, top, 2000)
    ok = [h for h in hs if stable(h)]
    if not ok:
        return 0.0
    lo, hi = max(ok), min(top, max(ok) + top / 2000)
    while hi - lo > tol:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if stable(mid) else (lo, mid)
    return round(lo, 3)


def main() -> None:
    rows = []
    for m in (0.0, 0.4, 0.6, 0.9):
        row = {"momentum": m,
               "sync": largest_stable(m, np.array([1.0, 0, 0, 0])),
               "delay": largest_stable(m, np.array([0, 1.0, 0, 0]))}
        for c in (-0.5, 0.25, 0.5, 1.0):
            row[f"look {c}"] = largest_stable(m, np.array([0, 1.0 + c, -c, 0]))
        row["sync / delay"] = round(row["sync"] / row["delay"], 1)
        rows.append(row)
        print(json.dumps(row))
    OUT.write_text(json.dumps({"what": __doc__.split("\n\n")[0], "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
