"""The CUDA backend's host side, testable on any machine: NVRTC compiles every kernel source to sm_90
(when cuda-bindings is installed), launches mirror the dispatcher's plan exactly, the pre-launch check
and argument packing, and typed errors instead of aborts when there is no GPU."""

from __future__ import annotations

import re

import numpy as np
import pytest

from hybrid_runtime.ops.dispatcher import MULTI, SINGLE, DecodeBatch, DeviceLimits, make_plan, plan


def nvrtc_or_skip() -> None:
    try:
        from cuda.bindings import nvrtc

        err, *_ = nvrtc.nvrtcVersion()
        assert int(err) == 0
    except Exception as e:  # not installed, or no libnvrtc
        pytest.skip(f"NVRTC unavailable: {e}")


def nvdisasm_path() -> str | None:
    """nvdisasm (SASS of a cubin), where one is (benchmarks.sass_loops: $NVDISASM, PATH, the nvidia-cuda-nvdisasm
    dev dependency, /usr/local/cuda); None when there is none."""
    from benchmarks.sass_loops import nvdisasm_path as find

    return find()


def ptx(src: str, name: str, opts: tuple[str, ...]) -> str:
    """PTX of the CUDA source ``src`` (file name ``name``) for compute_90, from NVRTC directly (the package
    caches only cubins)."""
    from cuda.bindings import nvrtc

    err, prog = nvrtc.nvrtcCreateProgram(src.encode(), name.encode(), 0, [], [])
    assert int(err) == 0
    try:
        args = [b"-arch=compute_90", b"-std=c++17", *(o.encode() for o in opts)]
        (err,) = nvrtc.nvrtcCompileProgram(prog, len(args), args)
        assert int(err) == 0
        err, size = nvrtc.nvrtcGetPTXSize(prog)
        buf = bytearray(int(size))  # written by NVRTC: a fresh mutable buffer
        (err,) = nvrtc.nvrtcGetPTX(prog, buf)
        assert int(err) == 0
        return bytes(buf).rstrip(b"\0").decode()
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def check_log(log: str, max_spill: int = 0) -> None:
    """Registers within the hardware limit and no real spilling. NVRTC 13.0 (the H200 image) spills 8 bytes
    in a few builds (the float32 portable kernel; the hd-64 tensor-core one); NVRTC 13.5 spills none."""
    regs = [int(m) for m in re.findall(r"Used (\d+) registers", log)]
    assert regs and max(regs) <= 255, log
    spills = [int(m) for m in re.findall(r"(\d+) bytes spill (?:stores|loads)", log)]
    assert max(spills, default=0) <= max_spill, log


def test_compiling_leaves_python_bytes_alone() -> None:
    """NVRTC writes its log and cubin into buffers we hand it. A clean compile has a one-byte log, and
    ``b" " * 1`` is CPython's shared one-byte object: writing the log's NUL into it once turned every
    b" " of the process into b"\\0" (safetensors headers written later got NUL padding)."""
    nvrtc_or_skip()
    import uuid

    from hybrid_runtime.cuda.kernels import compile_cubin

    src = f'// {uuid.uuid4()}\nextern "C" __global__ void k(float* x) {{ x[0] = 1.f; }}\n'  # never cached
    cubin = compile_cubin(src, "empty_log.cu", (), "sm_90")
    assert cubin[:4] == b"\x7fELF"
    assert bytes([32, 32, 32]) == b" " * 3


ATTENTION_VARIANTS = [("bfloat16", 256, 8), ("float16", 128, 4), ("bfloat16", 64, 1), ("float16", 80, 3),
                      ("bfloat16", 128, 16), ("float32", 128, 4), ("bfloat16", 256, 32), ("float16", 16, 2)]


