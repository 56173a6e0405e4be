import json
import os
import subprocess

import pytest

from spark_dl import ConfigError, load_profile
from spark_dl.session import available_profiles, parse_properties


def test_shipped_profiles():
    assert {"local", "local-cluster", "standalone", "yarn", "kubernetes", "gpu"} <= \
        set(available_profiles())
    assert load_profile("local")["spark.master"] == "local[*]"
    assert load_profile("local-cluster")["spark.master"] == "local-cluster[2,1,1024]"
    assert load_profile("standalone")["spark.master"].startswith("spark://")
    gpu = load_profile("gpu")
    assert gpu["spark.task.resource.gpu.amount"] == "1"
    script = gpu["spark.executor.resource.gpu.discoveryScript"]
    assert os.path.isabs(script) and os.access(script, os.X_OK)
    out = subprocess.run([script], env={**os.environ, "SPARK_DL_FAKE_GPUS": "0,1"},
                         capture_output=True, text=True, check=True).stdout
    assert json.loads(out) == {"name": "gpu", "addresses": ["0", "1"]}
    for name in available_profiles():
        assert load_profile(name)["spark.sql.execution.arrow.pyspark.enabled"] == "true"


def test_unknown_profile_lists_the_available_ones():
    with pytest.raises(ConfigError, match=r"unknown Spark profile 'loacl'; available: .*local"):
        load_profile("loacl")


def test_properties_syntax():
    props = parse_properties("# c\nspark.a  1\nspark.b=2\nspark.c: x y\n\n", "t")
    assert props == {"spark.a": "1", "spark.b": "2", "spark.c": "x y"}
    with pytest.raises(ConfigError, match=r"t:2: unknown key 'master'"):
        parse_properties("spark.a 1\nmaster local\n", "t")
    with pytest.raises(ConfigError, match=r"t:1: expected 'key value'"):
        parse_properties("spark.lonely\n", "t")


def test_profile_directory_override(tmp_path, monkeypatch):
    (tmp_path / "mine.conf").write_text("spark.master local[1]\n")
    monkeypatch.setenv("SPARK_DL_CONF_DIR", str(tmp_path))
    assert load_profile("mine") == {"spark.master": "local[1]"}
    assert load_profile(str(tmp_path / "mine.conf")) == {"spark.master": "local[1]"}
