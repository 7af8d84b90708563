"""The add + RMSNorm and the prefill MoE's slot dtype on any machine: NVRTC compiles fused.cu's ``rmsnorm_rows`` /
``rmsnorm_rows_t`` (every dtype, the default and the wide NORM_KMAX builds) and the ``_t`` down GEMMs (mma.sync and
both wgmma builds) without spills; the norm's PTX reads rows with 16-byte (float32) / 8-byte (bf16 / fp16 slots)
vector loads; and the backend's plumbing (a stub backend, no GPU): prefill steps on the tensor-core MoE write the
slots in the bundle dtype (routed experts and the shared expert's cuBLASLt GEMM, slot k at k * H * 2 bytes) and the
add reads them with ``rmsnorm_rows_t``; decode steps, float32 bundles and ``moe_slots_lowp = False`` keep float32;
the norm's block follows ``norm_block``."""

from __future__ import annotations

import contextlib
import re
from types import SimpleNamespace

import pytest
from test_cuda_compile import check_log, nvrtc_or_skip, ptx

from hybrid_runtime.cuda.driver import DeviceArray


def _entry_log(log: str, name: str) -> str:
    for part in log.split("Compiling entry function")[1:]:
        if part.split("'")[1] == name:
            return part
    raise AssertionError(f"{name} not compiled:\n{log}")


@pytest.mark.parametrize("dt", [0, 1, 2])
@pytest.mark.parametrize("kmax", [None, 8])
def test_norm_builds_compile_without_spills(dt: int, kmax: int | None) -> None:
    nvrtc_or_skip()
    from hybrid_runtime.cuda.backend import NORM_MAX_THREADS
    from hybrid_runtime.cuda.kernels import compile_log, source

    opts = (f"-DDT={dt}",) + ((f"-DNORM_KMAX={kmax}",) if kmax else ())
    log = compile_log(source("fused.cu"), "fused.cu", opts, "sm_90")
    for name in ("rmsnorm_rows", "rmsnorm_rows_t"):
        part = _entry_log(log, name)
        check_log(part)
        assert re.search(r"\b0 bytes stack frame", part), part
        regs = int(re.search(r"Used (\d+) registers", part).group(1))
        assert regs * NORM_MAX_THREADS <= 65536, part


@pytest.mark.parametrize("dt", [1, 2])
def test_norm_reads_rows_with_vector_loads(dt: int) -> None:
    nvrtc_or_skip()
    from hybrid_runtime.cuda.kernels import source

    text = ptx(source("fused.cu"), "fused.cu", (f"-DDT={dt}",))

    def body(name: str) -> str:
        i = text.index(f".entry {name}(")
        j = text.find(".entry", i + 8)
        return text[i:j if j > 0 else None]

    f32, lowp = body("rmsnorm_rows"), body("rmsnorm_rows_t")
    assert ".maxntid 512, 1, 1" in f32 and ".maxntid 512, 1, 1" in lowp
    assert re.search(r"ld\.global(\.nc)?\.v4\.(f32|u32|b32)", f32)  # x and float32 slots: 16 bytes a lane
    assert re.search(r"ld\.global(\.nc)?\.v2\.(u32|b32)", lowp)  # bf16 / fp16 slots: 4 values, 8 bytes a lane
    assert re.search(r"st\.global\.v4\.f32", f32)  # x_out
    assert re.search(r"st\.global\.v2\.(u32|b32)", f32)  # h in T, 4 values


def test_down_gemms_in_the_bundle_dtype_compile_without_spills() -> None:
    nvrtc_or_skip()
    from hybrid_runtime.cuda.kernels import compile_log, source
    from hybrid_runtime.cuda.moe_prefill import WGMMA_ARCH, WGMMA_VARIANTS

    jobs = [("moe_gemm.cu", (f"-DDT={d}",), "sm_90", "moe_gemm_down") for d in (1, 2)]
    jobs += [(v.source, (f"-DDT={d}", *v.options), WGMMA_ARCH, "moe_wgmma_down") for v in WGMMA_VARIANTS.values()
             for d in (1, 2)]
    for src, opts, arch, down in jobs:
        log = compile_log(source(src), src, opts, arch)
        check_log(log)
        _entry_log(log, down)
        b = _entry_log(log, down + "_t")
        assert "serialized" not in b, b  # C7518: wgmma serialised (no async MMA) would show here


