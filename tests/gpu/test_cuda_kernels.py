"""The ``cuda`` backend's kernels one by one against numpy: cuBLASLt GEMMs and the fused ``gemv`` (batch
invariance included), every segment-program op (``hybrid_runtime.program.apply_op`` is the reference), the MoE
kernels (experts with no token, one expert with every token, the folded shared expert), and the sampler against
its numpy twin (``hybrid_runtime.cuda.sampler.reference_sample``)."""

from __future__ import annotations

import numpy as np
import pytest

from hybrid_runtime.program import Op, apply_op

pytestmark = pytest.mark.gpu

DT = {"float32": 0, "float16": 1, "bfloat16": 2}
TOL = {"float32": 2e-5, "bfloat16": 1e-2, "float16": 2e-3}


@pytest.fixture(scope="module")
def dev():
    import torch

    torch.cuda.init()
    from hybrid_runtime.cuda.driver import CudaDevice

    return CudaDevice(0)


def rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm((np.asarray(a, np.float64) - b).ravel()) / max(np.linalg.norm(np.ravel(b)), 1e-30))


def rounded(a: np.ndarray, dtype: str) -> np.ndarray:
    """float32 values as the device holds them in ``dtype`` (what the reference must start from)."""
    a = np.asarray(a, np.float32)
    if dtype == "bfloat16":
        from hybrid_runtime.weights_io import bf16_to_f32, f32_to_bf16_bits

        return bf16_to_f32(f32_to_bf16_bits(a))
    if dtype == "float16":
        return a.astype(np.float16).astype(np.float32)
    return a


_KEEP: list = []  # device buffers a launch reads must outlive it: tests pass ``.ptr`` of temporaries


def up(dev, a: np.ndarray, dtype: str = "float32"):
    from hybrid_runtime.cuda.backend import to_dtype

    arr = dev.upload(to_dtype(a, dtype), dtype=dtype)
    _KEEP.append(arr)
    return arr


def keep(arr):
    _KEEP.append(arr)
    return arr


def fused(dev, dtype: str):
    from hybrid_runtime.cuda.kernels import load_module

    return load_module("fused.cu", (f"-DDT={DT[dtype]}",), dev.arch)


# ---------------------------------------------------------------------------------------------- GEMMs


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cublaslt_gemm_shapes_strides_bias_residual(dev, dtype: str) -> None:
    from hybrid_runtime.cuda.blas import Blas

    blas = Blas(dev)
    rng = np.random.default_rng(1)
    M, N, K, ldx, ldy = 7, 96, 64, 80, 112
    x = rounded(rng.standard_normal((M, ldx)), dtype)
    w = rounded(rng.standard_normal((N, K)) * 0.1, dtype)
    bias = rounded(rng.standard_normal(N), "float32")
    c = rng.standard_normal((M, ldy)).astype(np.float32)
    xd, wd, bd = up(dev, x, dtype), up(dev, w, dtype), dev.upload(bias)
    yd = dev.upload(c)
    blas.gemm(M, N, K, xd.ptr, wd.ptr, yd.ptr, dtype=dtype, out_dtype="float32", ldx=ldx, ldy=ldy, c=yd.ptr,
              bias=bd.ptr)
    want = x[:, :K].astype(np.float64) @ w.T.astype(np.float64) + bias + c[:, :N]
    got = dev.download(yd)
    assert rel(got[:, :N], want) < 2e-6  # float32 accumulation of exactly representable inputs
    assert np.array_equal(got[:, N:], c[:, N:])  # columns past N untouched
    # plain product into the weight dtype
    y2 = dev.empty((M, N), dtype)
    blas.gemm(M, N, K, xd.ptr, wd.ptr, y2.ptr, dtype=dtype, out_dtype=dtype, ldx=ldx)
    assert rel(dev.download(y2), x[:, :K] @ w.T) < TOL[dtype]


