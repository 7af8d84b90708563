"""GPTQ checkpoints on the ``cuda`` backend, on the GPU (stage 1: packed weights dequantised on the device at load):

(a) ``nbits_dequant`` (``ops/cuda/nbits.cu``) == the host's ``nbits_dequantize`` rounded to the bundle dtype, bit for
    bit, for bfloat16 / float16 / float32, int4 and int8, act order (padded irregular groups), with and without
    zero-points, single weights and stacked experts, written into rows of a larger weight (a part) without touching
    the rows around them; plus the shapes of the 35B-A3B layers;
(b) every GPTQ case of ``tests/gptq_cases.py``: its ``cuda`` bundle at float32 == the onnxruntime CPU bundle (fp32
    activations) of the same checkpoint (of its dequantised weights where onnxruntime's MoE refuses the case),
    logits within 1e-4 at every prefill and decode step, greedy tokens equal;
    ``keep_packed`` keeps the packed copies on the device (the stored bytes, counted in ``nbytes``) and changes
    no logit;
(c) the bfloat16 ``cuda`` bundle's greedy tokens vs the float32 CPU bundle's (teacher-forced), agreement reported.

Results go to ``$GPU_REPORT_DIR/gptq_cuda_report.json`` (default /tmp).
"""

from __future__ import annotations

import json
import os
import zlib
from pathlib import Path

import numpy as np
import pytest
from runner_cases import Driver, scattered_tables

from hybrid_runtime.config import Manifest
from hybrid_runtime.quant import QuantLinear, nbits_dequantize, nbits_tensors, to_nbits
from hybrid_runtime.runner import ModelRunner
from hybrid_runtime.weights_io import SafetensorsFile, bf16_to_f32, f32_to_bf16_bits, save_safetensors
from tests import gptq_cases as gc

pytestmark = pytest.mark.gpu

REPORT = Path(os.environ.get("GPU_REPORT_DIR", "/tmp")) / "gptq_cuda_report.json"
_report: dict[str, object] = {}


def _record(key: str, value: object) -> None:
    _report[key] = value
    REPORT.write_text(json.dumps(_report, indent=1, default=str))
    print(f"[gptq-cuda] {key}: {value}")


# ---------------------------------------------------------------------------------------- (a) the kernel


