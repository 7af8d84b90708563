"""The chunked GDN prefill kernels (ops/cuda/gdn_chunk.cu) compile for sm_90 without spilling, and the host's
shared-memory sizes are the kernel's own formulas (any machine with NVRTC; no GPU)."""

from __future__ import annotations

import re

import pytest
from test_cuda_compile import check_log, nvrtc_or_skip
from test_cuda_compile import ptx as compute_90_ptx


@pytest.mark.parametrize("opts", [("-DDT=0", "-DDK=128", "-DDV=128"), ("-DDT=2", "-DDK=128", "-DDV=128"),
                                  ("-DDT=1", "-DDK=20", "-DDV=12"), ("-DDT=0", "-DDK=64", "-DDV=32"),
                                  ("-DDT=0", "-DDK=16", "-DDV=16"),
                                  # the tf32 tensor-core build (precision="tf32")
                                  ("-DDT=0", "-DDK=128", "-DDV=128", "-DTC=1"),
                                  ("-DDT=2", "-DDK=128", "-DDV=128", "-DTC=1"),
                                  ("-DDT=1", "-DDK=16", "-DDV=12", "-DTC=1"),
                                  ("-DDT=0", "-DDK=64", "-DDV=32", "-DTC=1"),
                                  ("-DDT=0", "-DDK=192", "-DDV=64", "-DTC=1"),
                                  # the inverse-form tf32 build, 32-column state CTAs (precision="tf32_v2")
                                  ("-DDT=0", "-DDK=128", "-DDV=128", "-DTC=2"),
                                  ("-DDT=2", "-DDK=128", "-DDV=128", "-DTC=2"),
                                  ("-DDT=1", "-DDK=16", "-DDV=12", "-DTC=2"),
                                  ("-DDT=0", "-DDK=64", "-DDV=32", "-DTC=2"),
                                  ("-DDT=0", "-DDK=16", "-DDV=48", "-DTC=2"),
                                  ("-DDT=0", "-DDK=192", "-DDV=64", "-DTC=2"),
                                  # 64-column state CTAs (precision="tf32")
                                  ("-DDT=0", "-DDK=128", "-DDV=128", "-DTC=3"),
                                  ("-DDT=2", "-DDK=128", "-DDV=128", "-DTC=3"),
                                  ("-DDT=1", "-DDK=16", "-DDV=12", "-DTC=3"),
                                  ("-DDT=0", "-DDK=64", "-DDV=32", "-DTC=3"),
                                  ("-DDT=0", "-DDK=16", "-DDV=48", "-DTC=3"),
                                  ("-DDT=0", "-DDK=192", "-DDV=64", "-DTC=3")])
def test_chunk_kernels_compile_without_spills(opts: tuple[str, ...]) -> None:
    nvrtc_or_skip()
    from hybrid_runtime.cuda.kernels import compile_log, source

    log = compile_log(source("gdn_chunk.cu"), "gdn_chunk.cu", opts, "sm_90")
    assert "gdn_chunk_prep" in log and "gdn_chunk_state" in log
    check_log(log)
    ptx = compute_90_ptx(source("gdn_chunk.cu"), "gdn_chunk.cu", opts)
    tc = "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32" in ptx and "cvt.rna.tf32.f32" in ptx
    tc_build = next((int(o[5:]) for o in opts if o.startswith("-DTC=")), 0)
    assert tc == (tc_build > 0)  # the tf32 builds issue tf32 mma; the fp32 build none
    assert ("ldmatrix" in ptx) == (tc_build >= 2)
    if tc_build >= 2 and "-DDK=128" in opts:  # two prep CTAs per SM: <= 128 registers
        regs = dict(re.findall(r"Compiling entry function '(\w+)'.*?Used (\d+) registers", log, re.S))
        assert int(regs["gdn_chunk_prep"]) <= 128, log


def test_tf32_build_refuses_head_dims_off_16() -> None:
    nvrtc_or_skip()
    from hybrid_runtime.cuda.kernels import compile_log, source

    for tc in (1, 2, 3):
        with pytest.raises(Exception, match="DK % 16"):
            compile_log(source("gdn_chunk.cu"), "gdn_chunk.cu", ("-DDK=20", "-DDV=12", f"-DTC={tc}"), "sm_90")


