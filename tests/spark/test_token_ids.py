"""Integer feature columns reach the model as int64, exact (token ids of 2^24 + 1 and above,
which float32 would round), and the zoo's transformer trains on token ids from a DataFrame."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from spark_dl import fit
from spark_dl.data import CharVocab, char_windows, text_windows_dataframe
from spark_dl.inference import predict_udf
from spark_dl.models import build_model

K = 8                                   # the ids of a row: base, base + 1, ..., base + K - 1


class IdProbe(nn.Module):
    """Embeds ids base..base + K - 1; in training, every batch must arrive as int64 holding
    exactly those ids (a float32 trip would have rounded base + 1 to base + 2, or failed
    in the embedding)."""

    def __init__(self, base: int):
        super().__init__()
        self.base = base
        self.emb = nn.Embedding(K, 4)
        self.head = nn.Linear(4, 2)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.training:
            seen = sorted(set(ids.unique().tolist()))
            if ids.dtype != torch.int64 or seen != list(range(self.base, self.base + K)):
                raise AssertionError(f"ids arrived as {ids.dtype}: {seen}")
        return self.head(self.emb((ids - self.base).clamp(0, K - 1)).mean(1))


@pytest.mark.parametrize("strategy,kind,base", [("allreduce", "int", 2**24 + 1),
                                                ("downpour", "bigint", 2**53 + 1)])
def test_integer_ids_arrive_exact_in_the_model(spark, tmp_path, strategy, kind, base):
    g = np.random.default_rng(0)
    ids = base + np.argsort(g.random((32, K)), axis=1)             # each row: the K ids
    rows = [([int(v) for v in r], int(r[0] % 2)) for r in ids]
    df = spark.createDataFrame(rows, f"features array<{kind}>, label long").repartition(2)
    res = fit(df, lambda: IdProbe(base), strategy=strategy, shape=(K,), num_classes=2,
              epochs=1, batch_size=8, lr=0.1, validation=(ids[:8], ids[:8, 0] % 2),
              run_dir=tmp_path / "run", log=None, progress=False)
    assert res.history[0]["samples"] == 32 and np.isfinite(res.history[0]["val_loss"])


def test_the_transformer_learns_token_ids_from_a_dataframe(spark, tmp_path):
    text = "the cat sat on the mat; the dog lay on the log. " * 24
    (tmp_path / "t.txt").write_text(text)
    vocab = CharVocab.from_text(text)
    T = 16
    _, df = text_windows_dataframe(spark, str(tmp_path / "t.txt"), T, vocab, stride=4)
    vx, vy = char_windows(vocab.encode(text[:400]), T, stride=8)
    V = len(vocab)

    def model():
        return build_model("transformer", vocab=V, layers=1, width=32, heads=2, context=T,
                           dropout=0.0)
    res = fit(df, model, features="input", label="target", shape=(T,), label_shape=(T,),
              loss="sequence_cross_entropy", optimizer="adam", lr=3e-3, epochs=2,
              batch_size=16, validation=(vx, vy), run_dir=tmp_path / "run", log=None,
              progress=False)
    first, second = res.history
    assert second["loss"] < first["loss"] < np.log(V) + 0.5
    assert second["val_loss"] < first["val_loss"] < np.log(V)
    # the same ids through predict_udf: (T, V) logits per row, as the model gives in-process
    some = [r.input for r in df.limit(4).collect()]
    out = spark.createDataFrame([(r,) for r in some], "input array<int>") \
        .select(predict_udf(res.model, (T,))("input").alias("y")).collect()
    with torch.no_grad():
        want = res.model.eval()(torch.tensor(some))
    np.testing.assert_allclose(np.array([r.y for r in out]), want.reshape(4, -1).numpy(),
                               rtol=1e-4, atol=1e-5)
