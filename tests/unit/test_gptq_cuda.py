"""GPTQ checkpoints on the ``cuda`` backend, what the CPU can check (the device tests: tests/gpu/test_nbits_gpu.py):

* ``--backend cuda`` stores every quantized runtime weight packed; dequantising the written safetensors with the
  tests' own MatMulNBits-layout dequantiser (``tests/gptq_pack.nbits_reference``) gives, bit for bit, the weights
  of the float ``cuda`` bundle built from the dequantised checkpoint (float32), for every case of
  ``tests/gptq_cases.py`` (dense, MoE with quantized experts and shared expert, folded shared expert, act order,
  sym / asym, int4 / int8, groups 32 / 64 / 128 / -1, per-part weights, a recorded fallback, dynamic rules);
  a bfloat16 build stores the same packed bytes, and its float tensors are the float bundle's;
* the manifest records the quantization; :func:`plan_weights` (what ``DeviceWeights.load`` checks first) refuses
  a record that does not match the stored tensors, and a damaged permutation;
* a numpy model of ``nbits.cu``'s per-thread index mapping == the project's host dequantiser.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from builder.bundle import BuildOptions, build_bundle
from hybrid_runtime.config import BundleError, ConfigError, Manifest
from hybrid_runtime.cuda.quant import THREADS, launch_grid, plan_weights
from hybrid_runtime.program import linear_sources, stored_weight_specs
from hybrid_runtime.quant import QuantLinear, nbits_dequantize, nbits_tensors, to_nbits
from hybrid_runtime.weights_io import SafetensorsFile, bf16_to_f32, f32_to_bf16_bits
from tests import gptq_cases as gc
from tests import gptq_pack as gp


@pytest.fixture(scope="module", params=sorted(gc.CASES))
def case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """(case name, GPTQ cuda bundle float32, float cuda bundle of the dequantised weights, packed modules)."""
    root = tmp_path_factory.mktemp(f"gptq_cuda_{request.param}")
    ckpt, deq, done = gc.checkpoints(root, request.param)
    return request.param, gc.build(ckpt, root / "bq"), gc.build(deq, root / "bf"), done


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, np.float32).view(np.uint32)


def test_packed_weights_dequantise_to_the_float_bundle_bit_for_bit(case) -> None:
    _, bq, bf, done = case
    m = Manifest.load(bq)
    fq, ff = SafetensorsFile(bq / m.state_weights), SafetensorsFile(bf / m.state_weights)
    packed = 0
    for s in stored_weight_specs(m.model, m.limits.max_seq_len):
        want = ff.get(s.name)
        got = gp.stored_weight_reference(fq, s.name)
        assert got is not None, s.name
        assert got.shape == want.shape and np.array_equal(_bits(got), _bits(want)), s.name
        if s.name not in fq.header:
            packed += 1
            assert linear_sources(s.name), f"{s.name} is never quantized but stored packed"
    assert packed and done
    # float tensors are the float bundle's; every key is a runtime weight's
    prefixes = {s.name for s in stored_weight_specs(m.model, m.limits.max_seq_len)}
    for k in fq.keys():  # noqa: SIM118 (not a dict)
        base = k.split(".nbits_")[0].split(".part")[0].removesuffix(".parts")
        assert base in prefixes, k


def test_the_bundle_stays_small(case) -> None:
    """Packed int4 weights: B at half a byte a weight plus float32 scales per group; int8: one byte."""
    _, bq, bf, _ = case
    fq = SafetensorsFile(bq / "weights.safetensors")
    for k in fq.keys():  # noqa: SIM118
        if k.endswith(".nbits_meta"):
            p = k.removesuffix(".nbits_meta")
            K, N, bits, bs, _, _ = (int(v) for v in fq.raw(k))
            E = fq.raw(p + ".nbits_B").shape[0] if fq.raw(p + ".nbits_B").ndim == 4 else 1
            stored = sum(fq.raw(f"{p}.nbits_{t}").nbytes for t in ("B", "scales", "zp")
                         if f"{p}.nbits_{t}" in fq.header)
            nb = -(-K // bs)  # a partial last block is padded (tiny models: K = 48, 64 with blocks of 32, 128)
            assert stored <= E * N * nb * (bs * bits / 8 + 4 + 1) + 16, (k, stored)
    assert (bq / "weights.safetensors").stat().st_size < (bf / "weights.safetensors").stat().st_size


def test_manifest_records_the_quantization(case) -> None:
    name, bq, _, done = case
    m = Manifest.load(bq)
    q = m.quantization
    assert q is not None and q.method == "gptq" and q.activations == "float32" and q.accuracy_level == 0
    assert q.modules, "nothing recorded as packed"
    assert set(q.modules) | set(q.fallbacks) <= {c for s in stored_weight_specs(m.model, 96) for c in
                                                 linear_sources(s.name)}
    assert ("lm_head" in q.modules) == ("lm_head" in done)
    if name == "qwen35moe_int8_g32_sym_act_parts":
        assert q.bits == 8 and any(v == 4 for v in q.modules.values())
        assert q.fallbacks and all(k.endswith("experts.down_proj") for k in q.fallbacks)
        assert not any(k.endswith("self_attn.k_proj") for k in q.modules)
    stored = plan_weights(SafetensorsFile(bq / m.state_weights), m)
    kinds = {w.kind for w in stored.values()}
    assert "packed" in kinds
    if name == "qwen35moe_int8_g32_sym_act_parts":
        assert "parts" in kinds
        assert stored["layers.3.self_attn.qkv_proj"].kind == "parts"
        assert stored["layers.0.mlp.experts.gate_up"].kind == "parts"
        assert stored["layers.0.mlp.experts.down"].kind == "float"


def test_bfloat16_bundle_stores_the_same_packed_bytes(tmp_path: Path) -> None:
    ckpt, deq, _ = gc.checkpoints(tmp_path, "qwen35moe_int8_g32_sym_act_parts")
    b32, b16, f16 = (gc.build(ckpt, tmp_path / "b32"), gc.build(ckpt, tmp_path / "b16", dtype="bfloat16"),
                     gc.build(deq, tmp_path / "f16", dtype="bfloat16"))
    m = Manifest.load(b16)
    assert m.quantization.activations == "bfloat16" and m.dtype == "bfloat16"
    a, b, fl = (SafetensorsFile(p / "weights.safetensors") for p in (b32, b16, f16))
    assert set(a.keys()) == set(b.keys())
    for k in b.keys():  # noqa: SIM118
        if ".nbits_" in k or k.endswith(".parts"):
            assert np.array_equal(a.raw(k), b.raw(k)), k
    for s in stored_weight_specs(m.model, 96):
        if s.name in b.header:  # float: the float bf16 bundle's bits
            assert b.dtype(s.name) == fl.dtype(s.name) and np.array_equal(b.raw(s.name), fl.raw(s.name)), s.name
        else:  # packed: what the device writes (float32 dequantisation rounded to nearest even) == the float bundle
            ref = gp.stored_weight_reference(b, s.name)
            assert np.array_equal(f32_to_bf16_bits(ref), fl.raw(s.name)), s.name
    plan_weights(b, m)


# ---------------------------------------------------------------------------------------- refusals


@pytest.fixture(scope="module")
def parts_bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("gptq_cuda_refusals")
    ckpt, _, _ = gc.checkpoints(root, "qwen35moe_int8_g32_sym_act_parts")
    return gc.build(ckpt, root / "b")


def _edited(bundle: Path, dst: Path, edit) -> tuple[SafetensorsFile, Manifest]:
    shutil.copytree(bundle, dst)
    d = json.loads((dst / "manifest.json").read_text())
    edit(d)
    (dst / "manifest.json").write_text(json.dumps(d))
    m = Manifest.load(dst)
    return SafetensorsFile(dst / m.state_weights), m


@pytest.mark.parametrize("case_name,edit,match", [
    ("no_record", lambda d: d.pop("quantization"), "records no quantization"),
    ("other_dtype", lambda d: d.update(dtype="bfloat16"), "is \\('F32'"),
    ("other_activations", lambda d: d["quantization"].update(activations="bfloat16"), "bfloat16 activations"),
    ("onnxruntime_activations", lambda d: d["quantization"].update(activations="fp32"), "fp32 activations"),
    ("other_bits", lambda d: d["quantization"]["modules"].update(
        {k: 4 for k in d["quantization"]["modules"] if k.endswith("o_proj")}), "stored as \\[8\\]-bit"),
    ("float_recorded_quantized", lambda d: d["quantization"]["modules"].update(
        {"layers.0.mlp.experts.down_proj": 8}), "stored in float"),
    ("part_recorded_float", lambda d: [d["quantization"]["modules"].pop(k) for k in list(d["quantization"]["modules"])
                                       if k.endswith("experts.up_proj")], "packed parts are \\[4, 8\\]-bit"),
])
def test_a_record_that_does_not_match_is_refused(parts_bundle: Path, tmp_path: Path, case_name: str, edit,
                                                 match: str) -> None:
    f, m = _edited(parts_bundle, tmp_path / case_name, edit)
    with pytest.raises(BundleError, match=match):
        plan_weights(f, m)


def test_a_damaged_permutation_is_refused(parts_bundle: Path, tmp_path: Path) -> None:
    from hybrid_runtime.weights_io import save_safetensors

    dst = tmp_path / "perm"
    shutil.copytree(parts_bundle, dst)
    f = SafetensorsFile(dst / "weights.safetensors")
    t = {k: f.raw(k).copy() for k in f.keys()}  # noqa: SIM118
    name = "layers.3.self_attn.o_proj.nbits_perm"
    t[name][1] = t[name][0]  # one input column twice, another never
    bf16 = frozenset()
    save_safetensors(dst / "w2.safetensors", t, bf16)
    with pytest.raises(BundleError, match="nbits_perm is not a permutation"):
        plan_weights(SafetensorsFile(dst / "w2.safetensors"), Manifest.load(dst))


def test_cuda_refuses_int8_activations(tmp_path: Path) -> None:
    ckpt, _, _ = gc.checkpoints(tmp_path, "qwen35_dense_int4_g64_sym_v2")
    with pytest.raises(ConfigError, match="a cuda bundle's activations are its --dtype"):
        build_bundle(ckpt, tmp_path / "b", BuildOptions(backend="cuda", quant_activations="int8", **gc.limits()),
                     progress=lambda _m: None)


# ---------------------------------------------------------------------------------------- the kernel's mapping


def kernel_model(t: dict[str, np.ndarray], prefix: str, k_in: int, N_out: int, row0: int, dtype_round) -> np.ndarray:
    """One launch of ``nbits_dequant`` (:func:`kernel_writes`) into rows ``row0..`` of a ``[E, N_out, k_in]`` buffer
    (NaN where nothing is written)."""
    B = t[prefix + ".nbits_B"]
    E = max(1, B.shape[0] if B.ndim == 4 else 0)
    out = np.full(E * N_out * k_in, np.nan, np.float32)
    dst, v = kernel_writes(t, prefix, k_in, N_out * k_in, dtype_round)
    out[row0 * k_in + dst] = v
    return out.reshape(E, N_out, k_in)


def _rand_ql(rng: np.random.Generator, N: int, K: int, bits: int, G: int, act: bool, sym: bool) -> QuantLinear:
    g = np.sort(rng.integers(0, G, K)) if not act else rng.permutation(np.arange(K) * G // K)
    zeros = (np.full((N, G), 1 << (bits - 1), np.uint8) if sym
             else rng.integers(0, 1 << bits, (N, G)).astype(np.uint8))
    return QuantLinear(rng.integers(0, 1 << bits, (N, K)).astype(np.uint8),
                       (rng.random((N, G)) * 0.05 + 1e-3).astype(np.float16).astype(np.float32), zeros,
                       g.astype(np.int32), bits)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("act,sym", [(False, True), (True, False), (True, True), (False, False)])
@pytest.mark.parametrize("experts", [0, 3])
def test_the_kernels_index_mapping_equals_the_host_dequantiser(bits: int, act: bool, sym: bool, experts: int) -> None:
    rng = np.random.default_rng(bits * 10 + act * 3 + sym + experts)
    K, N, G = 200, 24, 5  # irregular groups: padded blocks (perm naming k_in), an odd block count
    ws = [_rand_ql(rng, N, K, bits, G, act, sym) for _ in range(max(1, experts))]
    if experts:
        ws = [QuantLinear(w.q, w.scales, w.zeros, ws[0].g_idx, bits) for w in ws]  # a layer's experts share grouping
    t = nbits_tensors("w", [to_nbits(w) for w in ws], 0, stacked=bool(experts))
    want = np.stack([w.dequantize() for w in ws])
    for e, w in enumerate(ws):  # the host dequantiser of the stored layout agrees with the unpacked weight
        nb = to_nbits(w)
        assert np.array_equal(nbits_dequantize(nb.B, nb.scales, nb.zero_points, nb.perm, nb.meta(0)), want[e])
    got = kernel_model(t, "w", K, N + 7, 5, lambda v: v)  # a part: rows 5..5+N of a [N + 7, K] weight
    assert np.isnan(got[:, :5]).all() and np.isnan(got[:, 5 + N:]).all()
    assert np.array_equal(got[:, 5:5 + N], want)
    bf = kernel_model(t, "w", K, N, 0, lambda v: bf16_to_f32(f32_to_bf16_bits(v)))
    assert np.array_equal(bf, bf16_to_f32(f32_to_bf16_bits(want)))


def test_the_launch_grid() -> None:
    assert launch_grid(151936, 2048, 0) == (151936 * 2048 // THREADS, 1, 1)
    assert launch_grid(1024, 2048, 256) == (1024 * 2048 // THREADS, 256, 1)
    assert launch_grid(3, 100, 0) == (2, 1, 1)


# ---------------------------------------------------------------------------------------- the load path, host-emulated


class FakeDevice:
    """Device memory emulated on the host (one flat byte array, allocations 256-byte aligned): enough of
    :class:`~hybrid_runtime.cuda.driver.CudaDevice` for ``DeviceWeights.load``, so its addressing (fused rows,
    per-part row offsets, stacked experts, the folded shared expert, the router's shared-gate row) runs on a CPU."""

    def __init__(self, nbytes: int = 64 << 20) -> None:
        from types import SimpleNamespace

        self.mem = np.zeros(nbytes, np.uint8)
        self.top = 256
        self.ordinal = 0
        self.limits = SimpleNamespace(name="fake")
        self.freed = 0

    def empty(self, shape, dtype, stream_ordered: bool = False):
        from hybrid_runtime.cuda.driver import DeviceArray, dtype_of

        n = int(np.prod(shape, dtype=np.int64)) * dtype_of(dtype).itemsize
        ptr, self.top = self.top, self.top + -(-max(n, 1) // 256) * 256
        assert self.top <= self.mem.size
        return DeviceArray(ptr, shape, dtype, 0, owner=self)

    def free(self) -> None:
        self.freed += 1

    def zeros(self, shape, dtype):
        return self.empty(shape, dtype)  # the arena starts zeroed and is never reused

    def upload(self, host: np.ndarray, out=None, dtype=None, stream_ordered: bool = False):
        h = np.ascontiguousarray(host)
        out = out or self.empty(h.shape, dtype or h.dtype)
        self.copy_htod(out.ptr, h)
        return out

    def copy_htod(self, dst: int, host: np.ndarray) -> None:
        b = np.ascontiguousarray(host).reshape(-1).view(np.uint8)
        self.mem[dst:dst + b.size] = b

    def read(self, ptr: int, shape, dtype: str) -> np.ndarray:
        n = int(np.prod(shape))
        if dtype == "bfloat16":
            return bf16_to_f32(self.mem[ptr:ptr + 2 * n].view(np.uint16)).reshape(shape)
        dt = np.dtype(dtype)
        return self.mem[ptr:ptr + n * dt.itemsize].view(dt).reshape(shape)

    def synchronize(self) -> None:
        pass


class FakeDequant:
    """``NBitsDequant`` on a :class:`FakeDevice`: the launch runs :func:`kernel_writes` (the kernel's mapping)."""

    def __init__(self, device: FakeDevice, dtype: str) -> None:
        self.device, self.dtype = device, dtype

    def upload(self, hp, row0: int = 0):
        from hybrid_runtime.cuda.quant import NBitsDequant

        return NBitsDequant.upload(self, hp, row0)  # type: ignore[arg-type]

    def launch(self, p, out: int, ldo: int, out_estride: int) -> None:
        d = self.device
        E = max(1, p.experts)
        nb = p.n_blocks
        t = {"w.nbits_meta": np.array([p.K, p.N, p.bits, p.block_size, 0, p.k_in]),
             "w.nbits_B": d.read(p.B.ptr, p.B.shape, "uint8"), "w.nbits_scales": d.read(p.scales.ptr, p.scales.shape,
                                                                                        "float32")}
        if p.zp is not None:
            t["w.nbits_zp"] = d.read(p.zp.ptr, p.zp.shape, "uint8")
        if p.perm is not None:
            t["w.nbits_perm"] = d.read(p.perm.ptr, p.perm.shape, "int32")
        assert t["w.nbits_B"].size == E * p.N * nb * p.block_size * p.bits // 8
        dst, v = kernel_writes(t, "w", ldo, out_estride, _ROUND[self.dtype])
        es = 4 if self.dtype == "float32" else 2
        raw = (f32_to_bf16_bits(v) if self.dtype == "bfloat16" else v.astype(np.float16 if es == 2 else np.float32))
        for k in range(es):
            d.mem[out + dst * es + k] = raw.view(np.uint8).reshape(-1, es)[:, k]


_ROUND = {"float32": lambda v: v, "float16": lambda v: v.astype(np.float16).astype(np.float32),
          "bfloat16": lambda v: bf16_to_f32(f32_to_bf16_bits(v))}


def kernel_writes(t: dict[str, np.ndarray], prefix: str, ldo: int, out_estride: int, dtype_round
                  ) -> tuple[np.ndarray, np.ndarray]:
    """(element offsets from ``out``, values) of every write of one ``nbits_dequant`` launch, thread by thread."""
    K, N, bits, bs, _, kin = (int(v) for v in t[prefix + ".nbits_meta"])
    B = t[prefix + ".nbits_B"]
    E = B.shape[0] if B.ndim == 4 else 0
    Bf, S = B.reshape(-1), t[prefix + ".nbits_scales"].reshape(-1)
    Z, P = t.get(prefix + ".nbits_zp"), t.get(prefix + ".nbits_perm")
    Z, P = (None if Z is None else Z.reshape(-1)), (None if P is None else P.reshape(-1).astype(np.int32))
    gx, gy, _ = launch_grid(N, K, E)
    assert gy == max(1, E) and (gx - 1) * THREADS < N * K <= gx * THREADS
    es = lambda a: a.size // max(1, E) if a is not None else 0  # noqa: E731
    dsts, vals = [], []
    for e in range(gy):  # blockIdx.y
        i = np.arange(gx * THREADS, dtype=np.int64)  # blockIdx.x * blockDim.x + threadIdx.x
        i = i[i < N * K]
        n, j = i // K, i % K
        nb = (K + bs - 1) // bs
        b = j // bs
        addr = e * es(B) + n * (nb * bs * bits // 8) + (j >> 1 if bits == 4 else j)
        byte = Bf[addr].astype(np.int64)
        q = np.where(j & 1, byte >> 4, byte & 15) if bits == 4 else byte
        if Z is None:
            z = np.full_like(q, 1 << (bits - 1))
        elif bits == 4:
            zb = Z[e * es(Z) + n * ((nb + 1) // 2) + (b >> 1)].astype(np.int64)
            z = np.where(b & 1, zb >> 4, zb & 15)
        else:
            z = Z[e * es(Z) + n * nb + b].astype(np.int64)
        s = S[e * es(S) + n * nb + b]
        col = P[e * es(P) + j] if P is not None else j
        keep = (col >= 0) & (col < kin)
        dsts.append((e * out_estride + n * ldo + col)[keep])
        vals.append(dtype_round((q - z).astype(np.float32) * s)[keep])
    dst = np.concatenate(dsts)
    assert len(np.unique(dst)) == dst.size, "two threads write one element"
    return dst, np.concatenate(vals).astype(np.float32)


def _load_fake(bundle: Path, monkeypatch: pytest.MonkeyPatch, keep: bool = False, linears: bool = False,
               experts: bool = False, dual: bool = False):
    from hybrid_runtime.cuda import weights as cw

    monkeypatch.setattr(cw, "NBitsDequant", FakeDequant)
    dev = FakeDevice()
    w = cw.DeviceWeights.load(dev, bundle, Manifest.load(bundle), keep_packed=keep,  # type: ignore[arg-type]
                              packed_linears=linears, packed_experts=experts, dual_linears=dual)
    return dev, w


def _device_state(dev: FakeDevice, w) -> dict[str, np.ndarray]:
    out = {n: dev.read(a.ptr, a.shape, a.dtype.name) for n, a in w.arrays.items()}
    for layer, m in w._moe.items():
        for k in ("router", "gate_up", "down", "shared_gate_up", "shared_down"):
            a = getattr(m, k)
            if a is not None:
                out[f"moe{layer}.{k}"] = dev.read(a.ptr, a.shape, a.dtype.name)
    return out


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", ["next_folded_int4_g128_sym_act_v1", "qwen35moe_int8_g32_sym_act_parts",
                                  "next_int4_g32_asym_act_v1"])
def test_load_writes_the_float_bundles_device_layout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str,
                                                     dtype: str) -> None:
    """``DeviceWeights.load`` of the GPTQ bundle (packed weights through the kernel's mapping) leaves device memory
    bit for bit as loading the float bundle of the dequantised weights does: every runtime array and every MoE
    layer's stacked router / experts / shared expert; ``keep_packed`` keeps the packed copies as stored."""
    ckpt, deq, _ = gc.checkpoints(tmp_path, name)
    bq, bf = gc.build(ckpt, tmp_path / "bq", dtype=dtype), gc.build(deq, tmp_path / "bf", dtype=dtype)
    dq, wq = _load_fake(bq, monkeypatch)
    df, wf = _load_fake(bf, monkeypatch)
    got, want = _device_state(dq, wq), _device_state(df, wf)
    assert set(got) == set(want) and not wq.packed
    for k in want:
        assert got[k].shape == want[k].shape and np.array_equal(_bits(got[k]), _bits(want[k])), k
    assert dq.freed > 0, "packed copies not freed"
    dk, wk = _load_fake(bq, monkeypatch, keep=True)
    assert wk.packed and dk.freed == 0
    f = SafetensorsFile(bq / "weights.safetensors")
    for key, p in wk.packed.items():
        assert np.array_equal(dk.read(p.B.ptr, p.B.shape, "uint8"), f.raw(key + ".nbits_B")), key
        assert p.perm is None or np.array_equal(dk.read(p.perm.ptr, p.perm.shape, "int32"), f.raw(key + ".nbits_perm"))
    assert wk.nbytes == wq.nbytes + sum(p.nbytes for p in wk.packed.values())


@pytest.mark.parametrize("name", ["next_int4_g32_asym_act_v1", "qwen35moe_int8_g32_sym_act_parts"])
def test_packed_linears_keep_the_dense_linears_only_packed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          name: str) -> None:
    """``packed_linears``: every runtime weight stored packed whole that is not a MoE weight stays on the device only
    in its packed form (the stored bytes; no float copy: fewer bytes), the backend's linear lookup gives it;
    everything else (per-part weights, the MoE layers, float weights) is laid out bit for bit as without the option."""
    from hybrid_runtime.cuda.backend import _linear_weight
    from hybrid_runtime.cuda.nbits_decode import NBitsOperand
    from hybrid_runtime.cuda.quant import PackedLinear, plan_weights

    ckpt, _, _ = gc.checkpoints(tmp_path, name)
    bq = gc.build(ckpt, tmp_path / "bq", dtype="bfloat16")
    m = Manifest.load(bq)
    f = SafetensorsFile(bq / "weights.safetensors")
    stored = plan_weights(f, m)
    specs = {s.name: s for s in stored_specs(m)}
    whole = {n for n, w in stored.items() if w.kind == "packed" and len(specs[n].shape) == 2
             and not (".mlp." in n and m.model.ffn_types[specs[n].layer] == "moe")}
    assert whole, "the case stores no dense linear packed whole"
    d0, w0 = _load_fake(bq, monkeypatch)
    d1, w1 = _load_fake(bq, monkeypatch, linears=True)
    assert set(w1.packed_only) == whole and not (whole & set(w1.arrays))
    for n in whole:
        p = _linear_weight(w1, n)
        assert isinstance(p, PackedLinear) and (p.N, p.k_in) == w0[n].shape
        assert np.array_equal(d1.read(p.B.ptr, p.B.shape, "uint8"), f.raw(n + ".nbits_B")), n
    s0, s1 = _device_state(d0, w0), _device_state(d1, w1)
    assert set(s0) - set(s1) == whole
    for k in s1:
        assert np.array_equal(_bits(s0[k]), _bits(s1[k])), k
    assert w1.nbytes < w0.nbytes
    # dual_linears: the same weights in both forms - every array as the plain load writes it (the dequantised
    # projections included), the packed copies as stored, counted on top; the backend's lookup gives the array
    d2, w2 = _load_fake(bq, monkeypatch, dual=True)
    assert set(w2.packed_decode) == whole and not w2.packed_only and whole <= set(w2.arrays)
    s2 = _device_state(d2, w2)
    assert set(s2) == set(s0)
    for k in s0:
        assert np.array_equal(_bits(s0[k]), _bits(s2[k])), k
    for n in whole:
        p = w2.packed_decode[n]
        op = NBitsOperand.from_packed(p)  # the backend's lookup checks the twin's (N, k_in) against the array
        assert (p.N, p.k_in) == (op.N, op.k_in) == w0[n].shape == w2[n].shape and _linear_weight(w2, n) is w2[n]
        assert np.array_equal(d2.read(p.B.ptr, p.B.shape, "uint8"), f.raw(n + ".nbits_B")), n
    assert w2.nbytes == w0.nbytes + sum(p.nbytes for p in w2.packed_decode.values())
    with pytest.raises(ValueError, match="not both"):
        _load_fake(bq, monkeypatch, linears=True, dual=True)


def stored_specs(m: Manifest):
    from hybrid_runtime.program import stored_weight_specs

    return stored_weight_specs(m.model, m.limits.max_seq_len)


def test_cuda_refuses_a_quantized_embedding_table(tmp_path: Path) -> None:
    from builder.gptq import GPTQError
    from hybrid_runtime.weights_io import save_safetensors

    ckpt, _, _ = gc.checkpoints(tmp_path, "qwen35_dense_int4_g64_sym_v2")
    f = SafetensorsFile(ckpt / "model.safetensors")
    t = {k: f.raw(k).copy() for k in f.keys()}  # noqa: SIM118
    emb = next(k for k in t if k.endswith("embed_tokens.weight"))
    t[emb.replace(".weight", ".qweight")] = np.zeros((8, 256), np.int32)
    save_safetensors(ckpt / "model.safetensors", t)
    with pytest.raises(GPTQError, match=r"quantized embedding table .* not supported: embeddings stay float"):
        build_bundle(ckpt, tmp_path / "b", BuildOptions(backend="cuda", **gc.limits()), progress=lambda _m: None)


def test_the_runner_takes_a_gptq_cuda_bundle_and_refuses_other_gpu_backends(tmp_path: Path) -> None:
    """``ModelRunner`` hands a GPTQ ``cuda`` bundle to its backend (it refused every GPU backend before stage 1);
    a manifest that claims another GPU backend with a quantization record is refused with what runs it."""
    import dataclasses
    from types import SimpleNamespace

    from hybrid_runtime.config import BundleError
    from hybrid_runtime.runner import ModelRunner

    ckpt, _, _ = gc.checkpoints(tmp_path, "qwen35_dense_int4_g64_sym_v2")
    bq = gc.build(ckpt, tmp_path / "bq", dtype="bfloat16")
    m = Manifest.load(bq)
    assert m.quantization is not None and m.backend == "cuda"
    be = SimpleNamespace(ops=SimpleNamespace(), device="cuda:0")
    assert ModelRunner(bq, m, device="cuda", backend=be).backend is be  # type: ignore[arg-type]
    with pytest.raises(BundleError, match="onnxruntime \\(CPU\\) and cuda backends only"):
        ModelRunner(bq, dataclasses.replace(m, backend="tensorrt"), device="cpu", backend=be)  # type: ignore[arg-type]


def test_packed_experts_keep_the_moe_layers_only_packed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``packed_experts``: every MoE layer whose experts stack as one packed operand keeps them only packed (the
    stored bytes: routed experts' gate | up rows, then the folded shared expert as expert E); its MoEWeights stacks
    are the one scratch pair, which ``dequantise_experts(layer)`` fills with exactly the plain load's stacks; the
    folded shared expert's own copy is the plain stack's expert E; the operands flagged short (float16 scales:
    the int4 FFMA dequantisation); router and every other array as without the option; fewer bytes. A layer that
    cannot stack (act order: another case) is loaded as before."""
    from hybrid_runtime.cuda.moe_nbits_decode import as_host_experts, fuse_rows, short_scales, stack_experts
    from hybrid_runtime.program import moe_layers

    bq = gc.packed_experts_bundle(tmp_path)
    cfg = Manifest.load(bq).model
    d0, w0 = _load_fake(bq, monkeypatch)
    d1, w1 = _load_fake(bq, monkeypatch, experts=True)
    layers = moe_layers(cfg)
    E = cfg.num_experts
    assert layers and set(w1.packed_moe) == set(layers) and w1.moe_scratch is not None
    stored = plan_weights(SafetensorsFile(bq / "weights.safetensors"), Manifest.load(bq))

    def host(name: str):
        w = stored[name]
        return as_host_experts(w.packed) if w.kind == "packed" else fuse_rows([as_host_experts(hp) for _, _, hp, _
                                                                               in w.parts])

    for layer in layers:
        m0, m1, pk = w0.moe(layer), w1.moe(layer), w1.packed_moe[layer]
        assert m0.fold and m1.fold and (m1.gate_up.ptr, m1.down.ptr) == tuple(a.ptr for a in w1.moe_scratch)
        rd = lambda d, a: _bits(d.read(a.ptr, a.shape, a.dtype.name))  # noqa: E731
        assert np.array_equal(rd(d1, m1.router), rd(d0, m0.router)), layer
        assert np.array_equal(rd(d1, m1.shared_gate_up), rd(d0, m0.gate_up)[E]), layer
        assert np.array_equal(rd(d1, m1.shared_down), rd(d0, m0.down)[E]), layer
        p = f"layers.{layer}.mlp."
        for src, op, (routed, shared) in zip(pk.sources, (pk.gate_up, pk.down),
                                             (("experts.gate_up", "shared.gate_up"), ("experts.down", "shared.down")),
                                             strict=True):
            want = stack_experts([host(p + routed), host(p + shared)])
            assert src.B.ptr == op.B and op.e_all == E + 1 and (op.rows, op.K) == (want.rows, want.K)
            assert np.array_equal(d1.read(src.B.ptr, src.B.shape, "uint8").reshape(want.B.shape), want.B), layer
            assert np.array_equal(d1.read(src.scales.ptr, src.scales.shape, "float32").reshape(want.scales.shape),
                                  want.scales)
            assert (src.zp is None) == (want.zp is None)
            assert op.short and short_scales(want.scales)  # GPTQ's float16 scales: the int4 FFMA dequantisation
        w1.dequantise_experts(layer)
        assert np.array_equal(rd(d1, m1.gate_up), rd(d0, m0.gate_up)), layer
        assert np.array_equal(rd(d1, m1.down), rd(d0, m0.down)), layer
    for name, a in w0.arrays.items():
        assert np.array_equal(_bits(d1.read(w1[name].ptr, a.shape, a.dtype.name)),
                              _bits(d0.read(a.ptr, a.shape, a.dtype.name))), name
    assert w1.nbytes < w0.nbytes
    # act order (and float parts): the layers stay dequantised, as without the option
    ckpt, _, _ = gc.checkpoints(tmp_path / "act", "next_folded_int4_g128_sym_act_v1")
    ba = gc.build(ckpt, tmp_path / "act" / "bq", dtype="bfloat16")
    _, wa = _load_fake(ba, monkeypatch, experts=True)
    assert not wa.packed_moe and wa.moe_scratch is None


def test_release_moe_scratch_frees_the_stack_and_any_later_dequantisation_is_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``DeviceWeights.release_moe_scratch`` (CudaBackend calls it at load when every step reads the experts packed):
    both stack arrays are freed through their owners, the packed layers' MoEWeights lose ``gate_up`` / ``down``
    (router and shared-expert copies kept), the weight bytes fall by exactly the stack's, and
    ``dequantise_experts`` then raises a RuntimeError naming the layer instead of launching into freed memory; a
    second release frees nothing."""
    bq = gc.packed_experts_bundle(tmp_path)
    dev, w = _load_fake(bq, monkeypatch, experts=True)
    assert w.packed_moe and w.moe_scratch is not None
    stack = sum(a.nbytes for a in w.moe_scratch)
    before, freed0 = w.nbytes, dev.freed
    kept = {layer: (w.moe(layer).router.ptr, w.moe(layer).shared_gate_up) for layer in w.packed_moe}
    assert w.release_moe_scratch() == stack
    assert w.moe_scratch is None and dev.freed == freed0 + 2
    assert w.nbytes == before - stack
    layer = next(iter(w.packed_moe))
    for lay, (router, sgu) in kept.items():
        m = w.moe(lay)
        assert m.gate_up is None and m.down is None and m.router.ptr == router and m.shared_gate_up is sgu
    with pytest.raises(RuntimeError, match=f"layer {layer}: .*scratch stack was released"):
        w.dequantise_experts(layer)
    assert w.release_moe_scratch() == 0


def test_moe_scratch_reasons_name_every_step_that_would_dequantise_packed_experts() -> None:
    """``moe_scratch_reasons`` (whether CudaBackend keeps the dequantised scratch stack of packed experts): none on
    Hopper with the default modes (decode on the packed decode MoE, prefill on the packed grouped GEMMs; int4 has no
    row cap); a reason for int8 steps past ``PACKED_MAX_TOKENS``, ``packed_moe_prefill`` off, the CUDA-core decode
    MoE, no tensor-core MoE at all, and a layer whose stacks the packed GEMMs refuse (asked only for the folds a
    step can take: prefill never folds; the ``tensor_cores`` decode mode folds the layers that have a shared
    expert)."""
    from hybrid_runtime.cuda.backend import moe_scratch_reasons
    from hybrid_runtime.cuda.moe_prefill import PACKED_MAX_TOKENS

    asked: list[tuple[int, bool]] = []

    def ok(layer: int, fold: bool) -> bool:
        asked.append((layer, fold))
        return True

    bits4, folds = {3: 4, 7: 4}, {3: True, 7: False}
    assert moe_scratch_reasons(bits4, folds, 8192, True, "auto", True, ok) == []
    assert sorted(asked) == [(3, False), (7, False)]  # prefill never folds; decode is mma_decode
    asked.clear()
    assert moe_scratch_reasons(bits4, folds, 8192, True, "tensor_cores", True, ok) == []
    assert sorted(asked) == [(3, False), (3, True), (7, False)]
    cap8 = PACKED_MAX_TOKENS[8]
    assert moe_scratch_reasons({3: 8}, folds, cap8, True, "auto", True, ok) == []
    why = moe_scratch_reasons({3: 8}, folds, cap8 + 1, True, "auto", True, ok)
    assert len(why) == 1 and f"steps of {cap8 + 1}..{cap8 + 1} rows (8-bit)" in why[0]
    assert "packed_moe_prefill is off" in moe_scratch_reasons(bits4, folds, 64, True, "auto", False, ok)[0]
    assert "CUDA-core MoE" in moe_scratch_reasons(bits4, folds, 64, True, "cuda_cores", True, ok)[0]
    no_tc = moe_scratch_reasons(bits4, folds, 64, False, "auto", True, ok)
    assert len(no_tc) == 1 and "no tensor-core MoE" in no_tc[0]
    why = moe_scratch_reasons(bits4, folds, 64, True, "auto", True, lambda layer, fold: layer != 7)
    assert why == ["layer 7: the packed grouped GEMMs refuse its stacks (see the load log)"]
    # a refusal only of the folded stacks matters only where decode steps take the tensor cores
    assert moe_scratch_reasons(bits4, folds, 64, True, "auto", True, lambda layer, fold: not fold) == []
    assert len(moe_scratch_reasons(bits4, folds, 64, True, "tensor_cores", True, lambda layer, fold: not fold)) == 1


def test_random_packed_weights_take_the_layout_a_gptq_bundle_loads_into(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """``DeviceWeights.random_packed`` (the quantized-step benchmark's model: no checkpoint) builds what
    ``load(packed_linears=True, packed_experts=True)`` of a GPTQ bundle of the same config builds: the same float
    arrays (names, shapes, dtypes), the same projections kept only packed (N, K, bits, block size; the codes' and
    scales' shapes), the same MoE layers kept only packed (operand shapes, the folded shared expert, the router and
    shared-expert copies, one scratch stack), short float16-valued scales, no zero-points (symmetric); refuses
    float32 and a block size that does not divide K."""
    from hybrid_runtime.cuda import weights as cw

    bq = gc.packed_experts_bundle(tmp_path, bits=4, group_size=32, sym=True)
    m = Manifest.load(bq)
    _, loaded = _load_fake(bq, monkeypatch, linears=True, experts=True)
    dev = FakeDevice(256 << 20)
    rng = np.random.default_rng(0)

    def fill(a, seed: int, scale: float, offset: float = 0.0) -> None:  # random bytes into the fake memory
        dev.mem[a.ptr:a.ptr + a.nbytes] = rng.integers(0, 256, a.nbytes, dtype=np.uint8)

    filled: list[tuple[int, int]] = []

    def codes(a, seed: int, bits: int) -> None:  # (the backend's fill_random_codes; modelled in the GPU test)
        assert a.dtype.name == "uint8" and bits == 4
        filled.append((a.nbytes, seed))
        dev.mem[a.ptr:a.ptr + a.nbytes] = rng.integers(1, 16, a.nbytes, dtype=np.uint8) * 17

    rnd = cw.DeviceWeights.random_packed(dev, m.model, "bfloat16", m.limits.max_seq_len, fill,  # type: ignore[arg-type]
                                         bits=4, block_size=32, fill_codes=codes)
    # every packed weight's codes came from fill_codes, each with a seed of its own
    srcs = [*rnd.packed_only.values(), *(s for pk in rnd.packed_moe.values() for s in pk.sources)]
    assert sorted(nb for nb, _ in filled) == sorted(p.B.nbytes for p in srcs)
    assert len({seed for _, seed in filled}) == len(filled)
    shape = lambda a: (a.shape, a.dtype.name)  # noqa: E731
    assert {k: shape(a) for k, a in rnd.arrays.items()} == {k: shape(a) for k, a in loaded.arrays.items()}
    assert loaded.packed_only and set(rnd.packed_only) == set(loaded.packed_only)
    for name, p in loaded.packed_only.items():
        q = rnd.packed_only[name]
        # (the bundle may store a block larger than K: one block a row; the random model keeps the nominal one)
        assert (q.N, q.K, q.k_in, q.bits, q.experts) == (p.N, p.K, p.k_in, p.bits, p.experts), name
        assert (q.block_size, q.B.shape, q.scales.shape) == (32, (q.N, q.K // 32, 16), (q.N * q.K // 32,)), name
        assert q.zp is None and q.perm is None
        assert cw_short(dev, q), name
    assert loaded.packed_moe and set(rnd.packed_moe) == set(loaded.packed_moe)
    for layer, pk in loaded.packed_moe.items():
        rk = rnd.packed_moe[layer]
        for a, b in ((rk.gate_up, pk.gate_up), (rk.down, pk.down)):
            assert (a.e_all, a.rows, a.K, a.bits, a.block_size, a.short, a.zp) == \
                (b.e_all, b.rows, b.K, b.bits, 32, True, 0), layer
        for a, b in zip(rk.sources, pk.sources, strict=True):
            assert (a.N, a.K, a.experts) == (b.N, b.K, b.experts), layer
            assert (a.B.shape, a.scales.shape) == ((a.experts, a.N, a.K // 32, 16), (a.experts, a.N * a.K // 32))
            assert cw_short(dev, a), layer
        mr, ml = rnd.moe(layer), loaded.moe(layer)
        assert (mr.e_pad, mr.num_experts, mr.fold, mr.router.shape) == (ml.e_pad, ml.num_experts, ml.fold,
                                                                          ml.router.shape)
        assert (mr.gate_up.ptr, mr.down.ptr) == tuple(a.ptr for a in rnd.moe_scratch)  # type: ignore[union-attr]
        assert (mr.shared_gate_up is None) == (ml.shared_gate_up is None)
    assert rnd._deq is not None
    # dual: the projections in both forms, as load(dual_linears=True) lays them out; each array the dequantisation
    # of its own packed codes
    _, loaded2 = _load_fake(bq, monkeypatch, experts=True, dual=True)
    rnd2 = cw.DeviceWeights.random_packed(dev, m.model, "bfloat16", m.limits.max_seq_len, fill,  # type: ignore[arg-type]
                                          bits=4, block_size=32, dual=True, fill_codes=codes)
    assert not rnd2.packed_only and set(rnd2.packed_decode) == set(loaded2.packed_decode) == set(loaded.packed_only)
    assert {k: shape(a) for k, a in rnd2.arrays.items()} == {k: shape(a) for k, a in loaded2.arrays.items()}
    for name, q in rnd2.packed_decode.items():
        a = rnd2[name]
        assert a.shape == (q.N, q.K) and a.dtype.name == "bfloat16", name
        want = dev.empty(a.shape, "bfloat16")
        FakeDequant(dev, "bfloat16").launch(q, want.ptr, q.K, 0)
        assert np.array_equal(dev.read(a.ptr, a.shape, "uint16"), dev.read(want.ptr, a.shape, "uint16")), name
    # linears=False (packed_weights=experts): the same projections, dequantised only (the same model as the others)
    rnd3 = cw.DeviceWeights.random_packed(dev, m.model, "bfloat16", m.limits.max_seq_len, fill,  # type: ignore[arg-type]
                                          bits=4, block_size=32, linears=False, fill_codes=codes)
    assert not rnd3.packed_only and not rnd3.packed_decode and rnd3.packed_moe
    assert {k: shape(a) for k, a in rnd3.arrays.items()} == {k: shape(a) for k, a in rnd2.arrays.items()}
    with pytest.raises(ValueError, match="needs linears"):
        cw.DeviceWeights.random_packed(dev, m.model, "bfloat16", 64, fill, linears=False,  # type: ignore[arg-type]
                                       dual=True, fill_codes=codes)
    with pytest.raises(ValueError, match="bfloat16 / float16"):
        cw.DeviceWeights.random_packed(dev, m.model, "float32", 64, fill, fill_codes=codes)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="not a multiple of the block size"):
        cw.DeviceWeights.random_packed(dev, m.model, "bfloat16", 64, fill, block_size=48,  # type: ignore[arg-type]
                                       fill_codes=codes)


def cw_short(dev: FakeDevice, p) -> bool:
    """Whether a fake-device PackedLinear's scales are short (moe_nbits_decode.short_scales)."""
    from hybrid_runtime.cuda.moe_nbits_decode import short_scales

    return short_scales(dev.read(p.scales.ptr, p.scales.shape, "float32"))


def test_packed_weights_option_reaches_the_cuda_backend(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    """``ModelRunner(packed_weights=...)`` (the ``packed_weights`` deployment parameter) turns into CudaBackend's
    ``packed_linears`` / ``packed_experts`` / ``dual_linears`` for a GPTQ cuda bundle (the backend a recording
    stand-in: no GPU here), ``auto`` (the default) as ``dual``; a bad value is refused before any backend is built
    (RuntimeOptions too); on a bundle it does not apply to, ``auto`` is silently ``off`` and another mode says so
    in the log, the backend built without it."""
    import dataclasses
    import logging
    from types import SimpleNamespace

    from hybrid_runtime.cuda import backend as cb
    from hybrid_runtime.runner import PACKED_WEIGHTS, ModelRunner
    from hybrid_runtime.serving import RuntimeOptions

    seen: list[dict] = []

    class Recorder:
        def __init__(self, bundle_dir, manifest, **kw) -> None:
            seen.append(kw)
            self.ops = SimpleNamespace()

    monkeypatch.setattr(cb, "CudaBackend", Recorder)
    bq = gc.packed_experts_bundle(tmp_path)
    m = Manifest.load(bq)
    want = {"auto": (False, True, True), "off": (False, False, False), "linears": (True, False, False),
            "experts": (False, True, False), "all": (True, True, False), "dual": (False, True, True)}
    assert set(want) == set(PACKED_WEIGHTS)
    flags = lambda kw: (kw["packed_linears"], kw["packed_experts"], kw["dual_linears"])  # noqa: E731
    for mode, f in want.items():
        ModelRunner(bq, m, device="cuda", cuda_graphs=False, packed_weights=mode)
        assert flags(seen[-1]) == f, mode
    ModelRunner(bq, m, device="cuda", cuda_graphs=False)  # the default: auto
    assert flags(seen[-1]) == want["auto"]
    assert RuntimeOptions().packed_weights == "auto"
    n = len(seen)
    with pytest.raises(ConfigError, match=r"packed_weights='some'.*auto, off, linears, experts, all, dual"):
        ModelRunner(bq, m, device="cuda", cuda_graphs=False, packed_weights="some")
    with pytest.raises(ConfigError, match="packed_weights"):
        RuntimeOptions(packed_weights="some")
    assert len(seen) == n
    plain = dataclasses.replace(m, quantization=None)  # a float cuda bundle: nothing to keep packed
    with caplog.at_level(logging.INFO, logger="hybrid_runtime.runner"):
        ModelRunner(bq, plain, device="cuda", cuda_graphs=False, packed_weights="auto")
        assert "has no effect" not in caplog.text  # auto says nothing where it does not apply
        assert flags(seen[-1]) == want["off"]
        ModelRunner(bq, plain, device="cuda", cuda_graphs=False, packed_weights="all")
    assert "packed_weights=all has no effect" in caplog.text and "not quantized" in caplog.text
    assert flags(seen[-1]) == want["off"]
