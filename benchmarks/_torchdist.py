"""PySpark's TorchDistributor as the benchmarks run it: N processes (2 by default) on the session's
executors, with a deadline (its torchrun agents sometimes abort, or wait out their 300 s exit
barrier here)."""

from __future__ import annotations

import threading
import time


def run_torchdistributor(spark, fn, *args, timeout_s: float, processes: int = 2):
    """``TorchDistributor(num_processes=processes, local_mode=False).run(fn, *args)``: (its result or
    None, wall seconds, the error or None); a run past ``timeout_s`` has its jobs cancelled."""
    from pyspark.ml.torch.distributor import TorchDistributor
    out, t0 = {}, time.perf_counter()

    def go():
        try:
            out["r"] = TorchDistributor(num_processes=processes, local_mode=False,
                                           use_gpu=False).run(
                fn, *args)
        except Exception as e:
            out["error"] = f"{type(e).__name__}: {str(e)[:300]}"
    t = threading.Thread(target=go, daemon=True)
    t.start()
    t.join(timeout_s)
    wall = time.perf_counter() - t0
    if t.is_alive() or "r" not in out:
        spark.sparkContext.cancelAllJobs()
        t.join(30)
        return None, wall, out.get("error", f"hung > {timeout_s} s")
    return out["r"], wall, None
