"""Model configuration and engine-bundle manifest, shared by the builder and the runtime.

`ModelConfig` is the *normalised* description of one hybrid decoder (Qwen3-Next / Qwen3.5 /
Qwen3.5-MoE text model). The builder derives it from a Hugging Face ``config.json`` (both the
transformers-5 spelling and the older one of released checkpoints, see ``builder.hf_config``); the
runtime reads it back from ``manifest.json``. It validates itself at construction.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

LINEAR = "linear_attention"
FULL = "full_attention"
DENSE = "dense"
MOE = "moe"

MANIFEST_VERSION = 1
MANIFEST_NAME = "manifest.json"


# Manifest.state_weights of a cuda bundle built with --dummy-weights: no weights file; the runtime generates
# seeded random weights on the device at load (benchmarks and load tests of a shape without its checkpoint,
# like vLLM's --load-format dummy). Its outputs are meaningless.
DUMMY_WEIGHTS = "(dummy: seeded random weights generated on the device at load)"


class ConfigError(ValueError):
    """A configuration value that this project does not support (names the key and the value)."""


class BundleError(RuntimeError):
    """An engine bundle that is missing, malformed, or does not fit the running environment."""


def _require(cond: bool, key: str, value: Any, why: str) -> None:
    if not cond:
        raise ConfigError(f"unsupported config value {key}={value!r}: {why}")


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Normalised hybrid-model hyper-parameters.

    Sizes use the names of MODEL_MATH.md: the linear-attention (Gated DeltaNet) mixer has ``nk`` key
    heads of ``dk`` and ``nv`` value heads of ``dv`` with a causal conv of width ``conv_kernel``; the
    full-attention mixer has ``num_heads`` query heads and ``num_kv_heads`` KV heads of ``head_dim``.
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    layer_types: tuple[str, ...]
    ffn_types: tuple[str, ...]
    rms_norm_eps: float
    tie_word_embeddings: bool
    # full attention
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rotary_dim: int
    rope_theta: float
    attention_bias: bool
    max_position_embeddings: int
    # linear attention (Gated DeltaNet)
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    conv_kernel: int
    # FFN
    intermediate_size: int
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        _require(self.num_layers > 0, "num_hidden_layers", self.num_layers, "must be positive")
        _require(len(self.layer_types) == self.num_layers, "layer_types", self.layer_types,
                 f"needs exactly num_hidden_layers={self.num_layers} entries")
        for t in self.layer_types:
            _require(t in (LINEAR, FULL), "layer_types", t, f"each entry must be {LINEAR!r} or {FULL!r}")
        _require(len(self.ffn_types) == self.num_layers, "ffn_types", self.ffn_types, "one per layer")
        for t in self.ffn_types:
            _require(t in (DENSE, MOE), "ffn_types", t, "each entry must be 'dense' or 'moe'")
        if FULL in self.layer_types:
            _require(self.num_heads > 0 and self.num_kv_heads > 0, "num_key_value_heads", self.num_kv_heads,
                     "attention layers need positive head counts")
            _require(self.num_heads % self.num_kv_heads == 0, "num_key_value_heads", self.num_kv_heads,
                     f"must divide num_attention_heads={self.num_heads}")
            _require(0 < self.head_dim <= 256, "head_dim", self.head_dim, "supported range is 1..256")
            _require(self.rotary_dim % 2 == 0 and 0 <= self.rotary_dim <= self.head_dim,
                     "partial_rotary_factor", self.rotary_dim / self.head_dim,
                     "rotary dims (head_dim * factor) must be even and <= head_dim")
        if LINEAR in self.layer_types:
            _require(self.linear_num_value_heads % self.linear_num_key_heads == 0, "linear_num_value_heads",
                     self.linear_num_value_heads, f"must be a multiple of linear_num_key_heads="
                     f"{self.linear_num_key_heads}")
            _require(self.conv_kernel >= 1, "linear_conv_kernel_dim", self.conv_kernel, "must be >= 1")
        if MOE in self.ffn_types:
            _require(0 < self.num_experts_per_tok <= self.num_experts, "num_experts_per_tok",
                     self.num_experts_per_tok, f"must be in 1..num_experts={self.num_experts}")
            _require(self.moe_intermediate_size > 0, "moe_intermediate_size", self.moe_intermediate_size,
                     "must be positive")

    # ---- derived sizes -------------------------------------------------------------------------
    @property
    def key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the causal conv: ``[q | k | v]``."""
        return 2 * self.key_dim + self.value_dim

    @property
    def linear_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == LINEAR)

    @property
    def attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == FULL)

    def num_parameters(self) -> int:
        """Parameter count of the text model (embeddings counted once when tied)."""
        h = self.hidden_size
        n = self.vocab_size * h * (1 if self.tie_word_embeddings else 2) + h
        for i in range(self.num_layers):
            n += 2 * h
            if self.layer_types[i] == LINEAR:
                n += h * (self.conv_dim + self.value_dim + 2 * self.linear_num_value_heads)
                n += self.conv_dim * self.conv_kernel + 2 * self.linear_num_value_heads
                n += self.linear_value_head_dim + self.value_dim * h
            else:
                qd, kvd = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
                n += h * (2 * qd + 2 * kvd) + qd * h + 2 * self.head_dim
            if self.ffn_types[i] == DENSE:
                n += 3 * h * self.intermediate_size
            else:
                n += self.num_experts * (h + 3 * h * self.moe_intermediate_size)
                n += 3 * h * self.shared_expert_intermediate_size + (h if self.shared_expert_intermediate_size else 0)
        return n

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["layer_types"] = list(self.layer_types)
        d["ffn_types"] = list(self.ffn_types)
        d["eos_token_ids"] = list(self.eos_token_ids)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ConfigError(f"unknown model config keys in manifest: {unknown}")
        d = dict(d)
        for k in ("layer_types", "ffn_types", "eos_token_ids"):
            if k in d:
                d[k] = tuple(d[k])
        return cls(**d)


