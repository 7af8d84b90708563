"""The decode tensor-core MoE (``ops/cuda/moe_decode.cu``, ``cuda/moe_decode.py``) on any machine: NVRTC compiles
both kernels for sm_90 in bf16 and fp16 for every knob set the benchmark offers, without spills and within the
shared memory and registers their occupancy needs; the host's rules (shapes, knobs, groups per pass, grids,
shared memory); and the numpy model (``moe_decode_model.py``): every (pair, row) of a step written exactly once
by the grids for random routings, and single CTAs modelled lane by lane (ring, swizzle, ldmatrix, mma
fragments, split-K, passes, short last k tiles) == plain numpy."""

from __future__ import annotations

import re

import numpy as np
import pytest
from moe_decode_model import coverage, cta_model, routing
from test_cuda_compile import check_log, nvrtc_or_skip

from hybrid_runtime.cuda.moe_decode import (
    DEFAULT_KNOBS,
    KNOB_SETS,
    SOURCE,
    DecodeKnobs,
    MoEDecode,
    bytes_in_flight,
    check_shape,
    grid,
    groups_per_pass,
    smem_bytes,
    stage_bytes,
    supported,
)

SM_SMEM = 228 * 1024  # H200 shared memory per SM (bytes); each resident CTA also reserves 1 KB
SM_REGS = 65536


def _per_kernel(log: str) -> dict[str, tuple[int, int]]:
    """kernel -> (registers, static smem bytes) from a ptxas -v log."""
    out, cur = {}, None
    for line in log.splitlines():
        if m := re.search(r"Compiling entry function '(\w+)'", line):
            cur = m.group(1)
        elif cur and (m := re.search(r"Used (\d+) registers.*?(\d+) bytes smem", line)):
            out[cur] = (int(m.group(1)), int(m.group(2)))
    return out


@pytest.mark.parametrize("name", sorted(KNOB_SETS))
@pytest.mark.parametrize("dt", [1, 2])
def test_moe_decode_compiles_for_sm90_without_spills(dt: int, name: str) -> None:
    nvrtc_or_skip()
    from hybrid_runtime.cuda.kernels import compile_log, source

    kn = KNOB_SETS[name]
    log = compile_log(source(SOURCE), SOURCE, (f"-DDT={dt}", *kn.options), "sm_90")
    check_log(log)
    res = _per_kernel(log)
    assert set(res) == {"moe_dec_gate_up", "moe_dec_down"}, log
    for kernel, kind in (("moe_dec_gate_up", "gate_up"), ("moe_dec_down", "down")):
        regs, static = res[kernel]
        # the largest launch (gcap = gmax) fits one CTA; a batch-1 launch (gcap 1) fits >= 2 CTAs per SM
        assert static + smem_bytes(kind, kn.gmax, kn) <= 227 * 1024, (kernel, log)
        per_cta = static + smem_bytes(kind, 1, kn) + 1024
        assert 2 * per_cta <= SM_SMEM and 2 * regs * kn.threads <= SM_REGS, (kernel, regs, per_cta)


def test_default_build_runs_a_batch_1_step_in_one_wave() -> None:
    """Batch 1 of Qwen3.5-35B-A3B (9 experts with the shared one folded): 288 CTAs per kernel, 3 resident per
    SM by shared memory and registers, so all of them fit the H200's 132 SMs at once; bytes in flight."""
    nvrtc_or_skip()
    from hybrid_runtime.cuda.kernels import compile_log, source

    kn = DEFAULT_KNOBS
    for dt in (1, 2):
        res = _per_kernel(compile_log(source(SOURCE), SOURCE, (f"-DDT={dt}", *kn.options), "sm_90"))
        for kernel, kind in (("moe_dec_gate_up", "gate_up"), ("moe_dec_down", "down")):
            regs, static = res[kernel]
            assert 3 * (static + smem_bytes(kind, 1, kn) + 1024) <= SM_SMEM, kernel
            assert 3 * regs * kn.threads <= SM_REGS, (kernel, regs)
    for kind in ("gate_up", "down"):
        g = grid(kind, 1, 9, 257, 2048, 512)
        assert g[0] * g[1] == 288 <= 3 * 132
    assert bytes_in_flight("gate_up") == 5 * 32 * 256 and bytes_in_flight("down") == 3 * 64 * 256


