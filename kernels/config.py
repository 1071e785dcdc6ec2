"""KernelConfig: the small config the kernel layer consumes.

`mode` picks between the batch-invariant implementations and plain torch ("fast", used for
speed and as the negative control of every invariance test). `num_threads` is the intra-op
thread count of a worker: part of the layout, never of the load. `tile_rows` is the fixed
row count every CPU BLAS call and row reduction is padded to.
"""

from __future__ import annotations

from dataclasses import dataclass

MODES = ("invariant", "fast")


@dataclass(frozen=True)
class KernelConfig:
    mode: str = "invariant"
    num_threads: int = 1
    tile_rows: int = 16

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"kernels.mode must be one of {MODES}, got {self.mode!r}")
        if not isinstance(self.num_threads, int) or self.num_threads < 1:
            raise ValueError(f"kernels.num_threads must be an int >= 1, got {self.num_threads!r}")
        if not isinstance(self.tile_rows, int) or self.tile_rows < 1:
            raise ValueError(f"kernels.tile_rows must be an int >= 1, got {self.tile_rows!r}")

    @property
    def is_invariant(self) -> bool:
        return self.mode == "invariant"
