"""Data in Spark: MNIST and extended MNIST, text corpora, image folders, Parquet shards, and
the partition -> torch mini-batch bridge."""

from .bridge import ShardData, column_to_numpy
from .distort import Distortion, distort_range
from .idx import load_mnist, read_idx
from .images import decode_image, read_images
from .mnist import (arrays_to_arrow, extended_mnist, mnist_dataframe, mnist_file_dataframe,
                    mnist_split, pixels_to_arrow)
from .shards import read_shards, shard_files, write_shards
from .stream import StreamShard, open_shard
from .text import CharVocab, char_windows, text_vocab, text_windows_dataframe

__all__ = ["ShardData", "StreamShard", "open_shard", "pixels_to_arrow", "column_to_numpy", "Distortion", "distort_range", "load_mnist",
           "read_idx", "decode_image", "read_images", "arrays_to_arrow", "extended_mnist",
           "mnist_dataframe", "mnist_file_dataframe", "mnist_split", "read_shards", "shard_files",
           "write_shards",
           "CharVocab", "char_windows", "text_vocab", "text_windows_dataframe"]
