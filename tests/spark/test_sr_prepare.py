"""Super-resolution patch pairs made in the executors and written as Parquet (local[2])."""

import dataclasses
import json
import shutil

import numpy as np
from PIL import Image

from spark_dl.superres.images import load_y
from spark_dl.superres.prepare import Degradation, make_pairs, prepare_patches

from ..conftest import ROOT


def test_prepare_patches_writes_pairs_and_skips_bad_images(spark, tmp_path):
    folder = tmp_path / "images"
    folder.mkdir()
    for name in ("t1.png", "t2.png"):
        shutil.copy(ROOT / "data" / "sr" / "T91" / name, folder / name)
    (folder / "broken.png").write_bytes(b"\\x89PNG\\r\\n\\x1a\\n not an image")
    Image.fromarray(np.zeros((10, 10), np.uint8)).save(folder / "tiny.png")
    rgba = np.zeros((40, 40, 4), np.uint8)
    rgba[..., 3] = 255
    Image.fromarray(rgba, "RGBA").save(folder / "rgba.png")
    out = tmp_path / "patches"
    res = prepare_patches(spark, str(folder), str(out), size=32, scale=2, stride=16,
                          degradation=Degradation("gaussian", sigma=20), augment=False)
    assert res.images == 5
    assert set(res.skipped) == {f"file:{folder}/broken.png", f"file:{folder}/tiny.png"}
    assert "corrupt or unreadable image" in res.skipped[f"file:{folder}/broken.png"]
    assert "smaller than a 32x32 patch" in res.skipped[f"file:{folder}/tiny.png"]
    # as many pairs as the images give, nothing else in the folder but the finished shards
    expected = sum(len(make_pairs(load_y(folder / n), 32, 2, 16, Degradation("none"),
                                  np.random.default_rng(0), augment=False)[0])
                   for n in ("t1.png", "t2.png", "rgba.png"))
    df = spark.read.parquet(str(out))
    assert res.patches == df.count() == expected
    assert not list(tmp_path.glob("patches.tmp-*"))
    meta = json.loads((out / "_spark_dl.json").read_text())
    assert meta["patches"] == expected and meta["degradation"]["sigma"] == 20
    row = df.where(df.image.endswith("t1.png")).first()
    hr = np.array(row.hr, np.float32).reshape(32, 32)
    lr_clean = np.array(row.lr_clean, np.float32).reshape(16, 16)
    lr = np.array(row.lr, np.float32).reshape(16, 16)
    assert 0.03 < float((lr - lr_clean).std()) < 0.1          # sigma 20 / 255 = 0.078
    assert hr.min() >= 0 and hr.max() <= 1 and lr.min() >= 0 and lr.max() <= 1


