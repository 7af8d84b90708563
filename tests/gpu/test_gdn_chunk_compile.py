"""The chunked GDN prefill kernels (ops/cuda/gdn_chunk.cu) compile for sm_90 without spilling, and the host's
shared-memory sizes are the kernel's own formulas (any machine with NVRTC; no GPU)."""

from __future__ import annotations

import itertools
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
                                  ("-DDT=0", "-DDK=192", "-DDV=64", "-DTC=3"),
                                  # bf16 state pass split in two (precision="bf16")
                                  ("-DDT=0", "-DDK=128", "-DDV=128", "-DTC=4"),
                                  ("-DDT=2", "-DDK=128", "-DDV=128", "-DTC=4"),
                                  ("-DDT=0", "-DDK=64", "-DDV=32", "-DTC=4"),
                                  ("-DDT=0", "-DDK=16", "-DDV=96", "-DTC=4"),
                                  ("-DDT=0", "-DDK=192", "-DDV=64", "-DTC=4")])
def test_chunk_kernels_compile_without_spills(opts: tuple[str, ...]) -> None:
    nvrtc_or_skip()
    from hybrid_runtime.cuda.kernels import compile_log, source

    log = compile_log(source("gdn_chunk.cu"), "gdn_chunk.cu", opts, "sm_90")
    tc_build = next((int(o[5:]) for o in opts if o.startswith("-DTC=")), 0)
    kernels = ("gdn_chunk_prep", *(("gdn_chunk_h", "gdn_chunk_o") if tc_build == 4 else ("gdn_chunk_state",)))
    assert all(k in log for k in kernels)
    check_log(log)
    ptx = compute_90_ptx(source("gdn_chunk.cu"), "gdn_chunk.cu", opts)
    tc = "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32" in ptx and "cvt.rna.tf32.f32" in ptx
    # the bf16 build's state pass and output on bf16 tensor cores (its prep stays tf32)
    assert ("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32" in ptx) == (tc_build == 4)
    assert tc == (tc_build > 0)  # the tf32 builds issue tf32 mma; the fp32 build none
    assert ("ldmatrix" in ptx) == (tc_build >= 2)
    if tc_build >= 2 and "-DDK=128" in opts:  # two prep CTAs per SM: <= 128 registers
        regs = dict(re.findall(r"Compiling entry function '(\w+)'.*?Used (\d+) registers", log, re.S))
        assert int(regs["gdn_chunk_prep"]) <= 128, log
        if tc_build == 4:  # two CTAs of each of the bf16 kernels per SM
            assert int(regs["gdn_chunk_h"]) <= 128 and int(regs["gdn_chunk_o"]) <= 128, log


def test_tf32_build_refuses_head_dims_off_16() -> None:
    nvrtc_or_skip()
    from hybrid_runtime.cuda.kernels import compile_log, source

    for tc in (1, 2, 3, 4):
        with pytest.raises(Exception, match="DK % 16"):
            compile_log(source("gdn_chunk.cu"), "gdn_chunk.cu", ("-DDK=20", "-DDV=12", f"-DTC={tc}"), "sm_90")
    with pytest.raises(Exception, match="DV % 32"):
        compile_log(source("gdn_chunk.cu"), "gdn_chunk.cu", ("-DDK=16", "-DDV=48", "-DTC=4"), "sm_90")


@pytest.mark.parametrize("tc", [0, 1, 2, 3, 4])
@pytest.mark.parametrize("dk", [16, 20, 64, 128, 192])
def test_host_shared_memory_matches_the_kernel_macros(dk: int, tc: int) -> None:
    from hybrid_runtime.cuda.gdn import chunk_out_smem, chunk_prep_smem, chunk_state_smem
    from hybrid_runtime.cuda.kernels import source

    src = source("gdn_chunk.cu")
    dv = {20: 12, 192: 64}.get(dk, dk)
    env: dict[str, int] = {"CH": 64, "BV": 32, "DK": dk, "DV": dv, "TC": tc}

    def macro(name: str) -> int:
        expr = re.search(rf"#define {name} (.*?)(?://|$)", src, re.M).group(1)  # type: ignore[union-attr]
        return int(eval(expr.replace("/", "//"), {}, env))  # our own source; names limited to env; C division

    for name in ("DKP", "WST", "KST", "AST", "VST", "DVP", "PKS", "PVS", "PAS", "BW", "SST", "UST", "VTS", "HB", "HKS",
                 "HUS", "HSS", "HOS", "HAS"):
        env[name] = macro(name)
    env["PQV"] = max(env["PKS"], env["PVS"])  # (PKS > PVS ? PKS : PVS)
    if tc >= 2:  # the second PREP_FLOATS definition (inside #if TC >= 2) comes first in the source
        prep = re.search(r"#if TC >= 2\n.*?#define PREP_FLOATS (.*?)\n#else\n#define PREP_FLOATS (.*?)\n", src, re.S)
        prep_floats = int(eval(prep.group(1).replace("/", "//"), {}, env))  # type: ignore[union-attr]
    else:
        prep = re.search(r"#else\n#define PREP_FLOATS (.*?)\n#endif", src)
        prep_floats = int(eval(prep.group(1), {}, env))  # type: ignore[union-attr]
    precision = {0: "fp32", 1: "tf32_v1", 2: "tf32_v2", 3: "tf32", 4: "bf16"}[tc]
    assert chunk_prep_smem(dk, precision, dv) == 4 * prep_floats
    if tc == 4:  # byte sizes (bf16 and float32 regions)
        assert chunk_state_smem(dk, precision) == macro("H_SMEM")
        assert chunk_out_smem(dk, dv) == macro("O_SMEM")
    else:
        state = {0: "STATE_FLOATS", 1: "STATE_FLOATS_TC", 2: "STATE_FLOATS_TC", 3: "STATE_FLOATS_TC3"}[tc]
        assert chunk_state_smem(dk, precision) == 4 * macro(state)
    if dk == 128:  # all fit the H200's 227 KB; the tf32 prep fits twice per SM, as do both bf16 kernels
        want = {0: (83_968, 157_696), 1: (85_504, 173_056), 2: (104_960, 173_056), 3: (104_960, 208_896),
                4: (104_960, 107_520)}[tc]
        assert (chunk_prep_smem(dk, precision, dv), chunk_state_smem(dk, precision)) == want
        if tc == 4:
            assert chunk_out_smem(dk, dv) == 79_872


