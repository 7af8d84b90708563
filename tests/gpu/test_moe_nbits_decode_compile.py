"""The packed-expert decode MoE (``ops/cuda/moe_nbits_decode.cu``, ``cuda/moe_nbits_decode.py``) on any machine:
NVRTC compiles both kernels for sm_90 in bf16 / fp16 x int4 / int8 for every knob set of the benchmark, without
spills, within the registers and shared memory of their occupancy; the host's rules and refusals (shapes, act order,
mixed bits, shared memory), grids == moe_decode's (so moe_decode_model's coverage proof carries over: every (pair,
row) written exactly once), the stacking of per-expert packed weights (zero-points implied where absent, gate and
up rows fused); and the numpy model of the packed ring stages and their dequantisation into the T tile
(moe_nbits_decode_model.py) == an independent dequantiser (nbits_decode_model.dequantize_op) rounded as the
dequantise-at-load path rounds, for int4 / int8, sym / asym, group sizes 32 / 64 / 128 / K, short last k tiles; the
same for the ``reg`` 1 builds' A fragments lane by lane (every (row, k) in exactly one fragment slot, with the
dequantise-at-load T value), and their swizzled packed stages read without shared-memory bank conflicts."""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Any

import numpy as np
import pytest
from gpu_bits import host_bits, to_f32
from moe_decode_model import coverage, routing
from moe_nbits_decode_model import pchunk, reg_fragments, wt_tiles
from nbits_decode_model import dequantize_op, random_packed
from test_cuda_compile import check_log, nvdisasm_path, nvrtc_or_skip

from hybrid_runtime.cuda import moe_decode
from hybrid_runtime.cuda.moe_nbits_decode import (
    ALL_SETS,
    DEFAULT_KNOBS,
    KNOB_SETS,
    SACC_SETS,
    SOURCE,
    HostExperts,
    MoENBitsDecode,
    NBitsExperts,
    NBitsKnobs,
    as_host_experts,
    bs_shift,
    check_shape,
    fuse_rows,
    grid,
    shape_problems,
    smem_bytes,
    stack_experts,
    stage_bytes,
)

SM_SMEM = 228 * 1024
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