@pytest.mark.parametrize("cfg", ATTENTION_VARIANTS)
def test_attention_sources_compile_for_sm90(cfg) -> None:
    nvrtc_or_skip()
    from hybrid_runtime.cuda.attention import SOURCE, choose_variant
    from hybrid_runtime.cuda.kernels import compile_log, source

    v = choose_variant(*cfg)
    # The portable (SIMT) build is capped at 64 registers by __launch_bounds__(1024); reading the chunk length
    # from device memory (graph replays) tipped its float32 hd-128 build from 64 to 68 spilled bytes (NVRTC 13.5).
    check_log(compile_log(source(SOURCE), SOURCE, v.options, "sm_90"), max_spill=16 if v.impl == "mma" else 96)


@pytest.mark.parametrize("opts", [("-DDT=2", "-DDK=128", "-DDV=128", "-DKW=4"),
                                  ("-DDT=1", "-DDK=20", "-DDV=12", "-DKW=1"),
                                  ("-DDT=0", "-DDK=64", "-DDV=32", "-DKW=2")])
def test_gdn_and_kv_sources_compile_for_sm90(opts) -> None:
    nvrtc_or_skip()
    from hybrid_runtime.cuda.kernels import compile_log, source

    check_log(compile_log(source("gdn.cu"), "gdn.cu", opts, "sm_90"))
    check_log(compile_log(source("kv_cache.cu"), "kv_cache.cu", (), "sm_90"))


def test_fill_random_codes_compiles_to_one_kernel_without_local_memory() -> None:
    """fused.cu's ``fill_random_codes`` (the quantized benchmarks' random GPTQ codes: ``DeviceWeights.random_packed``)
    compiles for sm_90 in every dtype build: its (dst, n, seed, bits) entry, no local memory. Its values are checked
    on a GPU against a numpy model (tests/gpu/test_cuda_kernels.py)."""
    nvrtc_or_skip()
    from hybrid_runtime.cuda.kernels import source

    for dt in (0, 1, 2):
        text = ptx(source("fused.cu"), "fused.cu", (f"-DDT={dt}",))
        i = text.index(".entry fill_random_codes(")
        j = text.find(".entry", i + 8)
        body = text[i:j if j > 0 else None]
        assert len(re.findall(r"\.param\s+\.(u64|u32|s32|b64|b32)", body.split(")")[0])) == 4, body[:400]
        assert ".local" not in body


def test_compile_error_is_typed() -> None:
    nvrtc_or_skip()
    from hybrid_runtime.cuda.kernels import CompileError, compile_cubin

    with pytest.raises(CompileError, match="error"):
        compile_cubin("__global__ void k() { undefined_thing(); }", "bad.cu", (), "sm_90")


def test_variant_choice() -> None:
    from hybrid_runtime.cuda.attention import choose_variant

    assert choose_variant("bfloat16", 256, 8).impl == "mma"
    assert choose_variant("bfloat16", 256, 9).impl == "simt"  # 2 tiles x 256 dims: too many registers
    assert choose_variant("float16", 128, 16) == choose_variant("float16", 128, 11)
    assert choose_variant("float32", 64, 1).impl == "simt"
    assert choose_variant("float16", 64, 8, block_threads=256).impl == "simt"


@pytest.mark.parametrize("mode", ["on", "off"])
def test_launches_follow_the_plan_exactly(mode: str) -> None:
    from hybrid_runtime.cuda.attention import ENTRY, REDUCE_ENTRY, attention_launches

    lim = DeviceLimits("fake-h200", sm_count=132, optin_set=frozenset({SINGLE, MULTI}))
    batch = DecodeBatch((32768, 100), (np.arange(512), np.arange(512, 514)), 16, 2, 256, 64, "bfloat16", 600)
    p = plan(batch, mode, lim, 1 << 30)
    ls = attention_launches(p, batch=2, num_q_heads=16, num_kv_heads=2, head_dim=256, page_size=64, q=1, k=2, v=3,
                            tables=4, table_stride=512, lens=5, out=6, workspace=7)
    assert ls[0].kernel == ENTRY[p.kernel]
    assert (ls[0].grid, ls[0].block, ls[0].smem) == (p.grid, (p.block_threads, 1, 1), p.smem_bytes)
    named = dict(zip(["q", "k", "v", "tables", "stride", "lens", "out", "ws", "B", "Hq", "Hkv", "ps", "chunk",
                      "nblk", "tile", "smem", "scale"], [a[1] for a in ls[0].args]))
    assert (named["chunk"], named["nblk"], named["tile"], named["smem"]) == \
        (p.chunk_len, p.blocks_per_seq, p.kv_tile, p.smem_bytes)
    assert ls[0].pdl  # may start under the previous kernel's tail; griddepcontrol.wait before any memory access
    if p.kernel == MULTI:
        assert len(ls) == 2 and ls[1].kernel == REDUCE_ENTRY[p.reduce_threads]
        assert (ls[1].grid, ls[1].block, ls[1].smem) == (p.reduce_grid, (p.reduce_threads, 1, 1), 0)
        assert ls[1].pdl  # programmatic dependent: waits in-kernel (griddepcontrol.wait) for the partials
    else:
        assert len(ls) == 1