def test_gemm_plan_cache_stays_bounded_and_evicted_plans_give_the_same_bits(dev) -> None:
    """A per-M plan cache of 4 over 40 prefill-like M values (``plans_by_class=False``): never more than 4 plans,
    evictions counted, and the products (pinned to the algorithm of M = 64, whose own plan is evicted over and
    over) bit-identical to a cache that keeps everything; a destroyed plan refuses to run."""
    from hybrid_runtime.cuda.blas import Blas, BlasError

    small, full = Blas(dev, max_plans=4, plans_by_class=False), Blas(dev, max_plans=1024, plans_by_class=False)
    rng = np.random.default_rng(4)
    N, K = 384, 256
    x = rounded(rng.standard_normal((64, K)), "bfloat16")
    w = rounded(rng.standard_normal((N, K)) * 0.05, "bfloat16")
    xd, wd = up(dev, x, "bfloat16"), up(dev, w, "bfloat16")
    first = None
    for m in [*range(1, 41), 7, 3]:
        ya, yb = dev.empty((m, N), "float32"), dev.empty((m, N), "float32")
        pa = small.gemm(m, N, K, xd.ptr, wd.ptr, ya.ptr, dtype="bfloat16", out_dtype="float32", pin_m=64)
        full.gemm(m, N, K, xd.ptr, wd.ptr, yb.ptr, dtype="bfloat16", out_dtype="float32", pin_m=64)
        first = first or pa
        assert small.num_plans <= 4
        assert np.array_equal(dev.download(ya), dev.download(yb)), m
    assert small.plan_evictions > 30 and full.plan_evictions == 0
    assert first is not None and first.destroyed
    with pytest.raises(BlasError, match="evicted"):
        first.run(xd.ptr, wd.ptr, dev.empty((1, N), "float32").ptr)


