"""The fused decode MoE router (``ops/cuda/moe_router.cu``, ``cuda/moe_router.py``) on any machine: NVRTC compiles
every build (bf16 / fp16 x rows per CTA 4 / 8 / 16) for sm_90 without spills within the 64 registers of a
1024-thread CTA; the weight loads stay ahead of griddepcontrol.wait in the SASS (where nvdisasm exists); a
lane-level numpy model of phase 1 (``moe_router_model.py``: fragments, warp reduction, which CTA writes which
logits) equals ``h @ w.T`` and writes every logit of the step exactly once, padding rows included, nothing
past the step's tokens or past E_pad; the shape rules; and which decode steps of the backend take the kernel."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from moe_router_model import phase1, phase2_copy
from test_cuda_compile import check_log, nvdisasm_path, nvrtc_or_skip

from hybrid_runtime.cuda import moe_router as mr
from hybrid_runtime.cuda.driver import DeviceArray

BUILDS = [(dt, rows) for dt in ("bfloat16", "float16") for rows in mr.ROWS_PER_CTA]


@pytest.mark.parametrize("dtype,rows", BUILDS)
def test_every_build_compiles_for_sm90_without_spills(dtype: str, rows: int) -> None:
    nvrtc_or_skip()
    from hybrid_runtime.cuda.kernels import compile_log, source

    log = compile_log(source(mr.SOURCE), mr.SOURCE, mr.options(dtype, rows), "sm_90")
    check_log(log)
    assert f"'{mr.KERNEL}'" in log, log
    regs = [int(m) for m in re.findall(r"Used (\d+) registers", log)]
    assert max(regs) <= 65536 // mr.THREADS, log  # a 1024-thread CTA must fit the register file
    assert re.search(r"\b0 bytes stack frame", log), log
    static = [int(m) for m in re.findall(r"(\d+) bytes smem", log)]
    assert static and max(static) + mr.MAX_SMEM <= 227 * 1024, log


def test_source_refuses_unknown_knobs() -> None:
    nvrtc_or_skip()
    from hybrid_runtime.cuda.kernels import CompileError, compile_cubin, source

    with pytest.raises(CompileError, match="MR_ROWS"):
        compile_cubin(source(mr.SOURCE), mr.SOURCE, ("-DDT=2", "-DMR_ROWS=12"), "sm_90")
    with pytest.raises(CompileError, match="DT must be"):
        compile_cubin(source(mr.SOURCE), mr.SOURCE, ("-DDT=0",), "sm_90")


@pytest.mark.parametrize("dtype,rows", [("bfloat16", 8), ("float16", 16)])
def test_weight_loads_are_issued_before_griddepcontrol_wait(dtype: str, rows: int, tmp_path: Path) -> None:
    """The point of PDL here: the weight read overlaps the previous kernel's tail. ptxas hoists ACQBULK
    (griddepcontrol.wait) above non-coherent (.nc) loads; the kernel uses plain ld.global, which it keeps first."""
    nvrtc_or_skip()
    tool = nvdisasm_path()
    if tool is None:
        pytest.skip("nvdisasm not found (set NVDISASM, or install the nvidia-cuda-nvdisasm dev dependency)")
    from hybrid_runtime.cuda.kernels import compile_cubin, source

    cubin = tmp_path / "moe_router.cubin"
    cubin.write_bytes(compile_cubin(source(mr.SOURCE), mr.SOURCE, mr.options(dtype, rows), "sm_90"))
    sass = subprocess.run([tool, "-c", str(cubin)], capture_output=True, text=True, check=True).stdout
    lines = sass.splitlines()
    wait = next(i for i, s in enumerate(lines) if "ACQBULK" in s)
    loads = [i for i, s in enumerate(lines) if re.search(r"\bLDG\b", s)]
    before = [i for i in loads if i < wait]
    assert len(before) >= mr.tiles_per_cta(rows) * 2, "\n".join(lines[:wait + 2])  # MR_PF = 2 blocks x tiles


def _bits_like(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """Values exactly representable in bfloat16 (what the device multiplies)."""
    x = rng.standard_normal(shape).astype(np.float32)
    return (x.view(np.uint32) & 0xFFFF0000).view(np.float32).astype(np.float64)


@pytest.mark.parametrize("rows", mr.ROWS_PER_CTA)
@pytest.mark.parametrize("H,e_pad,E", [(2048, 264, 256), (128, 16, 8), (160, 64, 61), (4096, 24, 17)])
def test_phase1_model_is_the_matmul_and_writes_every_logit_once(rows: int, H: int, e_pad: int, E: int) -> None:
    rng = np.random.default_rng(H + e_pad + rows)
    w = _bits_like(rng, (e_pad, H))
    w[E + 1:] = 0.0  # the router's padding rows
    h = _bits_like(rng, (16, H))
    ld = e_pad + 8  # columns past E_pad: never written
    for n in (1, 7, 16):
        got, writes = phase1(h, w, n, rows, ld)
        assert (writes[:, :e_pad] == 1).all() and not writes[:, e_pad:].any(), (n, rows)
        np.testing.assert_allclose(got[:, :e_pad], h[:n] @ w.T, rtol=1e-12, atol=1e-9)
        assert not got[:, E + 1:e_pad].any()  # padding rows written, as zeros


@pytest.mark.parametrize("e_pad", [264, 16, 8, 9, 1])
def test_every_router_row_belongs_to_exactly_one_cta(e_pad: int) -> None:
    for rows in mr.ROWS_PER_CTA:
        parts = mr.cta_rows(e_pad, rows)
        assert len(parts) == mr.grid_size(e_pad, rows)
        flat = [r for p in parts for r in p]
        assert flat == list(range(e_pad)) and all(len(p) <= rows for p in parts) and all(parts)
    assert mr.grid_size(264, 4) == 66 and mr.grid_size(264, 8) == 33 and mr.grid_size(264, 16) == 17


def test_last_cta_copies_the_routed_columns_of_the_step() -> None:
    for n, E, fold, ld in [(1, 256, True, 264), (16, 256, False, 264), (7, 8, True, 16)]:
        offs = phase2_copy(n, E, fold, ld)
        want = [t * ld + e for t in range(n) for e in range(E + int(fold))]
        assert offs.tolist() == want


def test_shared_memory_sizes() -> None:
    assert mr.smem_bytes(1, 256, True, 8) == 32 * 128 * 4  # phase 1's accumulators
    assert mr.smem_bytes(16, 256, True, 8) == 16 * 257 * 4  # the last CTA's copy of the logits
    assert mr.smem_bytes(16, 256, False, 16) == 32 * 2 * 128 * 4
    assert mr.MAX_SMEM == 16 * 1024 * 4


def test_shape_rules() -> None:
    ok = ("bfloat16", 16, 2048, 264, 256, 8, True)
    assert mr.shape_problems(*ok) == [] and mr.shape_problems("float16", 1, 128, 16, 8, 2, False) == []
    bad = {
        "dtype": dict(dtype="float32"), "n = 0": dict(n=0), "n = 17": dict(n=17), "H = 2040": dict(hidden=2040),
        "ldh = 2052": dict(ldh=2052), "ld = 256": dict(ld=256), "k = 0": dict(k=0), "k = 32": dict(k=32),
        "E + fold_shared = 265": dict(num_experts=264), "> 1024": dict(num_experts=1024, e_pad=1032),
    }
    names = ("dtype", "n", "hidden", "e_pad", "num_experts", "k", "fold_shared")
    for want, over in bad.items():
        kw = dict(zip(names, ok)) | over
        problems = mr.shape_problems(**kw)
        assert any(want in p for p in problems), (want, problems)
    assert mr.shape_problems("bfloat16", 1, 2048, 256, 256, 8, True)  # no row for the shared gate
    assert mr.shape_problems("bfloat16", 1, 2048, 256, 256, 8, False) == []
    assert mr.shape_problems("bfloat16", 1, 64, 8, 4, 5, False)  # k > E
    assert mr.supported("bfloat16", 2048, 264, 256, 8) and mr.supported("float16", 128, 16, 8, 2)
    assert not mr.supported("float32", 2048, 264, 256, 8) and not mr.supported("bfloat16", 2000, 264, 256, 8)


def _router_without_device(dtype: str = "bfloat16", rows: int = 8) -> mr.MoERouter:
    r = object.__new__(mr.MoERouter)
    r.device, r.dtype, r.rows_per_cta = None, dtype, rows
    return r


def test_launch_refuses_bad_shapes_before_the_driver() -> None:
    r = _router_without_device()
    w = DeviceArray(0x10000, (264, 2048), "bfloat16", 0)
    bufs = mr.RouteBuffers(0x20000, 0x30000, 0x40000, 0x50000, 0x60000, 0x70000)
    good = dict(n=4, h=0x80000, ldh=2048, router=w, logits=0x90000, ld=264, num_experts=256, k=8, renorm=True,
                fold_shared=True, bufs=bufs)
    for over, match in [(dict(n=17), "1 <= n <= 16"), (dict(ldh=2044), "ldh"), (dict(h=0x80008), "16-byte"),
                        (dict(ld=263), "ld = 263"), (dict(k=40), "k = 40"),
                        (dict(router=DeviceArray(0x10000, (264, 2048), "float16", 0)), "built for bfloat16"),
                        (dict(router=DeviceArray(0x10000, (264 * 2048,), "bfloat16", 0)), r"\[E_pad, H\]"),
                        (dict(router=DeviceArray(0x10000, (256, 2048), "bfloat16", 0)), "shared gate")]:
        with pytest.raises(ValueError, match=match):
            r.launch(**(good | over))
    with pytest.raises(ValueError, match="bfloat16 / float16"):
        mr.MoERouter(None, "float32")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="rows_per_cta"):
        mr.MoERouter(None, "bfloat16", rows_per_cta=32)  # type: ignore[arg-type]


def test_kernel_parameters_follow_the_source_order() -> None:
    src = (Path(mr.__file__).parents[1] / "ops" / "cuda" / mr.SOURCE).read_text()
    sig = src[src.index(f"{mr.KERNEL}("):src.index(") {", src.index(f"{mr.KERNEL}("))]
    params = [" ".join(p.replace("__restrict__", "").replace("const", "").split())
              for p in sig[len(mr.KERNEL) + 1:].split(",")]
    packed = mr.args(1, 2, 3, 4, 5, 6, 7, 8, 9, 10, True, False, mr.RouteBuffers(11, 12, 13, 14, 15, 16))
    assert len(packed) == len(params) == 18
    for (kind, _), param in zip(packed, params):
        want = "ptr" if "*" in param else {"int": "i32", "long long": "i64"}[param.rsplit(" ", 1)[0]]
        assert kind == want, (param, kind)


# ------------------------------------------------------------------ backend integration (no GPU)


class _Recorder:
    """Stands in for the CudaBackend pieces moe() calls: records launch names in order."""

    def __init__(self) -> None:
        self.calls: list[str] = []


def _stub_backend(fused: bool, dtype: str = "bfloat16", moe_decode: str = "auto", tensor_cores: bool = True,
                  fold: bool = True):
    import contextlib

    from hybrid_runtime.cuda.backend import CudaBackend, _Arena
    from hybrid_runtime.cuda.weights import MoEWeights

    rec = _Recorder()
    be = object.__new__(CudaBackend)
    H, inter, E, k, T = 128, 128, 8, 2, 64
    be.cfg = SimpleNamespace(hidden_size=H, moe_intermediate_size=inter, num_experts_per_tok=k, num_experts=E,
                             norm_topk_prob=True)
    be.dtype, be.es, be.ny, be.moe_decode = dtype, 2, k + 1, moe_decode
    be.dev = SimpleNamespace(ordinal=0)
    kk = k + 1
    arena = _Arena()
    ptr = iter(range(1 << 20, 1 << 30, 1 << 20))
    for name, shape, dt in [("router", (T, 16), "float32"), ("pair_w", (T, kk), "float32"),
                            ("pair_e", (T, kk), "int32"), ("pair_list", (T, kk), "int32"),
                            ("expert_off", (1, E + 2), "int32"), ("active", (1, E + 2), "int32"),
                            ("moe_act", (T * kk, inter), dtype), ("y", (T, kk * H), "float32"),
                            ("moe_tiles", (1, 64), "int32"), ("moe_cta_counts", (8, E + 1), "int32"),
                            ("moe_router_ws", (1, 4), "int32"), ("gu", (T, 2 * inter), "float32"),
                            ("act", (T, inter), dtype)]:
        arena.bufs[name] = DeviceArray(next(ptr), shape, dt, 0)
    be.arena = arena
    e_all = E + int(fold)
    mw = MoEWeights(DeviceArray(next(ptr), (16, H), dtype, 0), 16, DeviceArray(next(ptr), (e_all, 2 * inter, H),
                    dtype, 0), DeviceArray(next(ptr), (e_all, H, inter), dtype, 0), E, fold,
                    None if fold else DeviceArray(next(ptr), (2 * inter, H), dtype, 0),
                    None if fold else DeviceArray(next(ptr), (H, inter), dtype, 0))
    be.w = SimpleNamespace(moe=lambda layer: mw)
    be._prof = lambda name: contextlib.nullcontext()
    be._gemm = lambda x, w, out, **kw: rec.calls.append("gemm_router" if w is mw.router else "gemm")
    be._launch = lambda name, *a, **kw: rec.calls.append(name)
    be.moe_prefill = SimpleNamespace(launch=lambda *a, **kw: rec.calls.append("moe_tensor_cores"),
                                     route=lambda *a, **kw: rec.calls.append("moe_route_many")) \
        if tensor_cores else None
    be.moe_mma_decode = SimpleNamespace(launch=lambda *a, **kw: rec.calls.append("moe_mma_decode"))
    be.moe_mma_decode_one = be.moe_mma_decode  # the dn_pre build 1-row steps take: the same launch here
    be.moe_mma_decode_many = be.moe_mma_decode  # the "many" build of steps past 16 rows: likewise

    class _Router:
        def launch(self, n, h, ldh, router, logits, ld, num_experts, k_, renorm, fold_shared, bufs) -> None:
            assert router is mw.router and logits == arena.bufs["router"].ptr and ld == 16
            assert bufs.workspace == arena.bufs["moe_router_ws"].ptr and bufs.pair_e == arena.bufs["pair_e"].ptr
            rec.calls.append(f"moe_router_route(fold={int(fold_shared)})")

    be.moe_router = _Router() if fused else None
    return be, rec


@pytest.mark.parametrize("fold", [True, False])
def test_backend_decode_steps_of_up_to_16_rows_take_the_fused_router(fold: bool) -> None:
    from hybrid_runtime.cuda.backend import CudaCtx, Mat
    from hybrid_runtime.engine.base import Phase

    def run(be, phase: Phase, n: int) -> None:
        ctx = CudaCtx(phase, n, n, n, n, n, 1, None, None, n, None, False)
        be.moe(0, ctx, Mat(0x1000, n, 128, 128, "bfloat16"))

    be, rec = _stub_backend(True, fold=fold)  # auto: the weights-as-M tensor-core decode MoE at every size
    shared = [] if fold else ["gemm", "swiglu", "gemm"]
    for n in (1, 7, 16):
        rec.calls.clear()
        run(be, Phase.DECODE, n)
        assert rec.calls == [f"moe_router_route(fold={int(fold)})", "moe_mma_decode", *shared], (n, rec.calls)
    rec.calls.clear()
    run(be, Phase.DECODE, 17)  # past 16 rows: cuBLASLt + the many-CTA routing, never folded
    assert rec.calls[:3] == ["gemm_router", "moe_route_many", "moe_mma_decode"], rec.calls
    rec.calls.clear()
    run(be, Phase.PREFILL, 4)  # prefill: never
    assert rec.calls[:2] == ["gemm_router", "moe_tensor_cores"], rec.calls
    be, rec = _stub_backend(True, moe_decode="tensor_cores", fold=fold)  # the tensor-core decode MoE routes itself
    run(be, Phase.DECODE, 4)
    assert rec.calls[:2] == ["gemm_router", "moe_tensor_cores"], rec.calls
    be, rec = _stub_backend(True, moe_decode="cuda_cores", fold=fold)
    run(be, Phase.DECODE, 4)
    assert rec.calls == [f"moe_router_route(fold={int(fold)})", "moe_gate_up", "moe_down", *shared], rec.calls
    be, rec = _stub_backend(False, fold=fold)  # fused_router=False (or a float32 bundle): the old pair
    run(be, Phase.DECODE, 4)
    assert rec.calls[:3] == ["gemm_router", "moe_route", "moe_mma_decode"], rec.calls
    be, rec = _stub_backend(True, tensor_cores=False, fold=fold)  # no tensor-core MoE: every decode step <= 16
    run(be, Phase.DECODE, 16)
    assert rec.calls[0] == f"moe_router_route(fold={int(fold)})", rec.calls
    rec.calls.clear()
    run(be, Phase.DECODE, 17)
    assert rec.calls[:2] == ["gemm_router", "moe_route"], rec.calls
