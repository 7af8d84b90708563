"""The tensor-core prefill MoE (``cuda/moe_prefill.py``, ``ops/cuda/moe_gemm.cu``) on the GPU against a per-token
float64 reference (softmax, top-k, SwiGLU, down per token from the same bf16/fp16 weights and inputs; the
activation rounded to the dtype as the device stores it), for many token counts on the Qwen3.5-35B-A3B expert
shape (H 2048, I 512, 256 experts, top-8) and a small one: experts with no token, one expert with every token;
routing == fused.cu's moe_route (pair_e / pair_w bit for bit, the same pairs per expert), the tile list == its
numpy model, and nothing written outside the step's pairs (canaries in y and act after a larger step left a
stale tile list and pair_list behind); the slots in the bundle dtype (prefill's ``y_dtype``) == the float32 slots
rounded once, bit for bit. The backend's own bf16 tests (test_cuda_backend.py) run this path too:
the default model's MoE (H 128, I 128, 8 experts, top-2) is a tensor-core shape."""

from __future__ import annotations

import numpy as np
import pytest
from gpu_bits import host_bits, to_f32

pytestmark = pytest.mark.gpu

DT = {"float16": 1, "bfloat16": 2}
CANARY = -7777.0
SHAPES = {"a35b": (2048, 512, 256, 8), "small": (256, 128, 16, 4), "default": (128, 128, 8, 2)}
# (n, case) in this order: the largest first, so later, smaller steps run over its stale tiles and pair_list
CASES = [(4096, "spread"), (1000, "one_takes_all"), (64, "cold_experts"), (7, "spread"), (1, "spread")]


@pytest.fixture(scope="module")
def dev():
    import torch

    torch.cuda.init()
    from hybrid_runtime.cuda.driver import CudaDevice

    return CudaDevice(0)