def test_class_plans_give_the_bits_of_per_m_plans_with_one_plan(dev) -> None:
    """Pinned products through one class plan (the default): every M in 1..64 (in an order that goes back and
    forth) gives the bits of a per-M plan with the same pinned algorithm, one plan serves them all, and the
    M-dependent layouts follow each call (a smaller M after a larger one writes only its rows)."""
    from hybrid_runtime.cuda.blas import Blas

    cls, per_m = Blas(dev), Blas(dev, plans_by_class=False)
    rng = np.random.default_rng(5)
    N, K = 384, 256
    x = rounded(rng.standard_normal((64, K)), "bfloat16")
    w = rounded(rng.standard_normal((N, K)) * 0.05, "bfloat16")
    xd, wd = up(dev, x, "bfloat16"), up(dev, w, "bfloat16")
    for m in [64, 1, 33, 2, 64, 17, *range(3, 12), 40, 5]:
        ya = dev.upload(np.full((64, N), 7.0, np.float32))
        yb = dev.empty((m, N), "float32")
        cls.gemm(m, N, K, xd.ptr, wd.ptr, ya.ptr, dtype="bfloat16", out_dtype="float32", pin_m=64)
        per_m.gemm(m, N, K, xd.ptr, wd.ptr, yb.ptr, dtype="bfloat16", out_dtype="float32", pin_m=64)
        got = dev.download(ya)
        assert np.array_equal(got[:m], dev.download(yb)), m
        assert np.all(got[m:] == 7.0), m  # rows past M untouched
    assert cls.num_plans == 1 and cls.pin_failure_count == 0
    assert per_m.num_plans > 10


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gemm_rows_do_not_depend_on_m(dev, dtype: str) -> None:
    """cuBLASLt with a pinned algorithm and the fused gemv: row r of an M-row product is bit-identical to the
    same row computed alone (what batch invariance of decode steps rests on)."""
    from hybrid_runtime.cuda.blas import Blas

    blas = Blas(dev)
    rng = np.random.default_rng(2)
    N, K = 1000, 512
    x = rounded(rng.standard_normal((16, K)), dtype)
    w = rounded(rng.standard_normal((N, K)) * 0.05, dtype)
    xd, wd = up(dev, x, dtype), up(dev, w, dtype)
    outs = {}
    for m in (1, 3, 16):
        y = dev.empty((m, N), "float32")
        p = blas.gemm(m, N, K, xd.ptr, wd.ptr, y.ptr, dtype=dtype, out_dtype="float32", pin_m=16)
        assert p.shape.m == 16 and p.m_ok is not None  # the class plan of M = 16 ran it
        outs[m] = dev.download(y)
    assert np.array_equal(outs[1][0], outs[16][0]) and np.array_equal(outs[3], outs[16][:3])
    # prefill sizes: the algorithm of M = 256 used at 20 and 250 rows
    xl = rounded(rng.standard_normal((256, K)), dtype)
    xld = up(dev, xl, dtype)
    big = {}
    for m in (20, 250, 256):
        y = dev.empty((m, N), "float32")
        blas.gemm(m, N, K, xld.ptr, wd.ptr, y.ptr, dtype=dtype, out_dtype="float32", pin_m=256)
        big[m] = dev.download(y)
    assert np.array_equal(big[20], big[256][:20]) and np.array_equal(big[250], big[256][:250])
    mod = fused(dev, dtype)
    g = {}
    for m in (1, 5, 16):
        y = dev.empty((m, N), "float32")
        mod.kernel("gemv").launch(dev, (-(-N // 8), 1, 1), (128, 1, 1), 0,
                                  [("ptr", xd.ptr), ("i64", K), ("ptr", wd.ptr), ("i32", N), ("i32", K), ("ptr", 0),
                                   ("ptr", 0), ("i64", 0), ("ptr", y.ptr), ("i64", N), ("i32", 1), ("i32", m)])
        g[m] = dev.download(y)
    assert np.array_equal(g[1][0], g[16][0]) and np.array_equal(g[5], g[16][:5])
    assert rel(g[16], x.astype(np.float64) @ w.T) < 1e-5


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gemv_bias_residual_and_narrow_output(dev, dtype: str) -> None:
    rng = np.random.default_rng(3)
    M, N, K = 6, 77, 48
    x = rounded(rng.standard_normal((M, K)), dtype)
    w = rounded(rng.standard_normal((N, K)), dtype)
    b = rng.standard_normal(N).astype(np.float32)
    c = rng.standard_normal((M, N)).astype(np.float32)
    xd, wd, bd, cd = up(dev, x, dtype), up(dev, w, dtype), dev.upload(b), dev.upload(c)
    mod = fused(dev, dtype)
    mod.kernel("gemv").launch(dev, (-(-N // 8), 1, 1), (128, 1, 1), 0,
                              [("ptr", xd.ptr), ("i64", K), ("ptr", wd.ptr), ("i32", N), ("i32", K), ("ptr", bd.ptr),
                               ("ptr", cd.ptr), ("i64", N), ("ptr", cd.ptr), ("i64", N), ("i32", 1), ("i32", M)])
    assert rel(dev.download(cd), x @ w.T + b + c) < 1e-6
    y = dev.empty((M, N), dtype)
    mod.kernel("gemv").launch(dev, (-(-N // 8), 1, 1), (128, 1, 1), 0,
                              [("ptr", xd.ptr), ("i64", K), ("ptr", wd.ptr), ("i32", N), ("i32", K), ("ptr", 0),
                               ("ptr", 0), ("i64", 0), ("ptr", y.ptr), ("i64", N), ("i32", 0), ("i32", M)])
    assert rel(dev.download(y), x @ w.T) < TOL[dtype]


# ---------------------------------------------------------------------------------------------- program ops


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_norms_gates_and_elementwise_ops_match_the_program(dev, dtype: str) -> None:
    rng = np.random.default_rng(4)
    mod = fused(dev, dtype)
    n, H, eps = 5, 96, 1e-6
    x = rng.standard_normal((n, H)).astype(np.float32) * 3
    w = (1 + 0.1 * rng.standard_normal(H)).astype(np.float32)
    y = rng.standard_normal((n, 3, H)).astype(np.float32)
    sg = rng.standard_normal((n, 8)).astype(np.float32)
    xd, wd, yd, sgd = dev.upload(x), dev.upload(w), dev.upload(y), dev.upload(sg)
    h = dev.empty((n, H), dtype)
    # add of three slots, the last gated by sigmoid(sg[:, 2]), in place, then the norm
    mod.kernel("rmsnorm_rows").launch(dev, (n, 1, 1), (256, 1, 1), 0,
                                      [("ptr", xd.ptr), ("ptr", yd.ptr), ("i32", 3), ("ptr", sgd.ptr + 8),
                                       ("i64", 8), ("ptr", wd.ptr), ("ptr", xd.ptr), ("ptr", h.ptr), ("ptr", 0),
                                       ("i32", n), ("i32", H), ("f32", eps)])
    x2 = x + y[:, 0] + y[:, 1] + y[:, 2] / (1 + np.exp(-sg[:, 2:3]))
    env = {"x": x2}
    apply_op(Op("rmsnorm", ("x",), ("h",), ("w",), {"eps": eps}), env, {"w": w})
    assert rel(dev.download(xd), x2) < 1e-6
    assert rel(dev.download(h), env["h"]) < TOL[dtype]
    # rows selection (the head): output row r normalises input row rows[r]; no residual write
    rows = dev.upload(np.array([4, 1], np.int32))
    h2 = dev.empty((2, H), dtype)
    mod.kernel("rmsnorm_rows").launch(dev, (2, 1, 1), (256, 1, 1), 0,
                                      [("ptr", xd.ptr), ("ptr", 0), ("i32", 0), ("ptr", 0), ("i64", 0),
                                       ("ptr", wd.ptr), ("ptr", 0), ("ptr", h2.ptr), ("ptr", rows.ptr), ("i32", 2),
                                       ("i32", H), ("f32", eps)])
    assert rel(dev.download(h2), env["h"][[4, 1]]) < TOL[dtype]

    # GDN gates from a fused projection with a row stride
    C, vd, nv = 24, 16, 4
    P = C + vd + 2 * nv
    p = rounded(rng.standard_normal((n, P + 8)), dtype)
    nea, dtb = (-np.exp(rng.standard_normal(nv) * 0.3)).astype(np.float32), rng.standard_normal(nv).astype(np.float32)
    pd = up(dev, p)  # projections are float32 (GEMM outputs)
    g, beta = dev.empty((n, nv), "float32"), dev.empty((n, nv), "float32")
    mod.kernel("gdn_gates").launch(dev, (1, 1, 1), (256, 1, 1), 0,
                                   [("ptr", pd.ptr), ("i64", P + 8), ("i32", C + vd), ("i32", C + vd + nv),
                                    ("ptr", up(dev, nea).ptr), ("ptr", up(dev, dtb).ptr), ("ptr", g.ptr),
                                    ("ptr", beta.ptr), ("i32", n), ("i32", nv)])
    env = {"p": p[:, :P]}
    apply_op(Op("gdn_gates", ("p",), ("u", "z", "g", "beta"), ("a", "b"), {"conv_dim": C, "value_dim": vd, "nv": nv}),
             env, {"a": nea, "b": dtb})
    assert rel(dev.download(g), env["g"]) < 1e-5 and rel(dev.download(beta), env["beta"]) < 1e-5

    # gated RMSNorm (z read from a strided projection), sigmoid gate, SwiGLU
    core = rounded(rng.standard_normal((n, vd)), dtype)
    gw = rng.standard_normal(vd // nv).astype(np.float32)
    o = dev.empty((n, vd), dtype)
    mod.kernel("gated_rmsnorm").launch(dev, (n, 1, 1), (128, 1, 1), 0,
                                       [("ptr", up(dev, core).ptr), ("ptr", pd.ptr + C * 4),
                                        ("i64", P + 8), ("ptr", up(dev, gw).ptr), ("ptr", o.ptr), ("i32", n),
                                        ("i32", nv), ("i32", vd // nv), ("f32", eps)])
    env = {"c": core, "z": p[:, C:C + vd]}
    apply_op(Op("gated_rmsnorm", ("c", "z"), ("o",), ("w",), {"nv": nv, "dv": vd // nv, "eps": eps}), env, {"w": gw})
    assert rel(dev.download(o), env["o"]) < TOL[dtype]
    Hh, hd = 3, 16
    a = rng.standard_normal((n, Hh * hd)).astype(np.float32)
    qg = rounded(rng.standard_normal((n, Hh * 2 * hd)), dtype)
    qgd = up(dev, qg)
    o2 = dev.empty((n, Hh * hd), dtype)
    es = 4
    mod.kernel("sigmoid_mul").launch(dev, (n, 1, 1), (256, 1, 1), 0,
                                     [("ptr", up(dev, a).ptr), ("ptr", qgd.ptr + hd * es), ("i64", Hh * 2 * hd),
                                      ("i32", hd), ("ptr", o2.ptr), ("i32", n), ("i32", Hh)])
    gate = qg.reshape(n, Hh, 2 * hd)[..., hd:].reshape(n, Hh * hd)
    assert rel(dev.download(o2), a / (1 + np.exp(-gate))) < TOL[dtype]
    inter = 40
    gu = rounded(rng.standard_normal((n, 2 * inter)), dtype)
    act = dev.empty((n, inter), dtype)
    mod.kernel("swiglu").launch(dev, (n, 1, 1), (256, 1, 1), 0,
                                [("ptr", up(dev, gu).ptr), ("i64", 2 * inter), ("ptr", act.ptr), ("i32", n),
                                 ("i32", inter)])
    env = {"gu": gu}
    apply_op(Op("swiglu", ("gu",), ("act",), attrs={"inter": inter}), env, {})
    assert rel(dev.download(act), env["act"]) < TOL[dtype]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("hd,rd", [(16, 4), (256, 64), (128, 128)])
def test_attn_qkv_norms_rope_and_writes_the_pools(dev, dtype: str, hd: int, rd: int) -> None:
    from hybrid_runtime.reference import rope_tables

    rng = np.random.default_rng(hd + rd)
    mod = fused(dev, dtype)
    n, H, Hkv, eps = 4, 4, 2, 1e-6
    P = (2 * H + 2 * Hkv) * hd
    p = rounded(rng.standard_normal((n, P)), dtype)
    qn, kn = (1 + 0.1 * rng.standard_normal(hd)).astype(np.float32), (1 + 0.1 * rng.standard_normal(hd)).astype(
        np.float32)
    cos, sin = rope_tables(np.arange(64), rd, 10000.0)
    pos = np.array([0, 5, 63, 17])
    rows = np.array([9, 2, 30, 11], np.int64)
    pools = dev.zeros((32, Hkv * hd), dtype), dev.zeros((32, Hkv * hd), dtype)
    q = dev.empty((n, H * hd), dtype)
    mod.kernel("attn_qkv").launch(
        dev, (n, -(-(H + 2 * Hkv) // 4), 1), (128, 1, 1), 0,
        [("ptr", up(dev, p).ptr), ("i64", P), ("ptr", keep(dev.upload(pos.astype(np.int32))).ptr),
         ("ptr", up(dev, qn).ptr), ("ptr", up(dev, kn).ptr), ("ptr", up(dev, cos).ptr),
         ("ptr", up(dev, sin).ptr), ("ptr", q.ptr), ("ptr", pools[0].ptr), ("ptr", pools[1].ptr),
         ("ptr", keep(dev.upload(rows)).ptr), ("ptr", 0), ("ptr", 0), ("i32", n), ("i32", H), ("i32", Hkv), ("i32", hd),
         ("i32", rd), ("f32", eps)])
    env = {"p": p, "pos": pos}
    apply_op(Op("attn_qkv", ("p", "pos"), ("q", "k", "v", "gate"), ("qn", "kn", "cos", "sin"),
                {"num_heads": H, "num_kv_heads": Hkv, "head_dim": hd, "rotary_dim": rd, "eps": eps}), env,
             {"qn": qn, "kn": kn, "cos": cos, "sin": sin})
    assert rel(dev.download(q), env["q"]) < TOL[dtype]
    kp, vp = dev.download(pools[0]), dev.download(pools[1])
    assert rel(kp[rows], env["k"]) < TOL[dtype] and np.array_equal(vp[rows], rounded(env["v"], dtype))
    assert np.isfinite(kp).all()
    assert not np.delete(kp, rows, axis=0).any()  # nothing else written


# ---------------------------------------------------------------------------------------------- MoE


def moe_reference(h: np.ndarray, logits: np.ndarray, gu: np.ndarray, dn: np.ndarray, k: int, renorm: bool,
                  shared: tuple[np.ndarray, np.ndarray, np.ndarray] | None) -> np.ndarray:
    E = gu.shape[0]
    p = np.exp(logits[:, :E] - logits[:, :E].max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    out = np.zeros_like(h, dtype=np.float64)
    silu = lambda v: v / (1 + np.exp(-v))  # noqa: E731
    inter = gu.shape[1] // 2
    for t in range(h.shape[0]):
        top = np.lexsort((np.arange(E), -logits[t, :E]))[:k]
        wt = p[t, top] / (p[t, top].sum() if renorm else 1.0)
        for e, we in zip(top, wt):
            a = h[t] @ gu[e].T
            out[t] += we * ((silu(a[:inter]) * a[inter:]) @ dn[e].T)
        if shared is not None:
            sgu, sdn, _ = shared
            a = h[t] @ sgu.T
            si = sgu.shape[0] // 2
            out[t] += (silu(a[:si]) * a[si:]) @ sdn.T / (1 + np.exp(-logits[t, E]))
    return out


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("case", ["spread", "one_expert_takes_all", "fold_shared", "wide_shared"])
def test_moe_kernels_match_a_per_token_reference(dev, dtype: str, case: str) -> None:
    rng = np.random.default_rng(len(case))
    mod = fused(dev, dtype)
    n, H, inter, E, k = 9, 64, 32, 16, 3
    fold = case == "fold_shared"
    si = {"fold_shared": inter, "wide_shared": 48}.get(case, 0)
    h = rounded(rng.standard_normal((n, H)), dtype)
    logits = rng.standard_normal((n, 24)).astype(np.float32)
    if case == "one_expert_takes_all":
        logits[:, 5] += 20.0  # every token's first choice; experts 14, 15 get nothing at all
        logits[:, 14:16] -= 50.0
    gu = rounded(rng.standard_normal((E + int(fold), 2 * inter, H)) * 0.1, dtype)
    dn = rounded(rng.standard_normal((E + int(fold), H, inter)) * 0.1, dtype)
    kk, ny, e_all = k + int(fold), k + int(si > 0), E + int(fold)
    d = {name: dev.empty(shape, dt) for name, shape, dt in (
        ("pw", (n * kk,), "float32"), ("pe", (n * kk,), "int32"), ("pl", (n * kk,), "int32"),
        ("off", (e_all + 1,), "int32"), ("active", (e_all + 1,), "int32"), ("act", (n * kk, inter), dtype))}
    y = dev.zeros((n, ny, H), "float32")
    lg = dev.upload(logits)
    hd_ = up(dev, h, dtype)
    mod.kernel("moe_route").launch(dev, (1, 1, 1), (1024, 1, 1), 0,
                                   [("ptr", lg.ptr), ("i32", 24), ("i32", n), ("i32", E), ("i32", k), ("i32", 1),
                                    ("i32", int(fold)), ("ptr", d["pw"].ptr), ("ptr", d["pe"].ptr),
                                    ("ptr", d["off"].ptr), ("ptr", d["pl"].ptr), ("ptr", d["active"].ptr)])
    off, active = dev.download(d["off"]), dev.download(d["active"])
    n_active = int(active[e_all])
    assert off[0] == 0 and off[e_all] == n * kk and np.all(np.diff(off) >= 0)
    assert active[:n_active].tolist() == [e for e in range(e_all) if off[e + 1] > off[e]]
    assert sorted(dev.download(d["pl"]).tolist()) == list(range(n * kk))  # every pair exactly once
    if case == "one_expert_takes_all":
        assert off[6] - off[5] == n and off[16] == off[14]
    es = 2 if dtype != "float32" else 4
    tg, tgd = min(8, 48 * 1024 // (H * es)), min(8, 48 * 1024 // (inter * es))
    mod.kernel("moe_gate_up").launch(dev, (-(-inter // 16), e_all, 1), (256, 1, 1), tg * H * es,
                                     [("ptr", hd_.ptr), ("ptr", up(dev, gu, dtype).ptr), ("i32", H), ("i32", inter),
                                      ("i32", kk), ("i32", e_all), ("ptr", d["off"].ptr), ("ptr", d["pl"].ptr),
                                      ("ptr", d["active"].ptr), ("ptr", d["act"].ptr), ("i32", tg)])
    mod.kernel("moe_down").launch(dev, (-(-H // 16), e_all, 1), (256, 1, 1), tgd * inter * es,
                                  [("ptr", d["act"].ptr), ("ptr", up(dev, dn, dtype).ptr), ("ptr", d["pw"].ptr),
                                   ("i32", H), ("i32", inter), ("i32", kk), ("i32", ny), ("i32", e_all),
                                   ("ptr", d["off"].ptr), ("ptr", d["pl"].ptr), ("ptr", d["active"].ptr),
                                   ("ptr", y.ptr), ("i32", tgd)])
    shared = None
    got = dev.download(y).astype(np.float64)
    if fold:
        shared = (gu[E], dn[E], None)
        got = got.sum(1)
    elif si:
        sgu = rounded(rng.standard_normal((2 * si, H)) * 0.1, dtype)
        sdn = rounded(rng.standard_normal((H, si)) * 0.1, dtype)
        shared = (sgu, sdn, None)
        a = h @ sgu.T
        s_out = (a[:, :si] / (1 + np.exp(-a[:, :si])) * a[:, si:]) @ sdn.T
        got = got[:, :k].sum(1) + s_out / (1 + np.exp(-logits[:, E:E + 1]))
    else:
        got = got.sum(1)
    want = moe_reference(h, logits, gu[:E], dn[:E], k, True, shared)
    assert rel(got, want) < (5e-6 if dtype == "float32" else 2e-2), case


# ---------------------------------------------------------------------------------------------- sampler


def test_sampler_matches_its_numpy_twin(dev) -> None:
    from hybrid_runtime.cuda.kernels import load_module
    from hybrid_runtime.cuda.sampler import DeviceSampler, reference_sample, row_params
    from hybrid_runtime.cuda.stepio import OutputLayout
    from hybrid_runtime.sampling import SamplingParams

    rng = np.random.default_rng(7)
    V = 30011
    cases = [SamplingParams(), SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=40),
             SamplingParams(temperature=1.3, top_p=0.9), SamplingParams(temperature=0.9, top_k=200, top_p=0.5),
             SamplingParams(temperature=2.0, top_k=1), SamplingParams(temperature=1.0, top_p=0.05)]
    rows, words = [], []
    for i in range(48):
        p = cases[i % len(cases)]
        rows.append(p)
        words.append(row_params(p, seed=1234 + i // len(cases), counter=100 + i, n_logprobs=[None, 0, 5, 20][i % 4]))
    R = len(rows)
    x = (rng.standard_normal((R, V)) * 2).astype(np.float32)
    x[3, 17] = x[3].max() + 5  # a clear winner
    mod = load_module("sampling.cu", (), dev.arch)
    smp = DeviceSampler(dev, mod, R, V)
    L = OutputLayout(R)
    out = dev.empty((L.nbytes,), "uint8")
    xd, pd = dev.upload(x), dev.upload(np.stack(words))
    smp.launch(R, xd.ptr, V, pd.ptr, out.ptr + L.tokens, out.ptr + L.logprobs, out.ptr + L.top_ids,
               out.ptr + L.top_logprobs)
    tok, lp, ti, tl = L.unpack(dev.download(out), R)
    same = 0
    for r in range(R):
        want_tok, _, want_top = reference_sample(x[r], words[r])
        same += int(tok[r] == want_tok)
        if rows[r].greedy:
            assert tok[r] == int(np.argmax(x[r]))
        lse = float(np.log(np.exp(x[r].astype(np.float64) - x[r].max()).sum()) + x[r].max())
        assert abs(lp[r] - (x[r, tok[r]] - lse)) < 1e-4
        n = words[r][7]
        if n > 0:
            assert ti[r, :n].tolist() == [i for i, _ in want_top]
            assert np.allclose(tl[r, :n], [v for _, v in want_top], atol=1e-4)
            assert (ti[r, n:] == -1).all()
    assert same >= R - 1, f"device and numpy twin drew different tokens in {R - same} of {R} rows"
    # same seed and counter: the same token whatever the row's position in the batch
    smp.launch(1, xd.ptr + 5 * V * 4, V, pd.ptr + 5 * 32, out.ptr + L.tokens, out.ptr + L.logprobs,
               out.ptr + L.top_ids, out.ptr + L.top_logprobs)
    assert L.unpack(dev.download(out), 1)[0][0] == tok[5]


# ---------------------------------------------------------------------------------------------- benchmark weights


def _hash64(seed: int, i: np.ndarray) -> np.ndarray:
    """fused.cu's hash64 (splitmix64 of seed + golden * (i + 1)) in wrapping uint64 arithmetic."""
    z = np.uint64(seed) + np.uint64(0x9E3779B97F4A7C15) * (i.astype(np.uint64) + np.uint64(1))
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


@pytest.mark.parametrize("bits", [4, 8])
def test_fill_random_codes_match_their_model_and_centre_on_the_zero_point(dev, bits: int) -> None:
    """``fill_random_codes`` (the quantized benchmarks' random GPTQ codes, ``DeviceWeights.random_packed``) writes
    exactly what its header describes (modelled here in numpy from the description), every code in 1 .. 2^bits - 1
    and their mean on the zero-point 2^(bits-1): the random model's (q - z) has no common component, so its tokens
    route to as many experts as uniform routing would (benchmarks/gpu_decode_step.py counts them)."""
    from hybrid_runtime.cuda.backend import fill_random_codes

    n, seed = 40_001, 1234
    a = dev.empty((4 * n,), "uint8")
    fill_random_codes(dev, fused(dev, "bfloat16"), a, seed, bits)
    got = dev.download(a).view(np.uint32)
    i = np.arange(n, dtype=np.int64)
    want = np.zeros(n, np.uint32)
    if bits == 4:
        z = (_hash64(seed, 2 * i), _hash64(seed, 2 * i + 1))
        for j in range(8):
            chunk = (z[j // 4] >> np.uint64(16 * (j % 4))) & np.uint64(0xFFFF)
            want |= ((np.uint64(1) + chunk % np.uint64(15)) << np.uint64(4 * j)).astype(np.uint32)
        codes = np.stack([(got >> (4 * j)) & 0xF for j in range(8)]).ravel()
    else:
        z = _hash64(seed, i)
        for j in range(4):
            chunk = (z >> np.uint64(16 * j)) & np.uint64(0xFFFF)
            want |= ((np.uint64(1) + chunk % np.uint64(255)) << np.uint64(8 * j)).astype(np.uint32)
        codes = got.view(np.uint8)
    assert np.array_equal(got, want)
    zp, top = 1 << (bits - 1), (1 << bits) - 1
    counts = np.bincount(codes.astype(np.int64), minlength=top + 1)
    assert counts[0] == 0 and counts[1:].min() > 0 and counts.sum() == codes.size
    # uniform over 1 .. top: the mean of (q - z) is 0 within 5 standard errors
    sd = np.sqrt(((top ** 2) - 1) / 12.0)
    assert abs(codes.astype(np.float64).mean() - zp) < 5 * sd / np.sqrt(codes.size)
    with pytest.raises(ValueError, match="bits 3"):
        fill_random_codes(dev, fused(dev, "bfloat16"), a, seed, 3)