# ---------------------------------------------------------------------------------------------- backend plumbing


def _stub(dtype: str = "bfloat16", tensor_cores: bool = True, H: int = 128):
    """A CudaBackend without a device: its moe() and _rmsnorm() with every launch / GEMM recorded."""
    from hybrid_runtime.cuda.backend import CudaBackend, _Arena
    from hybrid_runtime.cuda.weights import MoEWeights

    be = object.__new__(CudaBackend)
    inter, E, k, T = 128, 8, 2, 64
    be.cfg = SimpleNamespace(hidden_size=H, moe_intermediate_size=inter, num_experts_per_tok=k, num_experts=E,
                             norm_topk_prob=True, rms_norm_eps=1e-6)
    be.dtype, be.es, be.ny, be.moe_decode = dtype, 2 if dtype != "float32" else 4, k + 1, "auto"
    be.dev = SimpleNamespace(ordinal=0)
    kk = k + 1
    arena = _Arena()
    ptr = iter(range(1 << 20, 1 << 30, 1 << 20))
    for name, shape, dt in [("router", (T, 16), "float32"), ("pair_w", (T, kk), "float32"),
                            ("pair_e", (T, kk), "int32"), ("pair_list", (T, kk), "int32"),
                            ("expert_off", (1, E + 2), "int32"), ("active", (1, E + 2), "int32"),
                            ("moe_act", (T * kk, inter), dtype), ("y", (T, kk * H), "float32"),
                            ("moe_tiles", (1, 64), "int32"), ("moe_cta_counts", (8, E + 1), "int32"),
                            ("gu", (T, 2 * inter), "float32"), ("act", (T, inter), dtype)]:
        arena.bufs[name] = DeviceArray(next(ptr), shape, dt, 0)
    be.arena = arena
    mw = MoEWeights(DeviceArray(next(ptr), (16, H), dtype, 0), 16, DeviceArray(next(ptr), (E, 2 * inter, H), dtype, 0),
                    DeviceArray(next(ptr), (E, H, inter), dtype, 0), E, False,
                    DeviceArray(next(ptr), (2 * inter, H), dtype, 0), DeviceArray(next(ptr), (H, inter), dtype, 0))
    rec: list = []
    be.w = SimpleNamespace(moe=lambda layer: mw)
    be._prof = lambda name: contextlib.nullcontext()
    be._gemm = lambda x, w, out, **kw: rec.append(("gemm", w is mw.shared_down, out))
    be._launch = lambda name, grid, block, args, smem=0, module=None: rec.append((name, grid, block, args))
    be.moe_prefill = SimpleNamespace(launch=lambda *a, **kw: rec.append(("moe_prefill", kw.get("y_dtype"))),
                                     route=lambda *a, **kw: None) if tensor_cores else None
    be.moe_mma_decode = SimpleNamespace(launch=lambda *a, **kw: rec.append(("moe_mma_decode",)))
    be.moe_mma_decode_many = be.moe_mma_decode  # the build of decode steps past 16 rows: the same record
    be.moe_router = None
    return be, rec, mw


def _moe(be, phase, n: int):
    from hybrid_runtime.cuda.backend import CudaCtx, Mat

    ctx = CudaCtx(phase, n, n, n, n, n, 1, None, None, n, None, False)
    return be.moe(0, ctx, Mat(0x1000, n, be.cfg.hidden_size, be.cfg.hidden_size, be.dtype))


