"""CUDA decode attention (single-block, split-KV + LSE merge) against a PyTorch reference, and the guard:
plans the dispatcher rejects are exactly the launches the driver rejects with CUDA_ERROR_INVALID_VALUE."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest

from hybrid_runtime.ops.dispatcher import (
    MULTI,
    SINGLE,
    DecodeAttentionDispatcher,
    DecodeAttentionError,
    DecodeBatch,
    make_plan,
    validate,
)

pytestmark = pytest.mark.gpu

CUDA_ERROR_INVALID_VALUE = 1
TOL = {"float16": 4e-3, "bfloat16": 2e-2, "float32": 1e-4}


@pytest.fixture(scope="module")
def torch():
    import torch

    torch.cuda.init()
    return torch


@pytest.fixture(scope="module")
def dev(torch):
    from hybrid_runtime.cuda.driver import CudaDevice

    return CudaDevice(0)


@pytest.fixture(scope="module")
def backend(dev):
    from hybrid_runtime.cuda.attention import CudaDecodeAttention

    return CudaDecodeAttention(dev, optin=True)


def make_case(torch, rng: np.random.Generator, lens: list[int], hq: int, hkv: int, hd: int, ps: int, dtype: str,
              extra_pages: int = 3):
    """q, pools and shuffled (non-contiguous) page tables on the GPU, as torch tensors."""
    tdt = getattr(torch, dtype)
    need = [-(-n // ps) for n in lens]
    pages = sum(need) + extra_pages
    perm = rng.permutation(pages)
    starts = np.cumsum([0, *need])
    tables = [perm[starts[i]:starts[i + 1]].astype(np.int64) for i in range(len(lens))]
    g = torch.Generator(device="cuda").manual_seed(int(rng.integers(1 << 30)))
    k = torch.randn(pages, ps, hkv, hd, device="cuda", generator=g).to(tdt)
    v = torch.randn(pages, ps, hkv, hd, device="cuda", generator=g).to(tdt)
    q = torch.randn(len(lens), hq, hd, device="cuda", generator=g).to(tdt)
    return q, k, v, tables


def reference(torch, q, k, v, tables, lens):
    """float64 attention on the (rounded) inputs: out [B, Hq, hd]."""
    B, hq, hd = q.shape
    hkv = k.shape[2]
    G = hq // hkv
    out = torch.empty(B, hq, hd, dtype=torch.float64, device="cuda")
    for b in range(B):
        idx = torch.as_tensor(tables[b], device="cuda")
        kk = k[idx].reshape(-1, hkv, hd)[:lens[b]].double()
        vv = v[idx].reshape(-1, hkv, hd)[:lens[b]].double()
        qq = q[b].double().reshape(hkv, G, hd) / math.sqrt(hd)
        s = torch.einsum("hgd,lhd->hgl", qq, kk)
        p = torch.softmax(s, dim=-1)
        out[b] = torch.einsum("hgl,lhd->hgd", p, vv).reshape(hq, hd)
    return out


def run_modes(torch, backend, q, k, v, tables, lens, modes=("off", "on", "auto")):
    from hybrid_runtime.cuda.driver import DeviceArray

    qa, ka, va = (DeviceArray.from_torch(t) for t in (q, k, v))
    outs = {}
    for mode in modes:
        disp = backend.dispatcher(mode)
        o = disp.run(qa, ka, va, tables, lens)
        t = torch.as_tensor(o, device="cuda").clone()  # zero-copy view, then a copy we own
        backend.device.synchronize()
        outs[mode] = (t, disp.plans.copy(), disp.select(DecodeBatch.from_arrays(qa, ka, tables, lens)))
    return outs


def rel_err(torch, out, ref) -> float:
    return float(torch.linalg.vector_norm(out.double() - ref) / torch.linalg.vector_norm(ref))


# (Hq, Hkv, head_dim, dtype): covers the tensor-core variants (G 1..16, hd 64..256, 80 = partial swizzle)
# and the portable one (float32; G*hd too wide for the MMA registers).
CONFIGS = [
    (16, 2, 256, "bfloat16"), (16, 2, 256, "float16"), (32, 8, 128, "bfloat16"), (32, 8, 128, "float16"),
    (8, 8, 64, "bfloat16"), (8, 1, 128, "float16"), (12, 4, 80, "bfloat16"), (40, 8, 128, "bfloat16"),
    (16, 1, 128, "float16"), (32, 2, 256, "bfloat16"), (8, 2, 64, "float32"), (16, 2, 256, "float32"),
    (4, 1, 192, "float16"), (24, 2, 96, "bfloat16"),
]


@pytest.mark.parametrize("seed", range(len(CONFIGS) * 2))
def test_random_cases_match_reference(torch, backend, seed: int) -> None:
    rng = np.random.default_rng(1000 + seed)
    hq, hkv, hd, dtype = CONFIGS[seed % len(CONFIGS)]
    ps = int(rng.choice([16, 32, 64, 128]))
    B = int(rng.choice([1, 2, 3, 5, 8]))
    kinds = rng.choice(["one", "short", "mid", "long"], size=B, p=[0.15, 0.3, 0.3, 0.25])
    cap = 32768 if B <= 3 else 8192
    lens = [int({"one": 1, "short": rng.integers(2, 300), "mid": rng.integers(300, 4096),
                 "long": rng.integers(4096, cap + 1)}[kd]) for kd in kinds]
    q, k, v, tables = make_case(torch, rng, lens, hq, hkv, hd, ps, dtype)
    ref = reference(torch, q, k, v, tables, lens)
    for mode, (out, plans, p) in run_modes(torch, backend, q, k, v, tables, lens).items():
        assert torch.isfinite(out).all(), f"{mode}: non-finite output"
        err = rel_err(torch, out, ref)
        assert err < TOL[dtype], f"{mode} plan {p}: rel err {err:.2e} lens {lens} ps {ps}"
        assert sum(plans.values()) == 1


@pytest.mark.parametrize("hq,hkv,threads", [(16, 2, 128), (8, 1, 256)])
def test_long_context_multi_block_uses_many_chunks(torch, backend, hq: int, hkv: int, threads: int) -> None:
    """32k tokens at batch 1: the auto plan splits (about one wave of CTAs) and still matches. Two kv heads
    give 64 chunks (8-group reduction CTAs), one kv head 128 (16 groups)."""
    rng = np.random.default_rng(7)
    lens = [32768]
    q, k, v, tables = make_case(torch, rng, lens, hq, hkv, 256, 16, "bfloat16")
    ref = reference(torch, q, k, v, tables, lens)
    outs = run_modes(torch, backend, q, k, v, tables, lens, modes=("auto",))
    out, plans, p = outs["auto"]
    assert p.kernel == MULTI and p.blocks_per_seq >= 32, p
    assert p.reduce_threads == threads, p
    assert plans[MULTI] == 1
    assert rel_err(torch, out, ref) < TOL["bfloat16"]


@pytest.mark.parametrize("hq,hkv,hd,dtype", [(16, 2, 256, "bfloat16"), (32, 8, 128, "float16"),
                                           (8, 2, 64, "float32")])
def test_batch_invariant_split_gives_each_sequence_its_bits_alone(torch, backend, hq, hkv, hd, dtype) -> None:
    """The batch-invariant split (dispatcher.batch_invariant, the cuda backend's default): every sequence's output
    is bit-identical alone and inside batches of other lengths (a 32k neighbour, 1-token ones), eager and with a
    graph class's power-of-two grid, tensor-core and portable kernels; and it matches the float64 reference."""
    from hybrid_runtime.cuda.driver import DeviceArray
    from hybrid_runtime.ops.dispatcher import sequence_plan

    rng = np.random.default_rng(23)
    lens = [5000, 32768, 70, 1, 3000, 64, 65]
    q, k, v, tables = make_case(torch, rng, lens, hq, hkv, hd, 16, dtype)
    ref = reference(torch, q, k, v, tables, lens)
    ka, va = DeviceArray.from_torch(k), DeviceArray.from_torch(v)
    disp = DecodeAttentionDispatcher("on", backend.limits, backend.workspace_bytes, backend.kernels(),
                                     batch_invariant=True)

    def run(idx: list[int], blocks: int = 0) -> np.ndarray:
        qs = q[idx].contiguous()
        qa = DeviceArray.from_torch(qs)
        tb, ln = [tables[i] for i in idx], [lens[i] for i in idx]
        b = DecodeBatch.from_arrays(qa, ka, tb, ln)
        p = sequence_plan(b, backend.limits, blocks) if blocks else disp.select(b)
        assert p.seq_chunks is not None and not validate(p, b, backend.limits, backend.workspace_bytes), p
        o = torch.as_tensor(backend.run_plan(p, qa, ka, va, tb, ln), device="cuda").clone()
        backend.device.synchronize()
        return o.cpu().numpy()

    full = run(list(range(len(lens))))
    assert rel_err(torch, torch.as_tensor(full, device="cuda"), ref) < TOL[dtype]
    for blocks in (0, 64):
        for i in range(len(lens)):
            alone = run([i], blocks)
            assert np.array_equal(alone.view(np.uint32), full[i:i + 1].view(np.uint32)), (i, lens[i], blocks)
    # a grid too small for a sequence's own chunks (5000 tokens = 40 chunks of 128) is refused, never launched
    b = DecodeBatch.from_arrays(DeviceArray.from_torch(q[:1].contiguous()), ka, tables[:1], lens[:1])
    assert "plan_inconsistent" in validate(sequence_plan(b, backend.limits, 16), b, backend.limits,
                                           backend.workspace_bytes)


def test_workspace_fallback_still_correct(torch, backend) -> None:
    """A workspace too small for the split: the dispatcher halves the blocks (counted) and stays exact."""
    from hybrid_runtime.cuda.driver import DeviceArray

    rng = np.random.default_rng(11)
    lens = [20000, 9000]
    q, k, v, tables = make_case(torch, rng, lens, 32, 8, 128, 32, "float16")
    ref = reference(torch, q, k, v, tables, lens)
    qa, ka, va = (DeviceArray.from_torch(t) for t in (q, k, v))
    per_block = 2 * 32 * (128 + 2) * 4
    disp = DecodeAttentionDispatcher("on", backend.limits, per_block * 5, backend.kernels())
    out = torch.as_tensor(disp.run(qa, ka, va, tables, lens), device="cuda").clone()
    assert disp.fallbacks["workspace"] >= 1 and disp.plans[MULTI] == 1
    assert rel_err(torch, out, ref) < TOL["float16"]


@pytest.mark.parametrize("mode", ["off", "on"])
def test_small_shared_memory_merges_serially(torch, backend, mode: str) -> None:
    """Device limits of 30 KB of shared memory: the plan stages 16-token tiles, so one warp streams
    K/V and the four warps merge one after another through a single slice (the kernel's serial path,
    taken when the shared memory cannot hold a slice per warp). Still exact, single- and multi-block."""
    from hybrid_runtime.cuda.driver import DeviceArray

    rng = np.random.default_rng(23)
    lens = [5000, 77, 1]
    hq, hkv, hd = 16, 2, 256
    q, k, v, tables = make_case(torch, rng, lens, hq, hkv, hd, 16, "bfloat16")
    ref = reference(torch, q, k, v, tables, lens)
    qa, ka, va = (DeviceArray.from_torch(t) for t in (q, k, v))
    small = replace(backend.limits, max_shared_mem_optin=30 * 1024)
    disp = DecodeAttentionDispatcher(mode, small, backend.workspace_bytes, backend.kernels())
    p = disp.select(DecodeBatch.from_arrays(qa, ka, tables, lens))
    G, warps = hq // hkv, 4
    wide_bytes = (warps * G * (hd + 4) + 2 * warps * 8 + G * (warps + 2)) * 4  # the kernel's per-warp slices
    assert p.kv_tile == 16 and p.smem_bytes < wide_bytes, p
    assert p.smem_bytes < 2 * 2 * 16 * hd * 2, "more than one streaming warp"
    out = torch.as_tensor(disp.run(qa, ka, va, tables, lens), device="cuda").clone()
    assert (p.kernel == MULTI) == (mode == "on")
    assert rel_err(torch, out, ref) < TOL["bfloat16"]


def test_kv_written_by_kernel_then_attended(torch, dev, backend) -> None:
    """Tokens stored with the paged KV write kernel are what decode attention reads."""
    from hybrid_runtime.cuda.driver import DeviceArray
    from hybrid_runtime.cuda.state import DeviceKVCache
    from hybrid_runtime.kv_cache import KVLayout, PageAllocator

    layout = KVLayout(num_pages=64, page_size=16, num_kv_heads=2, head_dim=128, dtype=np.float16, num_layers=1)
    cache = DeviceKVCache(dev, layout, dtype="bfloat16")
    alloc = PageAllocator(64, 16)
    lens = [100, 37, 1]
    gen = torch.Generator(device="cuda").manual_seed(3)
    ks, vs = [], []
    for i, n in enumerate(lens):
        table = alloc.allocate(f"s{i}", n)
        kk = torch.randn(n, 2, 128, device="cuda", generator=gen).to(torch.bfloat16)
        vv = torch.randn(n, 2, 128, device="cuda", generator=gen).to(torch.bfloat16)
        # two writes (prefill chunk, then the rest) through the page table
        cut = n // 2
        for lo, hi in ((0, cut), (cut, n)):
            cache.write(0, table, lo, DeviceArray.from_torch(kk[lo:hi].contiguous()),
                        DeviceArray.from_torch(vv[lo:hi].contiguous()))
        ks.append(kk)
        vs.append(vv)
    dev.synchronize()
    kb, vb = cache.buffers(0)
    kt = torch.as_tensor(kb, device="cuda").view(torch.bfloat16)
    vt = torch.as_tensor(vb, device="cuda").view(torch.bfloat16)
    tables = [np.array(alloc.page_table(f"s{i}")) for i in range(len(lens))]
    for i, n in enumerate(lens):
        idx = torch.as_tensor(tables[i], device="cuda")
        assert torch.equal(kt[idx].reshape(-1, 2, 128)[:n], ks[i])
        assert torch.equal(vt[idx].reshape(-1, 2, 128)[:n], vs[i])
    q = torch.randn(len(lens), 8, 128, device="cuda", generator=gen).to(torch.bfloat16)
    ref = reference(torch, q, kt, vt, tables, lens)
    out = torch.as_tensor(backend.dispatcher("auto").run(DeviceArray.from_torch(q), kb, vb, tables, lens),
                          device="cuda").clone()
    assert rel_err(torch, out, ref) < TOL["bfloat16"]


# ------------------------------------------------------------------------------------------ the guard


def tiny_inputs(torch, dtype: str, hd: int):
    """A valid 1-token problem (B = Hq = Hkv = 1): argument buffers for raw launches. Any CTA beyond it
    exits at once, so even an unexpectedly accepted launch cannot touch memory out of bounds."""
    from hybrid_runtime.cuda.driver import DeviceArray

    tdt = getattr(torch, dtype)
    q = torch.randn(1, 1, hd, device="cuda").to(tdt)
    k = torch.randn(1, 16, 1, hd, device="cuda").to(tdt)
    meta = torch.tensor([1, 0], dtype=torch.int32, device="cuda")  # lens | table
    out = torch.empty(1, 1, hd, device="cuda")
    ws = torch.empty(1 << 16, device="cuda")
    return [DeviceArray.from_torch(t) for t in (q, k, meta, out, ws)]


def raw_args(p, arrays, hd: int):
    from hybrid_runtime.cuda.attention import attention_launches

    q, k, meta, out, ws = arrays
    return attention_launches(p, batch=1, num_q_heads=1, num_kv_heads=1, head_dim=hd, page_size=16, q=q.ptr,
                              k=k.ptr, v=k.ptr, tables=meta.ptr + 4, table_stride=1, lens=meta.ptr, out=out.ptr,
                              workspace=ws.ptr)[0].args


def test_guard_grid_y_matches_driver(torch, dev, backend) -> None:
    from hybrid_runtime.cuda.attention import choose_variant
    from hybrid_runtime.cuda.kernels import LaunchRejected

    assert dev.limits.max_grid_y == 65535
    batch = DecodeBatch((1,), (np.zeros(1, np.int64),), num_q_heads=70000, num_kv_heads=70000, head_dim=64,
                        page_size=16, dtype="float16", num_pool_pages=1)
    lim = backend.limits
    p = make_plan(batch, 1, lim)
    assert p.grid == (1, 70000, 1)
    assert validate(p, batch, lim, backend.workspace_bytes) == ["grid_y"]
    disp = backend.dispatcher("auto")
    with pytest.raises(DecodeAttentionError) as e:
        disp.select(batch)
    assert "grid_y" in e.value.reasons and disp.errors["grid_y"] == 1 and not disp.plans

    # The very launch the guard refused, straight to the driver: an error code, not a crash.
    arrays = tiny_inputs(torch, "float16", 64)
    kern = backend.kernels_for(choose_variant("float16", 64, 1))[SINGLE]
    args = raw_args(p, arrays, 64)
    assert kern.launch_unchecked(dev, p.grid, (p.block_threads, 1, 1), p.smem_bytes, args) == CUDA_ERROR_INVALID_VALUE
    with pytest.raises(LaunchRejected) as lr:
        kern.launch(dev, p.grid, (p.block_threads, 1, 1), p.smem_bytes, args)
    assert lr.value.reasons == ("grid_y",)
    # One below the limit is accepted (its extra CTAs exit at once); the context is healthy afterwards.
    ok = replace(p, grid=(1, 65535, 1))
    assert kern.launch_unchecked(dev, ok.grid, (ok.block_threads, 1, 1), ok.smem_bytes, args) == 0
    dev.synchronize()


def test_guard_smem_over_optin_matches_driver(torch, dev, backend) -> None:
    from hybrid_runtime.cuda.attention import choose_variant

    # G = 128 query heads of 256 float32 dims: even the smallest K/V tile needs > 227 KB.
    batch = DecodeBatch((16,), (np.zeros(1, np.int64),), num_q_heads=128, num_kv_heads=1, head_dim=256,
                        page_size=16, dtype="float32", num_pool_pages=1)
    lim = backend.limits
    p = make_plan(batch, 1, lim)
    assert p.smem_bytes > lim.max_shared_mem_optin
    assert "smem_optin" in validate(p, batch, lim, backend.workspace_bytes)
    disp = backend.dispatcher("on")
    with pytest.raises(DecodeAttentionError) as e:
        disp.select(batch)
    assert "smem_optin" in e.value.reasons

    arrays = tiny_inputs(torch, "float32", 256)
    kern = backend.kernels_for(choose_variant("float32", 256, 1))[SINGLE]
    assert kern.optin_bytes(dev) is not None
    small = make_plan(replace(batch, num_q_heads=1), 1, lim)  # a valid plan for the tiny problem
    args = raw_args(small, arrays, 256)
    block = (p.block_threads, 1, 1)
    assert kern.launch_unchecked(dev, p.grid, block, p.smem_bytes, args) == CUDA_ERROR_INVALID_VALUE
    cap = lim.max_shared_mem_optin - kern.static_smem(dev)
    assert kern.launch_unchecked(dev, (1, 1, 1), block, cap + 1, args) == CUDA_ERROR_INVALID_VALUE
    assert kern.launch_unchecked(dev, (1, 1, 1), block, cap, args) == 0  # exactly the limit: fine
    dev.synchronize()


def test_guard_optin_attribute_not_set_matches_driver(torch, dev, backend) -> None:
    """A kernel whose opt-in attribute was never set (a fresh load of the same cubin): plans above 48 KB
    are rejected by the guard for a device whose limits do not list the family, and by the driver."""
    from hybrid_runtime.cuda.attention import SOURCE, choose_variant
    from hybrid_runtime.cuda.kernels import Module, compile_cubin, source

    batch = DecodeBatch((16,), (np.zeros(1, np.int64),), num_q_heads=32, num_kv_heads=1, head_dim=256,
                        page_size=16, dtype="float16", num_pool_pages=1)
    bare = dev.limits  # queried limits, no family opted in
    assert not bare.optin_set
    p = make_plan(batch, 1, bare)
    assert p.smem_bytes > bare.max_shared_mem_per_block
    assert validate(p, batch, bare, 1 << 30) == ["smem_attr_not_set"]
    assert validate(make_plan(batch, 1, backend.limits), batch, backend.limits, 1 << 30) == []
    with pytest.raises(DecodeAttentionError) as e:
        DecodeAttentionDispatcher("auto", bare, 1 << 30, backend.kernels()).select(batch)
    assert "smem_attr_not_set" in e.value.reasons

    variant = choose_variant("float16", 256, 32)
    fresh = Module(compile_cubin(source(SOURCE), SOURCE, variant.options, dev.arch)).kernel("decode_attn_single")
    assert fresh.optin_bytes(dev) is None
    opted = backend.kernels_for(variant)[SINGLE]
    arrays = tiny_inputs(torch, "float16", 256)
    small = make_plan(replace(batch, num_q_heads=1, num_kv_heads=1), 1, backend.limits)
    args = raw_args(replace(small, smem_bytes=p.smem_bytes), arrays, 256)
    assert fresh.problems(dev, (1, 1, 1), (p.block_threads, 1, 1), p.smem_bytes) == ["smem_attr_not_set"]
    assert fresh.launch_unchecked(dev, (1, 1, 1), (p.block_threads, 1, 1), p.smem_bytes, args) == \
        CUDA_ERROR_INVALID_VALUE
    assert opted.launch_unchecked(dev, (1, 1, 1), (p.block_threads, 1, 1), p.smem_bytes, args) == 0
    dev.synchronize()


def test_limits_are_the_devices(dev, backend) -> None:
    lim = backend.limits
    assert lim.sm_count == dev.limits.sm_count > 0
    assert lim.max_shared_mem_optin > lim.max_shared_mem_per_block >= 48 * 1024
    assert lim.optin_set == frozenset({SINGLE, MULTI})
    rec = backend.optin_record()
    assert rec and all(v is not None for k, v in rec.items() if "reduce" not in k)