@pytest.mark.parametrize("tc", [0, 1, 2, 3])
@pytest.mark.parametrize("dk", [16, 20, 64, 128, 192])
def test_host_shared_memory_matches_the_kernel_macros(dk: int, tc: int) -> None:
    from hybrid_runtime.cuda.gdn import chunk_prep_smem, chunk_state_smem
    from hybrid_runtime.cuda.kernels import source

    src = source("gdn_chunk.cu")
    dv = {20: 12, 192: 64}.get(dk, dk)
    env: dict[str, int] = {"CH": 64, "BV": 32, "DK": dk, "DV": dv, "TC": tc}

    def macro(name: str) -> int:
        expr = re.search(rf"#define {name} (.*?)(?://|$)", src, re.M).group(1)  # type: ignore[union-attr]
        return int(eval(expr.replace("/", "//"), {}, env))  # our own source; names limited to env; C division

    for name in ("DKP", "WST", "KST", "AST", "VST", "DVP", "PKS", "PVS", "PAS", "BW", "SST", "UST", "VTS"):
        env[name] = macro(name)
    env["PQV"] = max(env["PKS"], env["PVS"])  # (PKS > PVS ? PKS : PVS)
    if tc >= 2:  # the second PREP_FLOATS definition (inside #if TC >= 2) comes first in the source
        prep = re.search(r"#if TC >= 2\n.*?#define PREP_FLOATS (.*?)\n#else\n#define PREP_FLOATS (.*?)\n", src, re.S)
        prep_floats = int(eval(prep.group(1).replace("/", "//"), {}, env))  # type: ignore[union-attr]
    else:
        prep = re.search(r"#else\n#define PREP_FLOATS (.*?)\n#endif", src)
        prep_floats = int(eval(prep.group(1), {}, env))  # type: ignore[union-attr]
    precision = {0: "fp32", 1: "tf32_v1", 2: "tf32_v2", 3: "tf32"}[tc]
    assert chunk_prep_smem(dk, precision, dv) == 4 * prep_floats
    state = {0: "STATE_FLOATS", 1: "STATE_FLOATS_TC", 2: "STATE_FLOATS_TC", 3: "STATE_FLOATS_TC3"}[tc]
    assert chunk_state_smem(dk, precision) == 4 * macro(state)
    if dk == 128:  # all fit the H200's 227 KB; the tf32 prep fits twice per SM
        want = {0: (83_968, 157_696), 1: (85_504, 173_056), 2: (104_960, 173_056), 3: (104_960, 208_896)}[tc]
        assert (chunk_prep_smem(dk, precision, dv), chunk_state_smem(dk, precision)) == want


def test_workspace_bytes_formula() -> None:
    from hybrid_runtime.cuda.gdn import CudaGdn

    g = CudaGdn.__new__(CudaGdn)  # the formula needs only the head shape
    g.nv, g.dk, g.dv = 32, 128, 128
    assert g.workspace_bytes(8192) == 4 * 8192 * 32 * (128 + 128 + 64 + 4) == 324 * 2**20
    w, u, a, s = g.workspace_views(1 << 20, 100)
    assert (u - w, a - u, s - a) == (4 * 100 * 32 * 128, 4 * 100 * 32 * 128, 4 * 100 * 32 * 64)
    assert all(p % 16 == 0 for p in (w, u, a, s))


def test_state_columns_per_build() -> None:
    """The state grid's x follows the build: 64 columns per CTA for "tf32" (BW), 32 for the others (BV)."""
    from hybrid_runtime.cuda.gdn import PRECISIONS, TC_BUILD, chunk_cols
    from hybrid_runtime.cuda.kernels import source

    src = source("gdn_chunk.cu")
    bw = int(re.search(r"#define BW (\d+)", src).group(1))  # type: ignore[union-attr]
    bv = int(re.search(r"#define BV (\d+)", src).group(1))  # type: ignore[union-attr]
    assert {p: chunk_cols(p) for p in PRECISIONS} == {p: bw if TC_BUILD[p] == 3 else bv for p in PRECISIONS}
