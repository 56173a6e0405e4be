"""Scratch (not a maintained benchmark): averaged_weights.py's loop at k = 2 with the relative
cut of grad_clip="auto" off ("none") or at another multiple of its running mean than fit's 2.0,
1 epoch, the average over 0.1 epoch, seeds 0-63, two processes. Run from the project root:

    .venv/bin/python benchmarks/results/two-replica-grid/scratch_cut.py OUT.json none|FACTOR
"""
import json
import multiprocessing
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path[:0] = [".", "benchmarks"]
import averaged_weights as aw  # noqa: E402
import scaled_rate_clip as sim  # noqa: E402


def run(data, k, seed, factor):
    avg = aw.Averages((0.1,))
    sim.simulate(data, k, factor is not None, 1, seed, factor=factor, watch=avg)
    acc = avg.accuracy[0.1]
    first = next(((i + 1) / 4 for i, v in enumerate(acc) if v >= sim.TARGET), None)
    return {"k": k, "seed": seed, "lr_factor": 1.0,
            "warmup": "auto, no cut" if factor is None else f"auto, cut {factor}",
            "accuracy": {"0.1": acc}, "epochs_to_target": {"0.1": first}}


if __name__ == "__main__":
    factor = None if sys.argv[2] == "none" else float(sys.argv[2])
    data = sim.make_data(48000, Path(tempfile.mkdtemp(prefix="cut-")))
    with ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("spawn")) as pool:
        runs = list(pool.map(run, [data] * 64, [2] * 64, range(64), [factor] * 64))
    Path(sys.argv[1]).write_text(json.dumps({"command": " ".join(sys.argv),
                                             "raw": {"runs": runs}}, indent=1))
