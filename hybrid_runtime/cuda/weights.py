"""The runtime weights of a ``cuda`` bundle in GPU memory, in the layout the executor reads.

:meth:`DeviceWeights.load` copies ``weights.safetensors`` (memory-mapped, one tensor at a time) to the
device; :meth:`DeviceWeights.random` fills the same layout on the device with seeded pseudo-random values
(the benchmarks' 70 GB models never touch the host). Per MoE layer the executor gets one
:class:`MoEWeights`: the router with the shared expert's gate row appended (one GEMM gives both), and the
experts stacked ``[E_all, 2I, H]`` / ``[E_all, H, I]`` where, when the shared expert has the experts' width,
it is expert ``E`` (``fold``: every token routes to it with weight sigmoid(gate)), so the routed kernels
serve it too.

A GPTQ bundle's packed weights (``cuda/quant.py``) are uploaded and dequantised on the device into the same
layout in the bundle dtype, so every kernel runs unchanged; ``keep_packed`` keeps the device copies of the packed
tensors in :attr:`DeviceWeights.packed` (for W4A16 / W8A16 kernels) instead of freeing them, and :attr:`nbytes`
counts them. ``packed_linears`` keeps the segments' dense linear weights that are stored packed whole (not MoE
weights, not per-part ones) ONLY packed (:attr:`DeviceWeights.packed_only`, no float copy): the backend runs them
with the int4 / int8 decode GEMM and, for prefill, dequantises them into a scratch buffer per GEMM.
``dual_linears`` keeps the same weights in BOTH forms: dequantised in :attr:`DeviceWeights.arrays` as without it (every
byte there as a plain load writes it) and packed in :attr:`DeviceWeights.packed_decode` (the stored tensors): the
backend reads the packed form in decode GEMMs of few rows (4x / 2x fewer bytes at int4 / int8) and the dequantised
one everywhere else (prefill and larger decode steps on cuBLASLt, no scratch), for the packed bytes' extra memory.
``packed_experts`` keeps the MoE layers whose experts stack as one packed operand (:func:`packed_layer_experts`:
every expert weight, and the folded shared expert, stored packed with one bit width and block size, no act order,
shapes the packed decode MoE takes) ONLY packed (:attr:`DeviceWeights.packed_moe`): decode steps read them with
``cuda/moe_nbits_decode.py``; every other use (prefill, the shared expert's GEMMs) dequantises the layer into one
scratch stack shared by all such layers (:meth:`DeviceWeights.dequantise_experts`), which their
:class:`MoEWeights` ``gate_up`` / ``down`` point at. The folded shared expert of such a layer is also kept
dequantised on its own (``shared_gate_up`` / ``shared_down``) for the steps that run it as GEMMs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..config import Manifest, ModelConfig
from ..program import WeightSpec, moe_layers, runtime_weight_specs, stored_weight_specs
from ..reference import rope_tables
from ..weights_io import SafetensorsFile
from .driver import CudaDevice, DeviceArray
from .quant import NBitsDequant, PackedLinear, fill_weight, plan_weights

ROUTER_ALIGN = 8  # router rows padded so the logits' row stride stays 16-byte aligned


@dataclass(frozen=True)
class MoEWeights:
    router: DeviceArray  # [E_pad, H]: experts' rows, then the shared gate's row (if any), then zeros
    e_pad: int
    gate_up: DeviceArray | None  # [E_all, 2I, H]; None: experts kept only packed, scratch stack released
    down: DeviceArray | None  # [E_all, H, I]
    num_experts: int  # E (routed)
    fold: bool  # the shared expert is expert E of gate_up / down
    shared_gate_up: DeviceArray | None  # [2Is, H] when a shared expert exists and is not folded, or its experts
    # are kept only packed (then gate_up / down are the scratch stack; DeviceWeights.dequantise_experts)
    shared_down: DeviceArray | None  # [H, Is]

    @property
    def e_all(self) -> int:
        return self.num_experts + int(self.fold)


@dataclass(frozen=True)
class PackedExperts:
    """One MoE layer's experts kept only packed (``load(packed_experts=True)``): the stacked operands of
    ``cuda/moe_nbits_decode.py`` (``gate_up`` / ``down``: :class:`~.moe_nbits_decode.NBitsExperts`, the shared
    expert as expert E when folded) and the same arrays as :class:`~.quant.PackedLinear` (``sources``: gate_up, down)
    for the dequantisation into the scratch stack."""

    gate_up: object  # NBitsExperts (imported lazily: moe_nbits_decode -> moe_prefill -> weights)
    down: object
    sources: tuple[PackedLinear, PackedLinear]
    # the sources' zero-points as int32 [E_all, N * nb] (moe_prefill.zero_points_i32: the packed prefill GEMMs' copy),
    # None where a source has none
    zeros: tuple[DeviceArray | None, DeviceArray | None] = (None, None)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.sources)


def packed_layer_experts(stored: dict, layer: int, cfg: ModelConfig, dtype: str) -> tuple[object, object] | str:
    """The stacked packed experts of MoE layer ``layer`` (host arrays, :class:`~.moe_nbits_decode.HostExperts`
    gate_up ``[E_all, 2I, H]`` and down ``[E_all, H, I]``, the shared expert folded as expert E when the layer
    folds it) from the bundle's stored weights (``quant.plan_weights``), or why they do not stack: a weight (or a
    part) stored float, act order, mixed bit widths or block sizes, or a shape / dtype the packed decode MoE
    refuses (``moe_nbits_decode.shape_problems``)."""
    from .moe_nbits_decode import (
        ALL_SETS,
        BACKEND_BUILDS,
        FAST_BUILDS,
        NBitsExperts,
        as_host_experts,
        fuse_rows,
        resolve_build,
        shape_problems,
        stack_experts,
    )

    E, inter, H = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
    si = cfg.shared_expert_intermediate_size
    fold = si > 0 and si == inter
    p = f"layers.{layer}.mlp."

    def host(name: str):  # one stored weight as HostExperts (parts fused along the rows)
        w = stored[name]
        if w.kind == "packed" and w.packed is not None:
            return as_host_experts(w.packed)
        if w.kind == "parts" and all(hp is not None for _, _, hp, _ in w.parts):
            return fuse_rows([as_host_experts(hp) for _, _, hp, _ in w.parts])
        raise ValueError(f"{name} is stored {'in float' if w.kind == 'float' else 'with float parts'}")

    try:
        gu, dn = host(p + "experts.gate_up"), host(p + "experts.down")
        if fold:
            gu, dn = stack_experts([gu, host(p + "shared.gate_up")]), stack_experts([dn, host(p + "shared.down")])
    except ValueError as e:
        return str(e)
    ops = [NBitsExperts(256, 256, 0, w.experts, w.rows, w.K, w.bits, w.block_size, short=w.short) for w in (gu, dn)]
    bad: list[str] = []
    # every build the backend may launch on it, with and without packed projections (their shared memory differs);
    # other bit widths: the default build's rules, which name them
    names = [name for table in (BACKEND_BUILDS, FAST_BUILDS) for _, name in table.get(gu.bits) or ((0, "default"),)]
    for name in dict.fromkeys(names):
        build = resolve_build(name, gu.bits, (gu.block_size, dn.block_size))
        bad += [p for p in shape_problems(dtype, H, inter, ops[0], ops[1], E + int(fold),
                                          cfg.num_experts_per_tok + int(fold), knobs=ALL_SETS[build]) if p not in bad]
    if bad:
        return "; ".join(bad)
    return gu, dn


class DeviceWeights:
    """Name -> :class:`DeviceArray` of every runtime weight (``lm_head`` aliases ``embed_tokens`` when tied),
    plus the MoE layers' stacked forms (:meth:`moe`)."""

    def __init__(self, device: CudaDevice, cfg: ModelConfig, dtype: str, rope_len: int) -> None:
        self.device, self.cfg, self.dtype, self.rope_len = device, cfg, dtype, rope_len
        self.arrays: dict[str, DeviceArray] = {}
        # packed GPTQ weights kept on the device (load(keep_packed=True)): runtime weight name, or
        # "<name>.part<i>" for a part of a per-part weight -> PackedLinear
        self.packed: dict[str, PackedLinear] = {}
        # dense linear weights kept only packed (load(packed_linears=True)): runtime weight name -> PackedLinear
        self.packed_only: dict[str, PackedLinear] = {}
        # dense linear weights kept packed BESIDE their dequantised array (load(dual_linears=True)): runtime weight
        # name -> PackedLinear (the backend's decode GEMMs of few rows read it)
        self.packed_decode: dict[str, PackedLinear] = {}
        # MoE layers whose experts are kept only packed (load(packed_experts=True)): layer -> PackedExperts, and
        # the one scratch stack (gate_up, down) their MoEWeights point at (dequantise_experts fills it)
        self.packed_moe: dict[int, PackedExperts] = {}
        self.moe_scratch: tuple[DeviceArray, DeviceArray] | None = None
        self._deq: NBitsDequant | None = None
        self._moe: dict[int, MoEWeights] = {}
        self.specs = {s.name: s for s in runtime_weight_specs(cfg, rope_len)}

    def _dtype(self, spec: WeightSpec) -> str:
        return self.dtype if spec.matrix else "float32"

    def __getitem__(self, name: str) -> DeviceArray:
        return self.arrays[name]

    def get(self, name: str) -> DeviceArray | None:
        return self.arrays.get(name)

    @property
    def nbytes(self) -> int:
        seen, n = set(), 0
        for a in [*self.arrays.values(), *(x for m in self._moe.values() for x in (m.router, m.gate_up, m.down))]:
            if a is not None and a.ptr not in seen:
                seen.add(a.ptr)
                n += a.nbytes
        return n + sum(p.nbytes for p in [*self.packed.values(), *self.packed_only.values(),
                                             *self.packed_decode.values(), *self.packed_moe.values()])

    def moe(self, layer: int) -> MoEWeights:
        return self._moe[layer]

    def dequantise_experts(self, layer: int) -> None:
        """Enqueue the dequantisation of packed layer ``layer``'s experts into the scratch stack its MoEWeights
        ``gate_up`` / ``down`` point at (two launches on the device's stream; stream order keeps a later layer's
        dequantisation behind this layer's readers). A no-op for a layer kept in float."""
        pk = self.packed_moe.get(layer)
        if pk is None:
            return
        if self.moe_scratch is None:
            raise RuntimeError(f"layer {layer}: a step needs its packed experts dequantised, but the scratch stack was "
                               f"released at load (CudaBackend found that every step reads them packed): a backend "
                               f"setting changed after load?")
        assert self._deq is not None
        for src, dst in zip(pk.sources, self.moe_scratch, strict=True):
            self._deq.launch(src, dst.ptr, src.K, src.N * src.K)

    def release_moe_scratch(self) -> int:
        """Free the dequantised scratch stack of the packed-expert layers (when no step can need it: CudaBackend
        decides at load, ``moe_scratch_reasons``); their MoEWeights' ``gate_up`` / ``down`` become None and
        :meth:`dequantise_experts` raises from then on. Returns the bytes freed (0: there was none)."""
        if self.moe_scratch is None:
            return 0
        freed = sum(a.nbytes for a in self.moe_scratch)
        for layer in self.packed_moe:
            self._moe[layer] = dataclasses.replace(self._moe[layer], gate_up=None, down=None)
        self.device.synchronize()  # nothing queued may still write it
        for a in self.moe_scratch:
            owner = a.owner
            if owner is not None and hasattr(owner, "free"):
                owner.free()
        self.moe_scratch = None
        return freed

    # ------------------------------------------------------------------ building

    @classmethod
    def load(cls, device: CudaDevice, bundle_dir: str | Path, manifest: Manifest,
             progress: Callable[[str], None] | None = None, keep_packed: bool = False,
             packed_linears: bool = False, packed_experts: bool = False,
             prefill_zeros: bool = True, dual_linears: bool = False) -> DeviceWeights:
        """Copy a ``cuda`` bundle's weights to ``device`` (checks every tensor's shape and dtype, and a GPTQ
        bundle's packed tensors against its quantization record, first: :func:`~.quant.plan_weights`). Packed
        weights are dequantised on the device into the bundle dtype; ``keep_packed`` keeps their device copies
        in :attr:`packed` (default: freed once dequantised). ``packed_linears``: the dense linear weights stored
        packed whole are kept only packed, in :attr:`packed_only`; ``packed_experts``: the MoE layers whose experts
        stack as one packed operand keep them only packed, in :attr:`packed_moe` (module docstring; bf16 / fp16);
        ``dual_linears`` (not with ``packed_linears``): the dense linear weights stored packed whole are dequantised
        into :attr:`arrays` as usual and their packed device copies kept in :attr:`packed_decode`;
        ``prefill_zeros``: their zero-points also get the int32 copy the packed prefill GEMMs read
        (:attr:`PackedExperts.zeros`; False where those GEMMs never run: not Hopper, or turned off)."""
        if packed_linears and dual_linears:
            raise ValueError("packed_linears keeps the dense linears only packed, dual_linears in both forms: not both")
        cfg, rope_len = manifest.model, manifest.limits.max_seq_len
        self = cls(device, cfg, manifest.dtype, rope_len)
        path = Path(bundle_dir) / manifest.state_weights
        f = SafetensorsFile(path)
        stored = plan_weights(f, manifest)
        deq = NBitsDequant(device, self.dtype) if any(w.kind != "float" for w in stored.values()) else None
        es = 4 if self.dtype == "float32" else 2
        keep = self.packed.__setitem__ if keep_packed else None

        def put(name: str, dst: int) -> None:
            fill_weight(device, deq, f, stored[name], dst, self.specs[name].shape, es if self.specs[name].matrix
                        else 4, keep)

        for s in stored_weight_specs(cfg, rope_len):
            if progress and s.layer >= 0 and s.name.endswith("input_norm"):
                progress(f"loading layer {s.layer + 1}/{cfg.num_layers} to {device.limits.name}")
            if ".mlp." in s.name and cfg.ffn_types[s.layer] == "moe":
                continue  # stacked below
            if stored[s.name].kind == "float":
                self.arrays[s.name] = device.upload(f.raw(s.name), dtype=self._dtype(s))
            elif packed_linears and stored[s.name].kind == "packed" and len(s.shape) == 2:
                assert deq is not None and stored[s.name].packed is not None
                self.packed_only[s.name] = deq.upload(stored[s.name].packed)  # type: ignore[arg-type]
            elif dual_linears and stored[s.name].kind == "packed" and len(s.shape) == 2:
                self.arrays[s.name] = a = device.empty(s.shape, self._dtype(s))
                fill_weight(device, deq, f, stored[s.name], a.ptr, s.shape, es, self.packed_decode.__setitem__)
            else:
                self.arrays[s.name] = a = device.empty(s.shape, self._dtype(s))
                put(s.name, a.ptr)
        self._alias_head()
        for layer in moe_layers(cfg):
            pair = packed_layer_experts(stored, layer, cfg, self.dtype) if packed_experts and deq is not None \
                else "packed_experts off"
            if isinstance(pair, str):
                if packed_experts and progress:
                    progress(f"layer {layer}: experts dequantised at load ({pair})")
                self._moe[layer] = self._stack_moe(layer, put)
            else:
                assert deq is not None
                self._moe[layer] = self._packed_moe_layer(layer, put, deq, pair, prefill_zeros)
        if deq is not None:
            device.synchronize()
            if progress:
                kept_gb = sum(p.nbytes for p in self.packed.values()) / 1e9
                kept = f", {kept_gb:.2f} GB packed kept" if keep_packed else ""
                if self.packed_only:
                    only_gb = sum(p.nbytes for p in self.packed_only.values()) / 1e9
                    kept += f", {len(self.packed_only)} dense linear weights kept only packed ({only_gb:.2f} GB)"
                if self.packed_decode:
                    dual_gb = sum(p.nbytes for p in self.packed_decode.values()) / 1e9
                    kept += (f", {len(self.packed_decode)} dense linear weights also kept packed for decode "
                             f"({dual_gb:.2f} GB)")
                progress(f"dequantised {sum(w.kind != 'float' for w in stored.values())} packed weights to "
                         f"{self.dtype} on {device.limits.name}{kept}")
        return self

    @classmethod
    def random(cls, device: CudaDevice, cfg: ModelConfig, dtype: str, rope_len: int, fill: Callable[..., None],
               seed: int = 0, progress: Callable[[str], None] | None = None) -> DeviceWeights:
        """Seeded pseudo-random weights generated on the device. ``fill(array, seed, scale)`` fills a
        DeviceArray in place (the ``fill_random`` kernel); norms are 1, gates and conv weights small."""
        self = cls(device, cfg, dtype, rope_len)
        H = cfg.hidden_size
        for n, s in enumerate(stored_weight_specs(cfg, rope_len)):
            if progress and s.layer >= 0 and s.name.endswith("input_norm"):
                progress(f"generating layer {s.layer + 1}/{cfg.num_layers} on {device.limits.name}")
            if ".mlp." in s.name and cfg.ffn_types[s.layer] == "moe":
                continue
            self._random_array(s, fill, seed + n)
        self._alias_head()
        for layer in moe_layers(cfg):
            self._moe[layer] = self._stack_moe(layer, None, fill=fill, seed=seed + 1000 * (layer + 1), hidden=H)
        return self

    @classmethod
    def random_packed(cls, device: CudaDevice, cfg: ModelConfig, dtype: str, rope_len: int, fill: Callable[..., None],
                      bits: int = 4, block_size: int = 128, seed: int = 0,
                      progress: Callable[[str], None] | None = None, linears: bool = True,
                      dual: bool = False, *, fill_codes: Callable[[DeviceArray, int, int], None]) -> DeviceWeights:
        """As :meth:`random`, in the layout a symmetric GPTQ bundle loads into with ``packed_linears`` and
        ``packed_experts``: the dense projections (``*_proj``: GDN in_proj / out_proj, attention qkv_proj / o_proj)
        kept only packed (:attr:`packed_only`), each MoE layer's routed experts (and the folded shared expert as
        expert E) only packed (:attr:`packed_moe`, the scratch stack for other uses), ``bits``-bit codes in blocks
        of ``block_size`` along K: random codes filled on the device by ``fill_codes(array, seed, bits)`` (the
        backend's ``fill_random_codes``: uniform over 1 .. 2^bits - 1, symmetric around the zero-point as a real
        checkpoint's; codes with a common bias make the random model route every token to the same few experts),
        float16-valued float32 scales (GPTQ's: short, the same host values for every weight of a size).
        Embeddings, lm_head, norms, router, conv and gates stay float (random as :meth:`random`). ``linears``
        False: the dense projections float too (the layout of ``packed_weights=experts``: only the experts packed;
        the projections are the dequantised random codes, so every layout of one seed is the same model and routes
        alike). ``dual`` (with ``linears``): the projections in both forms, as ``load(dual_linears=True)`` lays
        them out (``packed_weights=dual``): packed in :attr:`packed_decode` and dequantised from those codes into
        :attr:`arrays`. For speed benchmarks of quantized steps without a checkpoint (an int4 35B-A3B is ~18 GB).
        bf16 / fp16 only; K of every packed weight a multiple of ``block_size``."""
        from .moe_nbits_decode import NBitsExperts, short_scales

        if dtype not in ("bfloat16", "float16"):
            raise ValueError(f"packed weights run bfloat16 / float16 steps, not {dtype!r}")
        if bits not in (4, 8) or block_size < 16 or block_size % 16:
            raise ValueError(f"bits {bits} (4 / 8), block size {block_size} (a multiple of 16)")
        if dual and not linears:
            raise ValueError("dual keeps the packed projections beside their dequantised copies: it needs linears")
        self = cls(device, cfg, dtype, rope_len)
        self._deq = NBitsDequant(device, dtype)
        rng = np.random.default_rng(seed)
        host_scales: dict[int, np.ndarray] = {}

        def packed(N: int, K: int, experts: int, s: int) -> PackedLinear:
            if K % block_size:
                raise ValueError(f"K {K} is not a multiple of the block size {block_size}")
            E, nb, row = max(1, experts), K // block_size, block_size * bits // 8
            raw = device.empty((E * N * K * bits // 8,), "uint8")
            fill_codes(raw, s, bits)
            lead = (E,) if experts else ()
            B = DeviceArray(raw.ptr, (*lead, N, nb, row), "uint8", raw.device, owner=raw)
            n = E * N * nb
            if n not in host_scales:  # w = (q - 2^(bits-1)) s of random()'s spread: std ~0.55 / sqrt(K) (q uniform
                # over 1 .. 2^bits - 1: std(q - z) ~0.54 2^(bits-1) (4-bit) / 0.57 2^(bits-1) (8-bit), s ~1 / sqrt(K)
                # / 2^(bits-1)) against uniform +-1 / sqrt(K) (std 0.58 / sqrt(K))
                sc = rng.uniform(0.5, 1.5, n) * (1.0 / np.sqrt(K)) / (1 << (bits - 1))
                host_scales[n] = sc.astype(np.float16).astype(np.float32)
                assert short_scales(host_scales[n])
            sc_dev = device.upload(host_scales[n].reshape(E, N * nb) if experts else host_scales[n])
            return PackedLinear(B, sc_dev, None, None, K, N, bits, block_size, K, experts)

        H = cfg.hidden_size
        transient: list[PackedLinear] = []
        for n, spec in enumerate(stored_weight_specs(cfg, rope_len)):
            if progress and spec.layer >= 0 and spec.name.endswith("input_norm"):
                progress(f"generating layer {spec.layer + 1}/{cfg.num_layers} ({bits}-bit) on {device.limits.name}")
            if ".mlp." in spec.name and cfg.ffn_types[spec.layer] == "moe":
                continue
            if spec.name.endswith("_proj") and len(spec.shape) == 2:
                p = packed(spec.shape[0], spec.shape[1], 0, seed + n)
                if linears and not dual:
                    self.packed_only[spec.name] = p
                    continue
                self.arrays[spec.name] = a = device.empty(spec.shape, dtype)
                self._deq.launch(p, a.ptr, p.K, 0)
                if linears:
                    self.packed_decode[spec.name] = p
                else:
                    transient.append(p)  # freed once the stream has dequantised it
            else:
                self._random_array(spec, fill, seed + n)
        self._alias_head()
        E, inter = cfg.num_experts, cfg.moe_intermediate_size
        si = cfg.shared_expert_intermediate_size
        for layer in moe_layers(cfg):
            s0 = seed + 1000 * (layer + 1)
            fold = si > 0 and si == inter
            e_all = E + int(fold)
            e_pad = -(-(E + int(si > 0)) // ROUTER_ALIGN) * ROUTER_ALIGN
            router = device.zeros((e_pad, H), dtype)
            fill(router.view((e_pad * H,)), s0, 1.0 / np.sqrt(H))  # (rows past E + 1: unused padding)
            sgu = sdn = None
            if si:
                sgu, sdn = device.empty((2 * si, H), dtype), device.empty((H, si), dtype)
                fill(sgu, s0 + 1, 1.0 / np.sqrt(H))
                fill(sdn, s0 + 2, 1.0 / np.sqrt(si))
            srcs = (packed(2 * inter, H, e_all, s0 + 3), packed(H, inter, e_all, s0 + 4))
            self.packed_moe[layer] = PackedExperts(NBitsExperts.from_packed(srcs[0], short=True),
                                                   NBitsExperts.from_packed(srcs[1], short=True), srcs)
            if self.moe_scratch is None:
                self.moe_scratch = (device.empty((e_all, 2 * inter, H), dtype), device.empty((e_all, H, inter), dtype))
            gate_up, down = self.moe_scratch
            self._moe[layer] = MoEWeights(router, e_pad, gate_up, down, E, fold, sgu, sdn)
        if transient:
            device.synchronize()
            transient.clear()
        return self

    def _random_array(self, spec: WeightSpec, fill: Callable[..., None], seed: int) -> None:
        """One runtime weight of :meth:`random` / :meth:`random_packed` in :attr:`arrays`: the RoPE tables computed,
        norms around 1, the GDN decay logs around -1, the rest uniform (matrices scaled by 1 / sqrt(K))."""
        if spec.name in ("rope_cos", "rope_sin"):
            cos, sin = rope_tables(np.arange(self.rope_len), self.cfg.rotary_dim, self.cfg.rope_theta)
            self.arrays[spec.name] = self.device.upload(cos if spec.name == "rope_cos" else sin)
            return
        a = self.device.empty(spec.shape, self._dtype(spec))
        if spec.name.endswith(("norm", "q_norm", "k_norm", "final_norm")):
            fill(a, seed, 0.1, offset=1.0)
        elif spec.name.endswith("neg_exp_a"):
            fill(a, seed, 0.5, offset=-1.0)
        else:
            fill(a, seed, 1.0 / np.sqrt(spec.shape[-1]) if spec.matrix else 0.3)
        self.arrays[spec.name] = a

    def _alias_head(self) -> None:
        if self.cfg.tie_word_embeddings:
            self.arrays["lm_head"] = self.arrays["embed_tokens"]

    def _packed_moe_layer(self, layer: int, put: Callable[[str, int], None], deq: NBitsDequant,
                          pair: tuple, prefill_zeros: bool = True) -> MoEWeights:
        """Router (+ shared gate row) as :meth:`_stack_moe`; the experts uploaded as one stacked packed operand
        (:class:`PackedExperts`); gate_up / down the scratch stack; the folded shared expert also dequantised on
        its own (the steps that run it as GEMMs)."""
        from .moe_nbits_decode import NBitsExperts

        cfg, d = self.cfg, self.device
        E, inter, H = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
        si = cfg.shared_expert_intermediate_size
        p = f"layers.{layer}.mlp."
        fold = si > 0 and si == inter
        e_all = E + int(fold)
        e_pad = -(-(E + int(si > 0)) // ROUTER_ALIGN) * ROUTER_ALIGN
        router = d.zeros((e_pad, H), self.dtype)
        row = H * 2  # bytes of one bf16 / fp16 router row
        put(p + "router", router.ptr)
        if si:
            put(p + "shared.gate", router.ptr + E * row)
        sgu = sdn = None
        if si:
            sgu = d.empty((2 * si, H), self.dtype)
            sdn = d.empty((H, si), self.dtype)
            put(p + "shared.gate_up", sgu.ptr)
            put(p + "shared.down", sdn.ptr)
        from .moe_prefill import zero_points_i32

        srcs, zeros = [], []
        for w in pair:  # PackedLinear's stacked layout: B [E, N, nb, bs * bits / 8], scales [E, N * nb], zp [E, ...]
            assert w.experts == e_all
            nb = w.K // w.block_size
            B = d.upload(w.B.reshape(e_all, w.rows, nb, w.block_size * w.bits // 8))
            sc = d.upload(w.scales.reshape(e_all, w.rows * nb))
            zp = d.upload(w.zp.reshape(e_all, -1)) if w.zp is not None else None
            srcs.append(PackedLinear(B, sc, zp, None, w.K, w.rows, w.bits, w.block_size, w.K, e_all))
            zeros.append(None if w.zp is None or not prefill_zeros
                         else d.upload(zero_points_i32(w.zp, e_all, w.rows, nb, w.bits)))
        self.packed_moe[layer] = PackedExperts(NBitsExperts.from_packed(srcs[0], pair[0].short),
                                               NBitsExperts.from_packed(srcs[1], pair[1].short),
                                               (srcs[0], srcs[1]), (zeros[0], zeros[1]))
        self._deq = deq
        if self.moe_scratch is None:
            self.moe_scratch = (d.empty((e_all, 2 * inter, H), self.dtype), d.empty((e_all, H, inter), self.dtype))
        gate_up, down = self.moe_scratch
        assert gate_up.shape == (e_all, 2 * inter, H) and down.shape == (e_all, H, inter)
        return MoEWeights(router, e_pad, gate_up, down, E, fold, sgu, sdn)

    def _stack_moe(self, layer: int, put: Callable[[str, int], None] | None, fill: Callable[..., None] | None = None,
                   seed: int = 0, hidden: int = 0) -> MoEWeights:
        """Router (+ shared gate row) and the stacked experts of one layer, ``put(name, device address)`` writing
        a stored weight there, or (``put`` None) filled on the device."""
        cfg, d = self.cfg, self.device
        E, inter, H = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
        si = cfg.shared_expert_intermediate_size
        p = f"layers.{layer}.mlp."
        fold = si > 0 and si == inter
        e_all = E + int(fold)
        e_pad = -(-(E + int(si > 0)) // ROUTER_ALIGN) * ROUTER_ALIGN
        router = d.zeros((e_pad, H), self.dtype)
        gate_up = d.empty((e_all, 2 * inter, H), self.dtype)
        down = d.empty((e_all, H, inter), self.dtype)
        sgu = sdn = None
        row = H * (4 if self.dtype == "float32" else 2)  # bytes of one router row
        if put is not None:
            put(p + "router", router.ptr)
            if si:
                put(p + "shared.gate", router.ptr + E * row)
            put(p + "experts.gate_up", gate_up.ptr)
            put(p + "experts.down", down.ptr)
            if fold:
                put(p + "shared.gate_up", gate_up.row_ptr(E))
                put(p + "shared.down", down.row_ptr(E))
            elif si:
                sgu = d.empty((2 * si, H), self.dtype)
                sdn = d.empty((H, si), self.dtype)
                put(p + "shared.gate_up", sgu.ptr)
                put(p + "shared.down", sdn.ptr)
        else:
            assert fill is not None
            fill(router.view((e_pad * H,)), seed, 1.0 / np.sqrt(hidden))
            fill(gate_up, seed + 1, 1.0 / np.sqrt(hidden))
            fill(down, seed + 2, 1.0 / np.sqrt(inter))
            if si and not fold:
                sgu = d.empty((2 * si, H), self.dtype)
                sdn = d.empty((H, si), self.dtype)
                fill(sgu, seed + 3, 1.0 / np.sqrt(hidden))
                fill(sdn, seed + 4, 1.0 / np.sqrt(si))
        return MoEWeights(router, e_pad, gate_up, down, E, fold, sgu, sdn)
