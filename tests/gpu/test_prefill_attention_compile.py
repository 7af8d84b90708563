"""NVRTC compiles of the prefill attention kernel (``ops/cuda/prefill_attention.cu``) for sm_90, on any machine
with cuda-bindings: every default variant of the head dims / GQA groups / dtypes that matter fits the register
file without spilling (ptxas -v)."""

from __future__ import annotations

import re

import pytest

from tests.gpu.test_cuda_compile import check_log, nvrtc_or_skip

VARIANTS = [(dt, hd, g) for dt in ("float16", "bfloat16") for hd in (64, 128, 256) for g in (1, 4, 8)]


def ptxas_figures(log: str) -> tuple[int, int]:
    """(registers, largest spill bytes) of a verbose compile log."""
    regs = max(int(m) for m in re.findall(r"Used (\d+) registers", log))
    spills = max((int(m) for m in re.findall(r"(\d+) bytes spill (?:stores|loads)", log)), default=0)
    return regs, spills


def compile_variant_log(dtype: str, hd: int, group: int, m_tiles: int | None = None, warps: int | None = None) -> str:
    from hybrid_runtime.cuda.kernels import compile_log, source
    from hybrid_runtime.cuda.prefill_attention import SOURCE, choose_prefill_variant

    v = choose_prefill_variant(dtype, hd, group, m_tiles, warps)
    return compile_log(source(SOURCE), SOURCE, v.options, "sm_90")


@pytest.mark.parametrize("cfg", VARIANTS, ids=lambda c: f"{c[0]}-hd{c[1]}-g{c[2]}")
def test_prefill_variants_compile_without_spills(cfg) -> None:
    nvrtc_or_skip()
    check_log(compile_variant_log(*cfg), max_spill=0)


@pytest.mark.parametrize("cfg", [("bfloat16", 80, 3), ("float16", 16, 2), ("bfloat16", 256, 16),
                                 ("bfloat16", 128, 2), ("float16", 192, 8), ("bfloat16", 32, 16)])
def test_prefill_odd_shapes_compile(cfg) -> None:
    """Partial swizzle groups (hd 80, 192 = 24 chunks), the generic load path, wide groups. Not the serving
    shapes: NVRTC 13.x spills 20-32 bytes in hd 80 / G 3 (generic K/V load path), so a little is allowed."""
    nvrtc_or_skip()
    check_log(compile_variant_log(*cfg), max_spill=64)


def test_prefill_two_m_tiles_at_hd128_compiles() -> None:
    """The 128-row hd-128 build (m_tiles=2, the benchmark's alternative): it compiles; NVRTC 13 spills ~100
    bytes for G = 1 but none for G = 8, so only G = 8 is held to zero spills."""
    nvrtc_or_skip()
    check_log(compile_variant_log("bfloat16", 128, 8, 2), max_spill=0)
    regs, _ = ptxas_figures(compile_variant_log("bfloat16", 128, 1, 2))
    assert regs <= 255


@pytest.mark.parametrize("cfg", [(dt, hd, g, w) for dt in ("float16", "bfloat16") for hd in (64, 128, 256)
                                 for g in (1, 8) for w in (4, 8)], ids=lambda c: f"{c[0]}-hd{c[1]}-g{c[2]}-w{c[3]}")
def test_prefill_both_schedules_compile_without_spills(cfg) -> None:
    """The 4-warp single-buffered and the 8-warp double-buffered builds at every serving head dim (the default
    picks one per head dim; the benchmark compares both). 8 warps = 256 threads: <= 255 registers (one CTA of
    the register file), hd 256 needs ~249."""
    nvrtc_or_skip()
    dt, hd, g, w = cfg
    log = compile_variant_log(dt, hd, g, warps=w)
    check_log(log, max_spill=0)
    regs, _ = ptxas_figures(log)
    assert regs <= 255


@pytest.mark.parametrize("cfg", [(dt, hd, g, split, impl) for dt in ("float16", "bfloat16") for hd in (64, 128, 256)
                                 for g in (1, 3, 8, 128) for split in (False, True) for impl in ("wgmma", "wgmma_ws")],
                         ids=lambda c: f"{c[4]}-{c[0]}-hd{c[1]}-g{c[2]}-split{int(c[3])}")
def test_wgmma_builds_compile_without_spills(cfg) -> None:
    """The wgmma builds (``prefill_attention_wgmma.cu``, sm_90a; ``wgmma_ws`` = ``-DWS``) at every head dim they
    take, both P V forms: no spills (the plain build: <= 255 registers at 256 threads, hd 256 needs ~211, O is 128
    registers; the warp-specialised one: 168 at entry, its consumers raised to 232 by setmaxnreg), and no ptxas
    performance note (a wgmma it had to serialise, or a setmaxnreg it ignored, would print one)."""
    nvrtc_or_skip()
    from hybrid_runtime.cuda.kernels import compile_log, source
    from hybrid_runtime.cuda.prefill_attention import WGMMA_ARCH, choose_prefill_variant

    dt, hd, g, split, impl = cfg
    v = choose_prefill_variant(dt, hd, g, impl=impl, pv_split=split)
    log = compile_log(source(v.source), v.source, v.options, WGMMA_ARCH)
    check_log(log, max_spill=0)
    assert "warning" not in log.lower() and "Performance Loss" not in log, log


