"""The evaluation report on Set5 reproduces the reference figures of the bicubic baselines."""

import json
import shutil

import torch

from spark_dl.models import SRCNN
from spark_dl.models.ssda import SSDA
from spark_dl.superres.evaluate import evaluate_folder
from spark_dl.superres.prepare import Degradation

from ..conftest import ROOT

SET5 = ROOT / "data" / "sr" / "Set5"


def test_bicubic_baselines_on_set5(tmp_path):
    # the figures for x2, Y channel, border shaved: 23.4 dB noisy (sigma 20), 33.7 clean
    noisy = evaluate_folder(SET5, tmp_path / "noisy", 2, Degradation("gaussian", sigma=20), {})
    clean = evaluate_folder(SET5, tmp_path / "clean", 2, Degradation("none"), {})
    assert 23.2 < noisy["average"]["bicubic"]["psnr"] < 23.8
    assert 33.5 < clean["average"]["bicubic"]["psnr"] < 33.9
    assert set(noisy["images"]) == {"baby", "bird", "butterfly", "head", "woman"}
    assert json.loads((tmp_path / "noisy" / "report.json").read_text())["average"] == \
        noisy["average"]
    assert (tmp_path / "noisy" / "report.md").read_text().splitlines()[-1].startswith(
        "| average | 23.")


def test_report_compares_methods_and_draws_each_image(tmp_path):
    from PIL import Image
    folder = tmp_path / "one"
    folder.mkdir()
    shutil.copy(SET5 / "bird.png", folder / "bird.png")
    torch.manual_seed(0)
    models = (SSDA(256), SRCNN())
    rep = evaluate_folder(folder, tmp_path / "out", 2, Degradation(),
                          {"conventional": models, "cascade": models})
    assert set(rep["images"]["bird"]) == {"bicubic", "conventional", "cascade"}
    # the same models give the same figures; the strip is noisy | 2 methods | truth
    assert rep["images"]["bird"]["conventional"] == rep["images"]["bird"]["cascade"]
    from spark_dl.superres.images import load_y, modcrop
    hr = modcrop(load_y(folder / "bird.png"), 2)
    assert Image.open(tmp_path / "out" / "bird.png").size == (4 * hr.shape[1], hr.shape[0])
    # the self-ensemble adds a "+" column per learned method, not a panel to the strip
    ens = evaluate_folder(folder, tmp_path / "ens", 2, Degradation(),
                          {"cascade": models}, stride=8, ensemble=True)
    assert list(ens["average"]) == ["bicubic", "cascade", "cascade+"]
    assert ens["images"]["bird"]["cascade"] == rep["images"]["bird"]["cascade"]
    assert ens["images"]["bird"]["cascade+"] != ens["images"]["bird"]["cascade"]
    assert "cascade+ PSNR / SSIM" in (tmp_path / "ens" / "report.md").read_text()
    assert Image.open(tmp_path / "ens" / "bird.png").size == (3 * hr.shape[1], hr.shape[0])
