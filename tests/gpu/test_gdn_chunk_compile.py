"""The chunked GDN prefill kernels (ops/cuda/gdn_chunk.cu) compile for sm_90 without spilling, and the host's
shared-memory sizes are the kernel's own formulas (any machine with NVRTC; no GPU)."""

from __future__ import annotations

import re

import pytest
from test_cuda_compile import check_log, nvrtc_or_skip


@pytest.mark.parametrize("opts", [("-DDT=0", "-DDK=128", "-DDV=128"), ("-DDT=2", "-DDK=128", "-DDV=128"),
                                  ("-DDT=1", "-DDK=20", "-DDV=12"), ("-DDT=0", "-DDK=64", "-DDV=32"),
                                  ("-DDT=0", "-DDK=16", "-DDV=16")])
def test_chunk_kernels_compile_without_spills(opts: tuple[str, ...]) -> None:
    nvrtc_or_skip()
    from hybrid_runtime.cuda.kernels import compile_log, source

    log = compile_log(source("gdn_chunk.cu"), "gdn_chunk.cu", opts, "sm_90")
    assert "gdn_chunk_prep" in log and "gdn_chunk_state" in log
    check_log(log)


@pytest.mark.parametrize("dk", [16, 20, 64, 128, 192])
def test_host_shared_memory_matches_the_kernel_macros(dk: int) -> None:
    from hybrid_runtime.cuda.gdn import chunk_prep_smem, chunk_state_smem
    from hybrid_runtime.cuda.kernels import source

    src = source("gdn_chunk.cu")
    env = {"CH": 64, "BV": 32, "DK": dk, "DKP": dk + 1}

    def macro(name: str) -> int:
        expr = re.search(rf"#define {name} (.*)", src).group(1)  # type: ignore[union-attr]
        return int(eval(expr, {}, env))  # our own source; names limited to env

    assert chunk_prep_smem(dk) == 4 * macro("PREP_FLOATS")
    assert chunk_state_smem(dk) == 4 * macro("STATE_FLOATS")
    if dk == 128:
        assert (chunk_prep_smem(dk), chunk_state_smem(dk)) == (83_968, 157_696)  # both fit the H200's 227 KB


def test_workspace_bytes_formula() -> None:
    from hybrid_runtime.cuda.gdn import CudaGdn

    g = CudaGdn.__new__(CudaGdn)  # the formula needs only the head shape
    g.nv, g.dk, g.dv = 32, 128, 128
    assert g.workspace_bytes(8192) == 4 * 8192 * 32 * (128 + 128 + 64 + 4) == 324 * 2**20
    w, u, a, s = g.workspace_views(1 << 20, 100)
    assert (u - w, a - u, s - a) == (4 * 100 * 32 * 128, 4 * 100 * 32 * 128, 4 * 100 * 32 * 64)
    assert all(p % 16 == 0 for p in (w, u, a, s))
