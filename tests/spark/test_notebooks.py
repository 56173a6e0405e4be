"""The notebooks in notebooks/ run headless (nbclient, a fresh kernel and SparkSession each),
on the small configuration they switch to when SPARK_DL_NOTEBOOK_QUICK=1."""

from __future__ import annotations

import sys

import nbformat
import pytest
from nbclient import NotebookClient

from ..conftest import ROOT

NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs_headless(path, monkeypatch):
    monkeypatch.setenv("SPARK_DL_NOTEBOOK_QUICK", "1")
    monkeypatch.setenv("PYSPARK_PYTHON", sys.executable)
    monkeypatch.delenv("PYSPARK_GATEWAY_PORT", raising=False)
    nb = nbformat.read(path, as_version=4)
    assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code"), \
        f"{path.name} is stored with outputs; clear them before committing"
    NotebookClient(nb, timeout=600, kernel_name="python3",
                   resources={"metadata": {"path": str(ROOT / "notebooks")}}).execute()
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs
              if o.output_type == "error"]
    assert not errors
    if path.stem == "01_quick_start":
        # fit's progress is one output area updated in place, ending with the epoch line
        live = [o["data"]["text/plain"] for c in nb.cells if c.cell_type == "code"
                for o in c.outputs if o.output_type == "display_data"
                and "text/plain" in o.get("data", {})]
        assert any(t.splitlines()[0].startswith("epoch 1: loss") for t in live), live
