"""Hugging Face GPTQ checkpoints: the quantization config and the packed tensors of one linear module.

Supported (anything else is a :class:`GPTQError` that lists this): ``quant_method`` ``gptq`` from
``quantization_config`` in config.json or a ``quantize_config.json``; ``bits`` 4 and 8; ``group_size``
32 / 64 / 128 / -1 (any positive size is read); ``sym`` true or false; ``desc_act`` with ``g_idx``;
``checkpoint_format`` ``gptq`` (v1: zero-points stored minus one) and ``gptq_v2`` (stored as they are);
``pack_dtype`` int32; GPTQModel's ``dynamic`` per-module overrides (``+:regex`` or ``regex``: override
bits / group_size / sym / desc_act; ``-:regex``: the module stays float), the first matching pattern wins,
matched with ``re.match`` against the module's name as stored (``model.layers.0.self_attn.q_proj``);
``lm_head`` quantized or not.

A module is quantized when the checkpoint stores ``<module>.qweight``; its bits and group size come from
the config (with the dynamic override) and are checked against the tensor shapes. Tensors (``pack = 32 //
bits``; ``K`` input features, ``N`` output features, ``G`` groups):

* ``qweight`` int32 ``[K / pack, N]``: code of input ``k`` is bits ``bits * (k % pack)`` up of row ``k // pack``
* ``qzeros`` int32 ``[G, N / pack]``: zero-point of output ``n`` in word ``n // pack``, low bits first
* ``scales`` float16 ``[G, N]``; ``g_idx`` int32 ``[K]`` (absent: ``k // group_size``)

``w[n, k] = (code[k, n] - zero[g_idx[k], n]) * scale[g_idx[k], n]``. v1 stores ``zero - 1`` masked to
``bits``: the zero-point is ``(stored + 1) mod 2^bits`` (a zero-point of 0 was stored as all ones).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from hybrid_runtime.config import ConfigError
from hybrid_runtime.quant import SUPPORTED_BITS, QuantLinear

SUPPORTED = ("quant_method gptq; bits 4 or 8; group_size a positive size (32/64/128) or -1; sym true/false; "
             "desc_act with g_idx; checkpoint_format gptq or gptq_v2; pack_dtype int32; GPTQModel dynamic "
             "overrides; lm_head quantized or not")
_FORMATS = ("gptq", "gptq_v2")


class GPTQError(ConfigError):
    """A quantized checkpoint this project cannot run (the message lists what it supports)."""


def _unsupported(what: str) -> GPTQError:
    return GPTQError(f"unsupported quantized checkpoint: {what}. Supported: {SUPPORTED}")


@dataclass(frozen=True, slots=True)
class ModuleQuant:
    """The quantization of one module after the dynamic override."""

    bits: int
    group_size: int
    sym: bool
    desc_act: bool


@dataclass(frozen=True, slots=True)
class GPTQScheme:
    """A checkpoint's GPTQ config (see the module docstring)."""

    bits: int
    group_size: int
    sym: bool
    desc_act: bool
    checkpoint_format: str
    lm_head: bool
    dynamic: dict[str, Any] = field(default_factory=dict)

    def module(self, name: str) -> ModuleQuant | None:
        """The quantization of the module stored as ``name`` (no ``.qweight``); None = left in float."""
        base = ModuleQuant(self.bits, self.group_size, self.sym, self.desc_act)
        for pattern, override in self.dynamic.items():
            if pattern.startswith("-:"):
                if re.match(pattern[2:], name):
                    return None
            elif re.match(pattern.removeprefix("+:"), name):
                o = override or {}
                unknown = set(o) - {"bits", "group_size", "sym", "desc_act", "damp_percent", "mse",
                                    "v2", "v2_alpha", "act_group_aware", "adapter"}
                if unknown:
                    raise _unsupported(f"dynamic override {pattern!r} sets {sorted(unknown)}")
                m = ModuleQuant(int(o.get("bits", base.bits)), int(o.get("group_size", base.group_size)),
                                bool(o.get("sym", base.sym)), bool(o.get("desc_act", base.desc_act)))
                _check_bits_group(m.bits, m.group_size, f"dynamic override {pattern!r}")
                return m
        return base

    def record(self) -> dict[str, Any]:
        return {"method": "gptq", "bits": self.bits, "group_size": self.group_size, "sym": self.sym,
                "desc_act": self.desc_act, "checkpoint_format": self.checkpoint_format, "lm_head": self.lm_head,
                "dynamic": dict(self.dynamic)}


def _check_bits_group(bits: int, group_size: int, where: str) -> None:
    if bits not in SUPPORTED_BITS:
        raise _unsupported(f"{where}: bits={bits}")
    if group_size != -1 and group_size <= 0:
        raise _unsupported(f"{where}: group_size={group_size}")


