"""The int4 / int8 decode GEMM (``ops/cuda/nbits_decode.cu``, ``cuda/nbits_decode.py``) on any machine: NVRTC
compiles every build (bf16 / fp16 x 4 / 8 bits x the benchmark's knob sets) for sm_90 without spills, the weight
loads go out before griddepcontrol.wait; the host's rules and refusals; the dequantisation tricks (magic exponents,
exact integer differences) on every code; and a lane-by-lane numpy model of the kernel (chunks, words, nibble /
byte order, zero-point nibbles, blocks per chunk half, act-order gathers with the zero column, chunks past the row,
prmt pairs, mma fragments, split K in warp order) on random packed operands == an independent dequantiser
followed by a plain matmul."""

from __future__ import annotations

import re

import ml_dtypes
import numpy as np
import pytest
from nbits_decode_model import cta_model, dequantize_op, random_packed, x_op
from test_cuda_compile import nvrtc_or_skip, ptx

from hybrid_runtime.cuda.nbits_decode import (
    DEFAULT_KNOBS,
    KNOB_SETS,
    MAX_WARPS,
    SOURCE,
    TUNE_SETS,
    NBitsDecode,
    NBitsKnobs,
    NBitsOperand,
    bs_shift,
    check,
    grid,
    launch_args,
    pick,
    problems,
    warps_for,
)

BUILDS = sorted({kn.options(dt, bits) for kn in KNOB_SETS.values() for dt in ("bfloat16", "float16")
                 for bits in (4, 8)})


@pytest.mark.parametrize("options", BUILDS, ids=lambda o: "_".join(x.split("=")[1] for x in o))
def test_every_build_compiles_for_sm90_without_spills(options: tuple[str, ...]) -> None:
    nvrtc_or_skip()
    from hybrid_runtime.cuda.kernels import compile_log, source

    log = compile_log(source(SOURCE), SOURCE, options, "sm_90")
    per = _per_kernel(log)
    assert set(per) == {"nb_gemm_m16", "nb_gemm_m32", "nb_gemm_m16_perm", "nb_gemm_m32_perm"}, log
    for name, (regs, spill) in per.items():
        # the act-order builds (an 8-bit one spills 4 bytes at 128 registers, NVRTC 13) may spill a word or two;
        # the plain ones, the decode path of GPTQ checkpoints without desc_act, none
        assert regs <= 255 and spill <= (8 if name.endswith("_perm") else 0), (name, regs, spill, log)


def _per_kernel(log: str) -> dict[str, tuple[int, int]]:
    """kernel -> (registers, spill store bytes) from a ptxas -v log."""
    out, cur = {}, None
    for line in log.splitlines():
        if m := re.search(r"Compiling entry function '(\w+)'", line):
            cur = m.group(1)
        elif cur and (m := re.search(r"(\d+) bytes spill stores", line)):
            out[cur] = (0, int(m.group(1)))
        elif cur and (m := re.search(r"Used (\d+) registers", line)):
            out[cur] = (int(m.group(1)), out.get(cur, (0, 0))[1])
    return out


def test_the_default_build_keeps_two_8_warp_ctas_per_sm() -> None:
    """<= 128 registers per thread in nb_gemm_m16 (65536 registers per SM / (2 x 256 threads)): the loads in flight
    per SM the decode stream needs."""
    nvrtc_or_skip()
    from hybrid_runtime.cuda.kernels import compile_log, source

    for bits in (4, 8):
        log = compile_log(source(SOURCE), SOURCE, DEFAULT_KNOBS.options("bfloat16", bits), "sm_90")
        regs = _per_kernel(log)["nb_gemm_m16"][0]
        assert regs <= 128, (bits, regs)


