"""Read a Hugging Face hybrid checkpoint into canonical float32 numpy weights.

Reads ``*.safetensors`` itself (one file or sharded with ``model.safetensors.index.json``), memory-mapped,
in F32, F16 or BF16; bfloat16 is widened to float32 exactly (its bits are the top half of a float32).
Weights are renamed to one canonical layout (see :func:`canonical_names`) so the rest of the project
knows a single form:

* Qwen3-Next's grouped ``in_proj_qkvz`` / ``in_proj_ba`` are split into the flat Qwen3.5 form
  ``in_proj_qkv [C,H]``, ``in_proj_z [nv*dv,H]``, ``in_proj_b [nv,H]``, ``in_proj_a [nv,H]``;
* per-expert MoE tensors (as ``save_pretrained`` writes them) or transformers' fused in-memory form
  (``experts.gate_up_proj [E,2I,H]``, ``experts.down_proj [E,H,I]``) become stacked
  ``experts.gate_proj [E,I,H]``, ``experts.up_proj [E,I,H]``, ``experts.down_proj [E,H,I]``;
* ``conv1d.weight [C,1,K]`` becomes ``conv1d [C,K]``; ``lm_head`` is ``embed_tokens`` when tied.

Vision (``model.visual.*``) and multi-token-prediction (``mtp.*``) tensors are ignored.

GPTQ checkpoints (:mod:`builder.gptq`): a linear module stored as ``qweight`` / ``qzeros`` / ``scales`` /
``g_idx`` is read as a :class:`~hybrid_runtime.quant.QuantLinear` (its rows are output features, so the
renames above are the same row operations), stacked experts with a quantized one as
:class:`~hybrid_runtime.quant.QuantExperts`. The router, the shared-expert gate, norms, conv weights and
embeddings stay float (a quantized router or shared-expert gate is dequantized).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

from hybrid_runtime.config import DENSE, FULL, LINEAR, MOE, ConfigError, ModelConfig
from hybrid_runtime.quant import QuantExperts, QuantLinear, as_float, is_quantized, take_rows
from hybrid_runtime.weights_io import SafetensorsFile, WeightsFormatError

from . import gptq
from .hf_config import CheckpointLayout, load_hf_config

_IGNORED_PREFIXES = ("mtp.", "model.visual.", "visual.", "model.mtp.")


class CheckpointError(ConfigError):
    """A checkpoint file that is missing, malformed or does not match its config."""


class Checkpoint:
    """A checkpoint folder: config, layout and a lazy name -> tensor lookup across shards."""

    def __init__(self, directory: str | Path) -> None:
        self.dir = Path(directory)
        if not self.dir.is_dir():
            raise CheckpointError(f"checkpoint directory {self.dir} does not exist")
        self.config, self.layout = load_hf_config(self.dir)
        self.quant = gptq.read_scheme(self.dir)  # None: a float checkpoint
        self._files: dict[str, SafetensorsFile] = {}
        self._where: dict[str, str] = {}
        index = self.dir / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            for name, fname in weight_map.items():
                self._where[name] = fname
        else:
            shards = sorted(p.name for p in self.dir.glob("*.safetensors"))
            if not shards:
                raise CheckpointError(f"no *.safetensors in {self.dir}")
            for fname in shards:
                for name in self._file(fname).keys():  # noqa: SIM118 (not a dict)
                    self._where[name] = fname
        # Released multimodal checkpoints keep the text model under model.language_model.
        if self.layout.prefix == "model." and "model.language_model.embed_tokens.weight" in self._where:
            self.layout = CheckpointLayout("model.language_model.", self.layout.fused_gdn,
                                           self.layout.torch_dtype)

    def _file(self, fname: str) -> SafetensorsFile:
        if fname not in self._files:
            path = self.dir / fname
            if not path.is_file():
                raise CheckpointError(f"shard {fname} listed in the index is missing from {self.dir}")
            try:
                self._files[fname] = SafetensorsFile(path)
            except WeightsFormatError as e:
                raise CheckpointError(str(e)) from e
        return self._files[fname]

    def has(self, name: str) -> bool:
        return name in self._where

    def get(self, name: str) -> np.ndarray:
        if name not in self._where:
            raise CheckpointError(f"tensor {name!r} is missing from the checkpoint in {self.dir}")
        return self._file(self._where[name]).get(name)

    def names(self) -> list[str]:
        return [n for n in self._where if not n.startswith(_IGNORED_PREFIXES)]

    def stored_dtypes(self) -> set[str]:
        return {self._file(f).header[n]["dtype"] for n, f in self._where.items()
                if not n.startswith(_IGNORED_PREFIXES)}


def _expect(name: str, arr: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    if tuple(arr.shape) != tuple(shape):
        raise CheckpointError(f"tensor {name}: shape {tuple(arr.shape)} does not match the config "
                              f"(expected {tuple(shape)})")
    return arr


def _split_qkvz(cfg: ModelConfig, qkvz, ba) -> dict[str, object]:
    """Qwen3-Next grouped projections -> flat ``[q | k | v]``, z, b, a (rows are output channels; the
    weights may be float arrays or :class:`QuantLinear`, whose rows move alike)."""
    nk, dk, dv = cfg.linear_num_key_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    r = cfg.linear_num_value_heads // nk
    g = np.arange(qkvz.shape[0]).reshape(nk, 2 * dk + 2 * r * dv)  # row index per (key head, row in group)
    q, k = g[:, :dk], g[:, dk:2 * dk]
    v, z = g[:, 2 * dk:2 * dk + r * dv], g[:, 2 * dk + r * dv:]
    gba = np.arange(ba.shape[0]).reshape(nk, 2 * r)
    return {
        "in_proj_qkv": take_rows(qkvz, np.concatenate([q.ravel(), k.ravel(), v.ravel()])),
        "in_proj_z": take_rows(qkvz, z.ravel()),
        "in_proj_b": take_rows(ba, gba[:, :r].ravel()),
        "in_proj_a": take_rows(ba, gba[:, r:].ravel()),
    }


def _linear(ck: Checkpoint, module: str, shape: tuple[int, int], keep_float: bool = False):
    """The weight ``[N, K]`` of the linear module stored as ``module`` (no ``.weight``): a float32 array,
    or a :class:`QuantLinear` when the checkpoint stores it GPTQ-packed (``keep_float``: dequantized)."""
    if not ck.has(module + ".qweight"):
        if ck.has(module + ".weight") or ck.quant is None:
            return _need(ck, module + ".weight", shape)
        raise CheckpointError(f"module {module}: neither {module}.weight nor {module}.qweight is in the checkpoint")
    if ck.quant is None:
        raise CheckpointError(f"{module}.qweight is in the checkpoint but config.json has no quantization_config "
                              "(and there is no quantize_config.json)")
    m = ck.quant.module(module)
    if m is None:  # a negative dynamic match, yet the tensors are packed: run them as they are stored
        m = gptq.ModuleQuant(ck.quant.bits, ck.quant.group_size, ck.quant.sym, ck.quant.desc_act)
    N, K = shape
    if K % (32 // m.bits):
        raise CheckpointError(f"{module}: {K} input features do not pack into int32 words of {m.bits}-bit codes")
    want = gptq.expected_shapes(K, N, m)
    t = {n: _need(ck, f"{module}.{n}", want[n]) for n in ("qweight", "qzeros", "scales")}
    g_idx = _need(ck, module + ".g_idx", want["g_idx"]) if ck.has(module + ".g_idx") else None
    if g_idx is not None and (g_idx.min() < 0 or g_idx.max() >= want["scales"][0]):
        raise CheckpointError(f"{module}.g_idx: group indices outside 0..{want['scales'][0] - 1}")
    if ck.has(module + ".bias") and np.any(ck.get(module + ".bias")):
        raise CheckpointError(f"{module}.bias: a biased quantized linear is not part of this model family")
    w = gptq.unpack_module(t["qweight"], t["qzeros"], t["scales"], g_idx, m.bits, m.group_size,
                           ck.quant.checkpoint_format)
    return w.dequantize() if keep_float else w


def _stack_experts(items: list) -> np.ndarray | QuantExperts:
    if any(isinstance(i, QuantLinear) for i in items):
        return QuantExperts(tuple(items))
    return np.stack(items)


def _need(ck: Checkpoint, name: str, shape: tuple[int, ...]) -> np.ndarray:
    """The stored tensor ``name``, checked against ``shape`` (errors name the tensor as stored)."""
    return _expect(name, ck.get(name), shape)


def _layer_weights(ck: Checkpoint, i: int) -> Iterator[tuple[str, np.ndarray]]:
    cfg, p = ck.config, f"{ck.layout.prefix}layers.{i}."
    h = cfg.hidden_size

    def need(name: str, shape: tuple[int, ...]) -> np.ndarray:
        return _need(ck, name, shape)

    def lin(module: str, shape: tuple[int, int], keep_float: bool = False):
        return _linear(ck, module, shape, keep_float)

    yield f"layers.{i}.input_layernorm", need(p + "input_layernorm.weight", (h,))
    yield f"layers.{i}.post_attention_layernorm", need(p + "post_attention_layernorm.weight", (h,))
    if cfg.layer_types[i] == LINEAR:
        la = p + "linear_attn."
        nv, C, vd = cfg.linear_num_value_heads, cfg.conv_dim, cfg.value_dim
        if ck.has(la + "in_proj_qkvz.weight") or ck.has(la + "in_proj_qkvz.qweight"):
            parts = _split_qkvz(cfg, lin(la + "in_proj_qkvz", (2 * cfg.key_dim + 2 * vd, h)),
                                lin(la + "in_proj_ba", (2 * nv, h)))
        else:
            shapes = {"in_proj_qkv": (C, h), "in_proj_z": (vd, h), "in_proj_b": (nv, h), "in_proj_a": (nv, h)}
            parts = {n: lin(la + n, shp) for n, shp in shapes.items()}
        for n, arr in parts.items():
            yield f"layers.{i}.linear_attn.{n}", arr
        conv = need(la + "conv1d.weight", (C, 1, cfg.conv_kernel))
        yield f"layers.{i}.linear_attn.conv1d", conv[:, 0, :]
        if ck.has(la + "conv1d.bias"):
            raise CheckpointError(f"{la}conv1d.bias: a biased conv is not part of this model family")
        yield f"layers.{i}.linear_attn.A_log", need(la + "A_log", (nv,))
        yield f"layers.{i}.linear_attn.dt_bias", need(la + "dt_bias", (nv,))
        yield f"layers.{i}.linear_attn.norm", need(la + "norm.weight", (cfg.linear_value_head_dim,))
        yield f"layers.{i}.linear_attn.out_proj", lin(la + "out_proj", (h, vd))
    else:
        sa = p + "self_attn."
        qd, kvd = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        shapes = {"q_proj": (2 * qd, h), "k_proj": (kvd, h), "v_proj": (kvd, h), "o_proj": (h, qd)}
        for n, shp in shapes.items():
            yield f"layers.{i}.self_attn.{n}", lin(sa + n, shp)
            if cfg.attention_bias:
                yield f"layers.{i}.self_attn.{n}_bias", need(sa + n + ".bias", shp[:1])
        for n in ("q_norm", "k_norm"):
            yield f"layers.{i}.self_attn.{n}", need(sa + n + ".weight", (cfg.head_dim,))
    m = p + "mlp."
    if cfg.ffn_types[i] == DENSE:
        inter = cfg.intermediate_size
        yield f"layers.{i}.mlp.gate_proj", lin(m + "gate_proj", (inter, h))
        yield f"layers.{i}.mlp.up_proj", lin(m + "up_proj", (inter, h))
        yield f"layers.{i}.mlp.down_proj", lin(m + "down_proj", (h, inter))
        return
    E, inter = cfg.num_experts, cfg.moe_intermediate_size
    yield f"layers.{i}.mlp.gate", lin(m + "gate", (E, h), keep_float=True)
    if ck.has(m + "experts.gate_up_proj.qweight"):
        raise gptq.GPTQError(f"{m}experts.gate_up_proj.qweight: quantized fused experts are not supported "
                             "(per-expert experts.N.gate_proj / up_proj / down_proj are)")
    if ck.has(m + "experts.gate_up_proj"):  # transformers' fused in-memory form
        gu = need(m + "experts.gate_up_proj", (E, 2 * inter, h))
        yield f"layers.{i}.mlp.experts.gate_proj", np.ascontiguousarray(gu[:, :inter])
        yield f"layers.{i}.mlp.experts.up_proj", np.ascontiguousarray(gu[:, inter:])
        yield f"layers.{i}.mlp.experts.down_proj", need(m + "experts.down_proj", (E, h, inter))
    else:
        for n, shp in (("gate_proj", (inter, h)), ("up_proj", (inter, h)), ("down_proj", (h, inter))):
            yield f"layers.{i}.mlp.experts.{n}", _stack_experts(
                [lin(f"{m}experts.{e}.{n}", shp) for e in range(E)])
    si = cfg.shared_expert_intermediate_size
    if si > 0:
        s = m + "shared_expert."
        yield f"layers.{i}.mlp.shared_expert.gate_proj", lin(s + "gate_proj", (si, h))
        yield f"layers.{i}.mlp.shared_expert.up_proj", lin(s + "up_proj", (si, h))
        yield f"layers.{i}.mlp.shared_expert.down_proj", lin(s + "down_proj", (h, si))
        yield f"layers.{i}.mlp.shared_expert_gate", lin(m + "shared_expert_gate", (1, h), keep_float=True)


def load_weights(ck: Checkpoint, progress: Callable[[str], None] | None = None) -> dict[str, np.ndarray]:
    """All text-model weights in canonical names, float32 (see module docstring)."""
    cfg, p = ck.config, ck.layout.prefix
    vh = (cfg.vocab_size, cfg.hidden_size)
    w: dict[str, np.ndarray] = {}
    if ck.has(p + "embed_tokens.qweight"):
        raise gptq.GPTQError("a quantized embedding table (embed_tokens.qweight) is not supported: embeddings "
                             "stay float")
    w["embed_tokens"] = _need(ck, p + "embed_tokens.weight", vh)
    w["norm"] = _need(ck, p + "norm.weight", (cfg.hidden_size,))
    if cfg.tie_word_embeddings:
        w["lm_head"] = w["embed_tokens"]
    else:
        w["lm_head"] = _linear(ck, "lm_head", vh)
    for i in range(cfg.num_layers):
        if progress:
            progress(f"loading layer {i + 1}/{cfg.num_layers} ({cfg.layer_types[i]}, {cfg.ffn_types[i]})")
        w.update(_layer_weights(ck, i))
    return w


def dequantize_weights(w: dict) -> dict[str, np.ndarray]:
    """Canonical weights with every quantized one dequantized to float32 (for the numpy reference)."""
    return {n: (as_float(v) if is_quantized(v) else v) for n, v in w.items()}


def canonical_names(cfg: ModelConfig) -> list[str]:
    """The canonical weight names a config implies (used by tests and the bundle writer)."""
    names = ["embed_tokens", "norm", "lm_head"]
    for i in range(cfg.num_layers):
        names += [f"layers.{i}.input_layernorm", f"layers.{i}.post_attention_layernorm"]
        if cfg.layer_types[i] == FULL:
            names += [f"layers.{i}.self_attn.{n}" for n in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm",
                                                             "k_norm")]
        else:
            names += [f"layers.{i}.linear_attn.{n}" for n in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a",
                                                               "conv1d", "A_log", "dt_bias", "norm", "out_proj")]
        if cfg.ffn_types[i] == MOE:
            names += [f"layers.{i}.mlp.gate"] + [f"layers.{i}.mlp.experts.{n}" for n in
                                                 ("gate_proj", "up_proj", "down_proj")]
    return names
