"""Model parallelism by column partitioning (the thesis's distributed backpropagation)."""

from .comm import Comm, CountingComm, split_sizes
from .layers import (ColumnConv2d, ColumnDenoisingLayer, ColumnLinear, ColumnLSTM, ColumnRNN,
                     kept_whole, merge_partitions, parameter_bytes, partition_model)
from .mappings import copy_to_partitions, gather_from_partitions
from .thesis import ThesisFC, fc_activation

__all__ = ["Comm", "CountingComm", "split_sizes", "ColumnLinear", "ColumnConv2d", "ColumnLSTM",
           "ColumnRNN", "ColumnDenoisingLayer", "kept_whole",
           "partition_model", "merge_partitions", "parameter_bytes", "copy_to_partitions",
           "gather_from_partitions", "ThesisFC", "fc_activation"]