def test_prefill_slots_are_in_the_bundle_dtype_and_decode_keeps_float32() -> None:
    from hybrid_runtime.cuda.backend import MoEOut, norm_block
    from hybrid_runtime.engine.base import Phase

    be, rec, _ = _stub()
    H, k, y = be.cfg.hidden_size, be.cfg.num_experts_per_tok, be.arena.bufs["y"].ptr
    out = _moe(be, Phase.PREFILL, 40)
    assert isinstance(out, MoEOut) and out.dtype == "bfloat16" and out.y == y and out.ny == k + 1 and out.sg
    assert ("moe_prefill", "bfloat16") in rec
    shared = [r[2] for r in rec if r[0] == "gemm" and r[1]]  # the shared expert's down GEMM: into slot k, bf16
    assert len(shared) == 1 and shared[0].dtype == "bfloat16" and shared[0].ptr == y + k * H * 2
    assert shared[0].ld == (k + 1) * H
    rec.clear()
    x = be.arena.mat("y", 40)  # any float32 [n, H] rows stand in for x
    x = type(x)(x.ptr, 40, H, H, "float32")
    be._rmsnorm(x, DeviceArray(0x5000, (H,), "float32", 0), x, 40, y=out, x_out=x)
    (name, grid, block, args), = rec
    assert name == "rmsnorm_rows_t" and grid == (40, 1, 1) and block == norm_block(H, 40)[0]
    assert [a[1] for a in args][1:5] == [y, k + 1, out.sg, out.sg_stride]
    for phase, n in ((Phase.DECODE, 4), (Phase.DECODE, 40)):  # decode: float32 slots, rmsnorm_rows
        rec.clear()
        out = _moe(be, phase, n)
        assert out.dtype == "float32", (phase, n)
        assert all(r[2].dtype == "float32" for r in rec if r[0] == "gemm" and r[1])
        rec.clear()
        be._rmsnorm(x, DeviceArray(0x5000, (H,), "float32", 0), x, n, y=out, x_out=x)
        assert rec[0][0] == "rmsnorm_rows"
    be.moe_slots_lowp = False  # the float32 slots on demand (comparisons)
    rec.clear()
    assert _moe(be, Phase.PREFILL, 40).dtype == "float32" and ("moe_prefill", "float32") in rec
    f32, _, _ = _stub("float32", tensor_cores=False)  # float32 bundles: the CUDA-core MoE, float32 slots
    assert _moe(f32, Phase.PREFILL, 40).dtype == "float32"
    with pytest.raises(ValueError, match="slots"):
        be._rmsnorm(x, None, None, 4, y=MoEOut(y, 3, dtype="float16"), x_out=x)


def test_norm_block_follows_the_rows_and_wide_rows_take_the_wide_build(monkeypatch: pytest.MonkeyPatch) -> None:
    from hybrid_runtime.cuda import backend as B
    from hybrid_runtime.engine.base import Phase  # noqa: F401 - the stub's moe() imports it

    be, rec, _ = _stub(H=2048)
    x = B.Mat(0x10000, 8192, 2048, 2048, "float32")
    w = DeviceArray(0x5000, (2048,), "float32", 0)
    h = B.Mat(0x20000, 8192, 2048, 2048, "bfloat16")
    for n, want in ((1, 512), (16, 512), (8192, 256)):
        rec.clear()
        be._rmsnorm(x, w, h, n)
        assert rec[0][0] == "rmsnorm_rows" and rec[0][2] == want, (n, rec[0][2])
    loads = []
    monkeypatch.setattr(B, "load_module", lambda src, opts, arch: loads.append(opts) or "wide")
    be.dev = SimpleNamespace(ordinal=0, arch="sm_90")
    be.cfg.hidden_size = 12288  # past 4 * NORM_KMAX * 512 columns
    mods = []
    be._launch = lambda name, grid, block, args, smem=0, module=None: mods.append((block, module))
    be._rmsnorm(x, w, h, 8192)
    be._rmsnorm(x, w, h, 1)
    assert loads == [("-DDT=2", "-DNORM_KMAX=8")]  # loaded once
    assert mods == [(512, "wide"), (512, "wide")]