@pytest.mark.parametrize("hd", [16, 32, 64, 80, 128, 160, 256])
def test_shared_memory_always_holds_the_mma_merge(hd: int) -> None:
    """The tensor-core kernel reuses its staging area to merge its 4 warps: per-warp max/sum rows
    (4 x 8*NT floats each), merged max/sum (8*NT each) and at least one [G][hd + 4] float slice. Every plan
    the dispatcher makes for a variant that uses it leaves room for that, down to the smallest tile."""
    from hybrid_runtime.cuda.attention import MMA_THREADS, choose_variant
    from hybrid_runtime.ops.dispatcher import smem_bytes

    warps = MMA_THREADS // 32
    for group in range(1, 8 * (256 // hd) + 1):
        v = choose_variant("bfloat16", hd, group)
        assert v.impl == "mma"
        need = 4 * (2 * warps * 8 * v.ntiles + 2 * 8 * v.ntiles) + 4 * group * (hd + 4)
        for tile in (16, 32, 64):
            assert smem_bytes(group, hd, 2, tile) >= need, (group, tile)


def test_launch_problems_mirror_device_limits() -> None:
    from hybrid_runtime.cuda.kernels import launch_problems

    lim = DeviceLimits("fake", sm_count=132, max_shared_mem_per_block=48 * 1024, max_shared_mem_optin=227 * 1024)
    ok = launch_problems(lim, (64, 2, 1), (128, 1, 1), 80_000, 0, 227 * 1024)
    assert ok == []
    assert launch_problems(lim, (1, 65536, 1), (128, 1, 1), 0, 0, None) == ["grid_y"]
    assert launch_problems(lim, (1, 1, 70000), (128, 1, 1), 0, 0, None) == ["grid_z"]
    assert launch_problems(lim, (0, 1, 1), (128, 1, 1), 0, 0, None) == ["grid_zero"]
    assert launch_problems(lim, (1, 1, 1), (1025, 1, 1), 0, 0, None) == ["threads"]
    assert launch_problems(lim, (1, 1, 1), (128, 1, 1), 80_000, 0, None) == ["smem_attr_not_set"]
    assert launch_problems(lim, (1, 1, 1), (128, 1, 1), 80_000, 0, 64_000) == ["smem_attr_not_set"]
    assert launch_problems(lim, (1, 1, 1), (128, 1, 1), 227 * 1024 + 1, 0, 227 * 1024) == ["smem_optin"]
    assert launch_problems(lim, (1, 1, 1), (128, 1, 1), 227 * 1024, 16, 227 * 1024) == ["smem_optin"]  # + static


def test_pack_args_layout() -> None:
    from hybrid_runtime.cuda.kernels import pack_args

    ptrs, vals = pack_args([("ptr", 0xDEADBEEF00), ("i32", -3), ("f32", 1.5), ("i64", 1 << 40)])
    assert ptrs.dtype == np.uint64 and len(ptrs) == 4
    assert [int(p) - vals.ctypes.data for p in ptrs] == [0, 8, 16, 24]
    raw = vals.view(np.uint8)
    assert int(raw[0:8].view(np.uint64)[0]) == 0xDEADBEEF00
    assert int(raw[8:12].view(np.int32)[0]) == -3
    assert float(raw[16:20].view(np.float32)[0]) == 1.5
    assert int(raw[24:32].view(np.int64)[0]) == 1 << 40


def test_device_array_and_dtypes() -> None:
    from hybrid_runtime.cuda.driver import DeviceArray, dtype_of

    a = DeviceArray(0x1000, (2, 3, 4), "bfloat16", 0)
    assert a.ndim == 3 and a.nbytes == 48 and a.dtype.name == "bfloat16" and a.dtype.itemsize == 2
    assert a.__cuda_array_interface__["typestr"] == "<i2"
    assert a.row_ptr(1) == 0x1000 + 24
    with pytest.raises(IndexError):
        a.row_ptr(2)
    assert a.view((6, 4)).shape == (6, 4)
    assert dtype_of(np.float16).name == "float16" and dtype_of("torch.float32").name == "float32"
    with pytest.raises(ValueError):
        dtype_of("complex64")
    # what DecodeBatch.from_arrays reads off a device array
    q = DeviceArray(0, (3, 16, 128), "bfloat16", 0)
    pool = DeviceArray(0, (10, 16, 2, 128), "bfloat16", 0)
    b = DecodeBatch.from_arrays(q, pool, [np.arange(2)] * 3, [20, 1, 32])
    assert (b.num_q_heads, b.num_kv_heads, b.head_dim, b.page_size, b.dtype, b.num_pool_pages) == \
        (16, 2, 128, 16, "bfloat16", 10)
    assert make_plan(b, 1, DeviceLimits.cpu()).grid == (1, 2, 3)


def test_no_gpu_gives_typed_errors() -> None:
    from hybrid_runtime.cuda import available
    from hybrid_runtime.cuda.driver import CudaDevice, CudaError, device_count

    if device_count() > 0:
        pytest.skip("a GPU is present")
    assert available() is False
    with pytest.raises(CudaError):
        CudaDevice(0)


def test_pack_tables_layout() -> None:
    """Lengths first, then each page table on a 128-byte-aligned start (the runtime's one upload per call)."""
    from hybrid_runtime.cuda.attention import pack_tables

    tables = [np.array([5, 3, 9]), np.array([7]), np.array([], np.int64)]
    host, off, stride = pack_tables(tables, [40, 12, 0])
    assert host.dtype == np.int32 and off % 32 == 0 and off >= 3 and stride == 3
    assert host[:3].tolist() == [40, 12, 0] and not host[3:off].any()
    assert host[off:off + 3].tolist() == [5, 3, 9] and host[off + 3:off + 6].tolist() == [7, 0, 0]
    assert len(host) == off + 3 * stride
    _, off40, _ = pack_tables([np.arange(2)] * 40, [2] * 40)
    assert off40 == 96  # 40 lengths + the chunk word + 40 per-sequence chunk lengths, rounded up to 32 ints
    # the word after the lengths is the chunk length kernels launched with chunk_len 0 read (graph replays),
    # then one chunk length per sequence (chunk_len -1: the batch-invariant split)
    host32, off32, _ = pack_tables([np.arange(2)] * 32, [2] * 32, chunk_len=192, stride=4,
                                   seq_chunks=[64 * (i + 1) for i in range(32)])
    assert off32 == 96 and host32[32] == 192 and len(host32) == 96 + 32 * 4
    assert host32[33:65].tolist() == [64 * (i + 1) for i in range(32)] and not host32[65:96].any()
    with pytest.raises(ValueError, match="chunk lengths"):
        pack_tables([np.arange(2)] * 3, [2] * 3, seq_chunks=[64, 64])
    with pytest.raises(ValueError, match="stride"):
        pack_tables([np.arange(5)], [70], stride=4)
    with pytest.raises(IndexError):
        pack_tables([np.array([-1])], [1])
    with pytest.raises(IndexError):
        pack_tables([np.array([2**31])], [1])
