"""``--backend cuda``: the bundle the native GPU runtime executes (no ONNX, no TensorRT).

One ``weights.safetensors`` holds every runtime weight of :func:`hybrid_runtime.program.runtime_weight_specs`
in the executor's layout: fused projections (GDN ``in_proj``, attention ``qkv_proj``, MLP ``gate_up``,
experts ``gate_up``), GEMM operands and embeddings in the bundle dtype (bfloat16 / float16 / float32), norms
(``1 + w`` already applied), gates, conv weights and RoPE tables in float32. ``lm_head`` is left out when
the embeddings are tied (the runtime aliases it). The file is streamed one layer at a time, so a checkpoint
of tens of gigabytes never sits in host memory whole.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np

from hybrid_runtime.config import ConfigError
from hybrid_runtime.program import PROGRAM_VERSION, derive_weight, stored_weight_specs
from hybrid_runtime.weights_io import SafetensorsWriter

from .checkpoint import Checkpoint, _layer_weights, _need

WEIGHTS = "weights.safetensors"
FORMAT_VERSION = "1"
DTYPE_TAG = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}


def write_cuda_weights(ck: Checkpoint, out_dir: Path, dtype: str, rope_len: int,
                       progress: Callable[[str], None]) -> dict[str, str]:
    """Stream the runtime weights of ``ck`` into ``out_dir/weights.safetensors``; returns the manifest's
    toolkit record."""
    if dtype not in DTYPE_TAG:
        raise ConfigError(f"--backend cuda: dtype {dtype!r} is not one of {', '.join(DTYPE_TAG)}")
    cfg, p = ck.config, ck.layout.prefix
    specs = stored_weight_specs(cfg, rope_len)
    tag = DTYPE_TAG[dtype]
    writer = SafetensorsWriter(out_dir / WEIGHTS, [(s.name, tag if s.matrix else "F32", s.shape) for s in specs],
                               metadata={"format": f"hybrid-llm cuda {FORMAT_VERSION}", "dtype": dtype})
    vh = (cfg.vocab_size, cfg.hidden_size)
    top: dict[str, np.ndarray] = {"embed_tokens": _need(ck, p + "embed_tokens.weight", vh),
                                  "norm": _need(ck, p + "norm.weight", (cfg.hidden_size,))}
    if not cfg.tie_word_embeddings:
        top["lm_head"] = _need(ck, "lm_head.weight", vh)
    layer_cache: dict[int, dict[str, np.ndarray]] = {}

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
            writer.write(s.name, derive_weight(cfg, s.name, get, rope_len))
        writer.close()
    except BaseException:
        writer.abort()
        raise
    return {"format": FORMAT_VERSION, "program": str(PROGRAM_VERSION), "weights": WEIGHTS,
            "kernels": "NVRTC at load for the running GPU"}
