"""The prefill MoE's packed grouped GEMMs (``moe_wgmma_ws.cu -DWS_NBITS=4|8``, ``MoEPrefill.experts_packed``) on
the GPU: each weight tile dequantised in shared memory by the producer warpgroup.

Random packed experts of the Qwen3.5-35B-A3B expert shape (H 2048, I 512, 256 experts + the shared one as expert
256, top-8; bf16) and a small one (H 256, I 128, 16 experts, top-4; fp16), int4 and int8, symmetric and
asymmetric, group sizes 32 / 64 / 128 / one block a row (``test_moe_nbits_decode_gpu.Rig``: the stacks also
dequantised on the device by the load path, nbits.cu). Steps of 1, 100 and 700 tokens routed by the prefill's
moe_topk + moe_group (spread routing, one expert taking every token: 6 tiles of one expert, half the experts cold).
Checked per step, for float32 and bundle-dtype y:

* == the same step on the dequantised stacks through ``experts`` with ``"wgmma_ws"`` (what a packed layer ran before:
  dequantise, then the grouped GEMMs), act and y BIT FOR BIT - the design: the tile holds the same T values and the
  consumers are unchanged;
* every pair's act row written; with float32 y, nothing written past y[:n, :k] (canaries).

``experts_packed`` refuses what it does not run (act order, a block size a code chunk straddles, 64-row tiles).
"""

from __future__ import annotations

import numpy as np
import pytest
from gpu_bits import host_bits
from test_moe_decode_gpu import CANARY, logits_for
from test_moe_nbits_decode_gpu import dev, rig  # noqa: F401 - the module's device fixture

pytestmark = pytest.mark.gpu

N_MAX = 700
# (dtype, shape, bits, group, asym)
CASES = [("bfloat16", "a35b", 4, 128, False), ("bfloat16", "a35b", 4, 32, True), ("bfloat16", "a35b", 4, -1, True),
         ("bfloat16", "a35b", 8, 128, False), ("bfloat16", "a35b", 8, 64, True), ("float16", "small", 4, 64, True),
         ("float16", "small", 8, 32, False)]
STEPS = [(700, "spread"), (700, "one_takes_all"), (100, "cold_experts"), (1, "spread")]