@pytest.mark.parametrize("name", sorted(ALL_SETS))
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_compiles_for_sm90_without_spills(dtype: str, bits: int, name: str) -> None:
    nvrtc_or_skip()
    from hybrid_runtime.cuda.kernels import compile_log, source

    kn = ALL_SETS[name]
    if not kn.runs_bits(bits):  # a 256-k tile: int4 sacc only, refused with the rule for int8
        with pytest.raises(ValueError, match="int4 experts only"):
            kn.options(dtype, bits)
        return
    log = compile_log(source(SOURCE), SOURCE, kn.options(dtype, bits), "sm_90")
    check_log(log)
    res = _per_kernel(log)
    assert set(res) == {"moe_nb_gate_up", "moe_nb_down"}, log
    for kernel, kind in (("moe_nb_gate_up", "gate_up"), ("moe_nb_down", "down")):
        regs, static = res[kernel]
        # the 35B shape at group size 32 (the largest scale table): the largest launch fits one CTA, a batch-1
        # launch (gcap 1) leaves room for 3 CTAs per SM by registers and 2 by shared memory
        K = 2048 if kind == "gate_up" else 512
        assert static + smem_bytes(kind, kn.gmax, bits, K // 32, kn) <= 227 * 1024, (kernel, log)
        assert 2 * (static + smem_bytes(kind, 1, bits, K // 32, kn) + 1024) <= SM_SMEM, kernel
        assert 3 * regs * kn.threads <= SM_REGS, (kernel, regs)


def test_knobs_options_grids_and_shared_memory() -> None:
    assert DEFAULT_KNOBS.options("bfloat16", 4) == (
        "-DDT=2", "-DMN_BITS=4", "-DMD_GU_COLS=16", "-DMD_GU_STAGES=6", "-DMD_DN_ROWS=64", "-DMD_DN_STAGES=4",
        "-DMD_BK=128", "-DMD_GMAX=4", "-DMD_WARPS=4")
    for bad in ({"gu_cols": 12}, {"bk": 32}, {"gmax": 5}, {"warps": 3}, {"dn_stages": 1}):
        with pytest.raises(ValueError, match="knobs"):
            NBitsKnobs(**bad)
    for name, kn in KNOB_SETS.items():  # every build splits K as moe_decode's default: the same bits
        dk = kn.decode_knobs()
        assert (dk.bk, dk.warps) == (moe_decode.DEFAULT_KNOBS.bk, moe_decode.DEFAULT_KNOBS.warps), name
        for kind in ("gate_up", "down"):
            for n, kk, e_all in ((1, 9, 257), (8, 9, 257), (64, 8, 256)):
                assert grid(kind, n, kk, e_all, 2048, 512, kn) == moe_decode.grid(kind, n, kk, e_all, 2048, 512, dk)
    assert grid("gate_up", 1, 9, 257, 2048, 512) == (32, 9, 1) and grid("down", 64, 8, 256, 2048, 512) == (32, 256, 1)
    # a stage: 32 packed rows of 64 (int4) / 128 (int8) bytes + 8 gcap B rows of 256 bytes
    assert stage_bytes("gate_up", 1, 4) == 32 * 64 + 8 * 256 and stage_bytes("down", 4, 8) == 64 * 128 + 32 * 256
    # WT + (scale, zero) table + ring
    assert smem_bytes("gate_up", 1, 4, 64) == 32 * 256 + 32 * 64 * 8 + 6 * (32 * 64 + 8 * 256)
    small = NBitsKnobs(gu_cols=32, gu_stages=2, bk=64)  # the partial sums outgrow the ring
    assert smem_bytes("gate_up", 4, 4, 1, small) == 64 * 128 + 64 * 8 + 4 * 4 * 4 * 512
    assert [bs_shift(b) for b in (16, 32, 128, 2048, 48, 0)] == [4, 5, 7, 11, -1, -1]


def _ops(bits: int = 4, bs: int = 128, H: int = 2048, inter: int = 512, e_all: int = 257, **kw: int
         ) -> tuple[NBitsExperts, NBitsExperts]:
    gu = NBitsExperts(256, 512, 0, e_all, 2 * inter, H, bits, bs)
    dn = NBitsExperts(1024, 2048, 0, e_all, H, inter, bits, bs)
    return replace(gu, **kw), dn


def test_shape_rules_refuse_with_clear_messages() -> None:
    gu, dn = _ops()
    assert shape_problems("bfloat16", 2048, 512, gu, dn, 257, 9, 2048, 9) == []
    check_shape("float16", 2048, 512, gu, dn, 257, 9)
    cases = [
        (("float32", 2048, 512, gu, dn, 257, 9), "bfloat16 / float16"),
        (("bfloat16", 2048, 96, *_ops(inter=96), 257, 9), "multiples of 64"),
        (("bfloat16", 2048, 512, gu, dn, 1025, 9), "E_all 1025"),
        (("bfloat16", 2048, 512, gu, dn, 257, 9, 2044), "ldh 2044"),
        (("bfloat16", 2048, 512, gu, dn, 257, 9, 2048, 8), "ny 8"),
        (("bfloat16", 2048, 512, *_ops(perm=4096), 257, 9), "act order"),
        (("bfloat16", 2048, 512, _ops(bits=8)[0], dn, 257, 9), "one bit width"),
        (("bfloat16", 2048, 512, *_ops(bits=3), 257, 9), "bits must be 4 or 8"),
        (("bfloat16", 2048, 512, *_ops(bs=24), 257, 9), "multiple of 16"),
        (("bfloat16", 2048, 512, *_ops(bs=96), 257, 9), "divide K"),
        (("bfloat16", 2048, 512, *_ops(e_all=200), 257, 9), "fewer than E_all"),
        (("bfloat16", 2048, 512, *_ops(B=8), 257, 9), "16-byte aligned"),
        (("bfloat16", 2048, 512, *_ops(rows=512), 257, 9), r"\[1024, 2048\]"),
        (("bfloat16", 16384, 512, *_ops(bs=16, H=16384), 257, 9), "shared memory"),
    ]
    for args, msg in cases:
        with pytest.raises(ValueError, match=msg):
            check_shape(*args)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="bfloat16 / float16"):
        MoENBitsDecode(None, "float32")  # type: ignore[arg-type]


@pytest.mark.parametrize("name", sorted(KNOB_SETS))
def test_every_pair_row_is_written_exactly_once(name: str) -> None:
    """The grids and the epilogue are moe_decode's (same grid, same fragment walk): moe_decode_model's coverage
    on the equivalent moe_decode build, random 35B routings, n 1 / 8 / 16 / 64."""
    kn = KNOB_SETS[name].decode_knobs()
    H, inter, E, k = 2048, 512, 256, 8
    rng = np.random.default_rng(5)
    for n in (1, 8, 16, 64):
        lg = rng.standard_normal((n, E))
        pe = np.concatenate([np.argsort(-lg, 1)[:, :k], np.full((n, 1), E)], 1).reshape(-1)
        off, pl, active = routing(pe, E + 1, rng)
        gcap = moe_decode.groups_per_pass(n, kn.gmax)
        for kind, width in (("gate_up", inter), ("down", H)):
            cnt = coverage(kind, n, k + 1, E + 1, H, inter, gcap, kn, off, pl, active)
            assert cnt.shape == (n * (k + 1), width) and (cnt == 1).all(), (name, n, kind)


def _experts(rng: np.random.Generator, E: int, R: int, K: int, bits: int, bs: int, asym: bool) -> list:
    return [random_packed(rng, R, K, bits, bs, asym, None, 0.01 if bits == 4 else 0.0006) for _ in range(E)]


def _want_t(p, dtype: str) -> np.ndarray:
    """The dequantise-at-load weights: (q - z) * s rounded to float32, then once to T."""
    return to_f32(host_bits(dequantize_op(p).astype(np.float32), dtype), dtype)


WT_CASES = [  # (kind, bits, group (-1: K), asym, H, I, knobs, dtype)
    ("gate_up", 4, 32, True, 256, 128, DEFAULT_KNOBS, "bfloat16"),
    ("gate_up", 4, 128, False, 384, 128, DEFAULT_KNOBS, "bfloat16"),
    ("gate_up", 8, 64, False, 320, 128, DEFAULT_KNOBS, "float16"),  # K 320: a last k tile of 64
    ("down", 4, 64, False, 256, 192, DEFAULT_KNOBS, "bfloat16"),  # K 192: a last k tile of 64
    ("down", 8, -1, True, 128, 256, DEFAULT_KNOBS, "bfloat16"),  # one block a row
    ("gate_up", 4, 64, True, 192, 64, KNOB_SETS["fine"], "bfloat16"),  # 16 rows a CTA: one packed chunk a thread
    ("down", 4, 16, True, 128, 128, KNOB_SETS["fine"], "float16"),  # group 16: odd block counts per nibble pair
    ("gate_up", 8, 32, True, 256, 64, NBitsKnobs(gu_cols=32, bk=64, warps=2), "bfloat16"),
    ("down", 4, 96, True, 64, 192, NBitsKnobs(dn_rows=16, bk=64), "bfloat16"),  # group 96: k >> bs_shift unused
]


def _stacked_case(rng: np.random.Generator, case: int, n: int) -> tuple[list, Any, int]:
    """WT_CASES[case]'s experts: ``n`` random packed ones, plus (asym) one without zero-points; (the packs, their
    stack, R = the weight rows an expert has)."""
    kind, bits, group, asym, H, inter, _, _ = WT_CASES[case]
    R, K = (2 * inter, H) if kind == "gate_up" else (H, inter)
    bs = K if group == -1 else group
    packs = _experts(rng, n, R, K, bits, bs, asym)
    if asym:
        packs.append(random_packed(rng, R, K, bits, bs, False, None))
    return packs, stack_experts([as_host_experts(p) for p in packs]), R


@pytest.mark.parametrize("case", range(len(WT_CASES)))
def test_dequantised_tiles_match_an_independent_dequantiser(case: int) -> None:
    """Every CTA column block of two experts (stacked with stack_experts, the last one without zero-points when
    the others have them): the T weights the mma loop reads, k tile by k tile, == (q - z) * s rounded as
    nbits.cu's dequantise-at-load rounds (what moe_decode reads on the dequantised weights), bit for bit."""
    kind, _, _, _, H, inter, kn, dtype = WT_CASES[case]
    rng = np.random.default_rng(case)
    packs, w, R = _stacked_case(rng, case, 3)
    assert w.experts == len(packs)
    nbx = grid(kind, 1, 1, 1, H, inter, kn)[0]
    for e in (1, len(packs) - 1):
        want = _want_t(packs[e], dtype)
        for bx in range(nbx):
            got, rows = wt_tiles(kind, w, e, bx, H, inter, kn, dtype)
            assert not np.isnan(got).any(), (case, e, bx)
            assert np.array_equal(got, want[rows - e * R]), (case, e, bx)


def test_stacking_and_fusing_packed_experts() -> None:
    rng = np.random.default_rng(3)
    H, inter, bits, bs = 128, 64, 4, 32
    gate = _experts(rng, 2, inter, H, bits, bs, True)
    up = _experts(rng, 2, inter, H, bits, bs, True)
    shared_gate = random_packed(rng, inter, H, bits, bs, False, None)
    shared_up = random_packed(rng, inter, H, bits, bs, False, None)
    routed = fuse_rows([stack_experts([as_host_experts(p) for p in gate]),
                        stack_experts([as_host_experts(p) for p in up])])
    shared = fuse_rows([as_host_experts(shared_gate), as_host_experts(shared_up)])
    w = stack_experts([routed, shared])
    assert (w.experts, w.rows, w.K) == (3, 2 * inter, H)
    assert w.B.shape == (3, 2 * inter, H * bits // 8) and w.scales.shape == (3, 2 * inter, H // bs)
    assert w.zp is not None and w.zp.shape == (3, 2 * inter, (H // bs + 1) // 2)
    for e, (g, u) in enumerate([*zip(gate, up, strict=True), (shared_gate, shared_up)]):
        got = dequantize_op(_as_packed(w, e))
        np.testing.assert_array_equal(got, np.concatenate([dequantize_op(g), dequantize_op(u)]))
    # a stacked HostPacked-like weight (experts > 0) keeps its experts
    stacked = HostExperts(w.B, w.scales, w.zp, w.rows, w.K, w.bits, w.block_size)
    assert as_host_experts(_Stacked(w)).B.shape == stacked.B.shape
    with pytest.raises(ValueError, match="act order"):
        as_host_experts(random_packed(rng, 64, 128, 4, 32, False, 100))
    with pytest.raises(ValueError, match="block size"):
        as_host_experts(random_packed(rng, 64, 120, 4, 40, False, None))
    with pytest.raises(ValueError, match="differ"):
        stack_experts([as_host_experts(gate[0]), as_host_experts(random_packed(rng, inter, H, 8, bs, True, None))])
    with pytest.raises(ValueError, match="differ"):
        fuse_rows([as_host_experts(gate[0]), as_host_experts(random_packed(rng, inter, H, 4, 64, True, None))])


class _Stacked:
    """A stacked packed weight as quant.HostPacked carries one (flat scales / zp per expert)."""

    def __init__(self, w: HostExperts) -> None:
        E = w.experts
        self.B, self.scales = w.B, w.scales.reshape(E, -1)
        self.zp = None if w.zp is None else w.zp.reshape(E, -1)
        self.perm, self.K, self.N, self.bits, self.block_size, self.experts = None, w.K, w.rows, w.bits, \
            w.block_size, E


def _as_packed(w: HostExperts, e: int):
    from nbits_decode_model import Packed

    return Packed(w.B[e], w.scales[e], None if w.zp is None else w.zp[e], None, w.K, w.rows, w.bits, w.block_size,
                  w.K)


def _signature(src: str, name: str) -> list[str]:
    """The parameter kinds ("ptr" / "i64" / "i32") of kernel ``name`` in the CUDA source."""
    m = re.search(name + r"\(([^)]*)\)", src)
    assert m, name
    kinds = []
    for p in m.group(1).split(","):
        p = p.strip()
        kinds.append("ptr" if "*" in p else "i64" if "long long" in p else "i32" if p.startswith("int ") else p)
    return kinds


def test_launch_arguments_match_the_kernel_signatures(monkeypatch: pytest.MonkeyPatch) -> None:
    """Both launches pass the kernels' parameters in their order and kinds (no GPU: the kernels are recorders),
    with the grids, block and shared memory of the host's rules."""
    from hybrid_runtime.cuda.kernels import source
    from hybrid_runtime.cuda.moe_prefill import MoEBuffers

    src = source(SOURCE)
    calls: list[tuple] = []

    class Rec:
        def __init__(self, name: str) -> None:
            self.name = name

        def launch(self, device, grid_, block, smem, args, pdl=False) -> None:
            calls.append((self.name, grid_, block, smem, args, pdl))

    monkeypatch.setattr(MoENBitsDecode, "_kernel", lambda self, bits, kind: Rec(
        "moe_nb_gate_up" if kind == "gate_up" else "moe_nb_down"))
    moe = MoENBitsDecode(None, "bfloat16")  # type: ignore[arg-type]
    gu, dn = _ops(bits=4, bs=64)
    moe.launch(9, 4096, 2048, gu, dn, 2048, 512, 9, 10, 257, MoEBuffers(*range(16, 16 * 10, 16), 0))
    assert [c[0] for c in calls] == ["moe_nb_gate_up", "moe_nb_down"]
    for name, grid_, block, smem, args, pdl in calls:
        assert [k for k, _ in args] == _signature(src, name), name
        kind = "gate_up" if name.endswith("gate_up") else "down"
        w = gu if kind == "gate_up" else dn
        assert grid_ == grid(kind, 9, 9, 257, 2048, 512) and block == (128, 1, 1) and pdl
        assert smem == smem_bytes(kind, 2, 4, w.K // 64)  # 9 tokens: 2 groups per pass
        vals = dict(zip(_signature_names(src, name), (v for _, v in args), strict=True))
        assert (vals["B"], vals["scales"], vals["zp"], vals["bs"], vals["bs_shift"]) == (w.B, w.scales, w.zp, 64, 6)
        assert (vals["H"], vals["I"], vals["kk"], vals["E_all"], vals["gcap"]) == (2048, 512, 9, 257, 2)


def _signature_names(src: str, name: str) -> list[str]:
    m = re.search(name + r"\(([^)]*)\)", src)
    assert m
    return [re.split(r"[\s*]+", p.strip())[-1] for p in m.group(1).split(",")]


def _reg(kn: NBitsKnobs) -> NBitsKnobs:
    return replace(kn, reg=1)


@pytest.mark.parametrize("case", range(len(WT_CASES)))
def test_register_fragments_match_an_independent_dequantiser(case: int) -> None:
    """The reg 1 builds (no T tile): every lane's A fragments, k16 step by k16 step of every warp, cover each (row, k)
    of the CTA's weight rows exactly once, in the mma.m16n8k16 A slot of that (row, k) - the slot ldmatrix fills in
    moe_decode's loop, so the MMAs see the very registers of the reg 0 / moe_decode builds - with the dequantise-at-load
    T value, bit for bit; the cases of the T-tile test (short last k tiles, group 16 / 96 / K, bk 64, 2 warps)."""
    kind, _, _, _, H, inter, kn, dtype = WT_CASES[case]
    kn = _reg(kn)
    rng = np.random.default_rng(50 + case)
    packs, w, R = _stacked_case(rng, case, 2)
    nbx = grid(kind, 1, 1, 1, H, inter, kn)[0]
    for e in (1, len(packs) - 1):
        want = _want_t(packs[e], dtype)
        for bx in range(nbx):
            got, cnt, rows = reg_fragments(kind, w, e, bx, H, inter, kn, dtype)
            assert (cnt == 1).all(), (case, e, bx, int(cnt.min()), int(cnt.max()))
            assert np.array_equal(got, want[rows - e * R]), (case, e, bx)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("bk", [64, 128])
def test_register_path_reads_are_bank_conflict_free(bits: int, bk: int) -> None:
    """A warp's packed read of one k16 step (reg 1): rows g = 0..7 (+ 8 h + 16 mt) each read 8 (int4) / 2 x 4 (int8)
    bytes of one 16-byte chunk; with mn_pchunk's swizzle the 8 rows' chunks lie in 8 different 16-byte bank groups
    (mod 128 bytes) - one shared-memory wavefront a load - and the swizzle keeps each chunk inside its row."""
    kn = NBitsKnobs(bk=bk, warps=2 if bk == 64 else 4, reg=1)
    prowb = bk * bits // 8
    for mt in range(4):
        for h in range(2):
            for ks in range(bk // 16):
                ch = ks >> 1 if bits == 4 else ks
                groups = set()
                for g in range(8):
                    row = mt * 16 + g + 8 * h
                    pc = pchunk(row, ch, bits, kn)
                    assert 0 <= pc < prowb // 16
                    groups.add((row * prowb + pc * 16) % 128 // 16)
                assert len(groups) == 8, (bits, bk, mt, h, ks, groups)
    # a permutation of the row's chunks (copies never collide) for every row
    for row in range(64):
        assert sorted(pchunk(row, c, bits, kn) for c in range(prowb // 16)) == list(range(prowb // 16))


def test_register_builds_drop_the_t_tile_and_keep_the_order() -> None:
    """reg 1 options and shared memory: no T tile (rows x bk x 2 fewer bytes), the ring and table unchanged; early
    only with reg; every reg build of KNOB_SETS splits K as the default (the same bits) and compiles with
    -DMN_REG=1."""
    kn = _reg(DEFAULT_KNOBS)
    assert kn.options("bfloat16", 4) == (*DEFAULT_KNOBS.options("bfloat16", 4), "-DMN_REG=1")
    assert smem_bytes("gate_up", 1, 4, 64, kn) == smem_bytes("gate_up", 1, 4, 64) - 32 * 256
    assert kn.decode_knobs() == DEFAULT_KNOBS.decode_knobs()
    for bad in ({"reg": 2}, {"early": 1}, {"reg": 1, "early": 2}):  # early only with reg
        with pytest.raises(ValueError, match="early"):
            NBitsKnobs(**bad)
    assert replace(kn, early=1).options("bfloat16", 8)[-2:] == ("-DMN_REG=1", "-DMN_EARLY=1")
    assert replace(kn, early=1).decode_knobs() == DEFAULT_KNOBS.decode_knobs()
    regs = [name for name, k in KNOB_SETS.items() if k.reg]
    assert {"reg", "reg_late", "reg_many"} <= set(regs) and KNOB_SETS["reg"].early and not KNOB_SETS["reg_late"].early
    for name in regs:
        assert "-DMN_REG=1" in KNOB_SETS[name].options("float16", 8), name


def test_warm_cache_compiles_into_the_disk_cache(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """kernels.warm_cache (the GPU test's parallel warm-up): each distinct job compiled once, in worker processes,
    into the disk cache; compile_cubin then reads those files (they are not rewritten)."""
    nvrtc_or_skip()
    from hybrid_runtime.cuda import kernels

    monkeypatch.setenv("HYBRID_LLM_CACHE", str(tmp_path))
    jobs = [(SOURCE, KNOB_SETS[name].options("bfloat16", 4), "sm_90") for name in ("default", "reg")]
    assert kernels.warm_cache([*jobs, jobs[0]], workers=2) == 2
    files = sorted(tmp_path.glob("*.cubin"))
    assert len(files) == 2
    before = {p: p.stat().st_ino for p in files}
    monkeypatch.setattr(kernels, "_cubins", {})
    got = [kernels.compile_cubin(kernels.source(name), name, opts, arch) for name, opts, arch in jobs]
    assert sorted(got) == sorted(p.read_bytes() for p in files)
    assert {p: p.stat().st_ino for p in files} == before  # read, not compiled and replaced
    assert kernels.warm_cache([]) == 0


@pytest.mark.parametrize("name", sorted(n for n, k in ALL_SETS.items() if k.reg))
def test_register_builds_use_no_local_memory_in_sass(tmp_path, name: str) -> None:
    """Where cuobjdump or nvdisasm is installed: the reg builds' SASS has no local-memory load or store (LDL / STL:
    a spill, or a fragment array indexed at run time), bf16 int4 (FADD + FMUL and FFMA; the sacc builds' own int4
    path) and int8."""
    import shutil
    import subprocess

    nvrtc_or_skip()
    tool = shutil.which("cuobjdump") or nvdisasm_path()
    if tool is None:
        pytest.skip("neither cuobjdump nor nvdisasm (the nvidia-cuda-nvdisasm dev dependency) found")
    from hybrid_runtime.cuda.kernels import compile_cubin, source

    for bits, fma in ((4, False), (4, True), (8, False)):
        if (fma and ALL_SETS[name].sacc) or not ALL_SETS[name].runs_bits(bits):
            continue  # the sacc builds have no FFMA dequantisation, the 256-k ones no int8 module
        path = tmp_path / f"{name}{bits}{fma}.cubin"
        path.write_bytes(compile_cubin(source(SOURCE), SOURCE, ALL_SETS[name].options("bfloat16", bits, fma),
                                       "sm_90"))
        args = [tool, "-sass", str(path)] if tool.endswith("cuobjdump") else [tool, str(path)]
        sass = subprocess.run(args, capture_output=True, text=True, check=True).stdout
        assert "moe_nb_gate_up" in sass and "moe_nb_down" in sass, sass[:2000]
        local = [ln.strip() for ln in sass.splitlines() if re.search(r"\b(LDL|STL)(\.\w+)*\b", ln)]
        assert not local, (name, bits, fma, local[:8])


def _prmt(a: np.ndarray, b: np.ndarray, sel: int) -> np.ndarray:
    """PTX prmt.b32 (default mode) on uint32 arrays: byte i of the result is byte sel[4i:4i+3] of {b, a} (a: bytes
    0-3, b: 4-7; selector bit 3 of each nibble, the sign-replicating mode, is not used by the kernel)."""
    src = np.stack([(a >> (8 * i)) & 0xFF for i in range(4)] + [(b >> (8 * i)) & 0xFF for i in range(4)])
    out = np.zeros_like(a)
    for i in range(4):
        nib = (sel >> (4 * i)) & 0xF
        assert nib < 8, "sign-replicating selector"
        out |= src[nib].astype(np.uint32) << np.uint32(8 * i)
    return out


def test_ffma_byte_permutes_place_each_lanes_codes() -> None:
    """MN_FMA's a_frag: for lane k pair t (0..3), prmt(w.x, w.y, sel_u / sel_v) then the masks 0xF0000 / 0xF000 give
    the codes of k 2t, 2t + 1, 2t + 8, 2t + 9 of the step's 16 codes (8 bytes, low nibble first) at bits 16-19 /
    12-15 - the very codes the FADD + FMUL path shifts out; int8's PRMT with 0x4B000000 gives 2^23 + the code."""
    rng = np.random.default_rng(0)
    wx, wy = (rng.integers(0, 2**32, 4096, dtype=np.uint64).astype(np.uint32) for _ in range(2))
    codes = np.stack([(np.where(i < 8, wx, wy) >> np.uint32(4 * (i % 8))) & 15 for i in range(16)])  # code i of k
    for t in range(4):
        sel_u, sel_v = (t << 4) | ((4 + t) << 8), ((4 + t) << 4) | (t << 8)  # as the kernel computes them
        u, v = _prmt(wx, wy, sel_u), _prmt(wx, wy, sel_v)
        got = [(v >> 16) & 15, (u >> 12) & 15, (u >> 16) & 15, (v >> 12) & 15]  # d0..d3: k 2t, 2t+1, 2t+8, 2t+9
        for g, k in zip(got, (2 * t, 2 * t + 1, 2 * t + 8, 2 * t + 9), strict=True):
            assert np.array_equal(g, codes[k]), (t, k)
        # int8 (2 lanes per word pair): bytes 2 (t % 2) and 2 (t % 2) + 1 of a word under 0x4B000000
        mag = np.full_like(wx, 0x4B000000)
        for sel, byte in (((2 * (t & 1)) | 0x7540, 2 * (t & 1)), ((2 * (t & 1) + 1) | 0x7540, 2 * (t & 1) + 1)):
            assert np.array_equal(_prmt(wx, mag, sel), np.uint32(0x4B000000) | ((wx >> np.uint32(8 * byte)) & 0xFF))


def _ffma_f32(q: int, z: int, s: np.float32, p: int) -> np.float32:
    """The kernel's MN_FMA value: fma(f32(2^23 + q 2^p), f32(s 2^-p), f32(-(2^(23-p) + z) s)) with the constants
    rounded to float32 as the kernel computes them (tbl_store) and the fma exact, then rounded once (Fractions)."""
    from fractions import Fraction

    x = np.float32(2.0**23 + q * 2.0**p)
    sp = np.float32(s) * np.float32(2.0**-p)
    c = np.float32(-(np.float32(2.0 ** (23 - p)) + np.float32(z))) * np.float32(s)
    exact = Fraction(float(x)) * Fraction(float(sp)) + Fraction(float(c))
    return np.float32(_round_f32(exact))


def _round_f32(v: object) -> float:
    """A Fraction rounded to the nearest float32 (ties to even), through float64 only where that is exact."""
    from fractions import Fraction

    assert isinstance(v, Fraction)
    d = float(v)  # nearest float64; exact when the value has <= 53 significant bits (the cases here: <= 48)
    assert Fraction(d) == v, "value not exact in float64: extend the rounding"
    return float(np.float32(d))


def test_ffma_dequantisation_is_the_fadd_fmul_value_for_short_scales() -> None:
    """For every int4 code q and zero-point z and p = 12 / 16: the kernel's FFMA value == float32((q - z) * s) (the
    FADD + FMUL path, one rounding) for short scales (float16 values incl. subnormal / extreme ones, bfloat16 values,
    negative, zero); short_scales accepts exactly those and refuses random float32 scales (and inf / NaN / tiny
    ones), for which the FFMA value does differ somewhere (what the predicate guards)."""
    from hybrid_runtime.cuda.moe_nbits_decode import short_scales

    rng = np.random.default_rng(1)
    f16 = np.concatenate([rng.uniform(1e-4, 0.05, 40), [6.1035e-05, 5.96e-08, 3.0e-06, 65504.0, 0.0]]
                         ).astype(np.float16).astype(np.float32)
    bf16 = (rng.uniform(1e-3, 1.0, 20).astype(np.float32).view(np.uint32) & 0xFFFF0000).view(np.float32)
    short = np.concatenate([f16, -f16[:5], bf16])
    assert short_scales(short) and short_scales(np.zeros(0, np.float32))
    for s in short:
        for q in range(16):
            for z in range(16):
                want = np.float32(np.float32(q - z) * s)
                for p in (12, 16):
                    got = _ffma_f32(q, z, s, p)
                    assert got == want, (float(s), q, z, p, float(got), float(want))
    long_ = rng.uniform(0.005, 0.015, 64).astype(np.float32)
    assert not short_scales(long_)
    assert not short_scales(np.array([0.01, np.inf], np.float32)) and not short_scales(np.array([np.nan], np.float32))
    assert not short_scales(np.array([2.0**-110], np.float32))  # s 2^-16 would be subnormal
    differ = sum(_ffma_f32(q, z, s, 12) != np.float32(np.float32(q - z) * s) for s in long_[:16] for q in range(16)
                 for z in range(16))
    assert differ > 0, "float32 scales would be exact too: the predicate is needlessly strict"


def test_ffma_builds_compile_and_cut_the_k_tile_loop() -> None:
    """The int4 reg builds with -DMN_FMA=1 (short scales) compile for sm_90 without spills within 3 CTAs' registers,
    a larger (scale, zero) table in shared memory; options refuse FMA for int8 / reg 0 builds; where nvdisasm is
    installed (a dev dependency), reg_g1's gate_up k-tile loop (the innermost loop with MMAs) dequantises with one
    FFMA per weight (32 per lane per k tile: 2 m-tiles x 2 k16 steps x 8; no FADD / FMUL) and is shorter than the
    FADD + FMUL build's."""
    nvrtc_or_skip()
    from hybrid_runtime.cuda.kernels import compile_log, source

    with pytest.raises(ValueError, match="int4 reg build"):
        KNOB_SETS["reg"].options("bfloat16", 8, fma=True)
    with pytest.raises(ValueError, match="int4 reg build"):
        KNOB_SETS["default"].options("bfloat16", 4, fma=True)
    assert KNOB_SETS["reg_g1"].options("bfloat16", 4, fma=True)[-1] == "-DMN_FMA=1"
    assert smem_bytes("gate_up", 1, 4, 16, KNOB_SETS["reg_g1"], fma=True) == \
        smem_bytes("gate_up", 1, 4, 16, KNOB_SETS["reg_g1"]) + 32 * 16 * 8
    for name in sorted(n for n, k in KNOB_SETS.items() if k.reg):
        kn = KNOB_SETS[name]
        for dtype in ("bfloat16", "float16"):
            log = compile_log(source(SOURCE), SOURCE, kn.options(dtype, 4, fma=True), "sm_90")
            check_log(log)
            for kernel, (regs, _) in _per_kernel(log).items():
                assert 3 * regs * kn.threads <= SM_REGS, (name, dtype, kernel, regs)
    if nvdisasm_path() is None:
        pytest.skip("no nvdisasm (the nvidia-cuda-nvdisasm dev dependency)")
    from benchmarks.sass_loops import disassemble, kernels, loops

    defines = [d[2:] for d in KNOB_SETS["reg_g1"].options("bfloat16", 4)]
    inner = {}
    for fma in (False, True):
        ins = kernels(disassemble(SOURCE, defines + (["MN_FMA=1"] if fma else []), "sm_90"))["moe_nb_gate_up"]
        inner[fma] = min((lp for lp in loops(ins) if lp.mix["HMMA"]), key=lambda lp: lp.size)
    f, plain = inner[True].mix, inner[False].mix
    assert f["FFMA"] == 32 and f["FADD"] == 0 and f["FMUL"] == 0 and f["PRMT"] == 16, f
    assert plain["FADD"] == 32 and plain["FMUL"] == 32, plain
    assert sum(f.values()) < sum(plain.values()), (sum(f.values()), sum(plain.values()))


# ------------------------------------------------------------------------------ scale on the accumulator (sacc)

_MAGIC = {"bfloat16": 0x4300, "float16": 0x6400}  # the T values 128 / 1024: a code in the low mantissa bits adds q


def _t_of(bits16: np.ndarray, dtype: str) -> np.ndarray:
    return to_f32(bits16.astype(np.uint16), dtype).astype(np.float64)


def test_sacc_lane_codes_and_permuted_b_fragments_give_the_integer_product() -> None:
    """MN_SACC's a_frag_s and B permutation, lane by lane in numpy: for every lane (g, t) of a warp and random packed
    words, prmt(w.x, w.y, sel_s), the LOP3 with 0x000F000F and the magic pair (before and after a 4-bit shift) and
    the HFMA2 x 1 + table pair give T pairs holding exactly q - z of k (2t, 2t + 8) and (2t + 1, 2t + 9) (the table
    pair -(magic + z) as tbl_store writes it, z = 0 / 8 / 15); with the B fragments prmt'd by 0x5410 / 0x7632, an
    mma.m16n8k16 reading the registers at their nominal slots (A: a0 / a1 rows g / g + 8 at k 2t, 2t + 1, a2 / a3 at
    2t + 8, 2t + 9; B: b0 at k 2t, 2t + 1 of column g, b1 at 2t + 8, 2t + 9) computes exactly (q - z) @ x: every
    product pairs a weight and an activation of the same k."""
    rng = np.random.default_rng(3)
    for dtype in ("bfloat16", "float16"):
        for z in (0, 8, 15):
            q = rng.integers(0, 16, (16, 16))  # one k16 step of 16 rows, packed two a byte, low nibble first
            packed = (q[:, 0::2] | (q[:, 1::2] << 4)).astype(np.uint8)
            wx = packed[:, :4].copy().view(np.uint32).reshape(16)
            wy = packed[:, 4:].copy().view(np.uint32).reshape(16)
            xb = host_bits(rng.standard_normal((16, 8)).astype(np.float32), dtype).view(np.uint16).astype(np.uint32)
            neg = _t_of(np.array([(0xC300 if dtype == "bfloat16" else 0xE400) | z]), dtype)[0]  # tbl_store's half
            magp = np.uint32(_MAGIC[dtype] * 0x10001)
            a_slots = np.zeros((32, 2, 4))  # [lane, h]: nominal k slots 2t, 2t + 1, 2t + 8, 2t + 9 of row g + 8h
            b_slots = np.zeros((32, 4))  # [lane]: the 4 nominal k slots of column g
            for lane in range(32):
                g, t = lane >> 2, lane & 3
                sel = t | (t << 4) | ((4 + t) << 8) | ((4 + t) << 12)
                for h in range(2):
                    row = g + 8 * h
                    u = _prmt(wx[row:row + 1], wy[row:row + 1], sel)[0]
                    regs = []
                    for p in ((u & np.uint32(0x000F000F)) | magp, ((u >> np.uint32(4)) & np.uint32(0x000F000F)) | magp):
                        halves = _t_of(np.array([p & 0xFFFF, p >> 16]), dtype)
                        regs.append(halves + neg)  # HFMA2 x 1 + (-(magic + z)): exact small integers
                    a_slots[lane, h] = np.concatenate(regs)  # a[h] (nominal 2t, 2t + 1), a[2 + h] (2t + 8, 2t + 9)
                    want = [q[row, k] - z for k in (2 * t, 2 * t + 8, 2 * t + 1, 2 * t + 9)]
                    assert a_slots[lane, h].tolist() == want, (dtype, z, lane, h)
                b0 = np.array([xb[2 * t, g] | (xb[2 * t + 1, g] << 16)], np.uint32)  # as ldmatrix.x2 gives them
                b1 = np.array([xb[2 * t + 8, g] | (xb[2 * t + 9, g] << 16)], np.uint32)
                pb = [_prmt(b0, b1, 0x5410)[0], _prmt(b0, b1, 0x7632)[0]]
                b_slots[lane] = np.concatenate([_t_of(np.array([v & 0xFFFF, v >> 16]), dtype) for v in pb])
            d = np.zeros((16, 8))  # the mma: D[m][n] = sum over t and the 4 slots of lane (m % 8, t)'s A, (n, t)'s B
            for m in range(16):
                for n in range(8):
                    d[m, n] = sum(float(a_slots[4 * (m % 8) + t, m // 8] @ b_slots[4 * n + t]) for t in range(4))
            want = (q - z).astype(np.float64) @ _t_of(xb, dtype).reshape(16, 8)
            assert np.allclose(d, want, rtol=1e-12, atol=1e-12), (dtype, z, float(np.abs(d - want).max()))


def test_sacc_knobs_options_and_block_rule() -> None:
    """sacc only with reg; its int4 modules compile with -DMN_SACC=1 and no FFMA, its int8 ones as the reg build's;
    the (scale, zero) table keeps 8-byte entries; a block size that splits one warp's k of a k tile (group 16 with
    2 k16 steps a warp) is refused with the rule, group 32 / 128 / a whole row run."""
    from hybrid_runtime.cuda.moe_nbits_decode import uses_fma

    with pytest.raises(ValueError, match="sacc"):
        NBitsKnobs(sacc=1)
    kn = SACC_SETS["sacc_g1"]
    assert kn.options("bfloat16", 4)[-1] == "-DMN_SACC=1" and "-DMN_SACC=1" not in kn.options("bfloat16", 8)
    assert kn.options("bfloat16", 8) == replace(kn, sacc=0).options("bfloat16", 8)
    with pytest.raises(ValueError, match="FFMA"):
        kn.options("bfloat16", 4, fma=True)
    assert not uses_fma(replace(_ops()[0], short=True), kn) and uses_fma(replace(_ops()[0], short=True),
                                                                         replace(kn, sacc=0))
    assert smem_bytes("gate_up", 1, 4, 16, kn) == smem_bytes("gate_up", 1, 4, 16, replace(kn, sacc=0))
    assert set(SACC_SETS) & set(KNOB_SETS) == set() and all(k.sacc for k in SACC_SETS.values())
    assert not any(k.sacc for k in KNOB_SETS.values())
    for bs, ok in ((16, False), (32, True), (128, True), (2048, True)):
        gu, dn = _ops(bs=bs)
        dn = replace(dn, block_size=min(bs, 512))
        probs = shape_problems("bfloat16", 2048, 512, gu, dn, 257, 9, knobs=kn)
        assert (probs == []) == ok, (bs, probs)
        if not ok:
            assert "multiple of 32" in "; ".join(probs)
    assert shape_problems("bfloat16", 2048, 512, *_ops(bits=8, bs=16), 257, 9, knobs=kn) == []  # int8: exact path
    # 256-k tiles: 4 k16 steps a warp, so blocks of a multiple of 64; no int8 module; bk 256 only with sacc
    k256 = SACC_SETS["sacc_wide_k256"]
    assert k256.steps_per_warp == 4 and k256.options("bfloat16", 4)[-1] == "-DMN_SACC=1"
    assert shape_problems("bfloat16", 2048, 512, *_ops(bs=128), 257, 9, knobs=k256) == []
    assert "multiple of 64" in "; ".join(shape_problems("bfloat16", 2048, 512, *_ops(bs=32), 257, 9, knobs=k256))
    assert "int4 experts only" in "; ".join(shape_problems("bfloat16", 2048, 512, *_ops(bits=8), 257, 9, knobs=k256))
    with pytest.raises(ValueError, match="bk 256"):
        NBitsKnobs(bk=256, reg=1)
    with pytest.raises(ValueError, match="twin"):
        k256.decode_knobs()


def test_sacc_builds_cut_the_k_tile_loop() -> None:
    """Where nvdisasm is installed: sacc_g1's gate_up k-tile loop (the innermost loop with MMAs) has no per-weight
    float32 work (no F2FP; 8 FFMA: one per accumulator element of its 2 m-tiles), converts the codes with 16 T-pair
    HADD2 / HFMA2 (2 a row and k16 step: 2 m-tiles x 2 rows x 2 steps x 2) and is shorter than the FFMA build's
    (reg_g1 with -DMN_FMA=1), bf16 and fp16; sacc_wide_k256's loop spends < 0.85x sacc_wide's instructions a
    weight."""
    nvrtc_or_skip()
    if nvdisasm_path() is None:
        pytest.skip("no nvdisasm (the nvidia-cuda-nvdisasm dev dependency)")
    from benchmarks.sass_loops import disassemble, kernels, loops

    for dt in ("2", "1"):
        sizes = {}
        for name, extra in (("sacc", []), ("fma", ["MN_FMA=1"])):
            kn = SACC_SETS["sacc_g1"] if name == "sacc" else KNOB_SETS["reg_g1"]
            defines = [d[2:] for d in kn.options("bfloat16", 4)] + extra
            defines = [f"DT={dt}" if d.startswith("DT=") else d for d in defines]
            ins = kernels(disassemble(SOURCE, defines, "sm_90"))["moe_nb_gate_up"]
            inner = min((lp for lp in loops(ins) if lp.mix["HMMA"]), key=lambda lp: lp.size)
            sizes[name] = inner.size
            if name == "sacc":
                m = inner.mix
                assert m["F2FP"] == 0 and m["FFMA"] == 8 and m["FADD"] == 0 and m["FMUL"] == 0, (dt, m)
                assert m["HADD2"] + m["HFMA2"] == 16 and m["HMMA"] == 4, (dt, m)
        assert sizes["sacc"] < 0.85 * sizes["fma"], (dt, sizes)
    # the 256-k tiles: the loop's fixed cost over twice the weights (instructions a weight a lane, gate_up, wide)
    per_weight = {}
    for name in ("sacc_wide", "sacc_wide_k256"):
        kn = SACC_SETS[name]
        ins = kernels(disassemble(SOURCE, [d[2:] for d in kn.options("bfloat16", 4)], "sm_90"))["moe_nb_gate_up"]
        inner = min((lp for lp in loops(ins) if lp.mix["HMMA"]), key=lambda lp: lp.size)
        per_weight[name] = inner.size / (kn.rows("gate_up") // 16 * kn.steps_per_warp * 8)
    assert per_weight["sacc_wide_k256"] < 0.85 * per_weight["sacc_wide"], per_weight


def test_backend_build_falls_back_to_the_exact_twin_where_sacc_refuses_the_block_size() -> None:
    """backend_build resolves a sacc build to its EXACT_TWIN (the same tiles, sacc off) for int4 experts whose block
    size splits a warp's k of a k tile (group 16), keeps it for groups 32 / 128 / a row and for int8; every twin is
    an exact build of KNOB_SETS with the sacc build's other knobs."""
    from hybrid_runtime.cuda.moe_nbits_decode import EXACT_TWIN, K128_TWIN, backend_build, resolve_build

    # every sacc build has one fallback: the 128-k ones an exact twin, the 256-k ones their 128-k sacc build
    assert set(EXACT_TWIN) | set(K128_TWIN) == set(SACC_SETS) and not set(EXACT_TWIN) & set(K128_TWIN)
    for name, twin in EXACT_TWIN.items():  # the same tiles without sacc
        assert KNOB_SETS[twin] == replace(SACC_SETS[name], sacc=0), name
    assert resolve_build("sacc_wide_k256", 4, (128, 128)) == "sacc_wide_k256"
    # a warp's 64 k split by group 32: the 128-k sacc build (32 k a warp); group 16 splits that too: the exact twin
    assert resolve_build("sacc_wide_k256", 4, (32, 32)) == "sacc_wide"
    assert resolve_build("sacc_wide_k256", 4, (128, 16)) == "reg_g1_wide"
    assert resolve_build("sacc_g1_k256", 8) == "sacc_g1"  # no int8 256-k module: the 128-k build's exact path
    assert backend_build(8, 8, {8: ((1 << 30, "sacc_wide_k256"),)}) == "sacc_wide"
    for name, twin in K128_TWIN.items():  # the same columns, rows and warps in 128-k tiles, sacc kept
        kn, tw = SACC_SETS[name], SACC_SETS[twin]
        assert kn.bk == 256 and (tw.bk, tw.sacc, tw.gu_cols, tw.dn_rows, tw.gmax, tw.warps) == (
            128, 1, kn.gu_cols, kn.dn_rows, kn.gmax, kn.warps), name
    table = {4: ((1, "sacc_g1_deep"), (1 << 30, "sacc_g1")), 8: ((1 << 30, "sacc_g1"),)}
    assert backend_build(4, 1, table, (128, 128)) == "sacc_g1_deep" and backend_build(4, 8, table) == "sacc_g1"
    assert backend_build(4, 8, table, (2048, 512)) == "sacc_g1" and backend_build(4, 8, table, (32, 32)) == "sacc_g1"
    assert backend_build(4, 1, table, (128, 16)) == "reg_g1_deep" and backend_build(4, 64, table, (16, 16)) == "reg_g1"
    assert backend_build(8, 8, table, (16, 16)) == "sacc_g1"  # int8 runs the exact path of the sacc build anyway
    assert resolve_build("reg_g1", 4, (16,)) == "reg_g1"


def test_backend_tables_name_sacc_builds_only_where_the_projections_are_packed() -> None:
    """BACKEND_BUILDS (packed_weights experts: the dequantised bundle's bits) names exact builds of KNOB_SETS only;
    FAST_BUILDS (all / dual) the sacc builds for int4 and BACKEND_BUILDS' for int8; both by ascending row bounds
    ending unbounded, every name a build of ALL_SETS."""
    from hybrid_runtime.cuda.moe_nbits_decode import BACKEND_BUILDS, FAST_BUILDS

    for table in (BACKEND_BUILDS, FAST_BUILDS):
        assert set(table) == {4, 8}
        for entries in table.values():
            bounds = [rows for rows, _ in entries]
            assert bounds == sorted(bounds) and bounds[-1] == 1 << 30 and len(set(bounds)) == len(bounds)
            assert all(name in ALL_SETS for _, name in entries)
    assert all(name in KNOB_SETS for entries in BACKEND_BUILDS.values() for _, name in entries)
    assert all(SACC_SETS[name].sacc for _, name in FAST_BUILDS[4])
    assert FAST_BUILDS[8] == BACKEND_BUILDS[8]
