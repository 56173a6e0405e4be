"""The learning-rate rule for the global batch (spark_dl.optim.schedule) and its checks."""

import math

import pytest

from spark_dl import ConfigError
from spark_dl.optim.schedule import LRSchedule, check_lr_scaling, resolve_scaling
from spark_dl.runtime.validation import mid_epoch_steps


def test_linear_rule_with_warmup_and_decay():
    s = LRSchedule(0.01, k=8, rule="linear", warmup_epochs=2, decay=0.5, epochs=4)
    assert s.scaled == pytest.approx(0.08)
    assert s.at(0) == pytest.approx(0.01)                     # Goyal: warmup from lr
    assert s.at(0.5) == pytest.approx(0.01 + 0.07 / 4)        # linear in the epochs done
    assert s.at(1.0) == pytest.approx(0.5 * (0.01 + 0.07 / 2))  # the decay of epoch 1
    assert s.at(2.0) == pytest.approx(0.25 * 0.08)            # warm: k lr, decayed twice
    assert s.at(3.5) == pytest.approx(0.125 * 0.08)


def test_sqrt_and_none_rules():
    assert LRSchedule(0.001, k=16, rule="sqrt", warmup_epochs=0).at(0) == pytest.approx(0.004)
    assert LRSchedule(0.1, k=16, rule="none").at(5.0) == pytest.approx(0.1)


def test_auto_warmup_grows_with_log_k_to_a_quarter_of_the_fit_and_none_for_one_replica():
    assert LRSchedule(0.1, k=2, rule="linear", epochs=3).warmup == pytest.approx(0.75 / 5)
    assert LRSchedule(0.1, k=16, rule="linear", epochs=3).warmup == pytest.approx(0.75 * 4 / 5)
    assert LRSchedule(0.1, k=64, rule="linear", epochs=3).warmup == pytest.approx(0.75)
    assert LRSchedule(0.1, k=64, rule="linear", epochs=40).warmup == 2.0
    assert LRSchedule(0.1, k=4, rule="none", epochs=4).warmup == 0.0
    one = LRSchedule(0.1, k=1, rule="linear", epochs=3)
    assert one.warmup == 0.0 and [one.at(t) for t in (0, 0.3, 2.9)] == [0.1] * 3


@pytest.mark.parametrize("optimizer, rule", [("sgd", "linear"), ("adam", "sqrt"),
                                             ("rmsprop", "sqrt"), ("adagrad", "sqrt"),
                                             ("lbfgs", "none"), ("cg", "none")])
def test_auto_picks_the_rule_by_the_optimizer(optimizer, rule):
    assert resolve_scaling("auto", optimizer) == rule
    assert resolve_scaling(None, optimizer) == "none"
    assert resolve_scaling("sqrt", optimizer) == "sqrt"


@pytest.mark.parametrize("scaling, warmup, match", [
    ("quadratic", "auto", (r"lr_scaling must be one of 'auto', 'linear', 'sqrt', 'none' or "
                           r"None, got 'quadratic'")),
    ("linear", -1, r"warmup_epochs must be 'auto' or a number of epochs >= 0, got -1"),
    ("linear", math.nan, r"warmup_epochs must be .*, got nan"),
    ("linear", "long", r"warmup_epochs must be .*, got 'long'"),
    ("linear", 5, r"warmup_epochs=5 is longer than the fit \(epochs=3\).*use warmup_epochs <= 3"),
])
def test_bad_scaling_arguments_are_config_errors(scaling, warmup, match):
    with pytest.raises(ConfigError, match=match):
        check_lr_scaling(scaling, warmup, 3)


def test_toml_keys_are_checked(tmp_path):
    from spark_dl import DemoConfig, load_toml
    p = tmp_path / "job.toml"
    p.write_text("[train]\nepochs = 2\nlr_scaling = 'cubic'\n")
    with pytest.raises(ConfigError, match=r"train.lr_scaling must be one of"):
        load_toml(DemoConfig, p)
    p.write_text("[train]\nepochs = 2\nlr_scaling = 'none'\nwarmup_epochs = 1.5\n")
    assert load_toml(DemoConfig, p).train.fit_options == {"lr_scaling": "none",
                                                           "warmup_epochs": 1.5,
                                                           "grad_clip": "auto",
                                                           "nesterov": False,
                                                           "resources": None}
    for strategy in ("allreduce", "localsgd"):
        p.write_text(f"[train]\nepochs = 2\nnesterov = true\nstrategy = '{strategy}'\n")
        assert load_toml(DemoConfig, p).train.fit_options["nesterov"] is True
    for bad, match in (("nesterov = 'yes'", "'train.nesterov' in .* must be of type bool"),
                       ("nesterov = true\nmomentum = 0.0",
                        (r"'train.nesterov' needs optimizer = 'sgd' and momentum > 0 \(optimizer "
                         r"= 'sgd', momentum = 0.0\)")),
                       ("nesterov = true\nstrategy = 'downpour'",
                        ("'train.nesterov' runs with strategy 'single', 'allreduce', 'gossip', "
                         "'localsgd' or 'fsdp', "
                         "not 'downpour'"))):
        p.write_text(f"[train]\nepochs = 2\n{bad}\n")
        with pytest.raises(ConfigError, match=match):
            load_toml(DemoConfig, p)
    p.write_text("[train]\nepochs = 2\ngrad_clip = -1\n")
    with pytest.raises(ConfigError, match=r"train.grad_clip must be 'auto', None \(off\) or "):
        load_toml(DemoConfig, p)


@pytest.mark.parametrize("steps, every, marks", [
    (100, 0.25, {24, 49, 74}), (10, 0.5, {4}), (7, 1.0, set()), (3, 0.25, {0, 1}),
    (1, 0.25, set())])
