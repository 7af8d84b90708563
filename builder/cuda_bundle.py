"""``--backend cuda``: the bundle the native GPU runtime executes (no ONNX, no TensorRT).

One ``weights.safetensors`` holds every runtime weight of :func:`hybrid_runtime.program.runtime_weight_specs`
in the executor's layout: fused projections (GDN ``in_proj``, attention ``qkv_proj``, MLP ``gate_up``,
experts ``gate_up``), GEMM operands and embeddings in the bundle dtype (bfloat16 / float16 / float32), norms
(``1 + w`` already applied), gates, conv weights and RoPE tables in float32. ``lm_head`` is left out when
the embeddings are tied (the runtime aliases it). The file is streamed one layer at a time, so a checkpoint
of tens of gigabytes never sits in host memory whole.

GPTQ checkpoints (:mod:`builder.gptq`): every runtime weight the checkpoint quantizes is stored PACKED, in the
MatMulNBits layout of the CPU bundle (:func:`hybrid_runtime.quant.nbits_tensors`: ``<w>.nbits_B`` uint8,
``.nbits_scales`` float32, optional ``.nbits_zp`` / ``.nbits_perm``, ``.nbits_meta``; the experts of a MoE
layer stacked on axis 0), fused at build time exactly as the float path fuses them; the runtime dequantises it
on the device at load (``hybrid_runtime/cuda/quant.py``). A fused weight whose row blocks cannot share one
quantization (:class:`~hybrid_runtime.quant.LinearParts`: float and quantized parts, or other bits / grouping)
is stored per part: ``<w>.parts`` int64 ``[P]`` (the rows of each part, in order) and ``<w>.part<i>`` (a float
part, in the bundle dtype) or ``<w>.part<i>.nbits_*`` (a quantized one); stacked experts split alike. Experts of
one projection that cannot be stacked (some float, or other block sizes) are stored dequantised in the bundle
dtype and recorded in the manifest's ``quantization.fallbacks``. The packed shapes are known only once a layer
is read, so that file is spooled (:class:`~hybrid_runtime.weights_io.SafetensorsSpool`) rather than written
under a header known up front; still one layer of canonical weights at a time.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from hybrid_runtime.config import BundleError, ConfigError
from hybrid_runtime.program import PROGRAM_VERSION, derive_weight, linear_sources, stored_weight_specs
from hybrid_runtime.quant import (
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
from hybrid_runtime.weights_io import SafetensorsSpool, SafetensorsWriter

from . import gptq
from .checkpoint import Checkpoint, _layer_weights, _linear, _need

WEIGHTS = "weights.safetensors"
FORMAT_VERSION = "1"
DTYPE_TAG = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}


PARTS = "parts"  # <weight>.parts: int64 [P], the rows of each part of a per-part weight (module docstring)
FALLBACK_EXPERTS = ("experts-not-stackable: the experts of this projection are not all quantized alike (some "
                    "float, or other block sizes), so they are stored dequantised in the bundle dtype")


class _Unstackable(Exception):
    """Experts of one projection that cannot share one stacked packed tensor."""


def _nbits(prefix: str, ws: list[QuantLinear], stacked: bool) -> dict[str, np.ndarray]:
    try:
        return nbits_tensors(prefix, [to_nbits(w) for w in ws], 0, stacked=stacked)
    except BundleError as e:
        raise _Unstackable(str(e)) from e


def quantized_tensors(name: str, w: Any) -> list[tuple[str, np.ndarray, bool]]:
    """The stored tensors of one quantized runtime weight: (tensor name, array, True for a float part stored in
    the bundle dtype). Raises :class:`_Unstackable` for experts that must fall back to float."""
    if isinstance(w, QuantLinear):
        return [(k, v, False) for k, v in _nbits(name, [w], False).items()]
    if isinstance(w, LinearParts):
        out = [(f"{name}.{PARTS}", np.array([p.shape[0] for p in w.parts], np.int64), False)]
        for i, part in enumerate(w.parts):
            if isinstance(part, QuantLinear):
                out += [(k, v, False) for k, v in _nbits(f"{name}.part{i}", [part], False).items()]
            else:
                out.append((f"{name}.part{i}", np.asarray(part, np.float32), True))
        return out
    assert isinstance(w, QuantExperts), type(w)
    items = w.items
    if all(isinstance(i, QuantLinear) for i in items):
        return [(k, v, False) for k, v in _nbits(name, list(items), True).items()]
    split = {tuple((p.shape[0], isinstance(p, QuantLinear)) for p in i.parts) if isinstance(i, LinearParts) else None
             for i in items}
    if len(split) != 1 or None in split:
        raise _Unstackable("some experts are float and some quantized")
    (layout,) = split
    out = [(f"{name}.{PARTS}", np.array([rows for rows, _ in layout], np.int64), False)]
    for j, (_, quant) in enumerate(layout):
        parts = [i.parts[j] for i in items]
        if quant:
            out += [(k, v, False) for k, v in _nbits(f"{name}.part{j}", parts, True).items()]
        else:
            out.append((f"{name}.part{j}", np.stack([np.asarray(p, np.float32) for p in parts]), True))
    return out


def write_cuda_weights(ck: Checkpoint, out_dir: Path, dtype: str, rope_len: int,
                       progress: Callable[[str], None]) -> tuple[dict[str, str], QuantRecord | None]:
    """Stream the runtime weights of ``ck`` into ``out_dir/weights.safetensors``; returns the manifest's
    toolkit record and, for a GPTQ checkpoint, its quantization record (``activations``: ``dtype``)."""
    if dtype not in DTYPE_TAG:
        raise ConfigError(f"--backend cuda: dtype {dtype!r} is not one of {', '.join(DTYPE_TAG)}")
    cfg, p = ck.config, ck.layout.prefix
    specs = stored_weight_specs(cfg, rope_len)
    tag = DTYPE_TAG[dtype]
    meta = {"format": f"hybrid-llm cuda {FORMAT_VERSION}", "dtype": dtype}
    quant = ck.quant is not None
    writer: SafetensorsWriter | SafetensorsSpool = (
        SafetensorsSpool(out_dir / WEIGHTS, metadata=meta) if quant else
        SafetensorsWriter(out_dir / WEIGHTS, [(s.name, tag if s.matrix else "F32", s.shape) for s in specs],
                          metadata=meta))
    vh = (cfg.vocab_size, cfg.hidden_size)
    if ck.has(p + "embed_tokens.qweight"):
        raise gptq.GPTQError("a quantized embedding table (embed_tokens.qweight) is not supported: embeddings "
                             "stay float")
    top: dict[str, Any] = {"embed_tokens": _need(ck, p + "embed_tokens.weight", vh),
                           "norm": _need(ck, p + "norm.weight", (cfg.hidden_size,))}
    if not cfg.tie_word_embeddings:
        top["lm_head"] = _linear(ck, "lm_head", vh) if quant else _need(ck, "lm_head.weight", vh)
    layer_cache: dict[int, dict[str, Any]] = {}
    modules: dict[str, int] = {}
    fallbacks: dict[str, str] = {}

    def get(name: str) -> np.ndarray:
        if name.startswith("layers."):
            i = int(name.split(".", 2)[1])
            if i not in layer_cache:
                layer_cache.clear()  # one layer's canonical weights at a time
                layer_cache[i] = dict(_layer_weights(ck, i))
            return layer_cache[i][name]
        return top[name]

    try:
        last = -2
        for s in specs:
            if s.layer != last and s.layer >= 0:
                progress(f"cuda weights: layer {s.layer + 1}/{cfg.num_layers} ({cfg.layer_types[s.layer]}, "
                         f"{cfg.ffn_types[s.layer]})")
            last = s.layer
            w = derive_weight(cfg, s.name, get, rope_len)
            st = tag if s.matrix else "F32"
            if not is_quantized(w):
                if isinstance(writer, SafetensorsSpool):
                    writer.write(s.name, w, st)
                else:
                    writer.write(s.name, w)
                continue
            assert isinstance(writer, SafetensorsSpool)
            sources = [(c, get(c)) for c in linear_sources(s.name)]
            try:
                entries = quantized_tensors(s.name, w)
            except _Unstackable as e:
                progress(f"cuda weights: {s.name} stored dequantised ({e})")
                writer.write(s.name, as_float(w), st)
                fallbacks.update({c: FALLBACK_EXPERTS for c, cw in sources if is_quantized(cw)})
                continue
            for tname, arr, is_float in entries:
                writer.write(tname, arr, st if is_float else None)
            for c, cw in sources:
                if bits := bits_of(cw):
                    modules[c] = max(bits)  # one value: a weight whose experts differ in bits is _Unstackable
        writer.close()
    except BaseException:
        writer.abort()
        raise
    record = None
    if ck.quant is not None:
        rec = ck.quant.record()
        record = QuantRecord(method=rec["method"], bits=rec["bits"], group_size=rec["group_size"], sym=rec["sym"],
                             desc_act=rec["desc_act"], checkpoint_format=rec["checkpoint_format"], activations=dtype,
                             modules=modules, lm_head=rec["lm_head"], dynamic=rec["dynamic"], fallbacks=fallbacks)
        progress(f"gptq: {len(modules)} weights stored packed (dequantised to {dtype} on the device at load), "
                 f"{len(fallbacks)} stored dequantised")
    return ({"format": FORMAT_VERSION, "program": str(PROGRAM_VERSION), "weights": WEIGHTS,
             "kernels": "NVRTC at load for the running GPU"}, record)
