"""The decode tensor-core MoE (``cuda/moe_decode.py``, ``ops/cuda/moe_decode.cu``) on the GPU: against a per-pair
float64 reference (softmax, top-k, the folded shared expert weighted sigmoid(logit E), SwiGLU with the activation
rounded to the dtype as the device stores it, down) for decode batch sizes 1 .. 64 with the shared expert folded
and not, experts with many pairs (one expert taking every token: two passes of 32 pairs), bf16 and fp16, the
Qwen3.5-35B-A3B expert shape (H 2048, I 512, 256 experts + 1 shared, top-8), a small one and one whose k loops end
in a half tile (H 320, I 192); routing as the backend does it (moe_route up to 16 tokens, moe_topk + moe_group
past that); canaries: nothing written outside y[:n, :kk] and act[:n*kk] after a larger step left stale routing
buffers behind; a token's bits the same alone and inside a 64-token step (batch invariance); agreement with
fused.cu's CUDA-core moe_gate_up / moe_down within bf16 rounding; every knob set of the benchmark."""

from __future__ import annotations

from dataclasses import asdict

import numpy as np
import pytest
from gpu_bits import host_bits, to_f32

pytestmark = pytest.mark.gpu

DT = {"float16": 1, "bfloat16": 2}
CANARY = -7777.0
SHAPES = {"a35b": (2048, 512, 256, 8), "small": (256, 128, 16, 4), "odd": (320, 192, 8, 2)}
# (n, case), largest first: later, smaller steps run over the stale routing buffers of the larger ones
CASES = [(64, "one_takes_all"), (64, "spread"), (24, "spread"), (16, "spread"), (8, "cold_experts"), (2, "spread"),
         (1, "spread")]


@pytest.fixture(scope="module")
def dev():
    import torch

    torch.cuda.init()
    from hybrid_runtime.cuda.driver import CudaDevice

    return CudaDevice(0)


