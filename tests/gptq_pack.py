"""The tests' own GPTQ writer and dequantiser, written from the format description (not the project's code).

Format (AutoGPTQ / GPTQModel ``checkpoint_format`` gptq and gptq_v2, ``pack_dtype`` int32; ``pack = 32 /
bits``, ``K`` input features, ``N`` output features, ``G`` groups):

* ``qweight`` int32 ``[K / pack, N]``: input row ``k`` sits in word ``k // pack`` at bit ``bits * (k % pack)``
* ``qzeros`` int32 ``[G, ceil(N / pack)]``: output ``n`` in word ``n // pack`` at bit ``bits * (n % pack)``;
  v1 (``gptq``) stores ``(zero - 1) & mask``, v2 stores ``zero``
* ``scales`` float16 ``[G, N]``; ``g_idx`` int32 ``[K]``: the group of each input row
* ``w[n, k] = (q[k, n] - zero[g_idx[k], n]) * scale[g_idx[k], n]``; ``sym`` puts the zero at ``2^(bits-1)``

:func:`quantize_rtn` is a round-to-nearest quantiser (no Hessian: GPTQ's packing, not its solver);
``desc_act`` draws a random act order, so ``g_idx`` is a permutation of ``k // group_size``.
"""

from __future__ import annotations

import json
import re
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hybrid_runtime.weights_io import SafetensorsFile, save_safetensors


@dataclass(frozen=True)
class Packed:
    qweight: np.ndarray
    qzeros: np.ndarray
    scales: np.ndarray
    g_idx: np.ndarray


