"""Draw docs/img/architecture.svg: the driver, the executors, the strategies and the data path,
each part named by the folder of spark_dl that holds it.

    python docs/diagrams/architecture.py            # writes docs/img/architecture.svg
    python docs/diagrams/architecture.py --check    # exits 1 when the committed SVG differs

Plain SVG from strings: no graphviz, no browser, no network.
"""

from __future__ import annotations

import sys
from pathlib import Path
from xml.sax.saxutils import escape

OUT = Path(__file__).resolve().parents[1] / "img" / "architecture.svg"
W, H = 900, 530
FONT = "font-family='DejaVu Sans, Helvetica, Arial, sans-serif'"


def box(x, y, w, h, title, lines=(), fill="#eef3fb", stroke="#3b6fb6") -> str:
    out = [(f"<rect x='{x}' y='{y}' width='{w}' height='{h}' rx='8' fill='{fill}' "
           f"stroke='{stroke}' stroke-width='1.5'/>"),
           (f"<text x='{x + w / 2}' y='{y + 20}' text-anchor='middle' font-size='14' "
           f"font-weight='bold' {FONT}>{escape(title)}</text>")]
    for i, line in enumerate(lines):
        out.append(f"<text x='{x + w / 2}' y='{y + 40 + 17 * i}' text-anchor='middle' "
                   f"font-size='12' {FONT}>{escape(line)}</text>")
    return "\n".join(out)


def arrow(x1, y1, x2, y2, label="", dashed=False) -> str:
    dash = " stroke-dasharray='6 4'" if dashed else ""
    out = [(f"<line x1='{x1}' y1='{y1}' x2='{x2}' y2='{y2}' stroke='#333' stroke-width='1.5'"
           f"{dash} marker-end='url(#head)'/>")]
    if label:
        out.append(f"<text x='{(x1 + x2) / 2 + 6}' y='{(y1 + y2) / 2 - 4}' font-size='11' "
                   f"fill='#444' {FONT}>{escape(label)}</text>")
    return "\n".join(out)


def svg() -> str:
    parts = [
        (f"<svg xmlns='http://www.w3.org/2000/svg' width='{W}' height='{H}' "
        f"viewBox='0 0 {W} {H}'>"),
        ("<defs><marker id='head' markerWidth='10' markerHeight='8' refX='9' refY='4' "
        "orient='auto'><path d='M0,0 L10,4 L0,8 z' fill='#333'/></marker></defs>"),
        f"<rect width='{W}' height='{H}' fill='white'/>",
        box(20, 20, 860, 170, "Driver", fill="#f6f6f6", stroke="#777"),
        box(40, 55, 250, 120, "spark_dl.fit(df, model, strategy)",
            ["fit.py, preflight.py, runs.py", "losses.py: losses, evaluation",
             "runtime/checkpoint.py", "history, info.json"]),
        box(320, 55, 270, 120, "Strategy: driver half",
            ["strategies/<name>/driver.py", "AllReduce · Gossip · LocalSGD ·",
             "Downpour · Boosting", "transport/: channel, parameter server"]),
        box(620, 55, 240, 120, "Spark DataFrame",
            ["data/: Parquet, images, text, MNIST", "partitions = data shards",
             "nothing collected here"]),
        box(20, 250, 860, 250, "Executors (Spark tasks, one per replica or partition)",
            fill="#f6f6f6", stroke="#777"),
    ]
    for i in range(3):
        x = 40 + i * 285
        parts.append(box(x, 285, 255, 195, f"Task {i}" if i < 2 else "Task N-1",
                         ["data/: Arrow record batches ->", "torch mini-batches (memory or disk)",
                          "runtime/: the replica loop, amp,", "errors to the driver",
                          "Strategy: task half (task.py)", "balance/ · model_parallel/",
                          "CPU, or the GPU Spark assigned"],
                         fill="#fdf3e7", stroke="#c07a1e"))
    parts += [
        arrow(740, 175, 740, 282, "mapInArrow over partitions"),
        arrow(455, 175, 455, 282, "closure: model factory, secret"),
        arrow(300, 282, 300, 175, "pushes, progress, errors", dashed=True),
        arrow(295, 380, 322, 380), arrow(322, 400, 295, 400),
        arrow(580, 380, 607, 380), arrow(607, 400, 580, 400),
        (f"<text x='450' y='515' text-anchor='middle' font-size='11' fill='#444' {FONT}>"
        "between tasks (transport/): rendezvous, gloo/NCCL all-reduce, shared memory (shm.py), "
        "gossip rounds, model-parallel all-gather</text>"),
        "</svg>",
    ]
    return "\n".join(parts) + "\n"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    text = svg()
    if "--check" in argv:
        return 0 if OUT.exists() and OUT.read_text() == text else 1
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
