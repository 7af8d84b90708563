"""What an onnxruntime bundle does with a GPTQ checkpoint's quantized weights.

* Every quantized linear of the segments (attention q/k/v/o, GDN in_proj* / out_proj, dense MLPs, lm_head)
  becomes ``com.microsoft.MatMulNBits`` (``builder/onnx_graph.py``); the routed experts and the shared
  expert of a MoE layer are stored in MatMulNBits layout in the state weights and run by the MoE
  operator's graph (``hybrid_runtime/ops/moe.py``).
* ``activations``: ``fp32`` (MatMulNBits ``accuracy_level`` 0: parity with the float model of the
  dequantised weights) or ``int8`` (level 4: MLAS quantises the activations per block and runs integer
  kernels; several times faster on AVX2 / AVX-512 VNNI, logits differ by the activation rounding).
* Fallback ``int8-weights-fp32-activations``: 8-bit weights with fp32 activations are dequantised to
  float32 at build time (the same function): onnxruntime 1.32's MLAS has no fast path for that pair
  (a 1024x4096 MatMulNBits took 40 ms at one row vs 2 ms for the float32 MatMul on the 2-core CI
  machine). Recorded in the manifest's ``quantization.fallbacks``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from hybrid_runtime.config import ConfigError
from hybrid_runtime.quant import (
    ACCURACY_LEVELS,
    LinearParts,
    QuantExperts,
    QuantLinear,
    QuantRecord,
    as_float,
    bits_of,
    is_quantized,
    nbits_tensors,
    to_nbits,
)

from .gptq import GPTQScheme

FALLBACK_INT8_FP32 = ("int8-weights-fp32-activations: dequantised to float32 MatMul (onnxruntime's 8-bit "
                      "MatMulNBits with fp32 activations, accuracy_level 0, is ~20x slower than the float32 "
                      "MatMul on this runtime's CPUs)")


def plan(weights: dict[str, Any], scheme: GPTQScheme, activations: str,
         progress: Callable[[str], None] = print) -> tuple[dict[str, Any], QuantRecord]:
    """Apply the fallbacks to the canonical ``weights`` (in place) and return them with the manifest record."""
    if activations not in ACCURACY_LEVELS:
        raise ConfigError(f"--quant-activations {activations!r}: choose one of {', '.join(ACCURACY_LEVELS)}")
    modules: dict[str, int] = {}
    fallbacks: dict[str, str] = {}
    for name, w in weights.items():
        bits = bits_of(w)
        if not bits:
            continue
        if activations == "fp32" and 8 in bits:
            weights[name] = _dequantize_bits(w, 8)
            fallbacks[name] = FALLBACK_INT8_FP32
            bits = bits_of(weights[name])
        if len(bits) > 1:
            raise ConfigError(f"{name}: parts quantized with different bits {sorted(bits)} in one weight")
        if bits:
            modules[name] = bits.pop()
    progress(f"gptq: {len(modules)} weights run quantized (MatMulNBits, {activations} activations), "
             f"{len(fallbacks)} dequantised ({'; '.join(sorted(set(fallbacks.values()))) or 'none'})")
    rec = scheme.record()
    record = QuantRecord(method=rec["method"], bits=rec["bits"], group_size=rec["group_size"], sym=rec["sym"],
                         desc_act=rec["desc_act"], checkpoint_format=rec["checkpoint_format"],
                         activations=activations, modules=modules, lm_head=rec["lm_head"], dynamic=rec["dynamic"],
                         fallbacks=fallbacks)
    return weights, record


def _dequantize_bits(w: Any, bits: int) -> Any:
    if isinstance(w, QuantLinear):
        return w.dequantize() if w.bits == bits else w
    if isinstance(w, QuantExperts):
        items = tuple(_dequantize_bits(i, bits) for i in w.items)
        return QuantExperts(items) if any(is_quantized(i) for i in items) else np.stack(items)
    if isinstance(w, LinearParts):
        return LinearParts(tuple(_dequantize_bits(p, bits) for p in w.parts))
    return w


def state_tensors(name: str, w: Any, accuracy_level: int) -> Mapping[str, np.ndarray]:
    """The state-weight tensors of one MoE weight: as it is (float), or in MatMulNBits layout."""
    if not is_quantized(w):
        return {name: w}
    if isinstance(w, QuantExperts):
        if not all(isinstance(i, QuantLinear) for i in w.items):
            raise ConfigError(f"{name}: some experts are quantized and some are not, or an expert's gate and up "
                              "projections are quantized differently; the MoE operator needs one quantization "
                              "per layer projection")
        return nbits_tensors(name, [to_nbits(i) for i in w.items], accuracy_level, stacked=True)
    if isinstance(w, QuantLinear):
        return nbits_tensors(name, [to_nbits(w)], accuracy_level, stacked=False)
    return {name: as_float(w)}
