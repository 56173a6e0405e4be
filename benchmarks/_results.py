"""What the benchmarks write: one JSON results file with the run's date, host and command, its
settings, the summary the docs quote and the raw runs; the summary is printed too."""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from pathlib import Path


def write_results(out: str | Path, script: str, argv, settings: dict, summary: dict,
                  raw: dict) -> None:
    doc = {"date": time.strftime("%Y-%m-%d %H:%M"), "host": platform.node(),
           "cpus": os.cpu_count(), **settings,
           "command": f"benchmarks/{script} " + " ".join(argv or sys.argv[1:]),
           "summary": summary, "raw": raw}
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1))
    print(json.dumps(summary, indent=1))
