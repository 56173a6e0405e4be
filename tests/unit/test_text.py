import numpy as np
import pytest

from spark_dl.data import CharVocab, char_windows
from spark_dl.errors import DataError


def test_encode_decode_round_trip_with_unicode():
    text = "To be, or not to be — ça?\n"
    v = CharVocab.from_text(text)
    ids = v.encode(text)
    assert ids.dtype == np.int64 and ids.max() == len(v) - 1
    assert v.decode(ids) == text
    assert CharVocab.from_json(v.to_json()) == v


def test_unknown_character_and_empty_vocabulary():
    v = CharVocab.from_text("abc")
    with pytest.raises(DataError, match="'z' at position 2 is not in the vocabulary"):
        v.encode("abz")
    with pytest.raises(DataError, match="vocabulary is empty"):
        CharVocab.from_text("")


def test_windows_shift_targets_by_one():
    ids = np.arange(11)
    x, y = char_windows(ids, T=3)
    assert x.tolist() == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    np.testing.assert_array_equal(y, x + 1)
    x2, _ = char_windows(ids, T=3, stride=1)
    assert len(x2) == 8 and x2[-1].tolist() == [7, 8, 9]
    assert char_windows(np.arange(3), T=5)[0].shape == (0, 5)
    with pytest.raises(ValueError, match="T must be >= 1"):
        char_windows(ids, T=0)
