"""Dataset readers and client partitions."""

from .partition import label_skew, partition_dirichlet, partition_iid
from .readers import (
    DataError,
    Dataset,
    DataWarning,
    check_arrays,
    dataset_from_arrays,
    load_dataset,
    read_idx,
    sample_shape,
)

__all__ = ["DataError", "DataWarning", "Dataset", "check_arrays", "dataset_from_arrays", "label_skew", "load_dataset",
           "partition_dirichlet", "partition_iid", "read_idx", "sample_shape"]