def test_shape_rules_and_knobs() -> None:
    assert supported("bfloat16", 2048, 512) and supported("float16", 64, 64) and supported("bfloat16", 320, 192)
    assert not supported("float32", 2048, 512)
    assert not supported("bfloat16", 2048 + 32, 512) and not supported("bfloat16", 2048, 96)
    check_shape("bfloat16", 2048, 512, 257, 9, 2048, 9)
    with pytest.raises(ValueError, match=r"H % 64 == 0, I % 64 == 0"):
        check_shape("bfloat16", 2048, 96)
    with pytest.raises(ValueError, match="E_all 1025"):
        check_shape("bfloat16", 2048, 512, 1025, 9)
    with pytest.raises(ValueError, match="ldh 2052"):
        check_shape("bfloat16", 2048, 512, 257, 9, 2052)
    with pytest.raises(ValueError, match="ny 8"):
        check_shape("bfloat16", 2048, 512, 257, 9, 2048, 8)
    with pytest.raises(ValueError, match="bfloat16 / float16"):
        MoEDecode(None, "float32")  # type: ignore[arg-type]
    for bad in ({"gu_cols": 12}, {"dn_rows": 128}, {"bk": 32}, {"gmax": 5}, {"warps": 3}, {"gu_stages": 1},
                {"early": 2}, {"pf_mb": -1}, {"dn_pre": 2}):
        with pytest.raises(ValueError, match="knobs"):
            DecodeKnobs(**bad)
    assert DEFAULT_KNOBS.options == ("-DMD_GU_COLS=16", "-DMD_GU_STAGES=6", "-DMD_DN_ROWS=64", "-DMD_DN_STAGES=4",
                                     "-DMD_BK=128", "-DMD_GMAX=4", "-DMD_WARPS=4", "-DMD_EARLY=0",
                                     "-DMD_PF_DOWN=0", "-DMD_DN_PRE=0")


def test_groups_per_pass_grids_and_shared_memory() -> None:
    assert [groups_per_pass(n, 4) for n in (1, 8, 9, 16, 17, 24, 25, 64)] == [1, 1, 2, 2, 3, 3, 4, 4]
    assert groups_per_pass(64, 2) == 2 and groups_per_pass(3, 1) == 1
    with pytest.raises(ValueError):
        groups_per_pass(0, 4)
    assert grid("gate_up", 1, 9, 257, 2048, 512) == (32, 9, 1)
    assert grid("down", 64, 8, 256, 2048, 512) == (32, 256, 1)
    assert grid("down", 8, 9, 257, 2048, 512, KNOB_SETS["fine"]) == (64, 72, 1)
    assert stage_bytes("gate_up", 1) == 40 * 256 and stage_bytes("down", 4) == 96 * 256
    assert smem_bytes("gate_up", 1) == 6 * 40 * 256 and smem_bytes("down", 1) == 4 * 72 * 256
    small = DecodeKnobs(gu_cols=32, gu_stages=2, bk=64)  # the partial sums outgrow the ring
    assert smem_bytes("gate_up", 4, small) == 4 * 4 * 4 * 512 > 2 * (64 + 32) * 128
    with pytest.raises(ValueError):
        grid("up", 1, 9, 257, 2048, 512)