def test_workspace_bytes_formula() -> None:
    from hybrid_runtime.cuda.gdn import CudaGdn

    g = CudaGdn.__new__(CudaGdn)  # the formula needs only the head shape and the build
    g.nk, g.nv, g.dk, g.dv, g.precision = 16, 32, 128, 128, "tf32"
    assert g.workspace_bytes(8192) == 4 * 8192 * 32 * (128 + 128 + 64 + 4) == 324 * 2**20
    assert g.workspace_bytes(8192, 8) == g.workspace_bytes(8192)  # sequences count only in the bf16 build
    w, u, a, s = g.workspace_views(1 << 20, 100)
    assert (u - w, a - u, s - a) == (4 * 100 * 32 * 128, 4 * 100 * 32 * 128, 4 * 100 * 32 * 64)
    assert all(p % 16 == 0 for p in (w, u, a, s))
    g.precision = "bf16"
    per_token = 2 * 32 * 128 + 4 * 32 * 128 + 2 * 32 * 64 + 16 * 32 + 4 * 16 * 128 + 2 * 32 * 128
    per_chunk = 2 * 32 * 128 * 128
    assert g.workspace_bytes(8192, 1) == 8192 * per_token + (128 + 1) * per_chunk == 485 * 2**20  # as documented
    assert g.workspace_bytes(100, 3) == 100 * per_token + (2 + 3) * per_chunk
    views = g.workspace_views(1 << 20, 100)
    sizes = [b - a for a, b in itertools.pairwise(views)]
    assert sizes == [100 * 2 * 32 * 128, 100 * 4 * 32 * 128, 100 * 2 * 32 * 64, 100 * 16 * 32, 100 * 4 * 16 * 128,
                     100 * 2 * 32 * 128]
    assert all(p % 16 == 0 for p in views)
    assert views[-1] - views[0] + (2 + 3) * per_chunk == g.workspace_bytes(100, 3)


def test_state_columns_per_build() -> None:
    """The state grid's x follows the build: 64 columns per CTA for "tf32" (BW), 32 for the others (BV)."""
    from hybrid_runtime.cuda.gdn import PRECISIONS, TC_BUILD, chunk_cols
    from hybrid_runtime.cuda.kernels import source

    src = source("gdn_chunk.cu")
    bw = int(re.search(r"#define BW (\d+)", src).group(1))  # type: ignore[union-attr]
    bv = int(re.search(r"#define BV (\d+)", src).group(1))  # type: ignore[union-attr]
    hb = int(re.search(r"#define HB (\d+)", src).group(1))  # type: ignore[union-attr]
    want = {p: {3: bw, 4: hb}.get(TC_BUILD[p], bv) for p in PRECISIONS}
    assert {p: chunk_cols(p) for p in PRECISIONS} == want


def test_h_slots_are_distinct_and_bounded() -> None:
    """gdn_chunk_h / gdn_chunk_o index chunk c of sequence s as (seq_start[s] + 64 c) // 64 + s (h_slot): on
    random varlen batches every chunk gets its own slot, below ceil(N / 64) + S (the workspace's chunk count)."""
    import numpy as np

    from hybrid_runtime.cuda.kernels import source

    assert "return (seq_start[s] + CH * c) / CH + s;" in source("gdn_chunk.cu")
    rng = np.random.default_rng(0)
    for _ in range(200):
        lens = rng.integers(1, 300, size=int(rng.integers(1, 20)))
        starts = np.concatenate([[0], np.cumsum(lens)])
        slots = [(starts[s] + 64 * c) // 64 + s for s, n in enumerate(lens) for c in range(-(-int(n) // 64))]
        assert len(set(slots)) == len(slots)
        assert max(slots) < -(-int(starts[-1]) // 64) + len(lens)