def pack_along_rows(codes: np.ndarray, bits: int) -> np.ndarray:
    """uint codes ``[R, C]`` (R a multiple of pack) -> int32 ``[R / pack, C]``, low bits first."""
    pack = 32 // bits
    out = np.zeros((codes.shape[0] // pack, codes.shape[1]), np.uint32)
    for j in range(pack):
        out |= codes[j::pack].astype(np.uint32) << np.uint32(bits * j)
    return out.view(np.int32)


def pack_along_cols(codes: np.ndarray, bits: int) -> np.ndarray:
    """uint codes ``[R, C]`` -> int32 ``[R, ceil(C / pack)]`` (a partial last word is zero-filled)."""
    pack = 32 // bits
    padded = np.zeros((codes.shape[0], -(-codes.shape[1] // pack) * pack), np.uint32)
    padded[:, :codes.shape[1]] = codes
    return pack_along_rows(np.ascontiguousarray(padded.T), bits).T.copy()


def unpack_reference(p: Packed, bits: int, fmt: str, n_out: int) -> tuple[np.ndarray, np.ndarray]:
    """Codes ``[K, N]`` and zero-points ``[G, N]`` from the packed tensors, one element at a time in numpy."""
    mask = (1 << bits) - 1
    pack = 32 // bits
    qw = p.qweight.astype(np.int64) & 0xFFFFFFFF
    K = qw.shape[0] * pack
    codes = np.zeros((K, n_out), np.int64)
    for k in range(K):
        codes[k] = (qw[k // pack] >> (bits * (k % pack))) & mask
    qz = p.qzeros.astype(np.int64) & 0xFFFFFFFF
    zeros = np.zeros((qz.shape[0], n_out), np.int64)
    for n in range(n_out):
        zeros[:, n] = (qz[:, n // pack] >> (bits * (n % pack))) & mask
    if fmt == "gptq":
        zeros = (zeros + 1) & mask  # v1 stores zero - 1 (a zero of 0 is stored as all ones)
    return codes, zeros


def dequantize_reference(p: Packed, bits: int, fmt: str) -> np.ndarray:
    """The float32 ``[N, K]`` weight (nn.Linear layout) of packed GPTQ tensors."""
    n_out = p.scales.shape[1]
    codes, zeros = unpack_reference(p, bits, fmt, n_out)
    g = p.g_idx.astype(np.int64)
    s = p.scales.astype(np.float32)
    w = (codes.astype(np.float32) - zeros[g].astype(np.float32)) * s[g]  # [K, N]
    return np.ascontiguousarray(w.T.astype(np.float32))


def quantize_rtn(w: np.ndarray, bits: int, group_size: int, sym: bool, desc_act: bool, fmt: str,
                 rng: np.random.Generator) -> Packed:
    """Round-to-nearest GPTQ packing of a float ``[N, K]`` weight."""
    N, K = w.shape
    maxq = (1 << bits) - 1
    gs = K if group_size == -1 else group_size
    G = -(-K // gs)
    order = rng.permutation(K) if desc_act else np.arange(K)
    g_idx = np.empty(K, np.int32)
    g_idx[order] = np.arange(K) // gs  # the j-th column in act order belongs to group j // gs
    wt = w.T.astype(np.float32)  # [K, N]
    codes = np.zeros((K, N), np.int64)
    zeros = np.zeros((G, N), np.int64)
    scales = np.zeros((G, N), np.float16)
    for g in range(G):
        rows = np.nonzero(g_idx == g)[0]
        blk = wt[rows]
        lo, hi = np.minimum(blk.min(0), 0), np.maximum(blk.max(0), 0)
        if sym:
            amax = np.maximum(np.abs(lo), np.abs(hi))
            scale = np.where(amax > 0, 2 * amax / maxq, 1.0)
            zero = np.full(N, (maxq + 1) // 2)
        else:
            scale = np.where(hi > lo, (hi - lo) / maxq, 1.0)
            zero = np.clip(np.round(-lo / scale), 0, maxq).astype(np.int64)
        s16 = scale.astype(np.float16)
        scales[g], zeros[g] = s16, zero
        codes[rows] = np.clip(np.round(blk / s16.astype(np.float32)) + zero, 0, maxq)
    stored = (zeros - 1) & maxq if fmt == "gptq" else zeros
    return Packed(pack_along_rows(codes, bits), pack_along_cols(stored, bits), scales, g_idx)


# ---------------------------------------------------------------------------------------- checkpoints

# modules a GPTQ quantiser quantizes in this family (the router and the shared-expert gate stay float)
_QUANTIZABLE = re.compile(r".*\.(q_proj|k_proj|v_proj|o_proj|in_proj_qkvz|in_proj_ba|in_proj_qkv|in_proj_z|"
                          r"in_proj_b|in_proj_a|out_proj|gate_proj|up_proj|down_proj)$")


def module_rule(name: str, base: Mapping[str, Any], dynamic: Mapping[str, Any]) -> dict[str, Any] | None:
    """GPTQModel's dynamic rule for ``name``: the first matching pattern wins; ``-:`` = not quantized."""
    for pattern, override in dynamic.items():
        if pattern.startswith("-:"):
            if re.match(pattern[2:], name):
                return None
        elif re.match(pattern.removeprefix("+:"), name):
            return {**base, **override}
    return dict(base)


def write_gptq_checkpoint(float_dir: Path, gptq_dir: Path, dequant_dir: Path | None, *, bits: int = 4,
                          group_size: int = 32, sym: bool = True, desc_act: bool = False, fmt: str = "gptq",
                          dynamic: Mapping[str, Any] | None = None, lm_head: bool = False,
                          config_file: str = "config.json", seed: int = 0) -> dict[str, int]:
    """Quantize the float checkpoint in ``float_dir`` into ``gptq_dir`` (and write the float checkpoint of
    the dequantised weights into ``dequant_dir`` unless None: the model the quantized one must equal).
    Other files (tokenizer) are copied. Returns the module -> bits of what was quantized."""
    rng = np.random.default_rng(seed)
    dynamic = dict(dynamic or {})
    base = {"bits": bits, "group_size": group_size, "sym": sym, "desc_act": desc_act}
    tensors: dict[str, np.ndarray] = {}
    for path in sorted(float_dir.glob("*.safetensors")):
        f = SafetensorsFile(path)
        tensors.update({k: f.get(k) for k in f.keys()})  # noqa: SIM118 (not a dict)
    quant: dict[str, np.ndarray] = {}
    dequant: dict[str, np.ndarray] = {}
    done: dict[str, int] = {}
    for name, arr in tensors.items():
        module = name.removesuffix(".weight")
        rule = module_rule(module, base, dynamic) if name.endswith(".weight") else None
        quantizable = _QUANTIZABLE.match(module) or (lm_head and module == "lm_head")
        if rule is None or not quantizable or arr.ndim != 2:
            quant[name] = dequant[name] = arr
            continue
        # act order: modules that read the same input share it (GPTQ's permutation comes from that input)
        share = re.sub(r"\.(q_proj|k_proj|v_proj|in_proj_\w+|gate_proj|up_proj)$", ".<in>", module)
        p = quantize_rtn(arr, rule["bits"], rule["group_size"], rule["sym"], rule["desc_act"], fmt,
                         np.random.default_rng(zlib.crc32(share.encode()) + seed) if rule["desc_act"] else rng)
        quant.update({f"{module}.qweight": p.qweight, f"{module}.qzeros": p.qzeros, f"{module}.scales": p.scales,
                      f"{module}.g_idx": p.g_idx})
        if dequant_dir is not None:
            dequant[name] = dequantize_reference(p, rule["bits"], fmt)
        done[module] = rule["bits"]
    for d, t in ((gptq_dir, quant), (dequant_dir, dequant)):
        if d is None:
            continue
        d.mkdir(parents=True, exist_ok=True)
        save_safetensors(d / "model.safetensors", t)
        for other in float_dir.iterdir():
            if other.is_file() and other.suffix != ".safetensors":
                (d / other.name).write_bytes(other.read_bytes())
    qc = {"quant_method": "gptq", "bits": bits, "group_size": group_size, "sym": sym, "desc_act": desc_act,
          "checkpoint_format": fmt, "pack_dtype": "int32", "lm_head": lm_head, "dynamic": dynamic}
    if config_file == "config.json":
        raw = json.loads((float_dir / "config.json").read_text())
        raw["quantization_config"] = qc
        (gptq_dir / "config.json").write_text(json.dumps(raw, indent=2))
    else:  # AutoGPTQ's quantize_config.json beside a plain config.json
        qc.pop("quant_method")
        (gptq_dir / "quantize_config.json").write_text(json.dumps(qc, indent=2))
    return done


# ---------------------------------------------------------------------------------------- MatMulNBits layout


def nbits_reference(B: np.ndarray, scales: np.ndarray, zp: np.ndarray | None, perm: np.ndarray | None,
                    meta: np.ndarray) -> np.ndarray:
    """The float32 ``[N, k_in]`` weight of one stored MatMulNBits-layout weight, written from the layout's
    description (com.microsoft.MatMulNBits; ``meta`` = ``[K, N, bits, block_size, accuracy_level, k_in]``):

    * ``B`` uint8 ``[N, nb, block_size * bits / 8]``, nb = ceil(K / block_size): the codes of row n along K;
      4-bit: code k in byte k // 2, the low nibble for even k
    * ``scales`` float32 ``[N * nb]``: row n, block b at n * nb + b
    * ``zp`` uint8: 4-bit ``[N * ceil(nb / 2)]``, block b of row n in byte n * ceil(nb / 2) + b // 2, low nibble
      for even b; 8-bit ``[N * nb]``; absent: every zero-point is 2^(bits - 1)
    * ``perm`` ``[K]``: op column k is input column perm[k] (k_in: padding, no weight); absent: the identity

    ``w[n, perm[k]] = (code(n, k) - zero(n, k // bs)) * scale(n, k // bs)``, computed column by column."""
    K, N, bits, bs, _, k_in = (int(v) for v in meta)
    nb = -(-K // bs)
    rows = np.asarray(B, np.uint8).reshape(N, nb * bs * bits // 8)
    s = np.asarray(scales, np.float32).reshape(N, nb)
    out = np.zeros((N, k_in), np.float32)
    seen = np.zeros(k_in, bool)
    for k in range(K):
        if bits == 4:
            byte = rows[:, k // 2].astype(np.int64)
            q = (byte >> 4) if k % 2 else (byte & 15)
        else:
            q = rows[:, k].astype(np.int64)
        b = k // bs
        if zp is None:
            z = np.full(N, 1 << (bits - 1), np.int64)
        elif bits == 4:
            zb = np.asarray(zp, np.uint8).reshape(N, -(-nb // 2))[:, b // 2].astype(np.int64)
            z = (zb >> 4) if b % 2 else (zb & 15)
        else:
            z = np.asarray(zp, np.uint8).reshape(N, nb)[:, b].astype(np.int64)
        col = int(perm[k]) if perm is not None else k
        if col == k_in:
            continue
        assert not seen[col], f"input column {col} read twice"
        seen[col] = True
        out[:, col] = (q - z).astype(np.float32) * s[:, b]
    assert seen.all(), "an input column has no weight"
    return out


def stored_weight_reference(f: Any, name: str) -> np.ndarray | None:
    """The float32 runtime weight ``name`` of a GPTQ ``cuda`` bundle's safetensors file ``f`` (a
    ``SafetensorsFile``) as stored: float (widened), packed (``<name>.nbits_*``, stacked experts on axis 0) or
    per part (``<name>.parts`` rows, ``<name>.part<i>`` float or packed); None if absent."""
    h = f.header

    def packed(prefix: str) -> np.ndarray:
        get = lambda k: f.raw(f"{prefix}.nbits_{k}") if f"{prefix}.nbits_{k}" in h else None  # noqa: E731
        meta, B, s, z, p = get("meta"), get("B"), get("scales"), get("zp"), get("perm")
        N = int(meta[1])
        if B.ndim == 3 and B.shape[0] == N:  # one weight
            return nbits_reference(B, s, z, p, meta)
        return np.stack([nbits_reference(B[e], s[e], None if z is None else z[e], None if p is None else p[e], meta)
                         for e in range(B.shape[0])])

    if name in h:
        return f.get(name)
    if f"{name}.nbits_meta" in h:
        return packed(name)
    if f"{name}.parts" in h:
        parts = [f.get(f"{name}.part{i}") if f"{name}.part{i}" in h else packed(f"{name}.part{i}")
                 for i in range(len(f.raw(f"{name}.parts")))]
        assert [p.shape[-2] for p in parts] == f.raw(f"{name}.parts").tolist()
        return np.concatenate(parts, axis=-2)
    return None