def _random_pairs(rng: np.random.Generator, n: int, k: int, E: int, fold: bool, case: str) -> np.ndarray:
    lg = rng.standard_normal((n, E))
    if case == "one_takes_all":
        lg[:, E // 3] += 30
    top = np.argsort(-lg, 1, kind="stable")[:, :k]
    if fold:
        top = np.concatenate([top, np.full((n, 1), E)], 1)
    return top.reshape(-1)


@pytest.mark.parametrize("name", sorted(KNOB_SETS))
def test_every_pair_row_is_written_exactly_once(name: str) -> None:
    """The grids over random routings of the 35B shape (n = 1 .. 64, the shared expert folded or not, one expert
    taking every token): each (pair, act column) by gate_up and each (pair, y row) by down exactly once, nothing
    else (the CTAs past active[E_all] exit)."""
    kn = KNOB_SETS[name]
    H, I, E, k = 2048, 512, 256, 8
    rng = np.random.default_rng(len(name))
    for n in (1, 2, 5, 8, 16, 24, 64):
        for fold in (True, False):
            for case in ("spread", "one_takes_all"):
                pe = _random_pairs(rng, n, k, E, fold, case)
                kk, e_all = k + int(fold), E + int(fold)
                off, pl, active = routing(pe, e_all, rng)
                gcap = groups_per_pass(n, kn.gmax)
                for kind, width in (("gate_up", I), ("down", H)):
                    cnt = coverage(kind, n, kk, e_all, H, I, gcap, kn, off, pl, active)
                    assert cnt.shape == (n * kk, width) and (cnt == 1).all(), (name, n, fold, case, kind)


CTA_CASES = [  # (knobs, H, I, pairs of the expert, gcap)
    (DEFAULT_KNOBS, 256, 128, 1, 1),
    (DEFAULT_KNOBS, 320, 192, 7, 1),  # short last k tiles (K % 128 == 64) in both kernels
    (DEFAULT_KNOBS, 256, 128, 19, 3),  # 3 groups, the last partly zero columns
    (DEFAULT_KNOBS, 256, 128, 41, 4),  # 2 passes: 32 + 9 pairs
    (KNOB_SETS["fine"], 192, 128, 9, 2),
    (KNOB_SETS["bk64"], 256, 192, 12, 2),
    (KNOB_SETS["g2"], 128, 64, 20, 2),  # 2 passes of 16 + 4
    (DecodeKnobs(gu_cols=32, gu_stages=3, dn_rows=16, dn_stages=2, bk=64, gmax=1, warps=2), 192, 128, 10, 1),
    (DecodeKnobs(gu_cols=8, gu_stages=2, dn_rows=32, dn_stages=3, bk=128, gmax=3, warps=8), 256, 64, 30, 3),
]


@pytest.mark.parametrize("case", range(len(CTA_CASES)))
def test_cta_model_matches_numpy(case: int) -> None:
    """Single CTAs of both kernels, lane by lane, == numpy on the gathered rows: gate_up's SwiGLU act columns and
    down's weighted y rows, every column block of one expert; nothing else written."""
    kn, H, I, cnt, gcap = CTA_CASES[case]
    rng = np.random.default_rng(case)
    E, kk, ny = 3, 4, 5
    n = 16
    ldh = H + 64
    pe = rng.integers(0, E, n * kk)
    pe[rng.permutation(n * kk)[:cnt]] = E  # expert E (the last) gets exactly cnt pairs
    e_all = E + 1
    off, pl, active = routing(pe, e_all, rng)
    by = int(np.nonzero(active[:active[e_all]] == E)[0][0])
    pairs = pl[off[E]:off[E + 1]]
    assert len(pairs) == cnt
    h = rng.standard_normal((n, ldh))
    gu = rng.standard_normal((e_all, 2 * I, H))
    dn = rng.standard_normal((e_all, H, I))
    act = np.full(n * kk * I, np.nan)
    for bx in range(grid("gate_up", n, kk, e_all, H, I, kn)[0]):
        cta_model("gate_up", h.ravel(), ldh, gu.ravel(), H, H, I, kk, ny, e_all, gcap, kn, off, pl, active, None,
                  bx, by, act)
    act = act.reshape(n * kk, I)
    x = h[pairs // kk, :H] @ gu[E].T
    want = x[:, :I] / (1 + np.exp(-x[:, :I])) * x[:, I:]
    np.testing.assert_allclose(act[pairs], want, rtol=1e-10, atol=1e-10)
    assert np.isnan(act[np.setdiff1d(np.arange(n * kk), pairs)]).all()
    a_in = rng.standard_normal((n * kk, I))
    pw = rng.random(n * kk)
    y = np.full(n * ny * H, np.nan)
    for bx in range(grid("down", n, kk, e_all, H, I, kn)[0]):
        cta_model("down", a_in.ravel(), I, dn.ravel(), I, H, I, kk, ny, e_all, gcap, kn, off, pl, active, pw, bx, by,
                  y)
    y = y.reshape(n, ny, H)
    np.testing.assert_allclose(y[pairs // kk, pairs % kk], pw[pairs, None] * (a_in[pairs] @ dn[E].T), rtol=1e-10,
                               atol=1e-10)
    written = np.zeros((n, ny), bool)
    written[pairs // kk, pairs % kk] = True
    assert np.isnan(y[~written]).all()
    # a CTA row past active[E_all] writes nothing
    act2 = np.full(n * kk * I, np.nan)
    cta_model("gate_up", h.ravel(), ldh, gu.ravel(), H, H, I, kk, ny, e_all, gcap, kn, off, pl, active, None, 0,
              int(active[e_all]), act2)
    assert np.isnan(act2).all()
