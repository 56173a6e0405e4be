import pytest

from spark_dl import ConfigError, DemoConfig, load_toml

from ..conftest import ROOT


def test_shipped_demo_config_loads():
    cfg = load_toml(DemoConfig, ROOT / "conf" / "jobs" / "demo.toml")
    assert cfg.train.model == "cnn" and cfg.data.n_train_source == 8000


def test_overrides(tmp_path):
    cfg = load_toml(DemoConfig, ROOT / "conf" / "jobs" / "demo.toml",
                    {"train.model": "fc", "data.partitions": 3, "train.lr": 1})
    assert (cfg.train.model, cfg.data.partitions, cfg.train.lr) == ("fc", 3, 1.0)
    cfg = load_toml(DemoConfig, ROOT / "conf" / "jobs" / "demo.toml",
                    {"train.strategy.partitions": "auto", "train.fc_hidden": [1024, 320]})
    assert (cfg.train.partitions, cfg.train.fc_hidden) == ("auto", (1024, 320))


@pytest.mark.parametrize("text, match", [
    ("[train]\nlearning_rate = 0.1\n", r"unknown key 'train.learning_rate'.*allowed keys.*lr"),
    ("[trian]\nlr = 0.1\n", r"unknown key 'trian'.*allowed keys here: data, train"),
    ("[train]\nlr = -1.0\n", r"'train.lr' must be > 0, got -1.0"),
    ("[train]\nmodel = 'resnet'\n", r"'train.model' must be one of 'cnn', 'cnn_bn', 'fc'"),
    ("[data]\npartitions = 'four'\n", r"'data.partitions' .* must be of type int"),
    ("train = 3\n", r"'train' .* must be a table"),
    ("[train.strategy]\nname = 'downpour'\npartitions = 'many'\n",
     r"'train.strategy': partitions must be an integer >= 1, got 'many'"),
    ("[train]\nfc_hidden = [0]\n", r"'train.fc_hidden' must list positive widths"),
    ("[train\n", r"not valid TOML"),
])
def test_bad_configs_name_the_key(tmp_path, text, match):
    p = tmp_path / "job.toml"
    p.write_text(text)
    with pytest.raises(ConfigError, match=match):
        load_toml(DemoConfig, p)


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_toml(DemoConfig, tmp_path / "nope.toml")


@pytest.mark.parametrize("master,task_gpus,device,refused", [
    ("spark://10.0.0.5:7077", None, "cuda", True),
    ("yarn", "0", "cuda", True),
    ("local-cluster[2,1,1024]", None, "cuda", True),
    ("spark://10.0.0.5:7077", "1", "cuda", False),
    ("k8s://https://api:443", "0.5", "cuda", False),      # two tasks share a GPU
    ("local[4]", None, "cuda", False),                    # one machine: rank modulo count
    ("spark://10.0.0.5:7077", None, "auto", False),       # auto falls back to the CPU
])
def test_gpu_requested_without_gpu_scheduling_is_refused(master, task_gpus, device, refused):
    from spark_dl.compat import gpu_request_error
    why = gpu_request_error(master, task_gpus, device)
    assert (why is not None) == refused
    if refused:
        assert why.startswith(f"device='cuda' but no GPU resources are configured for tasks on "
                              f"{master}: set spark.executor.resource.gpu.amount=1, "
                              f"spark.task.resource.gpu.amount=1")