def packed_sources(r):
    """The rig's current variant as experts_packed takes it: PackedLinear gate_up / down and int32 zero-points."""
    from hybrid_runtime.cuda.moe_prefill import zero_points_i32
    from hybrid_runtime.cuda.quant import PackedLinear

    srcs, zeros = [], []
    for kind, (R, K) in r.codes.items():
        _, d_s, d_z = r.ops[kind]
        bs = K if r.group == -1 else r.group
        srcs.append(PackedLinear(r.dB[kind], d_s, d_z, None, K, R, r.bits, bs, K, r.e_all))
        zp = r.host[kind][1]
        zeros.append(None if zp is None else r.dev.upload(zero_points_i32(zp, r.e_all, R, K // bs, r.bits)))
    return srcs, zeros


class Buffers:
    def __init__(self, device, r) -> None:
        from hybrid_runtime.cuda.moe_prefill import ROUTE_MAX_CTAS, tile_list_words

        P = N_MAX * r.k
        self.dev, self.r = device, r
        self.b = {name: device.empty(shape_, dt) for name, shape_, dt in (
            ("pw", (P,), "float32"), ("pe", (P,), "int32"), ("pl", (P,), "int32"), ("off", (r.e_all + 1,), "int32"),
            ("active", (r.e_all + 1,), "int32"), ("tiles", (tile_list_words(P, r.e_all),), "int32"),
            ("cta", (ROUTE_MAX_CTAS, r.e_all), "int32"), ("act", (P, r.I), r.dtype), ("act_ref", (P, r.I), r.dtype),
            ("y", (N_MAX, r.ny, r.H), "float32"), ("y_ref", (N_MAX, r.ny, r.H), "float32"))}

    def bufs(self, ref: bool):
        from hybrid_runtime.cuda.moe_prefill import MoEBuffers

        b = self.b
        return MoEBuffers(b["pw"].ptr, b["pe"].ptr, b["pl"].ptr, b["off"].ptr, b["active"].ptr, b["tiles"].ptr,
                          b["cta"].ptr, b["act_ref" if ref else "act"].ptr, b["y_ref" if ref else "y"].ptr,
                          (b["tiles"].size - 4) // 4)

    def canaries(self) -> None:
        r, b = self.r, self.b
        for name in ("y", "y_ref"):
            r.fused.kernel("fill_f32").launch(self.dev, (-(-b[name].size // 256), 1, 1), (256, 1, 1), 0,
                                              [("ptr", b[name].ptr), ("f32", CANARY), ("i64", b[name].size)])
        for name in ("act", "act_ref"):
            self.dev.memset_d8(b[name].ptr, 0xFF, b[name].nbytes)


def raw_bits(device, a) -> np.ndarray:
    """A device array's bytes as uint16 (bf16 / fp16 exactly as stored: DeviceArray.download widens them)."""
    from hybrid_runtime.cuda.driver import DeviceArray

    return device.download(DeviceArray(a.ptr, (a.nbytes,), "uint8", a.device)).view(np.uint16)


@pytest.mark.parametrize("dtype,shape,bits,group,asym", CASES)
def test_packed_prefill_gemms_give_the_dequantised_stacks_bits(dev, dtype: str, shape: str, bits: int, group: int,  # noqa: F811
                                                               asym: bool) -> None:
    from hybrid_runtime.cuda.moe_prefill import MoEPrefill

    r = rig(dev, dtype, shape, bits)
    r.variant(group, asym, seed=bits * 1000 + group + int(asym))
    srcs, zeros = packed_sources(r)
    mp = MoEPrefill(dev, dtype, impl="wgmma_ws")
    assert mp.packed_problems(*srcs, r.H, r.I, r.E, zeros) == []
    buf = Buffers(dev, r)
    rng = np.random.default_rng(bits + group)
    calls = 0
    for n, case in STEPS:
        for y_dtype in ("float32", dtype):
            h = rng.standard_normal((n, r.H)).astype(np.float32)
            hd = dev.upload(host_bits(h, dtype), dtype=dtype)
            lg = dev.upload(np.ascontiguousarray(logits_for(rng, n, r.E, r.ld, case), np.float32))
            buf.canaries()
            mp.route(n, lg.ptr, r.ld, r.E, r.k, True, buf.bufs(False))
            mp.experts(n, hd.ptr, r.H, r.wt["gate_up"].ptr, r.wt["down"].ptr, r.H, r.I, r.k, r.ny, r.E, buf.bufs(True),
                       y_dtype=y_dtype)
            mp.experts_packed(n, hd.ptr, r.H, *srcs, r.H, r.I, r.k, r.ny, r.E, buf.bufs(False), y_dtype=y_dtype,
                              zeros=(zeros[0], zeros[1]))
            dev.synchronize()
            got = {name: raw_bits(dev, buf.b[name]) for name in ("act", "act_ref", "y", "y_ref")}
            P = n * r.k
            assert np.array_equal(got["act"][:P], got["act_ref"][:P]), (n, case, y_dtype, "act")
            assert (got["act"][:P] != 0xFFFF).all(), (n, case)  # every pair's row written (the fill is 0xFFFF)
            if y_dtype == "float32":
                y, yr = (got[k_].view(np.float32).reshape(N_MAX, r.ny, r.H) for k_ in ("y", "y_ref"))
                assert np.array_equal(y[:n, :r.k].view(np.uint32), yr[:n, :r.k].view(np.uint32)), (
                    n, case, float(np.abs(y[:n, :r.k] - yr[:n, :r.k]).max()))
                assert (y[:n, r.k:] == CANARY).all() and (y[n:] == CANARY).all()
            else:  # T slots [n, ny, H] in the first half of the same bytes
                y, yr = (got[k_][:N_MAX * r.ny * r.H].reshape(N_MAX, r.ny, r.H) for k_ in ("y", "y_ref"))
                assert np.array_equal(y[:n, :r.k], yr[:n, :r.k]), (n, case, "y_t")
            calls += 1
    print(f"\n[moe_prefill_packed] {dtype} {shape} int{bits} group {group} {'asym' if asym else 'sym'}: {calls} steps "
          "bit-identical to dequantise + wgmma_ws")


def test_experts_packed_refuses_what_it_does_not_run(dev) -> None:  # noqa: F811
    from dataclasses import replace

    from hybrid_runtime.cuda.moe_prefill import MoEPrefill

    r = rig(dev, "bfloat16", "a35b", 4)
    r.variant(128, False, seed=1)
    srcs, _ = packed_sources(r)
    mp = MoEPrefill(dev, "bfloat16", impl="wgmma_ws")
    perm = dev.upload(np.arange(r.H, dtype=np.int32))
    bad = {"act order": (replace(srcs[0], perm=perm), srcs[1]),
           "block size 16": (replace(srcs[0], block_size=16), srcs[1]),
           "2-bit": (replace(srcs[0], bits=2), srcs[1]),
           "not a": (replace(srcs[0], N=r.H), srcs[1])}
    for why, (gu, dn) in bad.items():
        assert any(why in p for p in mp.packed_problems(gu, dn, r.H, r.I, r.E)), why
        with pytest.raises(ValueError, match="packed prefill MoE"):
            mp.experts_packed(1, 0, r.H, gu, dn, r.H, r.I, r.k, r.ny, r.E, Buffers(dev, r).bufs(False))
    asym = replace(srcs[1], zp=dev.upload(np.zeros(8, np.uint8)))
    assert any("int32 copy" in p for p in mp.packed_problems(srcs[0], asym, r.H, r.I, r.E))
    small = MoEPrefill(dev, "bfloat16", impl="wgmma64")
    assert any("64 rows" in p for p in small.packed_problems(*srcs, r.H, r.I, r.E))


@pytest.mark.parametrize("bits,sym", [(4, False), (8, True)])
def test_backend_prefill_of_packed_experts_gives_the_dequantised_bundles_bits(tmp_path, bits: int, sym: bool) -> None:
    """``CudaBackend(packed_experts=True)`` on a bf16 GPTQ bundle whose expert shape the packed GEMMs take (H 256,
    experts and folded shared expert of I 128): its prefill steps run the packed grouped GEMMs (counted), and
    prefill + decode give the logits of the same bundle dequantised at load BIT FOR BIT (teacher-forced, prefill
    chunks of 5 tokens then 6 decode steps of 3 sequences); with ``packed_moe_prefill`` off the same bits again.
    With it on, no step needs the dequantised scratch stack, so the backend frees it at load. The packed GEMMs'
    build is compiled when the backend is made (no step compiles), and zero-points get their int32 copy only where
    those GEMMs run."""
    from runner_cases import Driver, scattered_tables

    from hybrid_runtime.config import Manifest
    from hybrid_runtime.cuda.backend import CudaBackend
    from hybrid_runtime.runner import ModelRunner
    from tests import gptq_cases as gc

    b = gc.packed_experts_bundle(tmp_path, bits=bits, sym=sym, hidden_size=256, moe_intermediate_size=128,
                                 shared_expert_intermediate_size=128)
    m = Manifest.load(b)
    plain = CudaBackend(b, m, device="cuda")
    packed = CudaBackend(b, m, device="cuda", packed_experts=True)
    off = CudaBackend(b, m, device="cuda", packed_experts=True, packed_moe_prefill=False)
    assert packed.w.packed_moe and not plain.w.packed_moe
    assert set(packed.moe_prefill.__dict__.get("_packed_modules", {})) == {bits}  # compiled at load
    # every step of `packed` reads the experts packed: no dequantised scratch stack; `off` dequantises into it
    assert packed.w.moe_scratch is None and off.w.moe_scratch is not None
    assert all(packed.w.moe(layer).gate_up is None for layer in packed.w.packed_moe)
    assert not off.moe_prefill.__dict__.get("_packed_modules")
    for pk_on, pk_off in zip(packed.w.packed_moe.values(), off.w.packed_moe.values(), strict=True):
        assert all((z is None) == sym for z in pk_on.zeros)  # asymmetric: the int32 copies
        assert pk_off.zeros == (None, None)  # packed prefill off: no copy made
    rng = np.random.default_rng(bits)
    lens, slots, decode_steps = [40, 23, 9], [3, 0, 2], 6
    prompts = [rng.integers(3, m.model.vocab_size, n).tolist() for n in lens]
    tables = scattered_tables(m, [n + decode_steps for n in lens], seed=bits)
    drv = Driver([ModelRunner(b, m, backend=be) for be in (plain, packed, off)], slots, tables, prompts)
    steps = [list(r) for r in drv.prefill(chunk=5)] + [list(drv.decode()) for _ in range(decode_steps)]
    print(f"\n[moe_prefill_packed] backend int{bits} {'sym' if sym else 'asym'}: {len(steps)} steps, packed prefill "
          f"MoE calls {packed.moe_packed_prefill_calls} (off: {off.moe_packed_prefill_calls})")
    assert packed.moe_packed_prefill_calls > 0 and off.moe_packed_prefill_calls == 0
    for i, (a, c, d) in enumerate(steps):
        assert np.array_equal(a, c), (i, float(np.abs(a - c).max()))
        assert np.array_equal(a, d), (i, float(np.abs(a - d).max()))


def test_runner_default_keeps_a_gptq_bundles_experts_packed_with_the_same_bits(tmp_path) -> None:
    """``ModelRunner(packed_weights="experts")``, CUDA graphs captured as served, on a bf16 int4 asymmetric GPTQ
    bundle: the experts stay only packed (fewer weight bytes than ``packed_weights="off"``, and no dequantised
    scratch stack), prefill runs the packed grouped GEMMs and the captured decode graphs the packed decode MoE (both
    counted), and the logits equal ``off``'s BIT FOR BIT (teacher-forced: prefill chunks of 5 tokens, then 8 decode
    steps of 3 sequences). The default (``auto`` = ``dual`` for a GPTQ cuda bundle) runs beside them: the same
    packed experts, the projections also kept packed (counted on top), prefill ``off``'s bits, and decode steps
    ``packed_weights="all"``'s bits (the projections' decode GEMMs on the packed codes, the experts as here)."""
    from runner_cases import Driver, scattered_tables

    from hybrid_runtime.config import Manifest
    from hybrid_runtime.runner import ModelRunner
    from tests import gptq_cases as gc

    b = gc.packed_experts_bundle(tmp_path, bits=4, sym=False, hidden_size=256, moe_intermediate_size=128,
                                 shared_expert_intermediate_size=128)
    m = Manifest.load(b)
    off = ModelRunner(b, m, device="cuda", packed_weights="off")
    experts = ModelRunner(b, m, device="cuda", packed_weights="experts")
    default = ModelRunner(b, m, device="cuda")
    every = ModelRunner(b, m, device="cuda", packed_weights="all")
    be, dbe = experts.backend, default.backend
    assert be.w.packed_moe and not be.w.packed_only and not off.backend.w.packed_moe  # type: ignore[attr-defined]
    assert be.w.nbytes < off.backend.w.nbytes and be.graphs and be.moe_nbits_calls > 0  # type: ignore[attr-defined]
    assert be.w.moe_scratch is None  # type: ignore[attr-defined]  # every step reads them packed: stack freed
    assert dbe.w.packed_moe and dbe.w.packed_decode and dbe.w.moe_scratch is None  # type: ignore[attr-defined]
    assert dbe.w.nbytes == be.w.nbytes + sum(p.nbytes for p in dbe.w.packed_decode.values())  # type: ignore
    assert dbe.graphs and dbe.nbits_calls > 0  # type: ignore[attr-defined]
    rng = np.random.default_rng(5)
    lens, slots, decode_steps = [33, 18, 7], [2, 0, 1], 8
    prompts = [rng.integers(3, m.model.vocab_size, n).tolist() for n in lens]
    tables = scattered_tables(m, [n + decode_steps for n in lens], seed=5)
    drv = Driver([off, experts, default, every], slots, tables, prompts)
    pre = [list(r) for r in drv.prefill(chunk=5)]
    steps = pre + [list(drv.decode()) for _ in range(decode_steps)]
    print(f"\n[moe_prefill_packed] runner experts / default (dual) int4 asym: weight bytes {be.w.nbytes} / "
          f"{dbe.w.nbytes} vs {off.backend.w.nbytes}, packed prefill MoE calls {be.moe_packed_prefill_calls}")
    assert be.moe_packed_prefill_calls > 0
    for i, (a, c, d, e) in enumerate(steps):
        assert np.array_equal(a, c), (i, float(np.abs(a - c).max()))
        assert np.array_equal(d, a if i < len(pre) else e), (i, float(np.abs(d - (a if i < len(pre) else e)).max()))
    assert dbe.nbits_fallbacks == 0  # type: ignore[attr-defined]