def test_mid_epoch_validation_steps(steps, every, marks):
    assert mid_epoch_steps(steps, every) == marks


def test_gossip_auto_rule_is_sqrt_from_eight_replicas():
    from spark_dl.strategies.gossip.driver import SQRT_FROM, auto_rule
    assert SQRT_FROM == 8
    assert auto_rule("linear", True, 2, "ring", 0.1) == "linear"
    assert auto_rule("linear", True, 7, "ring", 0.1) == "linear"
    assert auto_rule("linear", True, 8, "ring", 0.1) == "sqrt"
    assert auto_rule("linear", True, 16, "ring", 0.1) == "sqrt"
    assert auto_rule("linear", False, 16, "ring", 0.1) == "linear"    # asked for by name: kept
    assert auto_rule("sqrt", True, 2, "ring", 0.1) == "sqrt"          # Adam-like: already sqrt
    assert auto_rule("none", True, 16, "ring", 0.1) == "none"
    # the exponential graph averaging whole models mixes fast enough for the linear rate
    assert auto_rule("linear", True, 16, "exponential", 1.0) == "linear"
    assert auto_rule("linear", True, 16, "exponential", 0.1) == "sqrt"
    assert auto_rule("linear", True, 16, "ring", 1.0) == "sqrt"
    # Gossip's defaults are that graph with whole models: linear at any number of replicas
    from spark_dl import Gossip
    default = Gossip()
    assert (default.topology, default.alpha) == ("exponential", 1.0)
    assert auto_rule("linear", True, 16, default.topology, default.alpha) == "linear"


@pytest.mark.parametrize("tensors", [False, True])     # a CPU's bookkeeping, a GPU's
def test_grad_clip_auto_cuts_spikes_at_twice_the_running_mean_norm(tensors):
    """"auto" is off while the rate is not scaled; when it is, the first step sets the running
    mean, a step above twice the mean is cut to exactly twice it (and counted), and the mean
    moves by the cut norm; a non-finite norm (fp16 overflow) changes nothing."""
    import torch

    from spark_dl.optim.clip import BETA, FACTOR, GradClip
    assert not GradClip("auto", False, "cpu").on and not GradClip(None, True, "cpu").on
    clip = GradClip("auto", True, "cpu", tensors=tensors)

    def norm(gs):
        return float(torch.linalg.vector_norm(torch.cat([g.reshape(-1) for g in gs])))
    g = [torch.tensor([3.0, 4.0]), torch.tensor([0.0])]           # norm 5: sets the mean
    clip(g)
    assert norm(g) == pytest.approx(5.0) and clip.mean == pytest.approx(5.0)
    g = [torch.tensor([6.0, 8.0]), torch.tensor([0.0])]           # 10 = 2 x 5: kept
    clip(g)
    assert norm(g) == pytest.approx(10.0)
    mean = BETA * 5.0 + (1 - BETA) * 10.0
    assert clip.mean == pytest.approx(mean)
    g = [torch.tensor([30.0, 40.0]), torch.tensor([120.0])]       # 130: cut to 2 x mean
    clip(g)
    assert norm(g) == pytest.approx(FACTOR * mean)
    assert g[1].item() == pytest.approx(120.0 * FACTOR * mean / 130.0)   # one factor for all
    mean = BETA * mean + (1 - BETA) * FACTOR * mean
    assert clip.mean == pytest.approx(mean)
    g = [torch.tensor([float("inf"), 1.0]), torch.tensor([0.0])]
    clip(g)
    assert g[0][1].item() == 1.0 and clip.mean == pytest.approx(mean)
    assert clip.describe() == {"rule": "relative: 2 x the running mean norm",
                               "clipped_steps": 1, "steps": 3}
    again = GradClip("auto", True, "cpu", tensors=not tensors)    # resumed from a checkpoint
    again.load(clip.state())
    for c in (clip, again):
        g = [torch.tensor([100.0, 0.0]), torch.tensor([0.0])]
        c(g)
        assert g[0][0].item() == pytest.approx(FACTOR * mean)
    assert again.describe() == clip.describe()
    zero = GradClip("auto", True, "cpu", tensors=tensors)        # a zero first norm: no mean
    for values in ([0.0, 0.0], [3.0, 4.0], [30.0, 40.0]):
        g = [torch.tensor(values)]
        zero(g)
    assert zero.mean == pytest.approx(BETA * 5.0 + (1 - BETA) * 10.0)
    assert g[0].tolist() == pytest.approx([6.0, 8.0])          # 50 cut to 2 x 5


@pytest.mark.parametrize("tensors", [False, True])
def test_grad_clip_by_number_is_a_fixed_maximum_norm_and_bad_values_are_refused(tensors):
    import torch

    from spark_dl.optim.clip import GradClip, check_grad_clip
    clip = GradClip(1.0, False, "cpu", tensors=tensors)                 # on whether or not the rate is scaled
    g = [torch.tensor([3.0, 4.0])]
    clip(g)
    assert g[0].tolist() == pytest.approx([0.6, 0.8])
    g = [torch.tensor([0.3, 0.4])]
    clip(g)
    assert g[0].tolist() == pytest.approx([0.3, 0.4])
    assert clip.describe() == {"rule": "max norm 1", "clipped_steps": 1, "steps": 2}
    assert not GradClip(0, True, "cpu").on
    assert GradClip("auto", False, "cpu").describe()["rule"] is None
    for ok in (None, "auto", 0, 2.5):
        check_grad_clip(ok)
    for bad in (-1, "big", float("nan"), True):
        with pytest.raises(ConfigError, match=r"grad_clip must be 'auto', None \(off\) or a "
                                              r"maximum gradient norm >= 0, got"):
            check_grad_clip(bad)