def reference_route(logits: np.ndarray, E: int, k: int, fold: bool) -> tuple[np.ndarray, np.ndarray]:
    """(experts [n, kk], weights [n, kk]) per token: top-k of the float32 logits (ties to the lower id), softmax
    weights renormalised (float64); with ``fold`` slot k is the shared expert E weighted sigmoid(logits[:, E])."""
    lg = logits[:, :E].astype(np.float64)
    p = np.exp(lg - lg.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    top = np.stack([np.lexsort((np.arange(E), -logits[t, :E]))[:k] for t in range(len(logits))])
    w = np.take_along_axis(p, top, 1)
    w = w / w.sum(1, keepdims=True)
    if fold:
        top = np.concatenate([top, np.full((len(logits), 1), E)], 1)
        w = np.concatenate([w, 1.0 / (1.0 + np.exp(-logits[:, E:E + 1].astype(np.float64)))], 1)
    return top, w


def logits_for(rng: np.random.Generator, n: int, E: int, ld: int, case: str) -> np.ndarray:
    lg = rng.standard_normal((n, ld)).astype(np.float32)
    if case == "one_takes_all":
        lg[:, E // 3] += 30.0  # every token's first choice: 64 pairs, two passes of 32
    elif case == "cold_experts":
        lg[:, E // 2:E] -= 60.0  # half the experts receive no token at all
    return lg


class Rig:
    """Weights of E + 1 experts (random on the device; host float32 copies per expert on demand), routing and
    output buffers for up to ``n_max`` tokens, the routing kernels and the CUDA-core pair."""

    def __init__(self, dev, dtype: str, shape: str, n_max: int = 64) -> None:
        from hybrid_runtime.cuda.backend import fill_random
        from hybrid_runtime.cuda.kernels import load_module
        from hybrid_runtime.cuda.moe_prefill import ROUTE_MAX_CTAS, MoEPrefill, tile_list_words

        self.dev, self.dtype, self.shape = dev, dtype, shape
        H, inter, E, k = SHAPES[shape]
        self.H, self.I, self.E, self.k = H, inter, E, k
        self.ny = k + 2  # slots past kk: never written by the routed kernels (canaries)
        self.ld = -(-(E + 1) // 8) * 8 + 8
        self.fused = load_module("fused.cu", (f"-DDT={DT[dtype]}",), dev.arch)
        self.gu = dev.empty((E + 1, 2 * inter, H), dtype)
        self.dn = dev.empty((E + 1, H, inter), dtype)
        fill_random(dev, self.fused, self.gu, 31, 1.0 / np.sqrt(H))
        fill_random(dev, self.fused, self.dn, 32, 1.0 / np.sqrt(inter))
        self._host: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self.router = MoEPrefill(dev, dtype, impl="mma")  # its moe_topk + moe_group: the routing past 16 tokens
        P = n_max * (k + 1)
        self.n_max = n_max
        self.b = {name: dev.empty(shape_, dt) for name, shape_, dt in (
            ("pw", (P,), "float32"), ("pe", (P,), "int32"), ("pl", (P,), "int32"), ("off", (E + 2,), "int32"),
            ("active", (E + 2,), "int32"), ("tiles", (tile_list_words(P, E + 1),), "int32"),
            ("cta", (ROUTE_MAX_CTAS, E + 1), "int32"), ("act", (P, inter), dtype),
            ("y", (n_max, self.ny, H), "float32"), ("act_cc", (P, inter), dtype),
            ("y_cc", (n_max, self.ny, H), "float32"))}

    def bufs(self, cuda_cores: bool = False):
        from hybrid_runtime.cuda.moe_prefill import MoEBuffers

        b = self.b
        return MoEBuffers(b["pw"].ptr, b["pe"].ptr, b["pl"].ptr, b["off"].ptr, b["active"].ptr, b["tiles"].ptr,
                          b["cta"].ptr, b["act_cc" if cuda_cores else "act"].ptr,
                          b["y_cc" if cuda_cores else "y"].ptr, (b["tiles"].size - 4) // 4)

    def expert(self, e: int) -> tuple[np.ndarray, np.ndarray]:
        """Host float32 copies of expert e's gate_up [2I, H] and down [H, I] (as the device holds them)."""
        if e not in self._host:
            from hybrid_runtime.cuda.driver import DeviceArray

            gu = DeviceArray(self.gu.row_ptr(e), (2 * self.I, self.H), self.dtype, self.dev.ordinal)
            dn = DeviceArray(self.dn.row_ptr(e), (self.H, self.I), self.dtype, self.dev.ordinal)
            self._host[e] = (np.asarray(self.dev.download(gu), np.float32),
                             np.asarray(self.dev.download(dn), np.float32))
        return self._host[e]

    def route(self, n: int, lg_ptr: int, fold: bool, policy: str = "backend") -> None:
        """Routing into the buffers: moe_route up to 16 tokens and moe_topk + moe_group past that (the backend's
        "mma_decode" policy), or always moe_route (``policy`` "moe_route")."""
        b = self.b
        if policy == "backend" and n > 16:
            self.router.route(n, lg_ptr, self.ld, self.E, self.k, True, self.bufs(), fold_shared=fold)
            return
        self.fused.kernel("moe_route").launch(
            self.dev, (1, 1, 1), (1024, 1, 1), 0,
            [("ptr", lg_ptr), ("i32", self.ld), ("i32", n), ("i32", self.E), ("i32", self.k), ("i32", 1),
             ("i32", int(fold)), ("ptr", b["pw"].ptr), ("ptr", b["pe"].ptr), ("ptr", b["off"].ptr),
             ("ptr", b["pl"].ptr), ("ptr", b["active"].ptr)], pdl=True)

    def cuda_cores(self, n: int, h_ptr: int, fold: bool) -> None:
        """fused.cu's moe_gate_up + moe_down (the CUDA-core decode path) on the same routing, into act_cc / y_cc."""
        from hybrid_runtime.cuda.backend import MOE_ROWS_PER_CTA, SMEM_DEFAULT

        b, H, inter = self.b, self.H, self.I
        kk, e_all = self.k + int(fold), self.E + int(fold)
        tg, tg_d = max(1, min(8, SMEM_DEFAULT // (H * 2))), max(1, min(8, SMEM_DEFAULT // (inter * 2)))
        grid_e = min(e_all, n * kk)
        self.fused.kernel("moe_gate_up").launch(
            self.dev, (-(-inter // MOE_ROWS_PER_CTA), grid_e, 1), (256, 1, 1), tg * H * 2,
            [("ptr", h_ptr), ("ptr", self.gu.ptr), ("i32", H), ("i32", inter), ("i32", kk), ("i32", e_all),
             ("ptr", b["off"].ptr), ("ptr", b["pl"].ptr), ("ptr", b["active"].ptr), ("ptr", b["act_cc"].ptr),
             ("i32", tg)], pdl=True)
        self.fused.kernel("moe_down").launch(
            self.dev, (-(-H // MOE_ROWS_PER_CTA), grid_e, 1), (256, 1, 1), tg_d * inter * 2,
            [("ptr", b["act_cc"].ptr), ("ptr", self.dn.ptr), ("ptr", b["pw"].ptr), ("i32", H), ("i32", inter),
             ("i32", kk), ("i32", self.ny), ("i32", e_all), ("ptr", b["off"].ptr), ("ptr", b["pl"].ptr),
             ("ptr", b["active"].ptr), ("ptr", b["y_cc"].ptr), ("i32", tg_d)], pdl=True)

    def run(self, moe, n: int, h_bits: np.ndarray, logits: np.ndarray, fold: bool, ldh: int | None = None,
            policy: str = "backend", cuda_cores: bool = False) -> dict[str, np.ndarray]:
        """One step: canaries into y / act, routing, ``moe`` (a MoEDecode) and optionally the CUDA-core pair;
        every buffer downloaded. ``h_bits`` [n, H] is uploaded into rows of ``ldh`` elements."""
        dev, b, H = self.dev, self.b, self.H
        assert moe.device is dev, "a decoder of another CudaDevice (another stream) than the rig's"
        ldh = ldh or H
        hp = np.zeros((n, ldh), h_bits.dtype)
        hp[:, :H] = h_bits
        hd = dev.upload(hp, dtype=self.dtype)
        lg = dev.upload(np.ascontiguousarray(logits, np.float32))
        for name in ("y", "y_cc"):
            self.fused.kernel("fill_f32").launch(dev, (-(-b[name].size // 256), 1, 1), (256, 1, 1), 0,
                                                 [("ptr", b[name].ptr), ("f32", CANARY), ("i64", b[name].size)])
        for name in ("act", "act_cc"):
            dev.memset_d8(b[name].ptr, 0xFF, b[name].nbytes)  # 0xFFFF: a NaN in bf16 and in fp16 (canary)
        kk, e_all = self.k + int(fold), self.E + int(fold)
        self.route(n, lg.ptr, fold, policy)
        moe.launch(n, hd.ptr, ldh, self.gu.ptr, self.dn.ptr, H, self.I, kk, self.ny, e_all, self.bufs())
        if cuda_cores:
            assert ldh == H  # fused.cu's kernels read h rows of H elements
            self.cuda_cores(n, hd.ptr, fold)
        dev.synchronize()
        out = {name: dev.download(a) for name, a in b.items() if name not in ("tiles", "cta")}
        del hd, lg
        return out

    def reference(self, h: np.ndarray, top: np.ndarray, w: np.ndarray) -> np.ndarray:
        """y [n, kk, H] float64: pair (t, j) = w[t, j] * down_e(round(silu(gate_e h_t) * up_e h_t)), e = top[t, j].
        Each row alone (grouped by expert only to use matrix products)."""
        n, kk = top.shape
        y = np.zeros((n, kk, self.H))
        for e in np.unique(top):
            t, j = np.nonzero(top == e)
            gu, dn = self.expert(int(e))
            x = h[t].astype(np.float64) @ gu.T.astype(np.float64)
            a = x[:, :self.I] / (1 + np.exp(-x[:, :self.I])) * x[:, self.I:]
            a = to_f32(host_bits(a.astype(np.float32), self.dtype), self.dtype).astype(np.float64)  # as stored
            y[t, j] = w[t, j, None] * (a @ dn.T.astype(np.float64))
        return y


# Keyed by the device too (each module that imports the ``dev`` fixture gets a CudaDevice, and a stream, of its own:
# a rig and a decoder of different devices would run unordered; test_moe_nbits_decode_gpu's caches hit exactly that).
_rigs: dict[tuple, Rig] = {}
_decoders: dict[tuple, object] = {}


def rig(dev, dtype: str, shape: str) -> Rig:
    if (dev, dtype, shape) not in _rigs:  # (the 35B shape: 1.5 GB of weights per dtype, 2 GB of host copies)
        _rigs[dev, dtype, shape] = Rig(dev, dtype, shape)
    return _rigs[dev, dtype, shape]


def decoder(dev, dtype: str, knobs: str = "default"):
    from hybrid_runtime.cuda.moe_decode import KNOB_SETS, MoEDecode

    if (dev, dtype, knobs) not in _decoders:
        _decoders[dev, dtype, knobs] = MoEDecode(dev, dtype, **asdict(KNOB_SETS[knobs]))
    return _decoders[dev, dtype, knobs]


def check_step(r: Rig, got: dict[str, np.ndarray], n: int, hb: np.ndarray, lg: np.ndarray, fold: bool,
               label: str, case: str = "spread") -> None:
    """Routing == the reference's choices, every pair's y within bf16/fp16 rounding of the float64 reference,
    canaries intact past the step's pairs and slots."""
    E, k = r.E, r.k
    kk = k + int(fold)
    P = n * kk
    top, w = reference_route(lg, E, k, fold)
    assert np.array_equal(got["pe"][:P].reshape(n, kk), top), label
    np.testing.assert_allclose(got["pw"][:P].reshape(n, kk), w, rtol=2e-6, atol=1e-7, err_msg=label)
    counts = np.diff(got["off"][:E + int(fold) + 1])
    if case == "one_takes_all":
        assert counts[E // 3] == n, label
    want = r.reference(to_f32(hb, r.dtype), top, w)
    y = got["y"][:n, :kk].astype(np.float64)
    err = np.linalg.norm(y - want, axis=-1) / np.maximum(np.linalg.norm(want, axis=-1), 1e-30)
    assert err.max() < 5e-3, (label, float(err.max()))
    assert np.linalg.norm(y - want) / np.linalg.norm(want) < 1e-3, label
    # nothing written past the step: y rows >= n, slots >= kk, act rows >= n*kk (canaries); every pair's act row
    assert (got["y"][n:] == CANARY).all() and (got["y"][:n, kk:] == CANARY).all(), label
    assert np.isnan(got["act"][P:]).all() and not np.isnan(got["act"][:P]).any(), label


@pytest.mark.parametrize("dtype,shape", [("bfloat16", "a35b"), ("float16", "a35b"), ("bfloat16", "small"),
                                         ("float16", "small"), ("bfloat16", "odd")])
def test_decode_moe_matches_a_float64_reference(dev, dtype: str, shape: str) -> None:
    r = rig(dev, dtype, shape)
    moe = decoder(dev, dtype)
    rng = np.random.default_rng(r.H + r.E)
    ldh = r.H + 64  # h rows of a wider buffer (the kernels take ldh)
    for n, case in CASES:
        for fold in (True, False):
            hb = host_bits(rng.standard_normal((n, r.H)).astype(np.float32), dtype)
            lg = logits_for(rng, n, r.E, r.ld, case)
            got = r.run(moe, n, hb, lg, fold, ldh=ldh)
            check_step(r, got, n, hb, lg, fold, f"{dtype} {shape} n={n} {case} fold={fold}", case)


@pytest.mark.parametrize("knobs", ["default", "fine", "bk64", "g2", "early", "pf24", "pf40", "dnpre", "many"])
def test_every_knob_set_matches_the_reference(dev, knobs: str) -> None:
    """Each build the benchmark compares (KNOB_SETS), on the small shape, the one with half k tiles and the 35B
    shape in bf16 (1 token: the down weights fit the pf builds' L2 prefetch), fp16 on the small shape."""
    from hybrid_runtime.cuda.moe_decode import KNOB_SETS

    assert set(KNOB_SETS) == {"default", "fine", "bk64", "g2", "early", "pf24", "pf40", "dnpre", "many"}
    for dtype, shape in [("bfloat16", "small"), ("bfloat16", "odd"), ("float16", "small"), ("bfloat16", "a35b")]:
        r = rig(dev, dtype, shape)
        moe = decoder(dev, dtype, knobs)
        rng = np.random.default_rng(7)
        steps = [(64, "one_takes_all"), (16, "spread"), (1, "spread")] if shape == "a35b" else \
            [(64, "one_takes_all"), (24, "spread"), (9, "spread"), (1, "spread")]
        for n, case in steps:
            for fold in (True, False):
                hb = host_bits(rng.standard_normal((n, r.H)).astype(np.float32), dtype)
                lg = logits_for(rng, n, r.E, r.ld, case)
                got = r.run(moe, n, hb, lg, fold)
                check_step(r, got, n, hb, lg, fold, f"{knobs} {dtype} {shape} n={n} {case} fold={fold}", case)


@pytest.mark.parametrize("knobs", ["default", "g2", "pf24", "dnpre", "many"])
@pytest.mark.parametrize("fold", [True, False])
def test_a_tokens_bits_do_not_depend_on_the_other_tokens(dev, fold: bool, knobs: str) -> None:
    """Batch invariance: the first tokens alone (1 and 3 tokens, one group per pass) and inside a 64-token step
    (4 groups per pass; the expert every token picks has 64 pairs, two passes; the first tokens' pairs in other
    columns and groups) give the same act and y bits, routed the way the backend routes each size."""
    r = rig(dev, "bfloat16", "a35b")
    moe = decoder(dev, "bfloat16", knobs)
    rng = np.random.default_rng(11)
    hb = host_bits(rng.standard_normal((64, r.H)).astype(np.float32), "bfloat16")
    for case in ("one_takes_all", "spread"):
        lg = logits_for(rng, 64, r.E, r.ld, case)
        big = r.run(moe, 64, hb, lg, fold)
        kk = r.k + int(fold)
        for m in (3, 1):
            small = r.run(moe, m, np.ascontiguousarray(hb[:m]), np.ascontiguousarray(lg[:m]), fold)
            label = f"{knobs} fold={fold} {case} first {m}"
            assert np.array_equal(small["pe"][:m * kk], big["pe"][:m * kk]), label
            assert small["y"][:m, :kk].tobytes() == big["y"][:m, :kk].tobytes(), label
            assert small["act"][:m * kk].tobytes() == big["act"][:m * kk].tobytes(), label


@pytest.mark.parametrize("fold", [True, False])
def test_the_backends_builds_give_the_same_bits(dev, fold: bool) -> None:
    """The backend runs 1-row steps on "dnpre", up to 16 rows on "default" and more on "many": a token's act and
    y bits must not depend on which of them ran its step (batch invariance across step sizes)."""
    r = rig(dev, "bfloat16", "a35b")
    rng = np.random.default_rng(13)
    hb = host_bits(rng.standard_normal((64, r.H)).astype(np.float32), "bfloat16")
    for case in ("one_takes_all", "spread"):
        lg = logits_for(rng, 64, r.E, r.ld, case)
        ref = r.run(decoder(dev, "bfloat16", "default"), 64, hb, lg, fold)
        for knobs in ("dnpre", "many"):
            got = r.run(decoder(dev, "bfloat16", knobs), 64, hb, lg, fold)
            assert np.array_equal(got["pe"], ref["pe"]), (knobs, case)
            assert got["y"].tobytes() == ref["y"].tobytes(), (knobs, case)
            assert got["act"].tobytes() == ref["act"].tobytes(), (knobs, case)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_decode_moe_agrees_with_the_cuda_core_kernels(dev, dtype: str) -> None:
    """fused.cu's moe_gate_up / moe_down (the CUDA-core decode path) on the same routing buffers: every pair's y
    within bf16/fp16 activation rounding (the two accumulate in different orders), on the 35B shape with the
    shared expert folded where the backend folds it (n <= 16)."""
    r = rig(dev, dtype, "a35b")
    moe = decoder(dev, dtype)
    rng = np.random.default_rng(17)
    for n in (64, 24, 16, 8, 1):
        fold = n <= 16
        kk = r.k + int(fold)
        hb = host_bits(rng.standard_normal((n, r.H)).astype(np.float32), dtype)
        lg = logits_for(rng, n, r.E, r.ld, "spread")
        got = r.run(moe, n, hb, lg, fold, cuda_cores=True)
        label = f"{dtype} n={n}"
        y, yr = got["y"][:n, :kk].astype(np.float64), got["y_cc"][:n, :kk].astype(np.float64)
        err = np.linalg.norm(y - yr, axis=-1) / np.maximum(np.linalg.norm(yr, axis=-1), 1e-30)
        assert err.max() < 1e-2, (label, float(err.max()))
        assert np.linalg.norm(y - yr) / np.linalg.norm(yr) < 2e-3, label
        a, ar = got["act"][:n * kk].astype(np.float64), got["act_cc"][:n * kk].astype(np.float64)
        assert np.linalg.norm(a - ar) / np.linalg.norm(ar) < 1e-2, label
        assert (got["y"][n:] == CANARY).all() and (got["y_cc"][n:] == CANARY).all(), label


def test_launch_refuses_shapes_it_does_not_run(dev) -> None:
    from hybrid_runtime.cuda.moe_prefill import MoEBuffers

    moe = decoder(dev, "bfloat16")
    b = MoEBuffers(*([0] * 9), 0)
    with pytest.raises(ValueError, match="I % 64 == 0"):
        moe.launch(1, 0, 2048, 0, 0, 2048, 96, 9, 9, 257, b)
    with pytest.raises(ValueError, match="E_all 1025"):
        moe.launch(1, 0, 2048, 0, 0, 2048, 512, 9, 9, 1025, b)
    with pytest.raises(ValueError, match="ldh 2044"):
        moe.launch(1, 0, 2044, 0, 0, 2048, 512, 9, 9, 257, b)
