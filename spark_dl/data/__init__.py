"""Data in Spark: MNIST and extended MNIST, text corpora, image folders, Parquet shards, and
the partition -> torch mini-batch bridge."""

from .bridge import ShardData, column_to_numpy
from .distort import Distortion, distort_range
from .idx import load_mnist, read_idx
from .images import decode_image, read_images
from .mnist import (
    arrays_to_arrow,
    extended_mnist,
    mnist_dataframe,
    mnist_file_dataframe,
    mnist_split,
    pixels_to_arrow,
)
from .shards import read_shards, shard_files, write_shards
from .stream import StreamShard, open_shard
from .text import CharVocab, char_windows, text_vocab, text_windows_dataframe

__all__ = ["CharVocab", "Distortion", "ShardData", "StreamShard", "arrays_to_arrow", "char_windows",
           "column_to_numpy", "decode_image", "distort_range", "extended_mnist", "load_mnist",
           "mnist_dataframe", "mnist_file_dataframe", "mnist_split", "open_shard",
           "pixels_to_arrow", "read_idx", "read_images", "read_shards", "shard_files", "text_vocab",
           "text_windows_dataframe", "write_shards"]
