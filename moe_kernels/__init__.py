"""Kernel layer: every reducing op as a batch-invariant reference and a plain-torch fast path.

Callers pick implementations only through `build_op_table`; nothing here imports from the
layers above (comm, eplb, moe_runtime, launch).
"""

from moe_kernels.config import KernelConfig
from moe_kernels.op_table import OpTable, build_op_table, pin_threads

__all__ = ["KernelConfig", "OpTable", "build_op_table", "pin_threads"]
