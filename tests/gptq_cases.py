"""GPTQ checkpoints for the ``cuda`` backend's tests (CPU unit tests and the GPU tests): small models of every kind
the GPTQ tests use, packed by the tests' own round-to-nearest packer (``tests/gptq_pack.py``), and the bundles
built from them."""

from __future__ import annotations

from pathlib import Path

from builder.bundle import BuildOptions, build_bundle
from tests import gptq_pack as gp
from tests.conftest import write_tiny_tokenizer
from tests.hf_models import VOCAB, tiny_raw_config, write_numpy_checkpoint

SMALL = dict(hidden_size=64, intermediate_size=96)
MOE = dict(moe_intermediate_size=32, shared_expert_intermediate_size=48)
# name -> (model_type, config overrides, packer options)
CASES = {
    # Qwen3-Next MoE, int4 groups of 32, asymmetric, act order, v1; layer 1's GDN left float by a negative dynamic
    # rule, down_proj int8 by a positive one; lm_head quantized
    "next_int4_g32_asym_act_v1": ("qwen3_next", {**SMALL, **MOE}, dict(
        bits=4, group_size=32, sym=False, desc_act=True, fmt="gptq", lm_head=True,
        dynamic={r"-:.*layers\.1\.linear_attn\..*": {}, r"+:.*down_proj": {"bits": 8}})),
    # Qwen3.5 dense, int4 groups of 64, symmetric, v2 (AutoGPTQ's quantize_config.json)
    "qwen35_dense_int4_g64_sym_v2": ("qwen3_5", SMALL, dict(
        bits=4, group_size=64, sym=True, fmt="gptq_v2", config_file="quantize_config.json")),
    # Qwen3.5-MoE, int4, one group per row (-1), asymmetric, v2; the shared expert left float
    "qwen35moe_int4_gm1_asym_v2": ("qwen3_5_moe", {**SMALL, **MOE}, dict(
        bits=4, group_size=-1, sym=False, fmt="gptq_v2", dynamic={r"-:.*shared_expert\..*": {}})),
    # Qwen3.5-MoE, int8 groups of 32, symmetric, act order, shared expert quantized; per-part weights: k_proj float
    # (qkv = quantized | float | quantized), the experts' up_proj int4 (gate_up = int8 | int4 per expert); expert
    # 0's down_proj float (the layer's experts cannot stack: stored dequantised, a recorded fallback)
    "qwen35moe_int8_g32_sym_act_parts": ("qwen3_5_moe", {**SMALL, **MOE}, dict(
        bits=8, group_size=32, sym=True, desc_act=True, fmt="gptq_v2",
        dynamic={r"-:.*self_attn\.k_proj": {}, r"+:.*experts\.\d+\.up_proj": {"bits": 4},
                 r"-:.*experts\.0\.down_proj": {}})),
    # Qwen3-Next with the shared expert as wide as the experts (folded into them at load), int4 groups of 128
    # (> hidden: one group), symmetric, act order, v1
    "next_folded_int4_g128_sym_act_v1": ("qwen3_next", {**SMALL, "moe_intermediate_size": 32,
                                                        "shared_expert_intermediate_size": 32}, dict(
        bits=4, group_size=128, sym=True, desc_act=True, fmt="gptq")),
}


def limits(**kw: object) -> dict[str, object]:
    return dict(max_batch_size=4, max_input_len=64, max_seq_len=96, max_num_tokens=16, page_size=4) | kw


def checkpoints(root: Path, case: str) -> tuple[Path, Path, dict[str, int]]:
    """(GPTQ checkpoint, float checkpoint of its dequantised weights, packed module -> bits) of ``case``."""
    model_type, overrides, pack = CASES[case]
    float_dir = root / "float"
    write_numpy_checkpoint(float_dir, tiny_raw_config(model_type, **overrides), seed=3)
    write_tiny_tokenizer(float_dir, VOCAB)
    done = gp.write_gptq_checkpoint(float_dir, root / "gptq", root / "dequant", **pack)
    return root / "gptq", root / "dequant", done


def build(ckpt: Path, out: Path, backend: str = "cuda", dtype: str = "float32", **lim: object) -> Path:
    if not (out / "manifest.json").exists():
        build_bundle(ckpt, out, BuildOptions(backend=backend, dtype=dtype, **limits(**lim)),  # type: ignore[arg-type]
                     progress=lambda _m: None)
    return out


# A Qwen3.5-MoE whose MoE layers the packed decode MoE takes (cuda/moe_nbits_decode.py): H 128, experts and the
# (folded) shared expert of I 64, every expert linear quantized alike, no act order. Not in CASES: the shapes of
# the other tests' models stay as they are.
PACKED_EXPERTS = ("qwen3_5_moe", {"hidden_size": 128, "intermediate_size": 96, "moe_intermediate_size": 64,
                                  "shared_expert_intermediate_size": 64})


def packed_experts_bundle(root: Path, dtype: str = "bfloat16", bits: int = 4, group_size: int = 32,
                          sym: bool = False, **sizes: int) -> Path:
    """The cuda bundle (``dtype``) of :data:`PACKED_EXPERTS` (``sizes``: config overrides on top of its own)
    quantized by the tests' packer (gptq_v2)."""
    model_type, overrides = PACKED_EXPERTS
    float_dir = root / "float"
    if not (root / "gptq").exists():
        write_numpy_checkpoint(float_dir, tiny_raw_config(model_type, **{**overrides, **sizes}), seed=3)
        write_tiny_tokenizer(float_dir, VOCAB)
        gp.write_gptq_checkpoint(float_dir, root / "gptq", None, bits=bits, group_size=group_size, sym=sym,
                                 fmt="gptq_v2")
    return build(root / "gptq", root / f"b_{dtype}", dtype=dtype)
