"""Character-level text corpora for the RNN/LSTM work.

``CharVocab`` maps characters to ids; ``char_windows`` cuts an id sequence into
(input, target) windows of length T with the target shifted by one character;
``text_windows_dataframe`` does the same inside the executors for text files read by Spark.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator

import numpy as np
import pyarrow as pa

from ..errors import DataError

__all__ = ["CharVocab", "char_windows", "text_vocab", "text_windows_dataframe"]


class CharVocab:
    """An ordered set of characters; id i <-> ``chars[i]``."""

    def __init__(self, chars: Iterable[str]):
        chars = list(chars)
        if not chars:
            raise DataError("the vocabulary is empty: the corpus holds no characters; "
                            "check the text file is not empty")
        if any(len(c) != 1 for c in chars) or len(set(chars)) != len(chars):
            raise ValueError("vocabulary entries must be distinct single characters")
        self.chars = chars
        self._index = {c: i for i, c in enumerate(chars)}
        self._table = None

    @classmethod
    def from_text(cls, text: str) -> CharVocab:
        return cls(sorted(set(text)))

    def __len__(self) -> int:
        return len(self.chars)

    def __eq__(self, other) -> bool:
        return isinstance(other, CharVocab) and other.chars == self.chars

    __hash__ = None                 # as __eq__ alone would leave it: not hashable

    def encode(self, text: str) -> np.ndarray:
        """text -> int64 ids; a character outside the vocabulary is a DataError."""
        codes = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
        if self._table is None:
            top = max(ord(c) for c in self.chars) + 1
            self._table = np.full(top, -1, np.int64)
            self._table[[ord(c) for c in self.chars]] = np.arange(len(self.chars))
        ids = np.full(len(codes), -1, np.int64)
        inside = codes < len(self._table)
        ids[inside] = self._table[codes[inside]]
        bad = np.flatnonzero(ids < 0)
        if len(bad):
            p = int(bad[0])
            raise DataError(f"character {text[p]!r} at position {p} is not in the vocabulary "
                            f"of {len(self)} characters; build the vocabulary from this corpus")
        return ids

    def decode(self, ids: Iterable[int]) -> str:
        return "".join(self.chars[int(i)] for i in ids)

    def to_json(self) -> str:
        return json.dumps({"chars": self.chars})

    @classmethod
    def from_json(cls, s: str) -> CharVocab:
        return cls(json.loads(s)["chars"])


def char_windows(ids: np.ndarray, T: int, stride: int | None = None):
    """ids (n,) -> inputs (w, T), targets (w, T) with targets[k, t] = ids[start_k + t + 1]."""
    if T < 1:
        raise ValueError(f"window length T must be >= 1, got {T}")
    stride = stride or T
    w = max(0, (len(ids) - 1 - T) // stride + 1)
    starts = np.arange(w) * stride
    idx = starts[:, None] + np.arange(T)[None, :]
    return ids[idx], ids[idx + 1]


def text_vocab(spark, path: str) -> CharVocab:
    """The vocabulary of text file(s) at ``path``, computed in the executors."""
    def _chars_task(batches):
        for b in batches:
            chars = set()
            for t in b.column(0).to_pylist():
                chars.update(t or "")
            yield pa.RecordBatch.from_pydict({"c": sorted(chars)},
                                             schema=pa.schema([("c", pa.string())]))

    rows = spark.read.text(path, wholetext=True).mapInArrow(_chars_task, "c string").distinct()
    return CharVocab(sorted(r.c for r in rows.collect()))


def text_windows_dataframe(spark, path: str, T: int, vocab: CharVocab | None = None,
                           stride: int | None = None, partitions: int = 2):
    """(vocab, DataFrame[input array<int>, target array<int>]) of windows of length T."""
    vocab = vocab or text_vocab(spark, path)
    chars = vocab.to_json()

    def _windows_task(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        v = CharVocab.from_json(chars)
        for b in batches:
            for t in b.column(0).to_pylist():
                x, y = char_windows(v.encode(t or ""), T, stride)
                if len(x) == 0:
                    continue
                off = pa.array(np.arange(0, (len(x) + 1) * T, T, dtype=np.int32))
                yield pa.RecordBatch.from_arrays(
                    [pa.ListArray.from_arrays(off, pa.array(x.ravel().astype(np.int32))),
                     pa.ListArray.from_arrays(off, pa.array(y.ravel().astype(np.int32)))],
                    ["input", "target"])

    df = spark.read.text(path, wholetext=True).mapInArrow(
        _windows_task, "input array<int>, target array<int>")
    return vocab, df.repartition(partitions)
