"""What a barrier-stage fit records of itself besides the epochs: where its wall time went
(info's "phases")."""

from __future__ import annotations

import pytest

from spark_dl.strategies.base import fit_phases


def test_the_phases_of_a_fit_add_up_to_its_wall_time():
    import time
    now = time.time()
    start = now - 100.0
    stamps = {"submitted": start + 3.0, "received": now - 2.0}
    task = {"started_at": start + 5.0, "ended_at": now - 4.0, "read_partition_s": 1.0,
            "rendezvous_s": 0.5, "setup_s": 2.0, "epochs_s": 70.0, "validation_s": 4.0,
            "checkpoints_s": 3.0, "result_s": 1.5, "task_total_s": 91.0, "allreduce_s": 9.0}
    phases = fit_phases(start, stamps, task)
    assert phases["checks_s"] == pytest.approx(3.0) and phases["launch_s"] == pytest.approx(2.0)
    assert phases["task_other_s"] == pytest.approx(9.0)        # 91 - the task's named phases
    assert phases["return_s"] == pytest.approx(2.0)
    assert phases["finish_s"] == pytest.approx(2.0, abs=0.5)
    parts = sum(v for k, v in phases.items() if k not in ("total_s", "outside_epochs_s"))
    assert parts == pytest.approx(phases["total_s"], abs=0.01)
    assert phases["total_s"] == pytest.approx(100.0, abs=0.5)
    assert phases["outside_epochs_s"] == pytest.approx(phases["total_s"] - 70.0, abs=0.01)
    # a stamp missing (a strategy with a loop of its own): no phases
    assert fit_phases(None, stamps, task) is None
    assert fit_phases(start, {"submitted": start}, task) is None
    assert fit_phases(start, stamps, {"setup_s": 1.0}) is None