def _rand_ql(rng: np.random.Generator, N: int, K: int, bits: int, gs: int, act: bool, sym: bool) -> QuantLinear:
    G = -(-K // gs)
    g = np.arange(K) // gs
    if act:  # act order, and irregular groups: sorted group sizes that do not fill whole blocks
        g = rng.permutation(np.sort(rng.integers(0, G, K)))
    zeros = (np.full((N, G), 1 << (bits - 1), np.uint8) if sym
             else rng.integers(0, 1 << bits, (N, G)).astype(np.uint8))
    scales = (rng.random((N, G)) * 0.05 + 1e-3).astype(np.float16).astype(np.float32)
    return QuantLinear(rng.integers(0, 1 << bits, (N, K)).astype(np.uint8), scales, zeros, g.astype(np.int32), bits)


def _as_bits(a: np.ndarray, dtype: str) -> np.ndarray:
    """Device download -> comparable bits (bfloat16 downloads come back widened to float32)."""
    return np.ascontiguousarray(a).view(np.uint16 if dtype == "float16" else np.uint32)


def _host_rounded(w: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "bfloat16":
        return bf16_to_f32(f32_to_bf16_bits(w))
    return w.astype(np.float16 if dtype == "float16" else np.float32)


SHAPES = [(24, 200, 32), (96, 256, 128), (40, 96, 64)]  # (N, K, group size)
A_CASES = [(dt, bits, act, sym, experts) for dt in ("bfloat16", "float16", "float32") for bits in (4, 8)
           for act in (False, True) for sym in (True, False) for experts in (0, 3)]


@pytest.mark.parametrize("dtype,bits,act,sym,experts", A_CASES)
def test_device_dequantiser_equals_the_host_bit_for_bit(dev, tmp_path: Path, dtype: str, bits: int, act: bool,
                                                        sym: bool, experts: int) -> None:
    from hybrid_runtime.cuda.quant import NBitsDequant, read_packed

    deq = NBitsDequant(dev, dtype)
    rng = np.random.default_rng(zlib.crc32(repr((dtype, bits, act, sym, experts)).encode()))
    for N, K, gs in SHAPES:
        ws = [_rand_ql(rng, N, K, bits, gs, act, sym) for _ in range(max(1, experts))]
        ws = [QuantLinear(w.q, w.scales, w.zeros, ws[0].g_idx, bits) for w in ws]
        nbs = [to_nbits(w) for w in ws]
        assert (nbs[0].zero_points is None) == sym and (nbs[0].perm is not None) == act
        path = tmp_path / f"w_{N}_{K}.safetensors"
        save_safetensors(path, nbits_tensors("w", nbs, 0, stacked=bool(experts)))
        hp = read_packed(SafetensorsFile(path), "w", experts, N, K)
        want = np.stack([nbits_dequantize(nb.B, nb.scales, nb.zero_points, nb.perm, nb.meta(0)) for nb in nbs])
        assert np.array_equal(want, np.stack([w.dequantize() for w in ws]))
        # rows [3, 3 + N) of a [E, N + 5, K] weight whose other rows hold a sentinel
        E, rows, r0 = max(1, experts), N + 5, 3
        out = dev.empty((E, rows, K), dtype)
        dev.memset_d8(out.ptr, 0x7F, out.nbytes)
        sentinel = dev.download(out).copy()
        p = deq.upload(hp, r0)
        es = out.dtype.itemsize
        # no act order and K % 8 == 0: the eight-codes-a-thread kernel (K 200 and act order: the per-code one)
        assert deq.vectorized(p, out.ptr + r0 * K * es, K, rows * K) == (not act and K % 8 == 0), (N, K, act)
        deq.launch(p, out.ptr + r0 * K * es, K, rows * K)
        got = dev.download(out)
        if deq.vectorized(p, out.ptr + r0 * K * es, K, rows * K):  # the per-code kernel writes the same bytes
            per_code = dev.empty((E, rows, K), dtype)
            dev.memset_d8(per_code.ptr, 0x7F, per_code.nbytes)
            deq.launch(p, per_code.ptr + r0 * K * es, K, rows * K, vectorized=False)
            assert _as_bits(dev.download(per_code), dtype).tobytes() == _as_bits(got, dtype).tobytes(), (N, K)
        assert np.array_equal(_as_bits(got[:, r0:r0 + N], dtype), _as_bits(_host_rounded(want, dtype), dtype)), \
            (N, K, gs)
        assert np.array_equal(_as_bits(got[:, :r0], dtype), _as_bits(sentinel[:, :r0], dtype))
        assert np.array_equal(_as_bits(got[:, r0 + N:], dtype), _as_bits(sentinel[:, r0 + N:], dtype))


@pytest.mark.parametrize("name,E,N,K,bits,act", [
    ("experts.gate_up", 16, 1024, 2048, 4, True), ("experts.down", 16, 2048, 512, 4, True),
    ("in_proj", 0, 12352, 2048, 4, True), ("lm_head", 0, 8192, 2048, 8, True),
    ("experts.gate_up", 16, 1024, 2048, 4, False), ("experts.down", 16, 2048, 512, 4, False)])
def test_device_dequantiser_on_35b_a3b_shapes(dev, tmp_path: Path, name: str, E: int, N: int, K: int,
                                              bits: int, act: bool) -> None:
    """The 35B-A3B layers' shapes (16 of its 256 experts; a slice of its lm_head), groups of 128, act order (the
    per-code kernel) or not (the experts as packed_experts' prefill steps dequantise them: the eight-codes-a-thread
    kernel); the write rate of each recorded."""
    from hybrid_runtime.cuda.quant import NBitsDequant, read_packed

    rng = np.random.default_rng(N + K)
    ws = [_rand_ql(rng, N, K, bits, 128, act, False) for _ in range(max(1, E))]
    ws = [QuantLinear(w.q, w.scales, w.zeros, ws[0].g_idx, bits) for w in ws]
    nbs = [to_nbits(w) for w in ws]
    path = tmp_path / "w.safetensors"
    save_safetensors(path, nbits_tensors("w", nbs, 0, stacked=bool(E)))
    hp = read_packed(SafetensorsFile(path), "w", E, N, K)
    deq = NBitsDequant(dev, "bfloat16")
    out = dev.empty((max(1, E), N, K), "bfloat16")
    p = deq.upload(hp)
    deq.launch(p, out.ptr, K, N * K)
    e0, e1 = dev.event(), dev.event()
    dev.record(e0)
    for _ in range(3):
        deq.launch(p, out.ptr, K, N * K)
    dev.record(e1)
    ms = dev.elapsed_ms(e0, e1) / 3
    assert deq.vectorized(p, out.ptr, K, N * K) == (not act)
    _record(f"dequant_time/{name}{'' if act else '/no_act_order'}", {
        "experts": E, "N": N, "K": K, "bits": bits, "ms": ms, "GB_per_s_written": out.nbytes / ms / 1e6})
    print(f"\n[nbits] dequantise {name} ({'act order' if act else 'no act order'}): {ms * 1e3:.0f} us, "
          f"{out.nbytes / ms / 1e6:.0f} GB/s written")
    got = dev.download(out)
    for e in (0, max(1, E) - 1):
        nb = nbs[e]
        want = nbits_dequantize(nb.B, nb.scales, nb.zero_points, nb.perm, nb.meta(0))
        assert np.array_equal(_as_bits(got[e], "bfloat16"), _as_bits(_host_rounded(want, "bfloat16"), "bfloat16"))


# ---------------------------------------------------------------------------------------- (b), (c) models


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("gptq_cuda_gpu")


def _case_bundles(root: Path, case: str, dtype: str = "float32") -> tuple[Path, Path]:
    """(onnxruntime CPU bundle, cuda bundle in ``dtype``) of ``case``'s GPTQ checkpoint. The CPU bundle is built
    from the GPTQ checkpoint itself where onnxruntime's MoE operator takes it; a case it refuses (per-part or
    partly float experts: ``qwen35moe_int8_g32_sym_act_parts``) gets the CPU bundle of the dequantised checkpoint,
    the same function (tests/unit/test_gptq.py shows the two CPU bundles equal within 1e-4)."""
    from hybrid_runtime.config import ConfigError

    d = root / case
    if not (d / "gptq" / "config.json").exists():
        gc.checkpoints(d, case)
    try:
        cpu = gc.build(d / "gptq", d / "ort", backend="onnxruntime")
    except ConfigError as e:
        _record(f"cpu_reference/{case}", f"the dequantised checkpoint's CPU bundle ({e})")
        cpu = gc.build(d / "dequant", d / "ort_dequant", backend="onnxruntime")
    return cpu, gc.build(d / "gptq", d / f"cuda_{dtype}", dtype=dtype)


def _drive(runners: list[ModelRunner], m: Manifest, seed: int, chunk: int = 5, decode_steps: int = 12
           ) -> list[list[np.ndarray]]:
    """Three sequences (37, 20, 5 tokens) prefilled in chunks (15 tokens a step: max_num_tokens 16) then decode
    steps, in lockstep (greedy tokens from the first runner); every step's logits of every runner."""
    rng = np.random.default_rng(seed)
    lens, slots = [37, 20, 5], [3, 0, 2]
    prompts = [rng.integers(3, m.model.vocab_size, n).tolist() for n in lens]
    tables = scattered_tables(m, [n + decode_steps for n in lens], seed=seed)
    drv = Driver(runners, slots, tables, prompts)
    steps = [list(r) for r in drv.prefill(chunk=chunk)]
    steps += [list(drv.decode()) for _ in range(decode_steps)]
    return steps


@pytest.mark.parametrize("case", sorted(gc.CASES))
def test_float32_gptq_cuda_bundle_matches_the_cpu_bundle(root: Path, case: str) -> None:
    from hybrid_runtime.cuda.backend import CudaBackend

    cpu_b, gpu_b = _case_bundles(root, case)
    m, gm = Manifest.load(cpu_b), Manifest.load(gpu_b)
    assert gm.quantization is not None and gm.quantization.activations == "float32"
    cpu = ModelRunner(cpu_b, m)
    gpu = ModelRunner(gpu_b, gm)
    assert gpu.device == "cuda:0"
    steps = _drive([cpu, gpu], m, seed=len(case))
    worst = max(float(np.abs(a - b).max()) for a, b in steps)
    tokens_equal = all(np.array_equal(a.argmax(1), b.argmax(1)) for a, b in steps)
    _record(f"fp32_max_logit_err/{case}", {"max_abs": worst, "greedy_equal": tokens_equal, "steps": len(steps),
                                           "max_logit": float(max(np.abs(a).max() for a, _ in steps))})
    assert worst < 1e-4, f"{case}: max |cpu - cuda| logit difference {worst:.2e}"
    assert tokens_equal
    # keep_packed: the packed copies stay on the device as stored, counted; the logits do not change
    be = CudaBackend(gpu_b, gm, device="cuda", keep_packed=True)
    plain = CudaBackend(gpu_b, gm, device="cuda")
    assert be.w.packed and not plain.w.packed
    assert be.w.nbytes == plain.w.nbytes + sum(p.nbytes for p in be.w.packed.values())
    f = SafetensorsFile(gpu_b / gm.state_weights)
    for key, p in be.w.packed.items():
        assert p.B.dtype.name == "uint8" and p.scales.dtype.name == "float32"
        assert p.perm is None or p.perm.dtype.name == "int32"
        assert np.array_equal(be.dev.download(p.B), f.raw(key + ".nbits_B")), key
        assert p.experts == (f.raw(key + ".nbits_B").shape[0] if f.raw(key + ".nbits_B").ndim == 4 else 0)
    again = _drive([cpu, ModelRunner(gpu_b, gm, backend=be)], m, seed=len(case))
    moved = max(float(np.abs(b - b2).max()) for (_, b), (_, b2) in zip(steps, again))
    _record(f"keep_packed_logit_change/{case}", moved)
    assert moved < 1e-6


def test_bfloat16_gptq_cuda_greedy_agreement_with_float32_cpu(root: Path) -> None:
    """Teacher-forced: both see the CPU's tokens; a step agrees when both pick the same next token."""
    shares = {}
    for case in sorted(gc.CASES):
        cpu_b, gpu_b = _case_bundles(root, case, "bfloat16")
        m = Manifest.load(cpu_b)
        cpu, gpu = ModelRunner(cpu_b, m), ModelRunner(gpu_b, Manifest.load(gpu_b))
        agree = total = 0
        worst = 0.0
        for seed in range(3):
            for a, b in _drive([cpu, gpu], m, seed=seed):
                agree += int((a.argmax(1) == b.argmax(1)).sum())
                total += a.shape[0]
                worst = max(worst, float(np.abs(a - b).max()))
        shares[case] = agree / total
        _record(f"bf16_greedy_agreement/{case}", {"agree": agree, "steps": total, "share": agree / total,
                                                  "max_logit_err": worst})
    # tiny random models have small logit margins (bf16 activations flip near-ties); a sane floor, the shares reported
    assert min(shares.values()) >= 0.6 and np.mean(list(shares.values())) >= 0.75, shares


# ---------------------------------------------------------------------------------------- (d) packed linears


@pytest.mark.parametrize("case", sorted(gc.CASES))
def test_packed_linears_match_the_dequantised_bundle(root: Path, case: str) -> None:
    """A bf16 GPTQ bundle with its dense linears kept only packed (``packed_linears=True``) against the same bundle
    fully dequantised at load (the default): fewer weight bytes on the device; prefill steps (the packed weights
    dequantised into the scratch, then the same cuBLASLt plans) give the same bits; decode steps (the int4 / int8
    decode GEMM instead of dense_decode over the dequantised weights: nbits_decode.BACKEND_KNOBS, which for 4-bit
    blocks of 128 puts the float32 scale on the accumulator and for others multiplies by the scale rounded to bf16,
    and sums in another order) stay within 2% of the logits' scale, teacher-forced, with the same
    greedy token on at least 90% of rows. In a MoE model a near-tie of the router can pick another expert under
    either rounding (a routing flip: tests/gpu/test_moe_decode_gpu.py), which moves that row's logits by O(1): there
    the bound holds for 90% of rows and the worst row is reported. The tiny test models' weights whose K is below
    their block (K 64 in blocks of 128) are refused by the kernel's rules and take the scratch path: the kernel must
    run wherever a weight fits its rules."""
    from hybrid_runtime.cuda.backend import CudaBackend
    from hybrid_runtime.cuda.nbits_decode import NBitsOperand, problems

    _, gpu_b = _case_bundles(root, case, "bfloat16")
    gm = Manifest.load(gpu_b)
    packed = CudaBackend(gpu_b, gm, device="cuda", packed_linears=True)
    plain = CudaBackend(gpu_b, gm, device="cuda")
    assert packed.w.packed_only and not plain.w.packed_only
    assert packed.w.nbytes < plain.w.nbytes

    def kernel_rules(p) -> list[str]:  # the kernel's rules on the weight alone (not on x's alignment)
        rules = problems("bfloat16", 1, 8 * p.k_in, 0, NBitsOperand.from_packed(p))
        return [r for r in rules if not r.startswith(("without a perm", "ldx"))]

    fits = [n for n, p in packed.w.packed_only.items() if not kernel_rules(p)]
    # the load's timing of the kernel's builds (capture_graphs does it; the runners here run eagerly): one build
    # kept per packed shape that fits, each with the default's bits, so every bound below holds whichever won
    packed.tune_nbits_decode()
    tuned = {(p.N, p.K, p.bits) for n, p in packed.w.packed_only.items() if n in fits}
    assert set(packed.nbits.choice) == tuned and set(packed.nbits.choice.values()) <= set(packed.nbits.builds)
    runners = [ModelRunner(gpu_b, gm, backend=plain), ModelRunner(gpu_b, gm, backend=packed)]
    prefill_steps = -(-37 // 5)
    steps = _drive(runners, gm, seed=len(case))
    assert (packed.nbits_calls > 0) == bool(fits), (packed.nbits_calls, fits)
    pre = max(float(np.abs(a - b).max()) for a, b in steps[:prefill_steps])
    dec = steps[prefill_steps:]
    rows = np.concatenate([np.abs(a - b).max(axis=1) for a, b in dec])
    scale = max(float(np.abs(a).max()) for a, _ in dec)
    agree = sum(int((a.argmax(1) == b.argmax(1)).sum()) for a, b in dec) / rows.size
    moe = "moe" in gm.model.ffn_types
    bound = float(np.percentile(rows, 90)) if moe else float(rows.max())
    _record(f"packed_linears/{case}", {"weight_bytes": [packed.w.nbytes, plain.w.nbytes], "prefill_max_diff": pre,
                                       "decode_max_diff": float(rows.max()), "decode_p90_diff": float(
                                           np.percentile(rows, 90)), "decode_scale": scale, "greedy_agreement": agree,
                                       "nbits_calls": packed.nbits_calls, "nbits_fallbacks": packed.nbits_fallbacks,
                                       "kernel_weights": fits})
    assert pre == 0.0, f"{case}: prefill logits differ by {pre}"
    assert bound <= 2e-2 * scale, f"{case}: decode logits differ by {bound} (scale {scale}, moe {moe})"
    assert agree >= 0.9, f"{case}: greedy agreement {agree}"


@pytest.mark.parametrize("case", sorted(gc.CASES))
def test_dual_linears_match_the_dequantised_and_the_packed_bundles(root: Path, case: str) -> None:
    """``packed_weights=dual``'s projections (``CudaBackend(dual_linears=True)``) against the same bf16 GPTQ bundle
    fully dequantised at load and with ``packed_linears``: the dequantised arrays are the plain load's bit for bit,
    the packed copies come on top (counted); teacher-forced, prefill steps give the dequantised bundle's bits (the
    same cuBLASLt plans on the same arrays: no scratch, never a dequantise-first fallback) and decode steps the
    ``packed_linears`` backend's bits (the same decode GEMM builds on the same packed weights)."""
    from hybrid_runtime.cuda.backend import CudaBackend

    _, gpu_b = _case_bundles(root, case, "bfloat16")
    gm = Manifest.load(gpu_b)
    dual = CudaBackend(gpu_b, gm, device="cuda", dual_linears=True)
    packed = CudaBackend(gpu_b, gm, device="cuda", packed_linears=True)
    plain = CudaBackend(gpu_b, gm, device="cuda")
    assert dual.w.packed_decode and not dual.w.packed_only and not plain.w.packed_decode
    assert set(dual.w.packed_decode) == set(packed.w.packed_only) and dual.nbits_scratch is None
    assert dual.w.nbytes == plain.w.nbytes + sum(p.nbytes for p in dual.w.packed_decode.values())
    for n in dual.w.packed_decode:
        assert np.array_equal(dual.dev.download(dual.w[n]), plain.dev.download(plain.w[n])), n
    for be in (dual, packed):  # the load's timing of the builds (every candidate gives the default's bits)
        be.tune_nbits_decode()
    assert dual.nbits is not None and packed.nbits is not None and dual.nbits.knobs == packed.nbits.knobs
    runners = [ModelRunner(gpu_b, gm, backend=b) for b in (plain, packed, dual)]
    prefill_steps = -(-37 // 5)
    steps = _drive(runners, gm, seed=len(case))
    assert dual.nbits_calls == packed.nbits_calls and dual.nbits_fallbacks == 0
    _record(f"dual_linears/{case}", {"weight_bytes": [dual.w.nbytes, plain.w.nbytes, packed.w.nbytes],
                                     "nbits_calls": dual.nbits_calls, "steps": len(steps)})
    for i, (a, b, c) in enumerate(steps):
        if i < prefill_steps:
            assert np.array_equal(c, a), (case, i, float(np.abs(c - a).max()))
        else:
            assert np.array_equal(c, b), (case, i, float(np.abs(c - b).max()))
