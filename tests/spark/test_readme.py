"""The README's Python examples, run as written (in a directory with the shipped data), on
the test session's Spark: they cannot rot."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


# the README's get_session() asks for local[*]; here the test session (local[2]) is reused
@pytest.mark.filterwarnings("ignore:a SparkSession on local.* is already running")
def test_the_readme_python_examples_run(spark, tmp_path, monkeypatch, capsys):
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.DOTALL)
    assert len(blocks) >= 2
    (tmp_path / "data").symlink_to(ROOT / "data")
    monkeypatch.chdir(tmp_path)                   # run directories go here
    scope: dict = {}
    for block in blocks:
        exec(compile(block, "README.md", "exec"), scope)
    out = capsys.readouterr().out
    acc = float(re.search(r"^accuracy (\S+),", out, flags=re.MULTILINE).group(1))
    assert acc > 0.85, out                        # two epochs of 8,000 digits
    assert "prediction" in out
    assert scope["res"].run_dir.is_relative_to(tmp_path)