def test_the_three_stages_train_with_the_engine(spark, tmp_path):
    import torch

    from spark_dl.models.ssda import LayerSpec
    from spark_dl.superres.pipeline import finetune_cascade, train_cnn, train_ssda
    folder = tmp_path / "images"
    folder.mkdir()
    for name in ("t1.png", "t2.png"):
        shutil.copy(ROOT / "data" / "sr" / "T91" / name, folder / name)
    res = prepare_patches(spark, str(folder), str(tmp_path / "p"), size=32, scale=2,
                          stride=16, augment=False)
    df = spark.read.parquet(res.path)
    layers = (LayerSpec(48), LayerSpec(256, beta=0.0, rho=1.0))
    kw = dict(replicas=2, batch_size=16, log=None)
    ssda, hist = train_ssda(df, 16, layers, pretrain_epochs=2, finetune_epochs=2, lr=3e-3, **kw)
    assert len(hist) == 3 and all(len(h) == 2 for h in hist)
    assert all(h[1]["loss"] < h[0]["loss"] for h in hist)          # every fit learns
    torch.manual_seed(5)                            # the SRCNN's initial weights
    conventional, h2 = train_cnn(df, ssda, epochs=2, lr=1e-3, **kw)
    # from the stage-2 pipeline as it is, its SSDA frozen (as init_cascade = "conventional")
    cascade, _h3 = finetune_cascade(df, conventional.ssda, conventional.cnn, epochs=1, lr=1e-4,
                                    **kw)
    assert h2[-1]["loss"] < h2[0]["loss"]
    # the patches streamed from spill files (buffer = whole shard) train the same CNN
    torch.manual_seed(5)
    streamed, h2s = train_cnn(df, ssda, epochs=2, lr=1e-3, data="stream",
                              shuffle_buffer=10**6, **kw)
    assert [h["loss"] for h in h2s] == [h["loss"] for h in h2]
    assert all(torch.equal(a, b) for a, b in zip(streamed.state_dict().values(),
                                                 conventional.state_dict().values()))
    # stage 2 left the denoiser alone; stage 3 tuned it
    assert all(torch.equal(a, b) for a, b in zip(conventional.ssda.state_dict().values(),
                                                 ssda.state_dict().values()))
    assert not all(torch.equal(a, b) for a, b in zip(cascade.ssda.state_dict().values(),
                                                     ssda.state_dict().values()))
    x = torch.from_numpy(np.array(df.first().lr, np.float32))[None]
    assert cascade(x).shape == (1, 1, 32, 32)


def test_superres_job_runs_end_to_end_on_a_tiny_config(spark, tmp_path):
    from spark_dl import load_toml
    from spark_dl.recipes.superres_pipeline import SuperResConfig, run_superres
    train, test = tmp_path / "train", tmp_path / "test"
    train.mkdir()
    test.mkdir()
    shutil.copy(ROOT / "data" / "sr" / "T91" / "t1.png", train / "t1.png")
    # a 96x96 crop of the bird: each of the two runs evaluates four pipelines on it
    Image.open(ROOT / "data" / "sr" / "Set5" / "bird.png").crop((96, 64, 192, 160)).save(
        test / "bird.png")
    cfg = load_toml(SuperResConfig, ROOT / "conf" / "jobs" / "superres.toml",
                    {"train_images": str(train), "test_images": str(test),
                     "ssda_layers": [32, 256], "finetune_epochs": 1, "cnn_epochs": 1,
                     "thesis_conventional_epochs": 1, "cnn_noisy_skip": True,
                     "batch_size": 32, "run.out_dir": str(tmp_path / "run")})
    out = run_superres(cfg, log=lambda _: None, spark=spark)
    assert out["patches"] > 0 and not out["skipped_images"]
    assert set(out["report"]["images"]["bird"]) == {"bicubic", "conventional", "cascade",
                                                    "thesis_conventional"}
    assert out["cascade_gain_over_thesis_conventional_db"] == round(
        out["psnr_cascade"] - out["psnr_thesis_conventional"], 3)
    assert (tmp_path / "run" / "report" / "report.md").exists()
    assert (tmp_path / "run" / "report" / "bird.png").exists()
    assert out["cascade_gain_db"] == round(out["psnr_cascade"] - out["psnr_conventional"], 3)
    active = out["srcnn_active_units"]                 # [active, units] per ReLU layer
    assert set(active) == {"conventional", "cascade", "thesis_conventional"}
    assert all([n for _, n in layers] == [64, 32] and all(0 <= a <= n for a, n in layers)
               for layers in active.values())
    # every fit has its own run directory under the job's, and both pipelines are saved whole
    fits = list((tmp_path / "run" / "fits").glob("superres-*"))
    assert len(fits) == 1
    assert sorted(p.name for p in fits[0].iterdir()) == \
        ["cascade", "cnn", "cnn-clean", "ssda-finetune", "ssda-layer1", "ssda-layer2"]
    assert all((p / "history.csv").exists() for p in fits[0].iterdir())
    import torch

    from spark_dl.superres.cascade import load_cascade
    cascade = load_cascade(out["models"]["cascade"])
    assert cascade.ssda.n_in == 256 and cascade.hr_size == 32
    # the noisy skip: the stages-apart and cascade SRCNNs see the noisy LR too, the SRCNN
    # trained on clean LR (the thesis's baseline) only its input
    assert cascade.cnn.inputs == 2
    assert load_cascade(out["models"]["conventional"]).cnn.inputs == 2
    assert load_cascade(out["models"]["thesis_conventional"]).cnn.inputs == 1
    # the continuation: stages 1-2 and the thesis's baseline taken from the run, the cascade
    # stage continued from its cascade (at a learning rate that leaves it where it was)
    again = run_superres(dataclasses.replace(cfg, init_from=str(tmp_path / "run"),
                                             cascade_lr=1e-9, thesis_conventional_epochs=0,
                                             run=dataclasses.replace(cfg.run, out_dir=str(
                                                 tmp_path / "again"))),
                         log=lambda _: None, spark=spark)
    assert set(again["histories"]) == {"cascade"} and set(again["timings"]) == {"cascade_s"}
    assert again["init_from"] == str((tmp_path / "run").resolve())
    assert again["init_cascade"] == "cascade"
    assert again["psnr_thesis_conventional"] == out["psnr_thesis_conventional"]
    assert again["psnr_conventional"] == out["psnr_conventional"]
    for name in ("conventional", "cascade", "thesis_conventional"):
        before, after = (load_cascade(p / f"{name}.pt").state_dict()
                         for p in (tmp_path / "run", tmp_path / "again"))
        same = torch.equal if name != "cascade" else \
            (lambda a, b: torch.allclose(a, b, atol=1e-5))
        assert all(same(before[k], after[k]) for k in before), name
    # and the first run's stage 3 trained the SSDA that stage 2 had frozen
    assert not torch.equal(load_cascade(tmp_path / "again" / "cascade.pt").ssda.layers[0].weight,
                           load_cascade(tmp_path / "run" / "conventional.pt").ssda.layers[0]
                           .weight)


