"""GPTQ weights of a ``cuda`` bundle: the stored packed tensors, checked on the host, and their dequantisation on
the device at load (``ops/cuda/nbits.cu``).

A GPTQ ``cuda`` bundle (``builder/cuda_bundle.py``) stores every runtime weight in one of three forms:

* ``float``: ``<w>`` in the bundle dtype (matrices) or float32, as a float bundle does;
* ``packed``: ``<w>.nbits_B`` / ``.nbits_scales`` / ``[.nbits_zp]`` / ``[.nbits_perm]`` / ``.nbits_meta``, the
  MatMulNBits layout of :class:`hybrid_runtime.quant.NBitsWeight` (stacked experts: one per expert on axis 0);
* ``parts``: ``<w>.parts`` int64 ``[P]`` (rows of each part, in order) and per part ``<w>.part<i>`` (float, bundle
  dtype) or ``<w>.part<i>.nbits_*`` (packed): a fused weight whose row blocks are quantized differently.

:func:`plan_weights` reads only the header, the small ``nbits_meta`` / ``parts`` / ``nbits_perm`` tensors and
checks every form's shapes and dtypes against the runtime weight specs and the manifest's quantization record
(:class:`~hybrid_runtime.quant.QuantRecord`, ``activations`` = the bundle dtype); it needs no GPU.
:class:`NBitsDequant` launches the kernel: ``w = (q - z) * s`` in float32, rounded once to the bundle dtype
(round to nearest even, as :func:`hybrid_runtime.cuda.backend.to_dtype`), act order scattered back through
``perm`` (value ``k_in``: a padding column, dropped), into the runtime weight's rows.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from ..config import BundleError, Manifest
from ..program import linear_sources, stored_weight_specs
from ..quant import QuantRecord
from ..weights_io import SafetensorsFile
from .driver import CudaDevice, DeviceArray
from .kernels import Module, load_module

SOURCE = "nbits.cu"
DT_CODES = {"float32": 0, "float16": 1, "bfloat16": 2}
THREADS = 256
TAGS = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}
MAX_EXPERTS = 65535  # grid y


@dataclass(frozen=True)
class PackedLinear:
    """One packed weight on the device (kept by ``DeviceWeights.load(keep_packed=True)``; a W4A16 / W8A16
    kernel reads these fields). ``nb = ceil(K / block_size)``; ``experts`` 0 = one ``[N, k_in]`` weight,
    E = E stacked (every array gains a leading ``[E]``):

    * ``B`` uint8 ``[N, nb, block_size * bits / 8]``: codes along K, 4-bit two a byte, low nibble first
    * ``scales`` float32 ``[N * nb]``
    * ``zp`` uint8 ``[N * ceil(nb / 2)]`` (4-bit, two a byte, low first) or ``[N * nb]`` (8-bit); None: every
      zero-point is ``2^(bits - 1)``
    * ``perm`` int32 ``[K]``: the input column op column k reads (``k_in`` = a zero padding column); None: identity
      (then ``K == k_in``)

    ``row0``: the first row of the runtime weight it fills (a part of a per-part weight; else 0)."""

    B: DeviceArray
    scales: DeviceArray
    zp: DeviceArray | None
    perm: DeviceArray | None
    K: int
    N: int
    bits: int
    block_size: int
    k_in: int
    experts: int = 0
    row0: int = 0

    @property
    def n_blocks(self) -> int:
        return -(-self.K // self.block_size)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.B, self.scales, self.zp, self.perm) if a is not None)


@dataclass(frozen=True)
class HostPacked:
    """One packed weight as the bundle stores it (memory-mapped host arrays), checked by :func:`read_packed`."""

    prefix: str
    B: np.ndarray
    scales: np.ndarray
    zp: np.ndarray | None
    perm: np.ndarray | None  # int64 as stored
    K: int
    N: int
    bits: int
    block_size: int
    k_in: int
    accuracy_level: int
    experts: int  # 0: not stacked


@dataclass(frozen=True)
class StoredWeight:
    """How one runtime weight is stored: ``kind`` ``float`` | ``packed`` | ``parts``. ``parts``: (first row, rows,
    the packed part or None, the float part's tensor name or None) in row order."""

    name: str
    kind: str
    packed: HostPacked | None = None
    parts: tuple[tuple[int, int, HostPacked | None, str | None], ...] = ()

    def bits(self) -> set[int]:
        ps = [self.packed] if self.packed else [p for _, _, p, _ in self.parts if p is not None]
        return {p.bits for p in ps}


def _bad(path: object, what: str) -> BundleError:
    return BundleError(f"{path}: {what}; rebuild the bundle")


def read_packed(f: SafetensorsFile, prefix: str, experts: int, N: int, k_in: int) -> HostPacked:
    """The packed tensors ``<prefix>.nbits_*`` of a weight of ``N`` rows, ``k_in`` input columns (``experts`` > 0:
    stacked), every shape, dtype and the permutation checked (BundleError names what is wrong)."""
    h = f.header
    need = {f"{prefix}.nbits_{s}" for s in ("B", "scales", "meta")}
    if missing := sorted(need - set(h)):
        raise _bad(f.path, f"packed weight {prefix} lacks {missing}")
    meta = f.raw(prefix + ".nbits_meta")
    if meta.shape != (6,) or h[prefix + ".nbits_meta"]["dtype"] != "I64":
        raise _bad(f.path, f"{prefix}.nbits_meta is {meta.dtype} {meta.shape}, expected int64 [6]")
    K, n_, bits, bs, level, kin = (int(v) for v in meta)
    if (n_, kin) != (N, k_in) or bits not in (4, 8) or bs < 16 or bs & (bs - 1) or k_in > K:
        raise _bad(f.path, f"{prefix}: meta [K {K}, N {n_}, bits {bits}, block {bs}, level {level}, k_in {kin}] does "
                           f"not fit a [{N}, {k_in}] weight (bits 4 / 8, block a power of two >= 16, K >= k_in)")
    nb = -(-K // bs)
    lead = (experts,) if experts else ()
    want = {"B": ("U8", (*lead, N, nb, bs * bits // 8)), "scales": ("F32", (*lead, N * nb)),
            "zp": ("U8", (*lead, N * (-(-nb // 2) if bits == 4 else nb))), "perm": ("I64", (*lead, K))}
    arrs: dict[str, np.ndarray | None] = {}
    for key, (dt, shape) in want.items():
        name = f"{prefix}.nbits_{key}"
        if name not in h:
            if key in ("B", "scales") or (key == "perm" and k_in != K):
                raise _bad(f.path, f"{name} is missing")
            arrs[key] = None
            continue
        got = (h[name]["dtype"], tuple(h[name]["shape"]))
        if got != (dt, shape):
            raise _bad(f.path, f"{name} is {got}, expected {(dt, shape)}")
        arrs[key] = f.raw(name)
    perm = arrs["perm"]
    if perm is not None:  # every input column exactly once, the rest padding: the output is fully written
        p = perm.reshape(-1, K)
        ok = (p.min() >= 0 and p.max() <= k_in
              and all(np.array_equal(np.sort(r[r < k_in]), np.arange(k_in)) for r in p))
        if not ok:
            raise _bad(f.path, f"{prefix}.nbits_perm is not a permutation of 0..{k_in - 1} plus padding {k_in}")
    return HostPacked(prefix, arrs["B"], arrs["scales"], arrs["zp"], perm, K, N, bits, bs, k_in,  # type: ignore
                      level, experts)


def plan_weights(f: SafetensorsFile, manifest: Manifest) -> dict[str, StoredWeight]:
    """Every stored runtime weight of a ``cuda`` bundle, its form checked (module docstring), and the forms checked
    against the manifest's quantization record: a packed tensor without a record, a record for other activations
    than the bundle dtype, a weight stored packed with bits the record does not give its canonical weights, or a
    weight the record lists stored in float, are each a BundleError."""
    cfg, dtype, record = manifest.model, manifest.dtype, manifest.quantization
    h, path = f.header, f.path
    out: dict[str, StoredWeight] = {}
    for s in stored_weight_specs(cfg, manifest.limits.max_seq_len):
        tag = TAGS[dtype] if s.matrix else "F32"
        experts = s.shape[0] if len(s.shape) == 3 else 0
        N, k_in = s.shape[-2:] if len(s.shape) >= 2 else (0, 0)
        if s.name in h:
            got = (h[s.name]["dtype"], list(h[s.name]["shape"]))
            if got != (tag, list(s.shape)):
                raise BundleError(f"{path}: weight {s.name} is {got}, this runtime expects {(tag, list(s.shape))}; "
                                  "rebuild")
            out[s.name] = StoredWeight(s.name, "float")
        elif s.name + ".nbits_meta" in h and s.matrix and len(s.shape) >= 2:
            out[s.name] = StoredWeight(s.name, "packed", read_packed(f, s.name, experts, N, k_in))
        elif s.name + ".parts" in h and s.matrix and len(s.shape) >= 2:
            rows = f.raw(s.name + ".parts")
            if rows.ndim != 1 or h[s.name + ".parts"]["dtype"] != "I64" or int(rows.sum()) != N or rows.min() < 1:
                raise _bad(path, f"{s.name}.parts {rows.tolist()} does not split its {N} rows")
            parts, r0 = [], 0
            for i, r in enumerate(int(v) for v in rows):
                pn = f"{s.name}.part{i}"
                if pn in h:
                    want = [tag, [*s.shape[:-2], r, k_in]]
                    if [h[pn]["dtype"], h[pn]["shape"]] != want:
                        raise _bad(path, f"{pn} is {[h[pn]['dtype'], h[pn]['shape']]}, expected {want}")
                    parts.append((r0, r, None, pn))
                else:
                    parts.append((r0, r, read_packed(f, pn, experts, r, k_in), None))
                r0 += r
            out[s.name] = StoredWeight(s.name, "parts", parts=tuple(parts))
        else:
            raise BundleError(f"{path}: weight {s.name} is missing; rebuild the bundle")
    _check_record(record, dtype, out, str(path))
    return out


def _check_record(record: QuantRecord | None, dtype: str, stored: dict[str, StoredWeight], path: str) -> None:
    quantized = {n: w for n, w in stored.items() if w.bits()}
    if record is None:
        if quantized:
            raise BundleError(f"{path} holds packed weights ({sorted(quantized)[:3]} ...) but the manifest records no "
                              "quantization: rebuild the bundle")
        return
    if record.activations != dtype:
        raise BundleError(f"the manifest's quantization record says {record.activations} activations, the bundle "
                          f"dtype is {dtype} (a cuda bundle's activations are its dtype): rebuild the bundle")
    for name, w in stored.items():
        sources = linear_sources(name)
        recorded = {record.modules[c] for c in sources if c in record.modules}
        bits = w.bits()
        levels = {p.accuracy_level for p in ([w.packed] if w.packed else [p for _, _, p, _ in w.parts if p])}
        if levels - {0}:
            raise BundleError(f"{path}: {name} was packed for MatMulNBits accuracy_level {sorted(levels)}, a cuda "
                              "bundle's are 0: rebuild the bundle")
        if bits and not sources:
            raise BundleError(f"{path}: {name} is stored packed, but it is never quantized: rebuild the bundle")
        if w.kind == "packed" and (bits != recorded or any(c not in record.modules for c in sources)):
            raise BundleError(f"{path}: {name} is stored as {sorted(bits)}-bit, the manifest's quantization record "
                              f"says {[record.modules.get(c) for c in sources]} for {list(sources)}: rebuild it")
        if w.kind == "parts" and (not bits or not bits <= recorded):
            raise BundleError(f"{path}: {name}'s packed parts are {sorted(bits)}-bit, the manifest's quantization "
                              f"record says {sorted(recorded)} for {list(sources)}: rebuild the bundle")
        if w.kind == "float" and recorded:
            raise BundleError(f"{path}: {name} is stored in float but the manifest records "
                              f"{[c for c in sources if c in record.modules]} as quantized: rebuild the bundle")


# ---------------------------------------------------------------------------------------- device


def launch_grid(N: int, K: int, experts: int) -> tuple[int, int, int]:
    """One thread per code: ``ceil(N * K / THREADS)`` blocks along x, one row of them per expert along y."""
    return (-(-(N * K) // THREADS), max(1, experts), 1)


class NBitsDequant:
    """The dequantisation kernel for one bundle dtype on one device."""

    def __init__(self, device: CudaDevice, dtype: str) -> None:
        if dtype not in DT_CODES:
            raise BundleError(f"packed weights dequantise to {sorted(DT_CODES)}, not {dtype!r}")
        self.device, self.dtype = device, dtype
        self.module: Module = load_module(SOURCE, (f"-DDT={DT_CODES[dtype]}",), device.arch)

    def upload(self, hp: HostPacked, row0: int = 0) -> PackedLinear:
        """Copy one stored packed weight to the device (``perm`` as int32)."""
        d = self.device
        perm = None if hp.perm is None else d.upload(np.ascontiguousarray(hp.perm, np.int32))
        zp = None if hp.zp is None else d.upload(hp.zp)
        return PackedLinear(d.upload(hp.B), d.upload(hp.scales), zp, perm, hp.K, hp.N, hp.bits, hp.block_size,
                            hp.k_in, hp.experts, row0)

    def vectorized(self, p: PackedLinear, out: int, ldo: int, out_estride: int) -> bool:
        """Whether :meth:`launch` runs ``nbits_dequant8`` (eight codes a thread, 16-byte stores) for this call: no
        act order, K, the block size, ``ldo`` and ``out_estride`` multiples of 8, ``out`` 16-byte aligned."""
        return (p.perm is None and p.K % 8 == 0 and p.block_size % 8 == 0 and ldo % 8 == 0 and out_estride % 8 == 0
                and out % 16 == 0)

    def launch(self, p: PackedLinear, out: int, ldo: int, out_estride: int, vectorized: bool | None = None) -> None:
        """Dequantise ``p`` into rows ``out + (e * out_estride + n * ldo + col) * itemsize`` (a guarded launch on the
        device's stream; the caller keeps ``p`` alive until the stream has run it). ``vectorized`` None: the
        eight-codes-a-thread kernel wherever :meth:`vectorized` allows it (the same bits); False: the per-code one
        (tests compare them); True where it is not allowed: ValueError."""
        if p.experts > MAX_EXPERTS or p.N * p.K >= 2**31:  # grid y; the kernel's 32-bit index within an expert
            raise BundleError(f"packed weight of {p.experts} experts x [{p.N}, {p.K}]: the dequantiser takes at most "
                              f"{MAX_EXPERTS} experts of N * K < 2^31 codes each")
        if ldo < p.k_in:
            raise ValueError(f"ldo {ldo} < k_in {p.k_in}")
        E = max(1, p.experts)
        es = lambda a: a.size // E if a is not None else 0  # noqa: E731 - per-expert stride in elements
        ok = self.vectorized(p, out, ldo, out_estride)
        if vectorized and not ok:
            raise ValueError("nbits_dequant8 needs no act order, K / block size / ldo / out_estride multiples of 8 "
                             "and a 16-byte aligned output")
        if ok and vectorized is not False:
            self.module.kernel("nbits_dequant8").launch(
                self.device, (-(-(p.N * p.K // 8) // THREADS), E, 1), (THREADS, 1, 1), 0,
                [("ptr", p.B.ptr), ("ptr", p.scales.ptr), ("ptr", p.zp.ptr if p.zp is not None else 0),
                 ("ptr", out), ("i32", p.N), ("i32", p.K), ("i32", p.bits), ("i32", p.block_size), ("i64", ldo),
                 ("i64", out_estride), ("i64", es(p.B)), ("i64", es(p.scales)), ("i64", es(p.zp))])
            return
        self.module.kernel("nbits_dequant").launch(
            self.device, launch_grid(p.N, p.K, p.experts), (THREADS, 1, 1), 0,
            [("ptr", p.B.ptr), ("ptr", p.scales.ptr), ("ptr", p.zp.ptr if p.zp is not None else 0),
             ("ptr", p.perm.ptr if p.perm is not None else 0), ("ptr", out), ("i32", p.N), ("i32", p.K),
             ("i32", p.k_in), ("i32", p.bits), ("i32", p.block_size), ("i64", ldo), ("i64", out_estride),
             ("i64", es(p.B)), ("i64", es(p.scales)), ("i64", es(p.zp)), ("i64", es(p.perm))])


def free_packed(device: CudaDevice, packed: Sequence[PackedLinear]) -> None:
    """Free device copies of packed weights once the stream has run their dequantisation."""
    if not packed:
        return
    device.synchronize()
    for p in packed:
        for a in (p.B, p.scales, p.zp, p.perm):
            if a is not None and hasattr(a.owner, "free"):
                a.owner.free()


def fill_weight(device: CudaDevice, deq: NBitsDequant | None, f: SafetensorsFile, w: StoredWeight, dst: int,
                shape: tuple[int, ...], itemsize: int, keep: Callable[[str, PackedLinear], None] | None) -> None:
    """Write stored weight ``w`` (runtime shape ``shape``: ``[N, K]`` or ``[E, N, K]``) to device memory at ``dst``
    (C-contiguous, ``itemsize`` bytes an element). Float forms are copied; packed ones uploaded, dequantised there
    and freed, or handed to ``keep(key, packed)`` (key: the weight's name, ``<name>.part<i>`` for a part)."""
    if w.kind == "float":
        device.copy_htod(dst, f.raw(w.name))
        return
    assert deq is not None
    K = shape[-1]
    estride = shape[-2] * K  # elements from one expert's rows to the next
    done: list[PackedLinear] = []
    items = [(0, shape[-2], w.packed, None, w.name)] if w.kind == "packed" else [
        (r0, r, hp, fn, f"{w.name}.part{i}") for i, (r0, r, hp, fn) in enumerate(w.parts)]
    for r0, _rows, hp, fname, key in items:
        base = dst + r0 * K * itemsize
        if hp is None:  # a float part: rows [r0, r0 + rows) of every expert
            raw = f.raw(fname)  # type: ignore[arg-type]
            if len(shape) == 3:
                for e in range(shape[0]):
                    device.copy_htod(base + e * estride * itemsize, raw[e])
            else:
                device.copy_htod(base, raw)
            continue
        p = deq.upload(hp, r0)
        deq.launch(p, base, K, estride)
        if keep is not None:
            keep(key, p)
        else:
            done.append(p)
    free_packed(device, done)
