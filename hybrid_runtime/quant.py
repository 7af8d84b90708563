"""Weight-only block-quantized linear weights (GPTQ int4 / int8): one canonical form, the MatMulNBits layout.

The builder reads a GPTQ checkpoint (``builder/gptq.py``) into :class:`QuantLinear`, an *unpacked* form
indexed like a float ``nn.Linear`` weight ``[N, K]`` (output rows, input columns), so that the row
shuffles of the checkpoint reader (Qwen3-Next's grouped ``in_proj_qkvz``, expert stacking) and the fused
layouts of the programs (``[q | k | v]``, ``[gate | up]``) are plain row operations on it:

    w[n, k] = (q[n, k] - zeros[n, g_idx[k]]) * scales[n, g_idx[k]]          (float32, exact)

The float32 product is exact: ``q - zeros`` is an integer of at most 9 bits and a GPTQ scale is a float16
(11 significant bits), so the product has at most 20 significant bits.

The CPU runs it through onnxruntime's ``com.microsoft.MatMulNBits`` (:func:`to_nbits`): ``B`` uint8
``[N, n_blocks, block_size * bits / 8]`` (codes packed low bits first along K), ``scales`` float32
``[N * n_blocks]``, ``zero_points`` uint8 packed along the blocks (4-bit: two per byte, low nibble first;
8-bit: one per byte), omitted when every zero-point is the op's default ``2^(bits-1)`` (symmetric GPTQ).
MatMulNBits has no act-order input (its ``g_idx`` is deprecated), so a ``g_idx`` that is not the identity
order (``desc_act``) is handled at build time: the input columns are sorted by group (stably), groups
are padded to whole blocks where they do not fill them, and the op reads ``x[:, perm]`` (``perm`` may name
a zero column ``K``). That is the same function: every product ``x[k] * w[n, k]`` is summed, only in
another order.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .config import BundleError

SUPPORTED_BITS = (4, 8)
BLOCK_SIZES = (128, 64, 32, 16)  # MatMulNBits block sizes we emit (powers of two >= 16), largest first
# MatMulNBits accuracy_level: the type the activations are multiplied in. 0 = float32 (A is not
# quantized: parity with the float model); 4 = int8 (A quantized per block, MLAS's fast integer kernels).
ACCURACY_LEVELS = {"fp32": 0, "int8": 4}
# A ``cuda`` bundle's activations: the bundle dtype (the packed weights are dequantised at load into it and every
# GEMM reads activations of that type); its tensors' ``nbits_meta`` accuracy_level is 0.
CUDA_ACTIVATIONS = ("float32", "float16", "bfloat16")
NBITS_SUFFIXES = ("nbits_B", "nbits_scales", "nbits_zp", "nbits_perm", "nbits_meta")


@dataclass(frozen=True, eq=False)
class QuantLinear:
    """A block-quantized ``[N, K]`` linear weight, unpacked (see the module docstring).

    ``q`` uint8 ``[N, K]`` codes in ``0 .. 2^bits - 1``; ``scales`` float32 ``[N, G]``; ``zeros`` uint8
    ``[N, G]`` (the zero-points themselves: GPTQ v1's stored-minus-one is undone by the reader);
    ``g_idx`` int32 ``[K]``, the group of every input column.
    """

    q: np.ndarray
    scales: np.ndarray
    zeros: np.ndarray
    g_idx: np.ndarray
    bits: int

    def __post_init__(self) -> None:
        N, K = self.q.shape
        G = self.scales.shape[1]
        assert self.bits in SUPPORTED_BITS, self.bits
        assert self.q.dtype == np.uint8 and self.zeros.dtype == np.uint8, (self.q.dtype, self.zeros.dtype)
        assert self.scales.shape == self.zeros.shape == (N, G), (self.scales.shape, self.zeros.shape, N, G)
        assert self.g_idx.shape == (K,), (self.g_idx.shape, K)

    @property
    def shape(self) -> tuple[int, int]:
        return self.q.shape  # type: ignore[return-value]

    def dequantize(self) -> np.ndarray:
        """The float32 ``[N, K]`` weight."""
        g = self.g_idx
        return ((self.q.astype(np.float32) - self.zeros[:, g].astype(np.float32))
                * self.scales[:, g].astype(np.float32)).astype(np.float32)

    def rows(self, index: np.ndarray | slice) -> QuantLinear:
        """The output rows ``index`` (a new weight; the column grouping is shared)."""
        return QuantLinear(np.ascontiguousarray(self.q[index]), np.ascontiguousarray(self.scales[index]),
                           np.ascontiguousarray(self.zeros[index]), self.g_idx, self.bits)

    def fuses_with(self, other: QuantLinear) -> bool:
        """Whether ``self`` and ``other`` can be stacked by rows into one weight (same bits, same grouping)."""
        return (self.bits == other.bits and self.shape[1] == other.shape[1]
                and self.scales.shape[1] == other.scales.shape[1] and np.array_equal(self.g_idx, other.g_idx))


@dataclass(frozen=True, eq=False)
class LinearParts:
    """A fused weight whose row blocks cannot share one quantized matmul (float and quantized parts, or
    quantized parts with different bits or column grouping): ``y = concat([x @ part.T for part])``."""

    parts: tuple[np.ndarray | QuantLinear, ...]

    @property
    def shape(self) -> tuple[int, int]:
        return sum(p.shape[0] for p in self.parts), self.parts[0].shape[1]

    def dequantize(self) -> np.ndarray:
        return np.concatenate([as_float(p) for p in self.parts], axis=0)


@dataclass(frozen=True, eq=False)
class QuantExperts:
    """One projection of every routed expert of a MoE layer, ``[E, N, K]``, with at least one expert
    quantized (``items``: one ``[N, K]`` weight per expert)."""

    items: tuple[Any, ...]

    @property
    def shape(self) -> tuple[int, int, int]:
        return (len(self.items), *self.items[0].shape)

    def dequantize(self) -> np.ndarray:
        return np.stack([as_float(i) for i in self.items])


Linear = np.ndarray | QuantLinear | LinearParts


def is_quantized(w: Any) -> bool:
    return isinstance(w, QuantLinear | LinearParts | QuantExperts)


def bits_of(w: Any) -> set[int]:
    """The bit widths a weight is quantized with (empty for a float weight)."""
    if isinstance(w, QuantLinear):
        return {w.bits}
    if isinstance(w, LinearParts | QuantExperts):
        parts = w.parts if isinstance(w, LinearParts) else w.items
        return set().union(*(bits_of(p) for p in parts))
    return set()


def as_float(w: Any) -> np.ndarray:
    """The float32 form of any weight (a quantized one is dequantized)."""
    return w.dequantize() if is_quantized(w) else np.asarray(w, np.float32)


def take_rows(w: Any, index: np.ndarray | slice) -> Any:
    """Rows ``index`` of a float or quantized ``[N, K]`` weight."""
    return w.rows(index) if isinstance(w, QuantLinear) else w[index]


def concat_rows(parts: Sequence[Any]) -> Any:
    """Stack ``[N_i, K]`` weights by rows: a float array if all are float, one :class:`QuantLinear` if all
    are quantized alike, else :class:`LinearParts` (adjacent alike parts merged)."""
    merged: list[Any] = []
    for p in parts:
        if isinstance(p, LinearParts):
            for sub in p.parts:
                _append(merged, sub)
        else:
            _append(merged, p)
    if len(merged) == 1:
        return merged[0]
    return LinearParts(tuple(merged))


def _append(merged: list[Any], p: Any) -> None:
    last = merged[-1] if merged else None
    if isinstance(p, QuantLinear) and isinstance(last, QuantLinear) and last.fuses_with(p):
        merged[-1] = QuantLinear(np.concatenate([last.q, p.q]), np.concatenate([last.scales, p.scales]),
                                 np.concatenate([last.zeros, p.zeros]), last.g_idx, last.bits)
    elif isinstance(p, np.ndarray) and isinstance(last, np.ndarray):
        merged[-1] = np.concatenate([last, np.asarray(p, np.float32)], axis=0)
    else:
        merged.append(p if isinstance(p, QuantLinear) else np.asarray(p, np.float32))


# ---------------------------------------------------------------------------------------- MatMulNBits layout


@dataclass(frozen=True, eq=False)
class NBitsWeight:
    """One :class:`QuantLinear` in ``com.microsoft.MatMulNBits`` layout (see the module docstring).

    ``K`` is the op's K (the input width after ``perm``); ``perm`` int64 ``[K]`` (None = identity, no
    gather) selects the input columns, the value ``k_in`` (the layer's input width) naming a zero column.
    """

    B: np.ndarray
    scales: np.ndarray
    zero_points: np.ndarray | None
    perm: np.ndarray | None
    K: int
    N: int
    bits: int
    block_size: int
    k_in: int

    def meta(self, accuracy_level: int) -> np.ndarray:
        """``[K, N, bits, block_size, accuracy_level, k_in]`` int64: what a reader of stored tensors needs."""
        return np.array([self.K, self.N, self.bits, self.block_size, accuracy_level, self.k_in], np.int64)


def _block_plan(g_sorted: np.ndarray) -> tuple[int, np.ndarray]:
    """Block size and, per padded column, the sorted column it reads (-1 = padding) for sorted groups."""
    _, counts = np.unique(g_sorted, return_counts=True)
    for bs in BLOCK_SIZES:
        if np.all(counts[:-1] % bs == 0):
            return bs, np.arange(g_sorted.size)
    bs = 32  # irregular groups: pad every group but the last to whole 32-column blocks
    cols: list[np.ndarray] = []
    start = 0
    for i, c in enumerate(counts):
        cols.append(np.arange(start, start + c))
        if i < len(counts) - 1 and c % bs:
            cols.append(np.full(bs - c % bs, -1))
        start += c
    return bs, np.concatenate(cols)


def to_nbits(w: QuantLinear) -> NBitsWeight:
    """The MatMulNBits tensors of ``w`` (same function; see the module docstring)."""
    N, k_in = w.shape
    g = w.g_idx.astype(np.int64)
    order = np.arange(k_in) if np.all(np.diff(g) >= 0) else np.argsort(g, kind="stable")
    bs, cols = _block_plan(g[order])
    pad = cols < 0
    src = np.where(pad, 0, order[np.where(pad, 0, cols)])
    perm = np.where(pad, k_in, src).astype(np.int64)
    K = perm.size
    nb = -(-K // bs)
    # codes in op order; padding columns get their block's zero-point (weight exactly 0; x is 0 there too)
    col_group = np.where(pad, -1, g[src])
    block_group = np.array([col_group[b * bs:(b + 1) * bs][col_group[b * bs:(b + 1) * bs] >= 0][0]
                            for b in range(nb)], np.int64)
    assert all(np.all(col_group[b * bs:(b + 1) * bs][~pad[b * bs:(b + 1) * bs]] == block_group[b])
               for b in range(nb)), "a block spans two groups"
    zeros = w.zeros[:, block_group]  # [N, nb]
    q = np.empty((N, nb * bs), np.uint8)
    q[:, :K] = w.q[:, src]
    q[:, :K][:, pad] = np.repeat(zeros, bs, axis=1)[:, :K][:, pad]
    q[:, K:] = np.repeat(zeros, bs, axis=1)[:, K:]  # the tail of a partial last block
    if w.bits == 4:
        B = (q[:, 0::2] | (q[:, 1::2] << 4)).reshape(N, nb, bs // 2)
    else:
        B = q.reshape(N, nb, bs)
    scales = np.ascontiguousarray(w.scales[:, block_group], np.float32).reshape(-1)
    zp: np.ndarray | None = None
    if not np.all(zeros == 1 << (w.bits - 1)):
        if w.bits == 4:
            zz = np.concatenate([zeros, np.zeros((N, nb % 2), np.uint8)], axis=1) if nb % 2 else zeros
            zp = (zz[:, 0::2] | (zz[:, 1::2] << 4)).reshape(-1)
        else:
            zp = np.ascontiguousarray(zeros).reshape(-1)
    identity = k_in == K and np.array_equal(perm, np.arange(k_in))
    return NBitsWeight(np.ascontiguousarray(B), scales, zp, None if identity else perm, K, N, w.bits, bs, k_in)


def nbits_dequantize(B: np.ndarray, scales: np.ndarray, zero_points: np.ndarray | None, perm: np.ndarray | None,
                     meta: np.ndarray) -> np.ndarray:
    """The float32 ``[N, k_in]`` weight of stored MatMulNBits tensors (``meta`` from :meth:`NBitsWeight.meta`):
    ``x @ result.T`` is what the op computes on ``x [T, k_in]``."""
    K, N, bits, bs, _, k_in = (int(v) for v in meta)
    nb = -(-K // bs)
    B = np.asarray(B, np.uint8).reshape(N, -1)
    q = np.stack([B & 15, B >> 4], axis=-1).reshape(N, -1) if bits == 4 else B
    if zero_points is None:
        z = np.full((N, nb), 1 << (bits - 1), np.uint8)
    elif bits == 4:
        zb = np.asarray(zero_points, np.uint8).reshape(N, -1)
        z = np.stack([zb & 15, zb >> 4], axis=-1).reshape(N, -1)[:, :nb]
    else:
        z = np.asarray(zero_points, np.uint8).reshape(N, nb)
    s = np.asarray(scales, np.float32).reshape(N, nb)
    w_op = ((q.astype(np.float32) - np.repeat(z, bs, 1)) * np.repeat(s, bs, 1))[:, :K]
    if perm is None:
        return w_op.astype(np.float32)
    w = np.zeros((N, k_in + 1), np.float32)
    np.add.at(w.T, np.asarray(perm), w_op.T)  # a column read twice would add (perm has no repeats but k_in)
    return w[:, :k_in]


def _harmonize(ws: Sequence[NBitsWeight]) -> list[NBitsWeight]:
    """Experts that differ only in having default zero-points or an identity order get them written out, so
    they stack with the others (the same function)."""
    with_zp, with_perm = any(w.zero_points is not None for w in ws), any(w.perm is not None for w in ws)
    out = []
    for w in ws:
        zp, perm = w.zero_points, w.perm
        if with_zp and zp is None:
            nb = -(-w.K // w.block_size)
            mid = 1 << (w.bits - 1)
            zp = (np.full(w.N * -(-nb // 2), mid | (mid << 4), np.uint8) if w.bits == 4
                  else np.full(w.N * nb, mid, np.uint8))
        if with_perm and perm is None and w.k_in == w.K:
            perm = np.arange(w.K, dtype=np.int64)
        out.append(NBitsWeight(w.B, w.scales, zp, perm, w.K, w.N, w.bits, w.block_size, w.k_in))
    return out


def nbits_tensors(prefix: str, ws: Sequence[NBitsWeight], accuracy_level: int, stacked: bool) -> dict[str, np.ndarray]:
    """The state-weight tensors of one quantized weight (``stacked``: one per expert, stacked on axis 0).
    Every expert must share K, N, bits, block size and whether it has zero-points / a permutation."""
    ws = _harmonize(ws)
    first = ws[0]
    key = lambda w: (w.K, w.N, w.bits, w.block_size, w.zero_points is None, w.perm is None)  # noqa: E731
    if any(key(w) != key(first) for w in ws):
        raise BundleError(f"{prefix}: experts quantized differently (bits, group size, zero-points or act "
                          "order); one MoE layer's experts must share one quantization")
    pick = (lambda arrs: np.stack(arrs)) if stacked else (lambda arrs: arrs[0])
    out = {f"{prefix}.nbits_B": pick([w.B for w in ws]), f"{prefix}.nbits_scales": pick([w.scales for w in ws]),
           f"{prefix}.nbits_meta": first.meta(accuracy_level)}
    if first.zero_points is not None:
        out[f"{prefix}.nbits_zp"] = pick([w.zero_points for w in ws])
    if first.perm is not None:
        out[f"{prefix}.nbits_perm"] = pick([w.perm for w in ws])
    return out


# ---------------------------------------------------------------------------------------- manifest record


@dataclass(frozen=True, slots=True)
class QuantRecord:
    """``manifest.json``'s ``quantization``: what the builder read and how the bundle runs it.

    ``modules``: canonical weight name -> bits, for every weight that runs quantized (the rest run in
    float32); ``activations``: ``fp32`` | ``int8`` (MatMulNBits ``accuracy_level`` 0 | 4) for an onnxruntime
    bundle, the bundle dtype (``float32`` | ``float16`` | ``bfloat16``, :data:`CUDA_ACTIVATIONS`) for a ``cuda``
    bundle, whose ``modules`` are the weights stored packed (dequantised into that dtype at load);
    ``fallbacks``: weights the checkpoint quantizes but this bundle stores dequantized, with the reason.
    """

    method: str
    bits: int
    group_size: int
    sym: bool
    desc_act: bool
    checkpoint_format: str
    activations: str
    modules: Mapping[str, int]
    lm_head: bool = False
    dynamic: Mapping[str, Any] = field(default_factory=dict)
    fallbacks: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.method != "gptq":
            raise BundleError(f"quantization method {self.method!r} is not supported by this runtime (gptq)")
        if self.bits not in SUPPORTED_BITS or any(b not in SUPPORTED_BITS for b in self.modules.values()):
            raise BundleError(f"quantization bits {self.bits} / {sorted(set(self.modules.values()))}: this runtime "
                              f"runs {SUPPORTED_BITS}")
        if self.activations not in (*ACCURACY_LEVELS, *CUDA_ACTIVATIONS):
            raise BundleError(f"quantization activations {self.activations!r}: choose {', '.join(ACCURACY_LEVELS)} "
                              f"(onnxruntime) or {', '.join(CUDA_ACTIVATIONS)} (cuda: the bundle dtype)")

    @property
    def accuracy_level(self) -> int:
        """MatMulNBits ``accuracy_level`` (0 for a cuda bundle's record)."""
        return ACCURACY_LEVELS.get(self.activations, 0)

    def to_dict(self) -> dict[str, Any]:
        return {"method": self.method, "bits": self.bits, "group_size": self.group_size, "sym": self.sym,
                "desc_act": self.desc_act, "checkpoint_format": self.checkpoint_format,
                "activations": self.activations, "lm_head": self.lm_head, "dynamic": dict(self.dynamic),
                "modules": dict(self.modules), "fallbacks": dict(self.fallbacks)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> QuantRecord:
        try:
            return cls(**dict(d))
        except TypeError as e:
            raise BundleError(f"malformed quantization record in the manifest: {e}") from e


def check_state_weights(record: QuantRecord | None, names: Sequence[str], meta: Mapping[str, np.ndarray]) -> None:
    """Refuse state weights that do not match the manifest's quantization record: a quantized tensor the
    record does not list, a listed one stored in float, or other bits / activation type.
    ``names``: every stored tensor name; ``meta``: ``<weight>.nbits_meta`` arrays by weight name."""
    stored_quant = {n.removesuffix(".nbits_meta") for n in names if n.endswith(".nbits_meta")}
    if record is None:
        if stored_quant:
            raise BundleError(f"state weights hold quantized tensors ({sorted(stored_quant)[:3]} ...) but the "
                              "manifest records no quantization: rebuild the bundle")
        return
    if record.activations not in ACCURACY_LEVELS:
        raise BundleError(f"the quantization record says {record.activations} activations: a cuda bundle's record, "
                          f"this runtime runs {', '.join(ACCURACY_LEVELS)}: rebuild the bundle")
    for name in stored_quant:
        m = meta[name]
        canon = _canonical_modules(name)
        want = {record.modules.get(c) for c in canon}
        if None in want or want != {int(m[2])}:
            raise BundleError(f"state weight {name}: stored as {int(m[2])}-bit, the manifest's quantization "
                              f"record says {sorted(str(w) for w in want)} for {canon}: rebuild the bundle")
        if int(m[4]) != record.accuracy_level:
            raise BundleError(f"state weight {name}: built for accuracy_level {int(m[4])}, the manifest says "
                              f"{record.activations} activations: rebuild the bundle")
    for name in names:
        if name.endswith(".nbits_meta") or name.split(".")[-1] in NBITS_SUFFIXES:
            continue
        for c in _canonical_modules(name):
            if c in record.modules:
                raise BundleError(f"state weight {name} is stored in float but the manifest records {c} as "
                                  f"{record.modules[c]}-bit: rebuild the bundle")


def _canonical_modules(state_name: str) -> tuple[str, ...]:
    """The canonical checkpoint weights a state weight is made of."""
    if state_name.endswith(".experts.gate_up_proj"):
        p = state_name.removesuffix("gate_up_proj")
        return (p + "gate_proj", p + "up_proj")
    return (state_name,)
