import numpy as np

from spark_dl.data import CharVocab, text_vocab, text_windows_dataframe

from ..conftest import ROOT

SHAKESPEARE = ROOT / "data" / "text" / "tinyshakespeare.txt"


def test_vocab_of_tinyshakespeare_computed_on_executors(spark):
    v = text_vocab(spark, str(SHAKESPEARE))
    assert len(v) == 65 and v == CharVocab.from_text(SHAKESPEARE.read_text())


def test_windows_dataframe(spark, tmp_path):
    text = "hello world, hello spark. " * 20
    (tmp_path / "t.txt").write_text(text)
    vocab, df = text_windows_dataframe(spark, str(tmp_path / "t.txt"), T=10, partitions=3)
    rows = df.collect()
    assert len(rows) == (len(text) - 1 - 10) // 10 + 1 and df.rdd.getNumPartitions() == 3
    for r in rows:
        assert len(r.input) == 10 and r.target[:-1] == r.input[1:]
        decoded = vocab.decode(r.input)
        assert decoded in text
    ids = vocab.encode(text)
    expected = {tuple(ids[i:i + 10]) for i in range(0, len(ids) - 10, 10)}
    assert {tuple(r.input) for r in rows} == expected
    assert np.all(np.array([r.input for r in rows]) < len(vocab))


def test_empty_text_file_has_a_clear_error(spark, tmp_path):
    import pytest

    from spark_dl.errors import DataError
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(DataError, match="vocabulary is empty"):
        text_vocab(spark, str(tmp_path / "empty.txt"))