def test_the_weight_loads_go_out_before_the_programmatic_wait() -> None:
    nvrtc_or_skip()
    from hybrid_runtime.cuda.kernels import source

    text = ptx(source(SOURCE), SOURCE, DEFAULT_KNOBS.options("bfloat16", 4))
    body = text[text.index(".entry nb_gemm_m16("):]
    body = body[:body.index(".entry", 10)] if ".entry" in body[10:] else body
    wait = body.index("griddepcontrol.wait")
    assert "ld.global.nc.L1::no_allocate.v4.u32" in body[:wait], "no weight load before the wait"
    assert "ld.global.nc.f32" in body[:wait], "no scale load before the wait"
    # X is read only after the wait (plain global loads of the activations)
    assert not re.search(r"ld\.global\.v4\.u32|ld\.global\.u16", body[:wait])
    assert "prefetch.global.L2" not in body
    # the pf build: L2 prefetches of the weights, also before the wait
    text = ptx(source(SOURCE), SOURCE, KNOB_SETS["pf8"].options("bfloat16", 4))
    body = text[text.index(".entry nb_gemm_m16("):]
    body = body[:body.index(".entry", 10)] if ".entry" in body[10:] else body
    wait = body.index("griddepcontrol.wait")
    assert "prefetch.global.L2" in body[:wait] and "prefetch.global.L2" not in body[wait:]


def test_tuning_candidates_keep_the_bits() -> None:
    """tune() may only choose among builds with the primary's split of K and dequantisation (same bits whatever
    wins); pick() keeps the primary on a tie."""
    for name in TUNE_SETS:
        assert KNOB_SETS[name].same_bits(DEFAULT_KNOBS, 4) and KNOB_SETS[name].same_bits(DEFAULT_KNOBS, 8), name
    assert not KNOB_SETS["bpw128"].same_bits(DEFAULT_KNOBS, 8) and not KNOB_SETS["exact"].same_bits(DEFAULT_KNOBS, 4)
    assert KNOB_SETS["exact"].same_bits(DEFAULT_KNOBS, 8)  # 8-bit always dequantises exactly
    kern = NBitsDecode(None, "bfloat16", DEFAULT_KNOBS, [KNOB_SETS[n] for n in TUNE_SETS])  # type: ignore[arg-type]
    assert kern.builds[0] == DEFAULT_KNOBS and len(kern.builds) == len(TUNE_SETS) and kern.modules == {}
    for bad in ("bpw128", "exact"):
        with pytest.raises(ValueError, match="same bits"):
            NBitsDecode(None, "bfloat16", DEFAULT_KNOBS, [KNOB_SETS[bad]])  # type: ignore[arg-type]
    u1, m32 = KNOB_SETS["u1"], KNOB_SETS["m32"]
    assert pick({DEFAULT_KNOBS: 2.0, u1: 1.0, m32: 1.5}, DEFAULT_KNOBS) == u1
    assert pick({DEFAULT_KNOBS: 1.0, u1: 1.0}, DEFAULT_KNOBS) == DEFAULT_KNOBS
    assert pick({}, DEFAULT_KNOBS) == DEFAULT_KNOBS and pick({u1: 3.0}, DEFAULT_KNOBS) == u1
    assert kern.knobs_for(12288, 2048, 4) == DEFAULT_KNOBS
    kern.choice[(12288, 2048, 4)] = m32
    assert kern.knobs_for(12288, 2048, 4) == m32 and kern.knobs_for(12288, 2048, 8) == DEFAULT_KNOBS


def test_xpre_loads_the_batch_activations_before_its_first_mma() -> None:
    """The xpre build's PTX: in the main loop, a batch's activation loads (plain v4 loads) all come before its first
    mma; the default's interleave (one batch: U super-steps x 4 vectors of 16 bytes for one n-group)."""
    nvrtc_or_skip()
    from hybrid_runtime.cuda.kernels import source

    def first_batch(options: tuple[str, ...]) -> str:
        text = ptx(source(SOURCE), SOURCE, options)
        body = text[text.index(".entry nb_gemm_m16("):]
        body = body[:body.index(".entry", 10)] if ".entry" in body[10:] else body
        return body[body.index("griddepcontrol.wait"):]

    for name, before in (("xpre", DEFAULT_KNOBS.u * 4), ("default", 4)):
        body = first_batch(KNOB_SETS[name].options("bfloat16", 4))
        head = body[:body.index("mma.sync")]
        assert len(re.findall(r"ld\.global(?:\.nc)?\.v4\.u32", head)) == before, name


