"""Run a test body on real processes: ``world`` spawned ranks in one gloo group on 127.0.0.1,
one thread each; every rank's body returns a JSON-able report, which the test gets back.
Ranks that have not finished after ``TIMEOUT_S`` are killed and the test fails (a hung
collective fails its test instead of the run)."""

from __future__ import annotations

import gc
import json
import os
import socket
import time

import torch

TIMEOUT_S = 600


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, world, port, out_dir, body, args):
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        report = body(rank, world, *args)
        # Rank 0 of a DDP test once ended in std::terminate (SIGABRT) at teardown: free what
        # the body made and wait for every rank before any of them takes the group (and
        # rank 0 its TCP store) down.
        gc.collect()
        dist.barrier()
    finally:
        dist.destroy_process_group()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)


def run_on_ranks(body, world: int, tmp_path, *args) -> list[dict]:
    """``body(rank, world, *args)`` (a module-level function) on ``world`` processes; the
    reports of ranks 0..world-1."""
    import torch.multiprocessing as mp
    ranks = mp.start_processes(_entry, args=(world, free_port(), str(tmp_path), body, args),
                               nprocs=world, join=False, start_method="spawn")
    deadline = time.monotonic() + TIMEOUT_S
    while not ranks.join(timeout=1.0):
        if time.monotonic() > deadline:
            for p in ranks.processes:
                p.kill()
            raise TimeoutError(f"{body.__name__} on {world} ranks did not finish in "
                               f"{TIMEOUT_S} s (killed)")
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]


__all__ = ["free_port", "run_on_ranks"]
