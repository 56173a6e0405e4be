"""What a barrier-stage fit leaves in its run directory besides the epochs: the model task 0
writes where the driver reads (the driver's mark), and where the fit's wall time went (info's
"phases")."""

from __future__ import annotations

import pytest
import torch

from spark_dl.errors import SparkDLError
from spark_dl.runs import MARK, sees_driver_dir, shared_mark
from spark_dl.runtime.loop import save_model_file
from spark_dl.runtime.stage import state_bytes
from spark_dl.strategies.base import _model_file, fit_phases

SECRET = "ab" * 16


def test_task_0_writes_the_model_only_where_the_driver_marked_the_directory(tmp_path):
    state = state_bytes({"w": torch.arange(6.0).reshape(2, 3)})
    assert not sees_driver_dir(tmp_path, SECRET)                 # no mark: another machine's
    assert save_model_file(state, str(tmp_path), SECRET) is None
    (tmp_path / MARK).write_text(shared_mark(tmp_path, "cd" * 16))   # another fit's mark
    assert save_model_file(state, str(tmp_path), SECRET) is None
    assert not (tmp_path / "model.pt").exists()
    (tmp_path / MARK).write_text(shared_mark(tmp_path, SECRET))
    assert SECRET not in (tmp_path / MARK).read_text()
    saved = save_model_file(state, str(tmp_path), SECRET)
    assert saved == {"name": "model.pt", "bytes": len(state)}
    loaded = torch.load(_model_file(tmp_path, saved), weights_only=True)
    assert torch.equal(loaded["w"], torch.arange(6.0).reshape(2, 3))
    assert sorted(p.name for p in tmp_path.iterdir()) == [MARK, "model.pt"]   # no temporary
    assert save_model_file(b"", str(tmp_path), SECRET) is None     # nothing to write


def test_a_model_file_changed_under_the_fit_is_an_error(tmp_path):
    (tmp_path / "model.pt").write_bytes(b"x" * 10)
    with pytest.raises(SparkDLError, match=r"task 0 wrote the fit's model to .*model.pt "
                                           r"\(12 bytes\) but the driver finds 10 bytes"):
        _model_file(tmp_path, {"name": "model.pt", "bytes": 12})
    with pytest.raises(SparkDLError, match="finds no file there"):
        _model_file(tmp_path, {"name": "gone.pt", "bytes": 12})


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