def read_scheme(directory: str | Path) -> GPTQScheme | None:
    """The GPTQ config of the checkpoint in ``directory``; None for a float checkpoint."""
    d = Path(directory)
    raw = json.loads((d / "config.json").read_text())
    qc = raw.get("quantization_config")
    if qc is None and isinstance(raw.get("text_config"), dict):
        qc = raw["text_config"].get("quantization_config")
    if qc is None and (d / "quantize_config.json").is_file():
        qc = json.loads((d / "quantize_config.json").read_text())
        qc.setdefault("quant_method", "gptq")  # AutoGPTQ's quantize_config.json predates the key
    if qc is None:
        return None
    method = str(qc.get("quant_method", "")).lower()
    if method != "gptq":
        raise _unsupported(f"quant_method={qc.get('quant_method')!r}")
    if qc.get("is_marlin_format"):
        raise _unsupported("is_marlin_format=true (marlin-repacked weights)")
    fmt = str(qc.get("checkpoint_format", qc.get("format", "gptq"))).lower()
    if fmt not in _FORMATS:
        raise _unsupported(f"checkpoint_format={fmt!r}")
    pack = str(qc.get("pack_dtype", "int32")).removeprefix("torch.")
    if pack != "int32":
        raise _unsupported(f"pack_dtype={qc.get('pack_dtype')!r}")
    bits, gs = int(qc.get("bits", 4)), int(qc.get("group_size", 128))
    _check_bits_group(bits, gs, "quantization config")
    dynamic = qc.get("dynamic") or {}
    if not isinstance(dynamic, dict):
        raise _unsupported(f"dynamic={dynamic!r} (expected a mapping of module patterns)")
    for pattern in dynamic:
        try:
            re.compile(pattern.removeprefix("-:").removeprefix("+:"))
        except re.error as e:
            raise _unsupported(f"dynamic pattern {pattern!r} is not a regular expression ({e})") from e
    return GPTQScheme(bits, gs, bool(qc.get("sym", True)), bool(qc.get("desc_act", False)), fmt,
                      bool(qc.get("lm_head", False)), dict(dynamic))


# ---------------------------------------------------------------------------------------- unpacking


def unpack_rows(packed: np.ndarray, bits: int) -> np.ndarray:
    """int32 ``[R, C]`` packed along axis 0 (``32 // bits`` codes a word, low bits first) -> uint8
    ``[R * pack, C]``."""
    pack = 32 // bits
    u = np.asarray(packed).view(np.uint32) if packed.dtype == np.int32 else np.asarray(packed, np.uint32)
    shifts = (np.arange(pack, dtype=np.uint32) * bits)[None, :, None]
    codes = (u[:, None, :] >> shifts) & np.uint32((1 << bits) - 1)  # [R, pack, C]
    return codes.reshape(-1, u.shape[1]).astype(np.uint8)


def unpack_cols(packed: np.ndarray, bits: int) -> np.ndarray:
    """int32 ``[R, C]`` packed along axis 1 -> uint8 ``[R, C * pack]``."""
    return np.ascontiguousarray(unpack_rows(np.ascontiguousarray(np.asarray(packed).T), bits).T)


def unpack_module(qweight: np.ndarray, qzeros: np.ndarray, scales: np.ndarray, g_idx: np.ndarray | None,
                  bits: int, group_size: int, fmt: str) -> QuantLinear:
    """The packed GPTQ tensors of one module -> :class:`QuantLinear` (``[N, K]`` rows = output features)."""
    codes = unpack_rows(qweight, bits)  # [K, N]
    K, N = codes.shape
    zeros = unpack_cols(qzeros, bits)[:, :N]  # [G, N]
    if fmt == "gptq":
        zeros = ((zeros.astype(np.int32) + 1) & ((1 << bits) - 1)).astype(np.uint8)
    if g_idx is None:
        g_idx = (np.arange(K) // (K if group_size == -1 else group_size)).astype(np.int32)
    return QuantLinear(np.ascontiguousarray(codes.T), np.ascontiguousarray(np.asarray(scales, np.float32).T),
                       np.ascontiguousarray(zeros.T), np.asarray(g_idx, np.int32), bits)


def expected_shapes(K: int, N: int, m: ModuleQuant) -> dict[str, tuple[int, ...]]:
    """The stored shapes of a module quantized as ``m``."""
    pack = 32 // m.bits
    G = 1 if m.group_size == -1 else -(-K // m.group_size)
    return {"qweight": (K // pack, N), "qzeros": (G, -(-N // pack)), "scales": (G, N), "g_idx": (K,)}
