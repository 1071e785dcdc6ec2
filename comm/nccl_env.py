"""NCCL environment that pins the all-reduce reduction order; launch/ sets it before workers start.

NCCL picks algorithm (Ring, Tree, NVLS, CollNet), protocol and channel count per call from the
message size, and each choice sums an element's contributions in a different order. With one
channel, the Simple protocol and the Tree algorithm, each element is reduced along one fixed
chain/tree of ranks whatever the message length. Ring is not enough: its chunk boundaries, and
so which rank starts each element's sum, move with the message size. This module only returns
the values; it never reads or writes os.environ (launch/ owns the environment).
"""

from __future__ import annotations

# Each entry: variable -> value, with why it is pinned.
_PINNED_NCCL_ENV: dict[str, str] = {
    # One all-reduce algorithm for every size; Tree's reduction order follows the tree, not the
    # chunking. Per-function form: a bare "Tree" also applies to all-gather, which has no Tree
    # implementation, and NCCL then refuses every all-gather (seen on 2 H200s).
    "NCCL_ALGO": "allreduce:tree",
    # One protocol: LL/LL128 are chosen for small messages and change the pipelining.
    "NCCL_PROTO": "Simple",
    # One channel: with several, a message is split across channels at size-dependent offsets.
    "NCCL_MIN_NCHANNELS": "1",
    "NCCL_MAX_NCHANNELS": "1",
    # No NVLink SHARP / in-switch reduction (its order is the switch's, not ours).
    "NCCL_NVLS_ENABLE": "0",
    # No CollNet (in-network reduction on SHARP-capable fabrics).
    "NCCL_COLLNET_ENABLE": "0",
}


def pinned_nccl_env() -> dict[str, str]:
    """The NCCL variables (name -> value) that pin the all-reduce order; a fresh copy."""
    return dict(_PINNED_NCCL_ENV)
