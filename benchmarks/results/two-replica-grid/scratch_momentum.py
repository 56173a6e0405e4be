"""Scratch (not a maintained benchmark): averaged_weights.py's loop at k = 2 with another
momentum than fit's 0.9 and the rate times LR_FACTOR (its warmup's start too), 1 epoch, the
average over 0.1 epoch, seeds 0..N-1, two processes. Momentum 0.8 at twice the linear rule's
rate keeps the long-run step per gradient, lr / (1 - momentum), and halves the momentum's
memory in steps, so that it spans as many rows as one replica's. Run from the project root:

    .venv/bin/python benchmarks/results/two-replica-grid/scratch_momentum.py OUT.json 0.8 2 64
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


def run(data, k, seed, momentum, lr_factor):
    sim.MOMENTUM = momentum
    avg = aw.Averages((0.1,))
    sim.simulate(data, k, True, 1, seed, lr_factor=lr_factor, watch=avg)
    acc = avg.accuracy[0.1]
    first = next(((i + 1) / 4 for i, v in enumerate(acc) if v >= sim.TARGET), None)
    return {"k": k, "seed": seed, "lr_factor": lr_factor,
            "warmup": f"auto, momentum {momentum}",
            "accuracy": {"0.1": acc}, "epochs_to_target": {"0.1": first}}


if __name__ == "__main__":
    m, f, n = float(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
    data = sim.make_data(48000, Path(tempfile.mkdtemp(prefix="momentum-")))
    with ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("spawn")) as pool:
        runs = list(pool.map(run, [data] * n, [2] * n, range(n), [m] * n, [f] * n))
    Path(sys.argv[1]).write_text(json.dumps({"command": " ".join(sys.argv),
                                             "raw": {"runs": runs}}, indent=1))