@dataclass(frozen=True, slots=True)
class ProfileSpec:
    """One optimization profile: the token dimension of every segment input ranges over min..max."""

    name: str
    min_tokens: int
    opt_tokens: int
    max_tokens: int

    def __post_init__(self) -> None:
        if not 1 <= self.min_tokens <= self.opt_tokens <= self.max_tokens:
            raise ConfigError(f"profile {self.name}: need 1 <= min <= opt <= max, got "
                              f"{self.min_tokens}/{self.opt_tokens}/{self.max_tokens}")


@dataclass(frozen=True, slots=True)
class Limits:
    """Serving limits a bundle was built for."""

    max_batch_size: int
    max_input_len: int
    max_seq_len: int
    max_num_tokens: int
    page_size: int
    num_kv_pages: int
    num_state_slots: int

    def __post_init__(self) -> None:
        checks = {
            "max_batch_size": self.max_batch_size >= 1,
            "max_input_len": 1 <= self.max_input_len < self.max_seq_len,
            "max_num_tokens": self.max_num_tokens >= self.max_batch_size,
            "page_size": self.page_size >= 1,
            "num_kv_pages": self.num_kv_pages >= 1,
            "num_state_slots": self.num_state_slots >= self.max_batch_size,
        }
        for key, ok in checks.items():
            if not ok:
                raise ConfigError(f"invalid limit {key}={getattr(self, key)!r} (limits: {self})")

    def profiles(self) -> tuple[ProfileSpec, ProfileSpec]:
        """PREFILL (1..max_num_tokens) and DECODE (1..max_batch_size), in that order."""
        prefill_opt = min(self.max_num_tokens, max(1, min(self.max_input_len, 256)))
        return (
            ProfileSpec("prefill", 1, prefill_opt, self.max_num_tokens),
            ProfileSpec("decode", 1, self.max_batch_size, self.max_batch_size),
        )


@dataclass(frozen=True, slots=True)
class SegmentSpec:
    """One stateless ONNX segment: inputs/outputs are ``[num_tokens, width]`` (ids/positions ``[num_tokens]``)."""

    name: str
    onnx: str
    inputs: tuple[tuple[str, str, int], ...]  # (name, dtype, width or 0 for rank-1)
    outputs: tuple[tuple[str, str, int], ...]
    plan: str | None = None


