"""Model parallelism by column partitioning (the thesis's distributed backpropagation)."""

from .comm import Comm, CountingComm, split_sizes
from .layers import (
    ColumnConv2d,
    ColumnDenoisingLayer,
    ColumnLinear,
    ColumnLSTM,
    ColumnRNN,
    kept_whole,
    merge_partitions,
    parameter_bytes,
    partition_model,
)
from .mappings import copy_to_partitions, gather_from_partitions
from .master import MasterBackpropFC, fc_activation

__all__ = ["ColumnConv2d", "ColumnDenoisingLayer", "ColumnLSTM", "ColumnLinear", "ColumnRNN",
           "Comm", "CountingComm", "MasterBackpropFC", "copy_to_partitions", "fc_activation",
           "gather_from_partitions", "kept_whole", "merge_partitions", "parameter_bytes",
           "partition_model", "split_sizes"]
