"""Each option of ``spark_dl.fit`` declared once (spark_dl/options.py): fit's signature, the
tasks' configs (StageConfig, LocalStepConfig), the jobs' TOML [train] table (TrainConfig) and
TorchEstimator's Params all have the options the others have, with the same defaults, but for
the differences listed here (and TOML_DEFAULTS / PARAM_DEFAULTS there), each with its reason."""

from __future__ import annotations

import dataclasses
import inspect
import re

import pytest

from spark_dl import ConfigError, TrainConfig, fit, options
from spark_dl.options import OPTIONS, default, on, param_name
from spark_dl.runtime.stage import LocalStepConfig, StageConfig
from spark_dl.strategies import STRATEGIES

# Fields of a surface that are not fit's options, and why.
NOT_OPTIONS = {
    "StageConfig": {"progress_every_s"},      # how often a task reports: the runtime's own pace
    "TrainConfig": {"model",                  # a job's network by name (fit: a name or factory)
                    "fc_hidden",              # the 'fc' network's widths
                    "strategy_options"},      # the [train.strategy] table's options
    "TorchEstimator": {"model", "hiddenLayers",   # the network it builds, as in TrainConfig
                       "partitions",              # Downpour's option, as a plain Param
                       "predictionCol"},          # what its model's transform writes
}
# Options the job file leaves out though the Estimator has them, and why: a job's recipe
# builds the DataFrame and the model, which fix the columns, the sample shape and the classes;
# and a job names its trackers in its [run] table (recipes/common.py), for all its fits.
NOT_IN_TOML = {"features", "label", "shape", "num_classes", "track"}
# StageConfig/LocalStepConfig fields whose default is not fit's, and why.
STAGE_DEFAULTS = {"lr_scaling": "none"}       # the resolved rule: fit's "auto" names none


def _fit_keywords() -> dict:
    params = inspect.signature(fit).parameters.values()
    return {p.name: p.default for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY}


def _fields(cls, own_only: bool = False) -> dict:
    inherited = set(cls.__mro__[1].__dataclass_fields__) if own_only else set()
    return {f.name: f.default for f in dataclasses.fields(cls) if f.name not in inherited}


def test_fit_takes_each_option_in_order_with_its_default():
    keywords = _fit_keywords()
    assert list(keywords) == [o.name for o in OPTIONS]
    assert keywords == {o.name: o.default for o in OPTIONS}
    assert len({o.name for o in OPTIONS}) == len(OPTIONS)


def test_the_stage_configs_hold_the_options_fit_hands_the_tasks():
    stage = {o.name: o.default for o in OPTIONS if o.to == "stage"}
    train = {o.name: STAGE_DEFAULTS.get(o.name, o.default) for o in OPTIONS if o.to == "train"}
    fields = _fields(StageConfig)
    assert set(fields) - NOT_OPTIONS["StageConfig"] == set(stage)
    assert {k: fields[k] for k in stage} == stage
    assert _fields(LocalStepConfig, own_only=True) == train
    assert {o.to for o in OPTIONS} == {"stage", "train", "fit"}


def test_the_toml_train_table_has_the_options_marked_toml():
    fields = _fields(TrainConfig)
    want = {o.name: default(o, "toml") for o in on("toml")}
    assert set(fields) - NOT_OPTIONS["TrainConfig"] == set(want)
    assert {k: fields[k] for k in want} == want
    assert set(options.TOML_DEFAULTS) <= set(want)
    assert set(TrainConfig().fit_options) <= set(want)


def test_the_estimator_has_a_param_per_option_marked_param():
    from spark_dl.ml import TorchEstimator, TorchModel
    est = TorchEstimator()
    have = {p.name: est.getOrDefault(p) for p in est.params}
    want = {param_name(o): default(o, "param") for o in on("param")}
    assert set(have) - NOT_OPTIONS["TorchEstimator"] == set(want)
    assert {k: have[k] for k in want} == want
    assert set(options.PARAM_DEFAULTS) <= {o.name for o in on("param")}
    for method in (TorchEstimator.__init__, TorchEstimator.setParams):
        keywords = dict(list(inspect.signature(method).parameters.items())[1:])
        assert {k: p.default for k, p in keywords.items()} == have
    assert {p.name for p in TorchModel().params} == set(have)
    with pytest.raises(TypeError, match="got 'batch_size'; the Params: batchSize"):
        TorchEstimator(batch_size=8)


def test_the_job_file_and_the_estimator_share_their_options():
    toml, param = {o.name for o in on("toml")}, {o.name for o in on("param")}
    assert param - toml == NOT_IN_TOML and not toml - param
    # where both differ from fit, they differ alike (but the job's one-process default)
    for o in on("toml"):
        if o.name not in ("strategy", "batch_size"):
            assert default(o, "toml") == default(o, "param"), o.name


def test_the_strategy_names_are_the_registry_s():
    names = list(STRATEGIES)
    from spark_dl.ml import TorchEstimator
    for doc in (TorchEstimator.strategy.doc, fit.__doc__,
                next(o.doc for o in OPTIONS if o.name == "strategy")):
        listed = " ".join(doc.split()).split("strategy's name (")[1].split(")")[0]
        assert re.findall(r"'(\w+)'", listed) == names
    for table in ({"n_push": 2}, "ring"):
        with pytest.raises(ConfigError) as e:
            TrainConfig(strategy=table)
        assert all(repr(n) in str(e.value) for n in names), str(e.value)


def test_fit_documents_each_option_without_results_or_dates():
    doc = fit.__doc__
    for o in OPTIONS:
        assert f"\n    {o.name}=" in doc, o.name
    assert "docs/guides/fit.md" in doc
    assert not re.search(r"\d+(\.\d+)?\s*%|\b\d{4}-\d{2}-\d{2}\b|\b\d{1,2}:\d{2}\b|×", doc)
    assert all(o.doc and "\n" not in o.doc for o in OPTIONS)


@pytest.mark.parametrize("name, bad, match", [
    ("lr", 0, r"^lr must be > 0, got 0$"),
    ("epochs", 1.5, r"^epochs must be an integer >= 1, got 1.5$"),
    ("optimizer", "adamw", r"^optimizer must be one of sgd, .*, got 'adamw'$"),
    ("grad_clip", -1, r"^grad_clip must be 'auto', None \(off\) or a maximum"),
    ("replicas", 0, r"^replicas must be an integer >= 1 or None, got 0$"),
])
def test_an_option_s_check_names_it_on_each_surface(name, bad, match):
    option = next(o for o in OPTIONS if o.name == name)
    option.check(option.default)
    with pytest.raises(ConfigError, match=match):
        option.check(bad)
    table = r"'train\.{}'" if option.verify is None else r"train\.{}"
    with pytest.raises(ConfigError, match=table.format(name) + match.lstrip("^")[len(name):]):
        option.check(bad, "train")


def test_zero_stands_for_fit_s_none_in_a_job_file_and_a_param():
    replicas = next(o for o in OPTIONS if o.name == "replicas")
    assert (default(replicas, "toml"), default(replicas, "param")) == (0, 0)
    assert options.to_fit(replicas, 0) is None and options.to_fit(replicas, 3) == 3
    assert TrainConfig(replicas=0, strategy="allreduce").replicas == 0
    with pytest.raises(ConfigError, match=r"'train.replicas' must be an integer >= 1 or None"):
        TrainConfig(replicas=-1)