def reference_route(logits: np.ndarray, E: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Per token: top-k of the float32 logits (ties to the lower id), softmax weights renormalised (float64)."""
    lg = logits[:, :E].astype(np.float64)
    p = np.exp(lg - lg.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    top = np.stack([np.lexsort((np.arange(E), -logits[t, :E]))[:k] for t in range(len(logits))])
    w = np.take_along_axis(p, top, 1)
    return top, w / w.sum(1, keepdims=True)


def reference_moe(h: np.ndarray, top: np.ndarray, w: np.ndarray, gu: np.ndarray, dn: np.ndarray, dtype: str
                  ) -> np.ndarray:
    """y [n, k, H] float64: pair (t, j) = w[t, j] * down_e(round(silu(gate_e h_t) * up_e h_t)), e = top[t, j].
    Each row is computed alone (grouped by expert only to use matrix products)."""
    from hybrid_runtime.cuda.backend import to_dtype

    n, k = top.shape
    inter = gu.shape[1] // 2
    y = np.zeros((n, k, dn.shape[1]))
    for e in np.unique(top):
        t, j = np.nonzero(top == e)
        x = h[t].astype(np.float64) @ gu[e].T.astype(np.float64)
        a = x[:, :inter] / (1 + np.exp(-x[:, :inter])) * x[:, inter:]
        a = to_f32(to_dtype(a.astype(np.float32), dtype), dtype).astype(np.float64)  # act as the device holds it
        y[t, j] = w[t, j, None] * (a @ dn[e].T.astype(np.float64))
    return y


class Setup:
    """Weights (random on the device, host copies), buffers for up to n_max tokens, the kernels."""

    def __init__(self, dev, dtype: str, shape: str, n_max: int = 4096, impl: str = "mma") -> None:
        from hybrid_runtime.cuda.backend import fill_random
        from hybrid_runtime.cuda.kernels import load_module
        from hybrid_runtime.cuda.moe_prefill import ROUTE_MAX_CTAS, MoEBuffers, MoEPrefill, tile_list_words
        from hybrid_runtime.cuda.weights import MoEWeights

        self.dev, self.dtype = dev, dtype
        H, inter, E, k = SHAPES[shape]
        self.H, self.I, self.E, self.k = H, inter, E, k
        self.ny = k + 1  # a shared expert's slot after the routed ones: never written by the routed kernels
        self.ld = -(-(E + 1) // 8) * 8 + 8
        self.fused = load_module("fused.cu", (f"-DDT={DT[dtype]}",), dev.arch)
        gu = dev.empty((E, 2 * inter, H), dtype)
        dn = dev.empty((E, H, inter), dtype)
        fill_random(dev, self.fused, gu, 11, 1.0 / np.sqrt(H))
        fill_random(dev, self.fused, dn, 12, 1.0 / np.sqrt(inter))
        # (download gives float32 for bfloat16, float16 for float16)
        self.gu = np.asarray(dev.download(gu), np.float32)
        self.dn = np.asarray(dev.download(dn), np.float32)
        self.mw = MoEWeights(dev.zeros((8, H), dtype), 8, gu, dn, E, False, None, None)
        P = n_max * k
        self.b = {name: dev.empty(shape_, dt) for name, shape_, dt in (
            ("pw", (P,), "float32"), ("pe", (P,), "int32"), ("pl", (P,), "int32"), ("off", (E + 1,), "int32"),
            ("active", (E + 1,), "int32"), ("tiles", (tile_list_words(P, E),), "int32"),
            ("cta", (ROUTE_MAX_CTAS, E), "int32"), ("act", (P, inter), dtype), ("y", (n_max, self.ny, H), "float32"),
            ("yt", (n_max, self.ny, H), dtype),  # the slots in the bundle dtype (run(y_dtype=dtype))
            # moe_route's outputs, for the comparison
            ("r_pw", (P,), "float32"), ("r_pe", (P,), "int32"), ("r_pl", (P,), "int32"),
            ("r_off", (E + 1,), "int32"), ("r_active", (E + 1,), "int32"))}
        b = self.b
        self.bufs = MoEBuffers(b["pw"].ptr, b["pe"].ptr, b["pl"].ptr, b["off"].ptr, b["active"].ptr,
                               b["tiles"].ptr, b["cta"].ptr, b["act"].ptr, b["y"].ptr,
                               (b["tiles"].size - 4) // 4)
        self.moe = MoEPrefill(dev, dtype, impl=impl)
        assert self.moe.impl == impl and self.moe.gemm_impl(H, inter) == impl  # the build under test runs

    def run(self, n: int, h_bits: np.ndarray, logits: np.ndarray, y_dtype: str = "float32"
            ) -> dict[str, np.ndarray]:
        """One step; ``y_dtype`` = the bundle dtype writes the slots into ``yt`` (``y`` keeps its canaries)."""
        from dataclasses import replace

        dev, b = self.dev, self.b
        hd = dev.upload(h_bits, dtype=self.dtype)
        lg = dev.upload(np.ascontiguousarray(logits, np.float32))
        self.fused.kernel("fill_f32").launch(dev, (-(-b["y"].size // 256), 1, 1), (256, 1, 1), 0,
                                             [("ptr", b["y"].ptr), ("f32", CANARY), ("i64", b["y"].size)])
        dev.memset_d8(b["act"].ptr, 0xFF, b["act"].nbytes)  # 0xFFFF: a NaN in bf16 and in fp16 (canary)
        dev.memset_d8(b["yt"].ptr, 0xFF, b["yt"].nbytes)
        bufs = self.bufs if y_dtype == "float32" else replace(self.bufs, y=b["yt"].ptr)
        self.moe.launch(n, lg.ptr, self.ld, self.mw, hd.ptr, self.H, self.k, True, self.ny, bufs, y_dtype=y_dtype)
        self.fused.kernel("moe_route").launch(
            dev, (1, 1, 1), (1024, 1, 1), 0,
            [("ptr", lg.ptr), ("i32", self.ld), ("i32", n), ("i32", self.E), ("i32", self.k), ("i32", 1), ("i32", 0),
             ("ptr", b["r_pw"].ptr), ("ptr", b["r_pe"].ptr), ("ptr", b["r_off"].ptr), ("ptr", b["r_pl"].ptr),
             ("ptr", b["r_active"].ptr)])
        dev.synchronize()
        out = {name: dev.download(a) for name, a in b.items()}
        del hd, lg
        return out


def logits_for(rng: np.random.Generator, n: int, E: int, ld: int, case: str) -> np.ndarray:
    lg = rng.standard_normal((n, ld)).astype(np.float32)
    if case == "one_takes_all":
        lg[:, E // 3] += 30.0  # every token's first choice
    elif case == "cold_experts":
        lg[:, E // 2:] -= 60.0  # half the experts receive no token at all
    return lg


IMPLS = ["mma", "wgmma", "wgmma128", "wgmma_ws", "wgmma64"]


def impl_or_skip(dev, impl: str) -> None:
    if impl != "mma" and tuple(dev.compute_capability) != (9, 0):
        pytest.skip(f"{impl} runs on compute capability 9.0 only")


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype,shape", [("bfloat16", "a35b"), ("bfloat16", "small"), ("float16", "small")])
def test_prefill_moe_matches_a_per_token_reference(dev, dtype: str, shape: str, impl: str) -> None:
    from hybrid_runtime.cuda.moe_prefill import tile_list

    impl_or_skip(dev, impl)
    s = Setup(dev, dtype, shape, impl=impl)
    E, k, H = s.E, s.k, s.H
    rng = np.random.default_rng(E + H)
    for n, case in CASES:
        P = n * k
        h = rng.standard_normal((n, H)).astype(np.float32)
        hb = host_bits(h, dtype)
        lg = logits_for(rng, n, E, s.ld, case)
        got = s.run(n, hb, lg)
        label = f"{dtype} {shape} n={n} {case}"
        # routing: moe_route's bits, and the reference's choices
        assert np.array_equal(got["pe"][:P], got["r_pe"][:P]), label
        assert np.array_equal(got["pw"][:P].view(np.uint32), got["r_pw"][:P].view(np.uint32)), label
        assert np.array_equal(got["off"], got["r_off"]), label
        na = int(got["r_active"][E])
        assert np.array_equal(got["active"][:na], got["r_active"][:na]) and got["active"][E] == na, label
        off = got["off"]
        for e in range(E):  # the same pairs per expert; ours ascending
            mine, theirs = got["pl"][off[e]:off[e + 1]], got["r_pl"][off[e]:off[e + 1]]
            assert np.array_equal(mine, np.sort(theirs)), (label, e)
        top, w = reference_route(lg, E, k)
        assert np.array_equal(got["pe"][:P].reshape(n, k), top), label
        np.testing.assert_allclose(got["pw"][:P].reshape(n, k), w, rtol=2e-6, atol=1e-7)
        counts = np.diff(off)
        if case == "one_takes_all":
            assert counts[E // 3] == n, label
        if case == "cold_experts":
            assert not counts[E // 2:].any(), label
        tiles = got["tiles"]
        want_tiles = tile_list(counts, s.moe.tile_rows)
        assert tiles[0] == len(want_tiles), label
        assert np.array_equal(tiles[4:4 + 4 * len(want_tiles)].reshape(-1, 4)[:, :3], want_tiles), label
        # the products, pair by pair
        want = reference_moe(to_f32(hb, dtype), top, w, s.gu, s.dn, dtype)
        y = got["y"][:n, :k].astype(np.float64)
        err = np.linalg.norm(y - want, axis=-1) / np.maximum(np.linalg.norm(want, axis=-1), 1e-30)
        assert err.max() < 5e-3, (label, float(err.max()))
        assert np.linalg.norm(y - want) / np.linalg.norm(want) < 1e-3, label
        # nothing written past the step: y rows >= n, the shared slot, act rows >= n*k (canaries)
        assert (got["y"][n:] == CANARY).all() and (got["y"][:n, k:] == CANARY).all(), label
        assert np.isnan(got["act"][P:]).all() and not np.isnan(got["act"][:P]).any(), label


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype,shape", [("bfloat16", "a35b"), ("bfloat16", "small"), ("float16", "small")])
def test_slots_in_the_bundle_dtype_are_the_float32_products_rounded_once(dev, dtype: str, shape: str,
                                                                         impl: str) -> None:
    """The ``_t`` down kernels (the backend's prefill steps: y in bf16 / fp16): every slot the step owns is the
    float32 kernel's value rounded to the dtype (round to nearest even), bit for bit; nothing else written (NaN
    canaries); against the float64 per-token reference within the float32 kernel's bounds plus that one rounding
    (relative 2^-8 per element for bf16, 2^-11 for fp16: per row <= 5e-3 + 2^-8 / 5e-3 + 2^-11, overall
    <= 1e-3 + 2^-9 / 1e-3 + 2^-12)."""
    from hybrid_runtime.cuda.backend import to_dtype

    impl_or_skip(dev, impl)
    s = Setup(dev, dtype, shape, impl=impl)
    E, k, H = s.E, s.k, s.H
    u = 2.0 ** -8 if dtype == "bfloat16" else 2.0 ** -11
    rng = np.random.default_rng(E + H + 1)
    for n, case in CASES:
        hb = host_bits(rng.standard_normal((n, H)).astype(np.float32), dtype)
        lg = logits_for(rng, n, E, s.ld, case)
        f32 = s.run(n, hb, lg)
        low = s.run(n, hb, lg, y_dtype=dtype)
        label = f"{impl} {dtype} {shape} n={n} {case}"
        assert np.array_equal(f32["pe"], low["pe"]) and np.array_equal(f32["pl"], low["pl"]), label
        want_bits = to_dtype(f32["y"][:n, :k], dtype).view(np.uint16)
        got = low["yt"]  # downloaded: float32 for bf16, float16 for fp16
        got_bits = to_dtype(got[:n, :k], dtype).view(np.uint16) if dtype == "bfloat16" else \
            np.ascontiguousarray(got[:n, :k]).view(np.uint16)
        assert np.array_equal(got_bits, want_bits), (label, int((got_bits != want_bits).sum()))
        assert np.isnan(got[n:]).all() and np.isnan(got[:n, k:]).all(), label  # only the step's routed slots
        assert (low["y"] == CANARY).all(), label  # the float32 slots untouched
        top, w = reference_route(lg, E, k)
        ref = reference_moe(to_f32(hb, dtype), top, w, s.gu, s.dn, dtype)
        y = got[:n, :k].astype(np.float64)
        # fp16 slots: a value below its normal range (2^-14) keeps only absolute precision (a pair weighted e^-30,
        # as "one_takes_all" makes them, rounds to 0 or a subnormal), so a row's error may also reach that floor
        tiny = 0.0 if dtype == "bfloat16" else np.sqrt(H) * 2.0 ** -14
        err = np.linalg.norm(y - ref, axis=-1)
        bound = (5e-3 + u) * np.linalg.norm(ref, axis=-1) + tiny
        assert (err <= bound).all(), (label, float((err / np.maximum(bound, 1e-30)).max()))
        assert np.linalg.norm(y - ref) / np.linalg.norm(ref) < 1e-3 + u / 2, label


@pytest.mark.parametrize("impl", IMPLS)
def test_a_rows_result_does_not_depend_on_the_other_tokens(dev, impl: str) -> None:
    """Batch invariance: the first 7 tokens alone and inside a 1000-token step give the same bits."""
    impl_or_skip(dev, impl)
    s = Setup(dev, "bfloat16", "small", n_max=1000, impl=impl)
    rng = np.random.default_rng(5)
    hb = host_bits(rng.standard_normal((1000, s.H)).astype(np.float32), "bfloat16")
    lg = logits_for(rng, 1000, s.E, s.ld, "spread")
    big = s.run(1000, hb, lg)
    small = s.run(7, np.ascontiguousarray(hb[:7]), np.ascontiguousarray(lg[:7]))
    assert np.array_equal(big["y"][:7].view(np.uint32), small["y"][:7].view(np.uint32))
    big = s.run(1000, hb, lg, y_dtype="bfloat16")  # the bf16 slots of prefill steps, likewise
    small = s.run(7, np.ascontiguousarray(hb[:7]), np.ascontiguousarray(lg[:7]), y_dtype="bfloat16")
    assert np.array_equal(big["yt"][:7, :s.k].view(np.uint32), small["yt"][:7, :s.k].view(np.uint32))


def test_the_64_row_build_gives_the_128_row_builds_bits(dev) -> None:
    """wgmma64 (64-row tiles) and wgmma_ws (128-row tiles): a token's slots have the same bits whichever build and
    step size computed them (7 tokens alone on one, the same 7 among 1000 on the other; the whole 1000-token step)."""
    impl_or_skip(dev, "wgmma64")
    rng = np.random.default_rng(6)
    ws = Setup(dev, "bfloat16", "small", n_max=1000, impl="wgmma_ws")
    s64 = Setup(dev, "bfloat16", "small", n_max=1000, impl="wgmma64")
    assert (ws.moe.tile_rows, s64.moe.tile_rows) == (128, 64)
    hb = host_bits(rng.standard_normal((1000, ws.H)).astype(np.float32), "bfloat16")
    lg = logits_for(rng, 1000, ws.E, ws.ld, "spread")
    h7, lg7 = np.ascontiguousarray(hb[:7]), np.ascontiguousarray(lg[:7])
    for y, y_dtype, view in (("y", "float32", np.uint32), ("yt", "bfloat16", np.uint16)):
        big = ws.run(1000, hb, lg, y_dtype=y_dtype)[y][:, :ws.k]
        assert np.array_equal(s64.run(7, h7, lg7, y_dtype=y_dtype)[y][:7, :ws.k].view(view), big[:7].view(view))
        assert np.array_equal(s64.run(1000, hb, lg, y_dtype=y_dtype)[y][:, :ws.k].view(view), big.view(view))


@pytest.mark.parametrize("other", ["wgmma", "wgmma_ws"])
def test_wgmma_and_mma_agree_closely(dev, other: str) -> None:
    """The two builds on the same step: the same routing bits; products within float32 accumulation-order noise
    (bf16 act may round differently in a few elements)."""
    impl_or_skip(dev, other)
    rng = np.random.default_rng(9)
    hb = host_bits(rng.standard_normal((300, 256)).astype(np.float32), "bfloat16")
    runs = {}
    for impl in ("mma", other):
        s = Setup(dev, "bfloat16", "small", n_max=300, impl=impl)
        lg = logits_for(np.random.default_rng(3), 300, s.E, s.ld, "spread")
        runs[impl] = s.run(300, hb, lg)
    a, b = runs["mma"], runs[other]
    assert np.array_equal(a["pl"], b["pl"]) and np.array_equal(a["pw"].view(np.uint32), b["pw"].view(np.uint32))
    ya, yb = a["y"][:300, :4].astype(np.float64), b["y"][:300, :4].astype(np.float64)
    assert np.linalg.norm(ya - yb) / np.linalg.norm(ya) < 2e-3


@pytest.mark.parametrize("shape", ["a35b", "small", "default"])
@pytest.mark.parametrize("impl", ["mma", "wgmma_ws"])
def test_decode_sizes_with_the_shared_expert_folded_match_the_cuda_core_kernels(dev, impl: str, shape: str) -> None:
    """Decode steps on the tensor cores (CudaBackend moe_decode): the shared expert folded in as expert E, slot k,
    weighted by sigmoid(logits[:, E]). Against fused.cu's folded CUDA-core kernels (moe_route + moe_gate_up +
    moe_down, the decode path) on the same inputs, at decode batch sizes 1 .. 64: the same routing bits, every
    pair's product within bf16 activation rounding, nothing written past the step's rows."""
    from hybrid_runtime.cuda.backend import MOE_ROWS_PER_CTA, SMEM_DEFAULT, fill_random
    from hybrid_runtime.cuda.kernels import load_module
    from hybrid_runtime.cuda.moe_prefill import ROUTE_MAX_CTAS, MoEBuffers, MoEPrefill, tile_list_words
    from hybrid_runtime.cuda.weights import MoEWeights

    impl_or_skip(dev, impl)
    H, inter, E, k = SHAPES[shape]
    e_all, kk, ny, n_max = E + 1, k + 1, k + 1, 64
    ld = -(-(E + 1) // 8) * 8
    fused = load_module("fused.cu", (f"-DDT={DT['bfloat16']}",), dev.arch)
    gu, dn = dev.empty((e_all, 2 * inter, H), "bfloat16"), dev.empty((e_all, H, inter), "bfloat16")
    fill_random(dev, fused, gu, 21, 1.0 / np.sqrt(H))
    fill_random(dev, fused, dn, 22, 1.0 / np.sqrt(inter))
    mw = MoEWeights(dev.zeros((ld, H), "bfloat16"), ld, gu, dn, E, True, None, None)
    moe = MoEPrefill(dev, "bfloat16", impl=impl)
    if moe.gemm_impl(H, inter) != impl:
        pytest.skip(f"{impl} tiles do not divide H {H}, I {inter}")
    P = n_max * kk

    def bufs(prefix: str) -> dict:
        return {name: dev.empty(shape, dt) for name, shape, dt in (
            ("pw", (P,), "float32"), ("pe", (P,), "int32"), ("pl", (P,), "int32"), ("off", (e_all + 1,), "int32"),
            ("active", (e_all + 1,), "int32"), ("tiles", (tile_list_words(P, e_all),), "int32"),
            ("cta", (ROUTE_MAX_CTAS, e_all), "int32"), ("act", (P, inter), "bfloat16"),
            ("y", (n_max, ny, H), "float32"))}

    tc, cc = bufs("tc"), bufs("cc")
    mb = MoEBuffers(tc["pw"].ptr, tc["pe"].ptr, tc["pl"].ptr, tc["off"].ptr, tc["active"].ptr, tc["tiles"].ptr,
                    tc["cta"].ptr, tc["act"].ptr, tc["y"].ptr, (tc["tiles"].size - 4) // 4)
    tg, tg_d = max(1, min(8, SMEM_DEFAULT // (H * 2))), max(1, min(8, SMEM_DEFAULT // (inter * 2)))
    rng = np.random.default_rng(17)
    for n in (64, 24, 16, 8, 1):  # largest first: later steps run over its stale buffers
        hb = host_bits(rng.standard_normal((n, H)).astype(np.float32), "bfloat16")
        hd = dev.upload(hb, dtype="bfloat16")
        lg = dev.upload(np.ascontiguousarray(rng.standard_normal((n, ld)).astype(np.float32)))
        for b in (tc, cc):
            fused.kernel("fill_f32").launch(dev, (-(-b["y"].size // 256), 1, 1), (256, 1, 1), 0,
                                            [("ptr", b["y"].ptr), ("f32", CANARY), ("i64", b["y"].size)])
        moe.launch(n, lg.ptr, ld, mw, hd.ptr, H, k, True, ny, mb, fold_shared=True)
        fused.kernel("moe_route").launch(
            dev, (1, 1, 1), (1024, 1, 1), 0,
            [("ptr", lg.ptr), ("i32", ld), ("i32", n), ("i32", E), ("i32", k), ("i32", 1), ("i32", 1),
             ("ptr", cc["pw"].ptr), ("ptr", cc["pe"].ptr), ("ptr", cc["off"].ptr), ("ptr", cc["pl"].ptr),
             ("ptr", cc["active"].ptr)])
        grid_e = min(e_all, n * kk)
        fused.kernel("moe_gate_up").launch(
            dev, (-(-inter // MOE_ROWS_PER_CTA), grid_e, 1), (256, 1, 1), tg * H * 2,
            [("ptr", hd.ptr), ("ptr", gu.ptr), ("i32", H), ("i32", inter), ("i32", kk), ("i32", e_all),
             ("ptr", cc["off"].ptr), ("ptr", cc["pl"].ptr), ("ptr", cc["active"].ptr), ("ptr", cc["act"].ptr),
             ("i32", tg)])
        fused.kernel("moe_down").launch(
            dev, (-(-H // MOE_ROWS_PER_CTA), grid_e, 1), (256, 1, 1), tg_d * inter * 2,
            [("ptr", cc["act"].ptr), ("ptr", dn.ptr), ("ptr", cc["pw"].ptr), ("i32", H), ("i32", inter),
             ("i32", kk), ("i32", ny), ("i32", e_all), ("ptr", cc["off"].ptr), ("ptr", cc["pl"].ptr),
             ("ptr", cc["active"].ptr), ("ptr", cc["y"].ptr), ("i32", tg_d)])
        dev.synchronize()
        got = {name: dev.download(a) for name, a in tc.items()}
        ref = {name: dev.download(a) for name, a in cc.items()}
        label = f"{impl} n={n}"
        q = n * kk
        assert np.array_equal(got["pe"][:q], ref["pe"][:q]), label
        assert (got["pe"][:q].reshape(n, kk)[:, k] == E).all(), label  # the shared expert is slot k
        assert np.array_equal(got["pw"][:q].view(np.uint32), ref["pw"][:q].view(np.uint32)), label
        assert np.array_equal(got["off"], ref["off"]), label
        y, yr = got["y"][:n, :kk].astype(np.float64), ref["y"][:n, :kk].astype(np.float64)
        err = np.linalg.norm(y - yr, axis=-1) / np.maximum(np.linalg.norm(yr, axis=-1), 1e-30)
        assert err.max() < 1e-2, (label, float(err.max()))
        assert np.linalg.norm(y - yr) / np.linalg.norm(yr) < 2e-3, label
        assert (got["y"][n:] == CANARY).all(), label
        del hd, lg
