"""bench/gluon_ws_attention.py without a GPU: its warp-specialised kernel still compiles for
sm_90 from this machine's Triton, inside the GPU's shared memory, so the figures it made
(BENCHMARKS.md) can be re-run. Its results are checked on the GPU by the script itself."""

from __future__ import annotations

import pytest

from bench.gluon_ws_attention import compile_sm90
from tests.test_gluon_attention import SM90_SHARED_BYTES


@pytest.mark.parametrize("write_out", (False, True))
def test_warp_specialised_form_compiles_for_sm90(write_out):
    shared, used = compile_sm90(write_out)
    assert 0 < shared <= SM90_SHARED_BYTES, shared
    assert "registers" in used, used
