"""predict_udf: any trained module through predict_batch_udf, equal to calling it in-process."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from spark_dl.inference import predict_udf
from spark_dl.models import FCNet
from spark_dl.models.ssda import SSDA, LayerSpec
from spark_dl.superres.cascade import Cascade


def _frame(spark, x: np.ndarray, partitions: int = 2):
    rows = [(i, [float(v) for v in row]) for i, row in enumerate(x.reshape(len(x), -1))]
    return spark.createDataFrame(rows, "id long, x array<float>").repartition(partitions)


def test_classes_and_probabilities_equal_the_module_in_process(spark):
    torch.manual_seed(0)
    net = FCNet((12, 9, 3), act="sigmoid")
    x = np.random.default_rng(1).normal(size=(300, 12)).astype(np.float32)
    df = _frame(spark, x)
    out = df.select("id", predict_udf(net, (12,), output="class", batch_size=32)("x")
                    .alias("cls"),
                    predict_udf(net, (12,), output="probabilities")("x").alias("p")) \
        .orderBy("id").collect()
    with torch.no_grad():
        logits = net(torch.from_numpy(x))
    assert [r.cls for r in out] == logits.argmax(1).double().tolist()
    np.testing.assert_allclose(np.array([r.p for r in out]), torch.softmax(logits, 1).numpy(),
                               rtol=1e-5, atol=1e-6)


def test_super_resolution_cascade_on_image_tiles(spark):
    """Noisy LR tiles (16x16) -> HR tiles (32x32) through the whole cascade, per row."""
    torch.manual_seed(0)
    cascade = Cascade(16, 2, SSDA(256, (LayerSpec(64, 0.01, 0.05, 1e-4),
                                        LayerSpec(32, 0.0, 1.0, 1e-4)))).eval()
    tiles = np.random.default_rng(2).uniform(size=(40, 1, 16, 16)).astype(np.float32)
    out = _frame(spark, tiles).select("id", predict_udf(cascade, (1, 16, 16), batch_size=16)("x")
                                      .alias("hr")).orderBy("id").collect()
    hr = np.array([r.hr for r in out], dtype=np.float32)
    assert hr.shape == (40, 32 * 32)
    with torch.no_grad():
        want = cascade(torch.from_numpy(tiles)).reshape(40, -1).numpy()
    np.testing.assert_allclose(hr, want, rtol=1e-5, atol=1e-6)


def test_rows_of_the_wrong_length_fail_with_the_expected_shape(spark):
    net = FCNet((12, 3))
    df = _frame(spark, np.zeros((4, 10), np.float32), partitions=1)
    with pytest.raises(Exception, match=r"a row of 10 values, but the model takes "
                                        r"input_shape=\(12,\), 12 values per row"):
        df.select(predict_udf(net, (12,))("x")).collect()


def test_bad_arguments_are_refused_on_the_driver():
    net = FCNet((12, 3))
    with pytest.raises(ValueError, match=r"output must be one of .*got 'logits'"):
        predict_udf(net, (12,), output="logits")
    with pytest.raises(ValueError, match=r"input_shape must list positive sizes, got \(0, 12\)"):
        predict_udf(net, (0, 12))
