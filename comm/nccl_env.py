"""The NCCL environment of the runtime's GPU workers: the Ray executor sets it in its actors'
environment (runtime_env), before they make a communicator.

No NCCL reduction decides a bit in invariant mode: the TP sums all-gather every rank's part and
add them in rank order (comm/allreduce.py), the MoE exchange and the all-gathers move bytes
without arithmetic, and the all-reduces of counts add integers. So NCCL keeps its own choice of
algorithm, protocol and channel count, which sets the all_to_all's and all-gather's bandwidth.
Why not pinned to one channel, the Simple protocol and Tree (an earlier choice, for the
backend's own all-reduce): that cut every collective to one NVLink channel, the MoE exchange
too, and slowed fast mode's all-reduce, the baseline invariance is priced against, for no bit
of invariant mode. This module only returns the values; it never reads or writes os.environ.
"""

from __future__ import annotations

# Each entry: variable -> value, with why it is set.
_NCCL_ENV: dict[str, str] = {
    # The in-network reductions (NVLink SHARP, CollNet) are off: only fast mode's all-reduce
    # could take them, and the runtime has never run with either.
    "NCCL_NVLS_ENABLE": "0",
    "NCCL_COLLNET_ENABLE": "0",
}


def worker_nccl_env() -> dict[str, str]:
    """The NCCL variables (name -> value) a GPU worker runs with; a fresh copy."""
    return dict(_NCCL_ENV)