def test_a_folder_of_images_is_super_resolved_by_a_spark_job(spark, tmp_path):
    import torch

    from spark_dl.models.ssda import SSDA, LayerSpec
    from spark_dl.superres.cascade import Cascade
    from spark_dl.superres.infer import super_resolve_folder
    folder = tmp_path / "in"
    folder.mkdir()
    shutil.copy(ROOT / "data" / "sr" / "Set5" / "bird.png", folder / "bird.png")
    gray = (np.random.default_rng(0).random((40, 52)) * 255).astype(np.uint8)
    Image.fromarray(gray).save(folder / "gray.png")
    (folder / "bad.png").write_bytes(b"not an image")
    torch.manual_seed(0)
    model = Cascade(16, 2, SSDA(256, (LayerSpec(32), LayerSpec(256, 0.0, 1.0))))
    rows = {r.path.rsplit("/", 1)[-1]: r for r in
            super_resolve_folder(spark, model, str(folder), str(tmp_path / "out"))}
    assert rows["bad.png"].error.startswith("corrupt or unreadable image")
    w, h = Image.open(folder / "bird.png").size
    out = Image.open(rows["bird.png"].output)
    assert out.size == (2 * w, 2 * h) and out.mode == "RGB"
    g = Image.open(rows["gray.png"].output)
    assert g.size == (104, 80) and g.mode == "L"
    assert not list((tmp_path / "out").glob("*.tmp"))
    # the self-ensemble in the job is the local one's output, rounded to 8 bits
    from spark_dl.superres.tiles import super_resolve
    one = tmp_path / "one"
    one.mkdir()
    Image.fromarray(gray).save(one / "gray.png")
    [row] = super_resolve_folder(spark, model, str(one), str(tmp_path / "ens"), ensemble=True)
    got = np.asarray(Image.open(row.output), np.float32) / 255
    want = super_resolve(gray.astype(np.float32) / 255, 2, model.ssda, model.cnn, ensemble=True)
    assert np.abs(got - want).max() <= 1 / 255 + 1e-6