@dataclass(frozen=True, slots=True)
class Manifest:
    """``manifest.json`` of an engine bundle (see README, "Engine bundle")."""

    version: int
    model: ModelConfig
    limits: Limits
    backend: str
    dtype: str
    segments: tuple[SegmentSpec, ...]
    state_weights: str
    toolkit: dict[str, str]
    target: dict[str, str]
    workarounds: tuple[dict[str, str], ...]
    checksums: dict[str, str]
    tokenizer: dict[str, Any]
    created_by: str = "hybrid-llm builder"
    # backend "tensorrt": segment -> per profile {"name", "index", "inputs": {input: {"min", "opt", "max"}}}
    trt_profiles: dict[str, Any] = field(default_factory=dict)
    # a GPTQ checkpoint's bundle: hybrid_runtime.quant.QuantRecord (None: float weights)
    quantization: Any = None

    @property
    def profiles(self) -> tuple[ProfileSpec, ProfileSpec]:
        return self.limits.profiles()

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "created_by": self.created_by,
            "backend": self.backend,
            "dtype": self.dtype,
            "model": self.model.to_dict(),
            "limits": dataclasses.asdict(self.limits),
            "profiles": [dataclasses.asdict(p) for p in self.profiles],
            "segments": [
                {"name": s.name, "onnx": s.onnx, "plan": s.plan,
                 "inputs": [list(t) for t in s.inputs], "outputs": [list(t) for t in s.outputs]}
                for s in self.segments
            ],
            "state_weights": self.state_weights,
            "toolkit": dict(self.toolkit),
            "target": dict(self.target),
            "workarounds": [dict(w) for w in self.workarounds],
            "checksums": dict(self.checksums),
            "tokenizer": dict(self.tokenizer),
            **({"trt_profiles": self.trt_profiles} if self.trt_profiles else {}),
            **({"quantization": self.quantization.to_dict()} if self.quantization is not None else {}),
        }

    def save(self, bundle_dir: Path) -> None:
        (Path(bundle_dir) / MANIFEST_NAME).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, bundle_dir: str | Path) -> Manifest:
        path = Path(bundle_dir) / MANIFEST_NAME
        if not path.is_file():
            raise BundleError(f"no {MANIFEST_NAME} in {bundle_dir}: build one with "
                              f"`python -m builder build --checkpoint CKPT --output {bundle_dir}`")
        try:
            d = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise BundleError(f"{path} is not valid JSON: {e}") from e
        if d.get("version") != MANIFEST_VERSION:
            raise BundleError(f"{path}: manifest version {d.get('version')!r} is not supported by this "
                              f"runtime (expects {MANIFEST_VERSION}); rebuild the bundle")
        try:
            limits = Limits(**d["limits"])
            recorded = [ProfileSpec(**p) for p in d["profiles"]]
            if tuple(recorded) != limits.profiles():
                raise BundleError(f"{path}: profiles {recorded} do not match the limits {limits}")
            return cls(
                version=d["version"],
                model=ModelConfig.from_dict(d["model"]),
                limits=limits,
                backend=d["backend"],
                dtype=d["dtype"],
                segments=tuple(
                    SegmentSpec(s["name"], s["onnx"], tuple(tuple(t) for t in s["inputs"]),
                                tuple(tuple(t) for t in s["outputs"]), s.get("plan"))
                    for s in d["segments"]
                ),
                state_weights=d["state_weights"],
                toolkit=d["toolkit"],
                target=d["target"],
                workarounds=tuple(d["workarounds"]),
                checksums=d["checksums"],
                tokenizer=d["tokenizer"],
                created_by=d.get("created_by", ""),
                trt_profiles=d.get("trt_profiles", {}),
                quantization=_quant_record(d.get("quantization")),
            )
        except (KeyError, TypeError) as e:
            raise BundleError(f"{path}: malformed manifest ({type(e).__name__}: {e})") from e


def _quant_record(d: dict[str, Any] | None) -> Any:
    from .quant import QuantRecord  # quant imports this module

    return None if d is None else QuantRecord.from_dict(d)
