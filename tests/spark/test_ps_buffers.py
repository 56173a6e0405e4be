"""BatchNorm's running statistics through the parameter server on real Spark (local[2]): the
model Downpour (one replica per task, or split over 2 partitions) and Boosting return holds
the workers' statistics, so that it validates as it trained."""

from __future__ import annotations

import pytest
import torch

from spark_dl import Boosting, Downpour, fit

from .test_allreduce import data, frame


def bn_net():
    # momentum 0.3: after a worker's 16 mini-batches its statistics hold 0.7^16 = 0.3% of the
    # initial values (0.9^16 = 19% at the default 0.1)
    return torch.nn.Sequential(torch.nn.Linear(12, 8), torch.nn.BatchNorm1d(8, momentum=0.3),
                               torch.nn.ReLU(), torch.nn.Linear(8, 3))


def _check_statistics(model, x, y):
    """The running statistics are the data's (through the returned first layer), not the
    initial zeros and ones, and the model in evaluation mode scores as in training mode."""
    x = torch.as_tensor(x)
    bn = model[1]
    assert int(bn.num_batches_tracked) == 0          # not floating point: model_fn()'s value
    with torch.no_grad():
        h = model[0](x)                              # (N, 8) what BatchNorm sees
    assert not torch.allclose(bn.running_mean, torch.zeros(8))
    assert not torch.allclose(bn.running_var, torch.ones(8))
    # EMAs over the last few mini-batches of each worker, of a moving model: near the data's,
    # each channel within their noise (up to 0.26 measured), and unbiased over the channels (a
    # worker that trained little holds much of the initial ones: weighted by its few batches,
    # not equally, else the variances were up to 1.95x the data's, 2026-11-27)
    assert torch.allclose(bn.running_mean, h.mean(0), atol=0.25 * float(h.std(0).mean()))
    relative = (bn.running_var - h.var(0)).abs() / h.var(0)
    assert float(relative.max()) < 0.45 and float(relative.mean()) < 0.2, relative
    y = torch.as_tensor(y)

    def loss_in(mode: bool) -> float:
        model.train(mode)
        with torch.no_grad():
            return float(torch.nn.functional.cross_entropy(model(x), y))
    saved = bn.running_mean.clone(), bn.running_var.clone()
    train, evaluation = loss_in(True), loss_in(False)
    bn.running_mean.copy_(saved[0])                  # train mode moved them: put them back
    bn.running_var.copy_(saved[1])
    assert abs(evaluation - train) < 0.1 * train, (train, evaluation)


@pytest.mark.parametrize("partitions", [1, 2])
def test_downpour_returns_the_workers_running_statistics(spark, tmp_path, partitions):
    x, y = data(256)
    lines = []
    res = fit(frame(spark, x, y, [128, 128]), bn_net,
              strategy=Downpour(partitions=partitions), replicas=2 // partitions,
              batch_size=16, epochs=2, lr=0.05, run_dir=tmp_path / "run",
              validation=(x, y), log=lines.append)
    assert not any("running statistics" in line for line in lines)
    _check_statistics(res.model, x, y)
    if partitions == 2:
        assert res.info["model_parallel"]["kept_whole"] == ["1"]
    # the history validated the server's model with its statistics: the last epoch's score is
    # the returned model's
    res.model.eval()
    with torch.no_grad():
        acc = float((res.model(torch.as_tensor(x)).argmax(1) == torch.as_tensor(y))
                    .float().mean())
    assert res.history[-1]["val_accuracy"] == pytest.approx(acc, abs=0.05)
    assert acc > 0.4                                  # chance: 1/3


def test_boosting_returns_the_workers_running_statistics(spark, tmp_path):
    def probed_bn_net():
        class Probe(torch.nn.Module):
            """A buffer the workers give another shape: not reported, model_fn()'s kept."""

            def __init__(self):
                super().__init__()
                self.register_buffer("seen", torch.zeros(1))

            def forward(self, h):
                if self.training:
                    self.seen = h.detach().mean(0)          # (8,), no longer (1,)
                return h
        net = bn_net()
        return torch.nn.Sequential(*net[:3], Probe(), net[3])

    x, y = data(256, seed=1)
    # average=0: the returned parameters are the last values, as the statistics are (with the
    # averaged server they are not: docs/guides/boosting.md, "Known gap")
    res = fit(frame(spark, x, y, [128, 128]), probed_bn_net,
              strategy=Boosting(n_push=2, average=0),
              replicas=2, batch_size=16, epochs=2, lr=0.05, run_dir=tmp_path / "run",
              validation=(x, y), log=None)
    assert res.model[3].seen.tolist() == [0.0]
    _check_statistics(res.model, x, y)
    assert res.history[-1]["val_accuracy"] > 0.4      # chance: 1/3
