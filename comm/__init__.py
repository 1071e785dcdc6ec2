"""Communication layer: process groups, MoE dispatch/combine, TP all-reduce, NCCL pinning.

Imports only `moe_kernels` and `comm`; never eplb, moe_runtime, launch or ray, and never reads
environment variables: every value arrives as an argument.
"""

from comm.allreduce import all_gather, all_reduce
from comm.capacity_dispatch import FixedCapacityDispatcher
from comm.config import ParallelConfig
from comm.deepep_dispatch import DeepEPDispatcher
from comm.dispatch import (
    AllToAllDispatcher,
    DispatchHandle,
    LocalDispatcher,
    sort_rows_by_destination,
)
from comm.errors import CollectiveError
from comm.groups import (
    ProcessGroups,
    destroy_process_groups,
    get_process_groups,
    init_process_groups,
)
from comm.nccl_env import worker_nccl_env

__all__ = [
    "AllToAllDispatcher",
    "CollectiveError",
    "DeepEPDispatcher",
    "DispatchHandle",
    "FixedCapacityDispatcher",
    "LocalDispatcher",
    "ParallelConfig",
    "ProcessGroups",
    "all_gather",
    "all_reduce",
    "destroy_process_groups",
    "get_process_groups",
    "init_process_groups",
    "worker_nccl_env",
    "sort_rows_by_destination",
]