def test_wgmma_variant_is_refused_where_it_cannot_run() -> None:
    from hybrid_runtime.cuda.prefill_attention import PrefillAttentionError, choose_prefill_variant, resolve_impl

    with pytest.raises(PrefillAttentionError, match="head_dim"):
        choose_prefill_variant("bfloat16", 80, 8, impl="wgmma")
    with pytest.raises(PrefillAttentionError, match="one schedule"):
        choose_prefill_variant("bfloat16", 256, 8, warps=4, impl="wgmma")
    with pytest.raises(PrefillAttentionError, match="compute capability"):
        resolve_impl("wgmma", (8, 0), "bfloat16", 256, 8)
    assert resolve_impl("auto", (8, 0), "bfloat16", 256, 8) == "mma"
    assert resolve_impl("auto", (9, 0), "bfloat16", 256, 8) == "wgmma_ws"
    assert resolve_impl("auto", (9, 0), "bfloat16", 192, 8) == "mma"
    assert resolve_impl("auto", (9, 0), "bfloat16", 256, 8, warps=8) == "mma"
    v = choose_prefill_variant("bfloat16", 256, 8, impl="wgmma")
    assert (v.threads, v.rows, v.tokens_per_tile, v.stages) == (256, 128, 16, 2)
    ws = choose_prefill_variant("bfloat16", 256, 8, impl="wgmma_ws")
    assert (ws.threads, ws.rows, ws.smem_bytes, ws.entry) == (384, 128, v.smem_bytes, "prefill_attn_wgmma_ws")
    assert "-DWS" in ws.options and "-DWS" not in v.options
    assert v.smem_bytes == (128 + 2 * 2 * 64) * 256 * 2 + 1024  # 193 KB: Q, two K/V stages, 1 KB alignment


def test_prefill_float32_is_refused_before_compiling() -> None:
    from hybrid_runtime.cuda.prefill_attention import PrefillAttentionError, choose_prefill_variant

    with pytest.raises(PrefillAttentionError, match="float32"):
        choose_prefill_variant("float32", 128, 8)


class _FakeKernel:
    def __init__(self, entry: str) -> None:
        self.entry = entry

    def optin_bytes(self, device: object) -> int | None:
        return None

    def set_max_dynamic_smem(self, device: object, nbytes: int | None = None) -> int:
        return nbytes or 0


class _FakeModule:
    def __init__(self, source: str, options: tuple[str, ...], arch: str) -> None:
        self.source, self.options, self.arch = source, options, arch

    def kernel(self, name: str) -> _FakeKernel:
        return _FakeKernel(name)


class _FakeDevice:
    def __init__(self, cc: tuple[int, int]) -> None:
        self.compute_capability, self.arch = cc, f"sm_{cc[0]}{cc[1]}"


def test_construction_picks_the_build_and_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """CudaPrefillAttention (no GPU: the module loader is faked): "auto" loads the warp-specialised wgmma build for
    sm_90a on compute capability 9.0 and the mma.sync build elsewhere; when the wgmma module fails to build under
    "auto" the mma.sync build runs (logged), while an explicit impl lets the error through."""
    import hybrid_runtime.cuda.prefill_attention as pa

    loads: list[_FakeModule] = []
    broken: set[str] = set()

    def fake_load(src: str, options: tuple[str, ...], arch: str) -> _FakeModule:
        if src in broken:
            raise RuntimeError(f"{src}: compile error")
        loads.append(_FakeModule(src, tuple(options), arch))
        return loads[-1]

    monkeypatch.setattr(pa, "load_module", fake_load)
    k = pa.CudaPrefillAttention(_FakeDevice((9, 0)), "bfloat16", 256, 8)  # type: ignore[arg-type]
    assert (k.impl, k.kernel.entry, loads[-1].arch) == ("wgmma_ws", "prefill_attn_wgmma_ws", "sm_90a")
    assert "-DWS" in loads[-1].options
    k = pa.CudaPrefillAttention(_FakeDevice((8, 0)), "bfloat16", 256, 8)  # type: ignore[arg-type]
    assert (k.impl, k.kernel.entry, loads[-1].arch) == ("mma", "prefill_attn", "sm_80")
    broken.add(pa.WGMMA_SOURCE)
    k = pa.CudaPrefillAttention(_FakeDevice((9, 0)), "bfloat16", 256, 8)  # type: ignore[arg-type]
    assert (k.impl, loads[-1].source, loads[-1].arch) == ("mma", pa.SOURCE, "sm_90")
    with pytest.raises(RuntimeError, match="compile error"):
        pa.CudaPrefillAttention(_FakeDevice((9, 0)), "bfloat16", 256, 8, impl="wgmma_ws")  # type: ignore[arg-type]
    with pytest.raises(pa.PrefillAttentionError, match="compute capability"):
        pa.CudaPrefillAttention(_FakeDevice((8, 0)), "bfloat16", 256, 8, impl="wgmma")  # type: ignore[arg-type]
