"""The runtime weights of a ``cuda`` bundle in GPU memory, in the layout the executor reads.

:meth:`DeviceWeights.load` copies ``weights.safetensors`` (memory-mapped, one tensor at a time) to the
device; :meth:`DeviceWeights.random` fills the same layout on the device with seeded pseudo-random values
(the benchmarks' 70 GB models never touch the host). Per MoE layer the executor gets one
:class:`MoEWeights`: the router with the shared expert's gate row appended (one GEMM gives both), and the
experts stacked ``[E_all, 2I, H]`` / ``[E_all, H, I]`` where, when the shared expert has the experts' width,
it is expert ``E`` (``fold``: every token routes to it with weight sigmoid(gate)), so the routed kernels
serve it too.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..config import BundleError, Manifest, ModelConfig
from ..program import WeightSpec, moe_layers, runtime_weight_specs, stored_weight_specs
from ..reference import rope_tables
from ..weights_io import SafetensorsFile
from .driver import CudaDevice, DeviceArray

ROUTER_ALIGN = 8  # router rows padded so the logits' row stride stays 16-byte aligned


@dataclass(frozen=True)
class MoEWeights:
    router: DeviceArray  # [E_pad, H]: experts' rows, then the shared gate's row (if any), then zeros
    e_pad: int
    gate_up: DeviceArray  # [E_all, 2I, H]
    down: DeviceArray  # [E_all, H, I]
    num_experts: int  # E (routed)
    fold: bool  # the shared expert is expert E of gate_up / down
    shared_gate_up: DeviceArray | None  # [2Is, H] when a shared expert exists and is not folded
    shared_down: DeviceArray | None  # [H, Is]

    @property
    def e_all(self) -> int:
        return self.num_experts + int(self.fold)


class DeviceWeights:
    """Name -> :class:`DeviceArray` of every runtime weight (``lm_head`` aliases ``embed_tokens`` when tied),
    plus the MoE layers' stacked forms (:meth:`moe`)."""

    def __init__(self, device: CudaDevice, cfg: ModelConfig, dtype: str, rope_len: int) -> None:
        self.device, self.cfg, self.dtype, self.rope_len = device, cfg, dtype, rope_len
        self.arrays: dict[str, DeviceArray] = {}
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
            if a.ptr not in seen:
                seen.add(a.ptr)
                n += a.nbytes
        return n

    def moe(self, layer: int) -> MoEWeights:
        return self._moe[layer]

    # ------------------------------------------------------------------ building

    @classmethod
    def load(cls, device: CudaDevice, bundle_dir: str | Path, manifest: Manifest,
             progress: Callable[[str], None] | None = None) -> DeviceWeights:
        """Copy a ``cuda`` bundle's weights to ``device`` (checks every tensor's shape and dtype first)."""
        cfg, rope_len = manifest.model, manifest.limits.max_seq_len
        self = cls(device, cfg, manifest.dtype, rope_len)
        path = Path(bundle_dir) / manifest.state_weights
        f = SafetensorsFile(path)
        tags = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}
        for s in stored_weight_specs(cfg, rope_len):
            if s.name not in f.header:
                raise BundleError(f"{path}: weight {s.name} is missing; rebuild the bundle")
            want = (tags[self._dtype(s)], list(s.shape))
            got = (f.header[s.name]["dtype"], list(f.header[s.name]["shape"]))
            if got != want:
                raise BundleError(f"{path}: weight {s.name} is {got}, this runtime expects {want}; rebuild")
        for i, s in enumerate(stored_weight_specs(cfg, rope_len)):
            if progress and s.layer >= 0 and s.name.endswith("input_norm"):
                progress(f"loading layer {s.layer + 1}/{cfg.num_layers} to {device.limits.name}")
            if ".mlp." in s.name and cfg.ffn_types[s.layer] == "moe":
                continue  # stacked below
            self.arrays[s.name] = device.upload(f.raw(s.name), dtype=self._dtype(s))
            _ = i
        self._alias_head()
        for layer in moe_layers(cfg):
            self._moe[layer] = self._stack_moe(layer, lambda n: f.raw(n))
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
            if s.name in ("rope_cos", "rope_sin"):
                cos, sin = rope_tables(np.arange(rope_len), cfg.rotary_dim, cfg.rope_theta)
                self.arrays[s.name] = device.upload(cos if s.name == "rope_cos" else sin)
                continue
            a = device.empty(s.shape, self._dtype(s))
            if s.name.endswith(("norm", "q_norm", "k_norm", "final_norm")):
                fill(a, seed + n, 0.1, offset=1.0)
            elif s.name.endswith("neg_exp_a"):
                fill(a, seed + n, 0.5, offset=-1.0)
            else:
                fill(a, seed + n, 1.0 / np.sqrt(s.shape[-1]) if s.matrix else 0.3)
            self.arrays[s.name] = a
        self._alias_head()
        for layer in moe_layers(cfg):
            self._moe[layer] = self._stack_moe(layer, None, fill=fill, seed=seed + 1000 * (layer + 1), hidden=H)
        return self

    def _alias_head(self) -> None:
        if self.cfg.tie_word_embeddings:
            self.arrays["lm_head"] = self.arrays["embed_tokens"]

    def _stack_moe(self, layer: int, raw: Callable[[str], np.ndarray] | None, fill: Callable[..., None] | None = None,
                   seed: int = 0, hidden: int = 0) -> MoEWeights:
        """Router (+ shared gate row) and the stacked experts of one layer, from ``raw(name)`` host arrays
        or (``raw`` None) filled on the device."""
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
        if raw is not None:
            d.copy_htod(router.ptr, raw(p + "router"))
            if si:
                d.copy_htod(router.ptr + E * row, raw(p + "shared.gate"))
            d.copy_htod(gate_up.ptr, raw(p + "experts.gate_up"))
            d.copy_htod(down.ptr, raw(p + "experts.down"))
            if fold:
                d.copy_htod(gate_up.row_ptr(E), raw(p + "shared.gate_up"))
                d.copy_htod(down.row_ptr(E), raw(p + "shared.down"))
            elif si:
                sgu = d.upload(raw(p + "shared.gate_up"), dtype=self.dtype)
                sdn = d.upload(raw(p + "shared.down"), dtype=self.dtype)
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
