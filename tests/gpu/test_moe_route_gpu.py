"""moe_route.cuh's route_token on the GPU: the register version (E <= 512: the lane's logits as order-preserving
keys, redux.sync arg-max rounds) gives the same experts, weights and pair lists, bit for bit, as the memory version
(``-DROUTE_MEM_ONLY``, what every E > 512 runs), through fused.cu's one-CTA ``moe_route``, on logits made to tie
(repeated values, -0.0 next to +0.0, -inf, a huge negative), at every register width (E 8 .. 512) and past it, with
and without renormalisation and the folded shared expert; and the experts match a numpy top-k (value desc, id asc)."""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.gpu


def logits_with_ties(rng: np.random.Generator, n: int, E: int, ld: int) -> np.ndarray:
    lg = np.round(rng.standard_normal((n, ld)) * 2, 1).astype(np.float32)  # one decimal: many exact ties
    lg[0, :E] = 0.0
    lg[0, 1:E:3] = -0.0  # +0 and -0 side by side: equal logits, ties broken by id
    if n > 1:
        lg[1, :E] = lg[1, 0]  # a whole row tied
    if n > 2:
        lg[2, ::5] = -np.inf
        lg[2, 1::7] = -3.0e38
    return lg


def run_route(dev, mod, lg: np.ndarray, n: int, E: int, k: int, renorm: bool, fold: bool) -> dict[str, np.ndarray]:
    kk, e_all = k + int(fold), E + int(fold)
    d = dev.upload(lg)
    out = {"pair_w": dev.zeros((n * kk,), "float32"), "pair_e": dev.zeros((n * kk,), "int32"),
           "expert_off": dev.zeros((e_all + 1,), "int32"), "pair_list": dev.zeros((n * kk,), "int32"),
           "active": dev.zeros((e_all + 1,), "int32")}
    mod.kernel("moe_route").launch(dev, (1, 1, 1), (1024, 1, 1), 0,
                                   [("ptr", d.ptr), ("i32", lg.shape[1]), ("i32", n), ("i32", E), ("i32", k),
                                    ("i32", int(renorm)), ("i32", int(fold)), ("ptr", out["pair_w"].ptr),
                                    ("ptr", out["pair_e"].ptr), ("ptr", out["expert_off"].ptr),
                                    ("ptr", out["pair_list"].ptr), ("ptr", out["active"].ptr)])
    dev.synchronize()
    return {name: dev.download(a) for name, a in out.items()}


@pytest.mark.parametrize("E, k", [(8, 2), (60, 4), (128, 8), (256, 8), (257, 8), (512, 10), (600, 8)])
def test_register_route_token_matches_the_memory_version_bit_for_bit(dev, E: int, k: int) -> None:
    from hybrid_runtime.cuda.kernels import load_module

    regs = load_module("fused.cu", ("-DDT=2",), dev.arch)
    mem = load_module("fused.cu", ("-DDT=2", "-DROUTE_MEM_ONLY"), dev.arch)
    rng = np.random.default_rng(E * 31 + k)
    n = 16
    ld = E + 9
    lg = logits_with_ties(rng, n, E + 1, ld)
    for renorm in (False, True):
        for fold in (False, True):
            a = run_route(dev, regs, lg, n, E, k, renorm, fold)
            b = run_route(dev, mem, lg, n, E, k, renorm, fold)
            for name in ("pair_w", "pair_e", "expert_off", "active"):
                assert np.array_equal(a[name].view(np.uint32), b[name].view(np.uint32)), (name, renorm, fold)
            kk = k + int(fold)
            pe = a["pair_e"].reshape(n, kk)
            for t in range(n):  # top-k by (value desc, id asc), -0 == +0
                row = lg[t, :E].astype(np.float64) + 0.0
                want = np.lexsort((np.arange(E), -row))[:k]
                assert pe[t, :k].tolist() == want.tolist(), (t, renorm, fold)
                if fold:
                    assert pe[t, k] == E