def test_the_split_of_k_fits_32_bit_arithmetic() -> None:
    """The kernel splits a row's S super-steps over nw warps as (S w) / nw in 32-bit unsigned arithmetic (the
    model: exact integers); the host keeps K < 2^24, so S nw < 2^22 never wraps, and the split covers [0, S) in order
    with no gap for every warp count the host chooses."""
    K_max = (1 << 24) - 32
    for bits in (4, 8):
        S = (K_max * bits // 128 + 3) // 4
        assert S * MAX_WARPS < 1 << 22
    for S in range(1, 70):
        for nw in range(1, MAX_WARPS + 1):
            bounds = [(S * w) // nw for w in range(nw + 1)]
            assert bounds[0] == 0 and bounds[-1] == S and bounds == sorted(bounds)


def _op(**kw: int) -> NBitsOperand:
    base = dict(B=256, scales=512, zp=0, perm=0, K=2048, N=12288, bits=4, block_size=128, k_in=2048)
    base.update(kw)
    return NBitsOperand(**base)


def test_knobs_and_host_rules() -> None:
    assert DEFAULT_KNOBS.kernel() == "nb_gemm_m16" and KNOB_SETS["m32"].kernel(perm=True) == "nb_gemm_m32_perm"
    assert not DEFAULT_KNOBS.exact and KNOB_SETS["exact"].exact
    for bad in ({"u": 0}, {"u": 9}, {"rows": 24}, {"bytes_per_warp": 100}, {"pf": -1}, {"pf": 65},
                {"sacc": True, "exact": True}):
        with pytest.raises(ValueError, match="nbits_decode knobs"):
            NBitsKnobs(**bad)
    assert DEFAULT_KNOBS.options("float16", 8) == ("-DDT=1", "-DNB_BITS=8", "-DNB_U=2", "-DNB_EXACT=0", "-DNB_XPRE=0",
                                                   "-DNB_PF=0", "-DNB_SACC=0")
    assert KNOB_SETS["xpre"].options("bfloat16", 4)[-3:] == ("-DNB_XPRE=1", "-DNB_PF=0", "-DNB_SACC=0")
    assert KNOB_SETS["pf8"].options("bfloat16", 4)[-2] == "-DNB_PF=8"
    assert KNOB_SETS["sacc"].options("bfloat16", 4)[-1] == "-DNB_SACC=1"
    assert KNOB_SETS["sacc"].options("bfloat16", 8)[-1] == "-DNB_SACC=0"  # 8-bit: the exact path
    # warps from a row's packed bytes / 256: 2048 int4 = 1 KiB -> 4, int8 -> 8; 512 int4 = 256 B -> 1; 4096 int4 -> 8
    assert warps_for(2048, 4) == 4 and warps_for(2048, 8) == 8 and warps_for(512, 4) == 1 and warps_for(4096, 4) == 8
    assert warps_for(32, 4) == 1 and warps_for(2048, 4, KNOB_SETS["bpw512"]) == 2
    # / 128: twice the warps (two 64-byte super-steps each for a 2048-column int4 row), clamped to 8
    bpw128 = KNOB_SETS["bpw128"]
    assert warps_for(2048, 4, bpw128) == 8 and warps_for(512, 4, bpw128) == 2 and warps_for(4096, 4, bpw128) == 8
    assert warps_for(512, 8, bpw128) == 4 and warps_for(2048, 8, bpw128) == 8 and warps_for(64, 4, bpw128) == 1
    assert grid(12288) == (768, 1, 1) and grid(64) == (4, 1, 1) and grid(40, KNOB_SETS["m32"]) == (2, 1, 1)
    assert [bs_shift(b) for b in (16, 32, 128, 2048, 48, 96)] == [4, 5, 7, 11, -1, -1]
    assert problems("bfloat16", 16, 2048, 4096, _op()) == []
    assert problems("float16", 1, 512, 0, _op(bits=8, K=512, k_in=512, N=2048, block_size=512, zp=64)) == []
    assert problems("bfloat16", 1, 2056, 0, _op(perm=1024, k_in=2000)) == []  # act order: any x alignment


@pytest.mark.parametrize("kw, ldx, n, dtype, match", [
    ({}, 2048, 17, "bfloat16", r"n 17 not in 1\.\.16"),
    ({}, 2048, 0, "bfloat16", r"n 0"),
    ({}, 2048, 1, "float32", r"dtype 'float32'"),
    ({"bits": 3}, 2048, 1, "bfloat16", r"bits 3"),
    ({"block_size": 8}, 2048, 1, "bfloat16", r"block size 8"),
    ({"block_size": 24}, 2048, 1, "bfloat16", r"block size 24"),
    ({"K": 2000, "k_in": 2000}, 2000, 1, "bfloat16", r"K 2000 is not a positive multiple"),
    ({"K": 48, "k_in": 48, "block_size": 16}, 48, 1, "bfloat16", r"multiple of 16 bytes \(K % 32"),
    ({"k_in": 2000}, 2048, 1, "bfloat16", r"k_in 2000 != K 2048 without a permutation"),
    ({}, 2044, 1, "bfloat16", r"16-byte aligned with ldx % 8"),
    ({"perm": 1024, "k_in": 3000}, 3000, 1, "bfloat16", r"k_in 3000 not in 1\.\.K"),
    ({"perm": 1026}, 2048, 1, "bfloat16", r"perm must be 4-byte aligned"),
    ({"perm": 1024, "k_in": 2000}, 1999, 1, "bfloat16", r"ldx 1999 < k_in 2000"),
    ({"B": 8}, 2048, 1, "bfloat16", r"B must be a 16-byte aligned"),
    ({"scales": 0}, 2048, 1, "bfloat16", r"scales must be"),
    ({"N": 0}, 2048, 1, "bfloat16", r"N 0 < 1"),
])
def test_refusals_name_the_rule(kw: dict, ldx: int, n: int, dtype: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        check(dtype, n, ldx, 4096, _op(**kw))


def test_operand_from_device_arrays() -> None:
    from hybrid_runtime.cuda.driver import DeviceArray

    def arr(ptr: int, n: int, dt: str) -> DeviceArray:
        return DeviceArray(ptr, (n,), dt, 0)

    meta = np.array([2048, 64, 4, 128, 0, 2000])  # K, N, bits, block size, accuracy level, k_in
    op = NBitsOperand.from_arrays(arr(4096, 64 * 1024, "uint8"), arr(512, 64 * 16, "float32"),
                                  arr(256, 64 * 8, "uint8"), arr(128, 2048, "int32"), meta)
    assert op == NBitsOperand(4096, 512, 256, 128, 2048, 64, 4, 128, 2000)
    assert op.nbytes == 64 * 1024 + 4 * 64 * 16 + 64 * 8 + 4 * 2048
    assert NBitsOperand.from_arrays(arr(16, 64 * 2048, "uint8"), arr(32, 64 * 16, "float32"), None, None,
                                    np.array([2048, 64, 8, 128, 0, 2048])).zp == 0
    with pytest.raises(ValueError, match=r"scales: float16 x 1024, want float32 x 1024; perm: int64"):
        NBitsOperand.from_arrays(arr(4096, 64 * 1024, "uint8"), arr(512, 64 * 16, "float16"), None,
                                 arr(128, 2048, "int64"), meta)
    with pytest.raises(ValueError, match=r"zp: uint8 x 1024, want uint8 x 512"):
        NBitsOperand.from_arrays(arr(4096, 64 * 1024, "uint8"), arr(512, 64 * 16, "float32"),
                                 arr(256, 64 * 16, "uint8"), None, np.array([2048, 64, 4, 128, 0, 2048]))
    with pytest.raises(ValueError, match="block size 96 does not divide K 2048"):
        NBitsOperand.from_arrays(arr(16, 1, "uint8"), arr(16, 1, "float32"), None, None, [2048, 64, 4, 96, 0, 2048])


def test_launch_refuses_before_touching_the_device() -> None:
    kern = NBitsDecode(None, "bfloat16")  # type: ignore[arg-type]  # no device needed: the check comes first
    with pytest.raises(ValueError, match="nbits_decode: n 17"):
        kern.launch(17, 4096, 2048, _op(), 8192, 12288, True)
    assert kern.modules == {}
    with pytest.raises(ValueError, match="bfloat16 / float16"):
        NBitsDecode(None, "float32")  # type: ignore[arg-type]


def test_launch_arguments_follow_the_kernel_signature() -> None:
    nvrtc_or_skip()
    from hybrid_runtime.cuda.kernels import source

    args = launch_args(3, 4096, 2056, _op(zp=64, perm=1024, k_in=2000, block_size=48 * 16), 8192, 12300, False,
                       residual=8192, ldr=12300, bias=640)
    text = ptx(source(SOURCE), SOURCE, DEFAULT_KNOBS.options("bfloat16", 4))
    entry = re.search(r"\.entry nb_gemm_m16\((.*?)\)", text, re.S)
    assert entry is not None
    kinds = re.findall(r"\.param \.(u64|u32|s32|s64|b64|b32) ", entry.group(1))
    want = {"ptr": "64", "i64": "64", "i32": "32"}
    assert [want[k] for k, _ in args] == [k[-2:] for k in kinds]
    assert args[10] == ("i32", -1) and args[9] == ("i32", 768) and args[11] == ("i32", 3)


def test_magic_exponents_make_the_integer_differences_exactly() -> None:
    """The fast path: (magic | c) is magic + c in T for every code, (magic + c) - (magic + z) == c - z exactly, and
    the scale product rounded once equals float32 (c - z) * s rounded to T for float16-valued scales (float16).
    The float32 path: 2^23 | c - (2^23 + z) == c - z for every 8-bit code."""
    c = np.arange(16, dtype=np.uint16)
    h16 = (0x6400 | c).view(np.float16)
    assert np.array_equal(h16.astype(np.float64), 1024 + c)
    b16 = (0x4300 | c).view(ml_dtypes.bfloat16)
    assert np.array_equal(b16.astype(np.float64), 128 + c)
    assert float(np.array([0x3F80], np.uint16).view(ml_dtypes.bfloat16)[0]) == 1.0
    assert float(np.array([0x3C00], np.uint16).view(np.float16)[0]) == 1.0
    for z in range(16):
        neg = np.array([(0x6400 | z) | 0x8000], np.uint16).view(np.float16)[0]
        d16 = h16 + neg
        assert np.array_equal(d16.astype(np.int64), c.astype(np.int64) - z)
        negb = np.array([(0x4300 | z) | 0x8000], np.uint16).view(ml_dtypes.bfloat16)[0]
        db = (b16.astype(np.float32) + np.float32(negb)).astype(ml_dtypes.bfloat16)
        assert np.array_equal(db.astype(np.int64), c.astype(np.int64) - z)
    rng = np.random.default_rng(0)
    s = (rng.uniform(0.5, 1.5, 4096) * 10.0 ** rng.integers(-6, 0, 4096)).astype(np.float16)
    d = rng.integers(-15, 16, 4096).astype(np.float16)
    assert np.array_equal((d * s).view(np.uint16),
                          (d.astype(np.float32) * s.astype(np.float32)).astype(np.float16).view(np.uint16))
    from nbits_decode_model import prmt

    for w in rng.integers(0, 1 << 32, 64, dtype=np.uint64).tolist():  # 8-bit: one prmt makes 0x4B0000 | byte
        assert [prmt(w, 0x4B000000, 0x7440 | j) for j in range(4)] == [0x4B000000 | (w >> 8 * j) & 255
                                                                        for j in range(4)]
    c8 = np.arange(256, dtype=np.uint32)
    f = (0x4B000000 | c8).view(np.float32)
    for z in (0, 1, 128, 255):
        assert np.array_equal((f - np.float32(8388608.0 + z)).astype(np.int64), c8.astype(np.int64) - z)


CASES = [  # N, K, bits, bs, asym, k_in (None: no perm), n, mt_count, nw
    (16, 128, 4, 32, True, None, 1, 1, 1),
    (40, 256, 4, 16, True, 230, 9, 2, 3),  # bs 16: two blocks per chunk; act order with 26 padding columns
    (20, 192, 4, 64, True, None, 5, 2, 2),  # 6 chunks per row: the second super-step is half past the row
    (24, 192, 8, 64, False, 190, 16, 1, 2),
    (16, 96, 8, 48, True, None, 8, 1, 1),  # a block size that is not a power of two (the kernel divides)
    (17, 160, 8, 160, True, None, 3, 1, 2),  # one block per row (group size -1); N past the last m-tile
    (33, 96, 4, 96, False, 90, 12, 2, 1),  # 4-bit, one block per row, 3 chunks, act order
    (24, 2048, 4, 128, True, None, 3, 1, 8),  # bpw128's split of a 2048-column int4 row: 8 warps of 2 super-steps
    (16, 512, 8, 64, False, 500, 16, 1, 4),  # bpw128, 8-bit: 4 warps of 2 super-steps, act order
]
SACC_CASES = [  # 4-bit, block sizes a multiple of 128 (what the host runs the sacc build for)
    (24, 2048, 4, 128, True, None, 3, 1, 8),
    (20, 640, 4, 128, True, None, 16, 2, 3),  # 5 super-steps over 3 warps; N past the last m-tile
    (33, 384, 4, 384, False, 370, 12, 2, 1),  # one block per row, act order with 14 padding columns
    (16, 1024, 4, 256, False, None, 9, 1, 2),  # two super-steps a block
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "N{}_K{}_b{}_bs{}_{}_{}_n{}_mt{}_w{}".format(
    *c[:4], "asym" if c[4] else "sym", "perm" if c[5] else "noperm", *c[6:]))
def test_the_lanes_compute_the_dequantised_product(case: tuple) -> None:
    N, K, bits, bs, asym, k_in, n, mt_count, nw = case
    rng = np.random.default_rng(N * K + bits + bs + n)
    p = random_packed(rng, N, K, bits, bs, asym, k_in)
    x = rng.standard_normal((16, p.k_in + 3))
    want = x_op(p, x)[:n] @ dequantize_op(p).T  # [n, N]
    if p.perm is not None:  # the same through the input's own columns (the zero column contributes nothing)
        w_in = np.zeros((N, p.k_in + 1))
        np.add.at(w_in.T, p.perm, dequantize_op(p).T)
        np.testing.assert_allclose(x[:n, :p.k_in] @ w_in[:, :p.k_in].T, want, rtol=1e-12, atol=1e-12)
    xo = x_op(p, x)
    rows = 16 * mt_count
    for row0 in range(0, N, rows):
        got = cta_model(p, xo, n, row0, mt_count, nw)
        r1 = min(N, row0 + rows)
        np.testing.assert_allclose(got[:r1 - row0, :n], want[:, row0:r1].T, rtol=1e-12, atol=1e-12)
        assert np.isnan(got[:, n:]).all() and np.isnan(got[r1 - row0:]).all()


@pytest.mark.parametrize("case", SACC_CASES, ids=lambda c: "N{}_K{}_bs{}_{}_{}_n{}_mt{}_w{}".format(
    c[0], c[1], c[3], "asym" if c[4] else "sym", "perm" if c[5] else "noperm", *c[6:]))
def test_the_sacc_lanes_compute_the_quantized_product(case: tuple) -> None:
    """NB_SACC: MMAs on q - z into a super-step's partial, each element scaled by its own lane's chunk scale ==
    x @ w.T with the unrounded dequantised weight (the float64 model: the only difference on the GPU is float32
    accumulation, no T rounding of weights or scales); and the host resolves these operands to the sacc build."""
    N, K, bits, bs, asym, k_in, n, mt_count, nw = case
    rng = np.random.default_rng(N * K + bs + n)
    p = random_packed(rng, N, K, bits, bs, asym, k_in)
    x = rng.standard_normal((16, p.k_in + 3))
    xo = x_op(p, x)
    want = xo[:n] @ dequantize_op(p).T
    rows = 16 * mt_count
    for row0 in range(0, N, rows):
        got = cta_model(p, xo, n, row0, mt_count, nw, sacc=True)
        r1 = min(N, row0 + rows)
        np.testing.assert_allclose(got[:r1 - row0, :n], want[:, row0:r1].T, rtol=1e-12, atol=1e-12)
        assert np.isnan(got[:, n:]).all() and np.isnan(got[r1 - row0:]).all()
    assert KNOB_SETS["sacc"].resolve(bits, bs) == KNOB_SETS["sacc"]


def test_sacc_needs_a_super_step_in_one_block() -> None:
    """Why the host keeps the sacc build to block sizes that are multiples of 128: with 64-code blocks the four
    lanes of a super-step hold two different scales per row, and the lane-own scaling the kernel does is wrong; such
    operands resolve to the build without it (the fast dequantisation), as 8-bit ones do."""
    rng = np.random.default_rng(3)
    p = random_packed(rng, 16, 512, 4, 64, True)
    xo = x_op(p, rng.standard_normal((16, 512)))
    got = cta_model(p, xo, 2, 0, 1, 1, sacc=True)[:, :2]
    want = (xo[:2] @ dequantize_op(p).T).T
    assert not np.allclose(got, want, rtol=1e-6, atol=1e-9)
    sacc, m32 = KNOB_SETS["sacc"], KNOB_SETS["sacc_m32"]
    for bits, bs in ((4, 64), (4, 32), (4, 192), (8, 128), (4, 0)):
        assert not sacc.runs_sacc(bits, bs) and sacc.resolve(bits, bs) == DEFAULT_KNOBS, (bits, bs)
    assert m32.resolve(4, 64) == KNOB_SETS["m32"] and m32.resolve(4, 2048) == m32
    assert DEFAULT_KNOBS.resolve(4, 128) == DEFAULT_KNOBS  # a build without sacc is never changed
    # same bits: sacc against the fast default only where sacc does not run
    assert not sacc.same_bits(DEFAULT_KNOBS, 4) and not sacc.same_bits(DEFAULT_KNOBS, 4, 2048)
    assert sacc.same_bits(DEFAULT_KNOBS, 4, 64) and sacc.same_bits(DEFAULT_KNOBS, 8) and sacc.same_bits(m32, 4)


def test_sacc_tuning_candidates_and_names() -> None:
    """tune_candidates gives every tuning set the primary's dequantisation (sacc too), so the primary's tuner keeps
    its bits; build_name names the derived builds for the load log."""
    from hybrid_runtime.cuda.nbits_decode import build_name, tune_candidates

    sacc = KNOB_SETS["sacc"]
    cands = tune_candidates(sacc)
    assert len(cands) == len(TUNE_SETS) and cands[0] == sacc and KNOB_SETS["sacc_m32"] in cands
    assert all(c.sacc and c.same_bits(sacc, 4) and c.same_bits(sacc, 4, 64) for c in cands)
    assert tune_candidates(DEFAULT_KNOBS) == [KNOB_SETS[n] for n in TUNE_SETS]
    kern = NBitsDecode(None, "bfloat16", sacc, cands)  # type: ignore[arg-type]
    assert kern.builds[0] == sacc and len(kern.builds) == len(TUNE_SETS)
    with pytest.raises(ValueError, match="same bits"):
        NBitsDecode(None, "bfloat16", sacc, [DEFAULT_KNOBS])  # type: ignore[arg-type]
    assert build_name(DEFAULT_KNOBS) == "default" and build_name(KNOB_SETS["sacc_m32"]) == "sacc_m32"
    assert build_name(cands[TUNE_SETS.index("pf8")]) == "pf8 (sacc, bpw 256)"


def test_the_backend_runs_the_sacc_build_where_it_applies() -> None:
    """CudaBackend's packed projections run BACKEND_KNOBS (the scale on the accumulator: 0.85-0.87x the fast
    build's time on the 35B-A3B projections, gpu_nbits_decode_h200.md "Stop 53"): GPTQ's 128 and whole-row blocks
    at 4 bits run it, other 4-bit blocks the fast build, 8-bit weights the exact path; the backend module hands
    NBitsDecode that build and its tuning candidates (the same bits, whichever the load's timing keeps)."""
    import inspect

    from hybrid_runtime.cuda import backend
    from hybrid_runtime.cuda.nbits_decode import BACKEND_KNOBS, tune_candidates

    assert BACKEND_KNOBS.sacc and BACKEND_KNOBS is KNOB_SETS["sacc"] and not BACKEND_KNOBS.exact
    assert BACKEND_KNOBS.resolve(4, 128) == BACKEND_KNOBS and BACKEND_KNOBS.resolve(4, 4096) == BACKEND_KNOBS
    assert BACKEND_KNOBS.resolve(4, 64) == DEFAULT_KNOBS and BACKEND_KNOBS.resolve(4, 32) == DEFAULT_KNOBS
    assert "-DNB_SACC=0" in BACKEND_KNOBS.options("bfloat16", 8)  # 8-bit: the exact path, as every build
    assert backend.NBITS_BACKEND_KNOBS is BACKEND_KNOBS
    src = inspect.getsource(backend.CudaBackend.__init__)
    assert "NBitsDecode(self.dev, self.dtype, NBITS_BACKEND_KNOBS," in src
    assert "nbits_tune_candidates(NBITS_BACKEND_KNOBS)" in src
    assert all(c.same_bits(BACKEND_KNOBS, 4) for c in tune_candidates(BACKEND_KNOBS))


def test_sacc_cuts_the_main_loop() -> None:
    """The sacc build's main loop (16 rows, one n-group: the decode steps of <= 8 rows) has no packed scale
    multiply (HMUL2) and one FFMA per output element a super-step, and at most 0.75x the default's instructions
    (SASS, NVRTC 13: 925 against 1318)."""
    nvrtc_or_skip()
    from benchmarks.sass_loops import disassemble, kernels, loops, nvdisasm_path

    if nvdisasm_path() is None:
        pytest.skip("no nvdisasm (the nvidia-cuda-nvdisasm dev dependency)")

    def one_group_loop(kn: NBitsKnobs) -> dict[str, int]:
        ins = kernels(disassemble(SOURCE, [d[2:] for d in kn.options("bfloat16", 4)], "sm_90"))["nb_gemm_m16"]
        # the k loops of both n-group counts (the one-group loop has half the HMMA of the two-group one)
        return min((lp for lp in loops(ins) if lp.mix["HMMA"]), key=lambda lp: lp.mix["HMMA"]).mix

    base, sacc = one_group_loop(DEFAULT_KNOBS), one_group_loop(KNOB_SETS["sacc"])
    assert base.get("HMUL2", 0) > 0 and sacc.get("HMUL2", 0) == 0, (base, sacc)
    assert sacc.get("FFMA", 0) > 0 and sacc["HMMA"] == base["HMMA"]
    assert sum(sacc.values()) <= 0.75 * sum(base.values()), (sum(sacc.values()), sum(base.values()))


def test_the_independent_dequantiser_agrees_with_the_project_layout() -> None:
    """The test's own reading of the format == quant.nbits_dequantize on a to_nbits operand (the loader's)."""
    from nbits_decode_model import Packed

    from hybrid_runtime.quant import QuantLinear, nbits_dequantize, to_nbits

    rng = np.random.default_rng(5)
    for bits, g_idx in ((4, np.arange(256) // 64), (8, rng.permutation(np.arange(256) // 32))):
        G = int(g_idx.max()) + 1
        ql = QuantLinear(rng.integers(0, 1 << bits, (24, 256), dtype=np.uint8),
                         rng.uniform(0.001, 0.01, (24, G)).astype(np.float16).astype(np.float32),
                         rng.integers(0, 1 << bits, (24, G), dtype=np.uint8), g_idx.astype(np.int32), bits)
        w = to_nbits(ql)
        nb = w.K // w.block_size
        zp = None if w.zero_points is None else w.zero_points.reshape(w.N, -1)
        p = Packed(w.B.reshape(w.N, -1), w.scales.reshape(w.N, nb), zp,
                   None if w.perm is None else w.perm.astype(np.int32), w.K, w.N, bits, w.block_size, w.k_in)
        x = rng.standard_normal((3, w.k_in))
        ref = x @ nbits_dequantize(w.B, w.scales, w.zero_points, w.perm, w.meta(0)).T.astype(np.float64)
        np.testing.assert_allclose(x_op(p, x) @ dequantize_op(p).T, ref, rtol=1e-9, atol=1e-9)


def test_prepare_compiles_each_resolved_build_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """NBitsDecode.prepare (what CudaBackend calls at load, before any capture) loads one module per (resolved
    build, bits) its operands run: a sacc primary compiles itself for 4-bit blocks of 128 / whole rows and its
    twin without sacc for 64-code blocks and for 8-bit weights; nothing twice (recording load_module: no GPU)."""
    import hybrid_runtime.cuda.nbits_decode as nbd

    loads: list[tuple[str, ...]] = []
    monkeypatch.setattr(nbd, "load_module", lambda src, opts, arch: loads.append(opts) or object())

    class Dev:
        arch = "sm_90"

    sacc = KNOB_SETS["sacc"]
    kern = NBitsDecode(Dev(), "bfloat16", sacc)  # type: ignore[arg-type]
    ops = [_op(), _op(K=4096, N=2048, k_in=4096), _op(block_size=2048), _op(block_size=64),
           _op(bits=8, block_size=128), _op(block_size=64, N=64)]
    got = kern.prepare(ops)
    assert got == [(sacc.resolve(4, 64), 4), (sacc, 4), (sacc.resolve(8, 128), 8)]
    assert [o[-1] for o in loads] == ["-DNB_SACC=0", "-DNB_SACC=1", "-DNB_SACC=0"]
    assert loads[2][1] == "-DNB_BITS=8" and len(kern.modules) == 3
    kern.prepare(ops)  # loaded once
    assert len(loads) == 3
