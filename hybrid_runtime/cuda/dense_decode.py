"""Dense projections of decode steps (1..16 rows) on tensor cores (``ops/cuda/dense_decode.cu``), the weights as
the mma.sync M operand and the step's rows as N ("swap AB", as the decode MoE): what replaces cuBLASLt for the
decode GEMMs of bf16 / fp16 bundles.

One guarded launch, a programmatic dependent (``pdl=True``) that issues its first weight loads before it waits
for the kernel ahead of it, so the weight stream of a projection overlaps the norm / GDN / attention kernel before
it (cuBLASLt's kernels are not programmatic dependents: every GEMM broke the chain twice).

``out[j, r] = X[j] . W[r] (+ bias[r]) (+ R[j, r])`` for ``j < n <= 16``: X T ``[n, ldx]``, W T ``[N, K]``, bias
float32 ``[N]``, R float32 ``[n, ldr]`` (may be ``out`` itself: D = C in place), out float32 or T ``[n, ldo]``.
Grid ``(ceil(N / rows), 1, 1)`` with ``rows`` 16 (``dd_gemm_m16``) or 32 (``dd_gemm_m32``), block ``32 * warps``
with :func:`warps_for` ``(K)`` warps splitting K.

Batch invariance by construction: an output element's accumulation order depends on (K, warps, the build's U)
only, never on n: a row's result has the same bits whatever else shares the step (tests/gpu/
test_dense_decode_gpu.py). Shapes (:func:`check`): bf16 / fp16, K % 32 == 0, ldx % 8 == 0, 16-byte aligned X
and W, 1 <= n <= 16.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from .driver import CudaDevice, graph_replay_seconds
from .kernels import Module, load_module

SOURCE = "dense_decode.cu"
DT_CODES = {"float16": 1, "bfloat16": 2}
MAX_ROWS = 16  # two n-groups of 8
MAX_WARPS = 8
SHAPE_RULES = "bfloat16 or float16, K % 32 == 0, ldx % 8 == 0, 16-byte aligned X and W, 1 <= n <= 16"


@dataclass(frozen=True)
class DenseKnobs:
    """One build: ``u`` super-steps (32 k each) per register batch, two batches in flight per warp; ``pf``
    super-steps prefetched into L2 before the programmatic wait; ``rows`` weight rows per CTA (16 or 32);
    ``k_per_warp``: K per warp the host aims for (:func:`warps_for`)."""

    u: int = 4
    pf: int = 0
    rows: int = 16
    k_per_warp: int = 512

    def __post_init__(self) -> None:
        problems = []
        if not 1 <= self.u <= 8:
            problems.append(f"u {self.u} not in 1..8")
        if not 0 <= self.pf <= 64:
            problems.append(f"pf {self.pf} not in 0..64")
        if self.rows not in (16, 32):
            problems.append(f"rows {self.rows} not 16 or 32")
        if self.k_per_warp < 32 or self.k_per_warp % 32:
            problems.append(f"k_per_warp {self.k_per_warp}: a positive multiple of 32")
        if problems:
            raise ValueError("dense_decode knobs: " + "; ".join(problems))

    @property
    def options(self) -> tuple[str, ...]:
        return (f"-DDD_U={self.u}", f"-DDD_PF={self.pf}")

    @property
    def kernel(self) -> str:
        return "dd_gemm_m16" if self.rows == 16 else "dd_gemm_m32"


DEFAULT_KNOBS = DenseKnobs()
KNOB_SETS: dict[str, DenseKnobs] = {
    "default": DEFAULT_KNOBS,
    "u1": DenseKnobs(u=1),
    "u2": DenseKnobs(u=2),
    "u3": DenseKnobs(u=3),
    "pf16": DenseKnobs(pf=16),
    "u2pf16": DenseKnobs(u=2, pf=16),
    "m32": DenseKnobs(rows=32, u=2),
    "m32u1": DenseKnobs(rows=32, u=1),
    "kw256": DenseKnobs(k_per_warp=256),
}
# The builds the backend times at load for each decode shape (:meth:`DenseDecode.tune`): all with the default's
# k_per_warp, so whichever wins, every output element is accumulated in the same order (the same bits).
TUNE_SETS: tuple[str, ...] = ("default", "u1", "u2", "u3", "pf16", "u2pf16", "m32", "m32u1")


def warps_for(K: int, knobs: DenseKnobs = DEFAULT_KNOBS) -> int:
    """Warps per CTA for reduction length K: K / k_per_warp, clamped to 1..8 (fixed per K, so per shape)."""
    return max(1, min(MAX_WARPS, K // knobs.k_per_warp))


def grid(N: int, knobs: DenseKnobs = DEFAULT_KNOBS) -> tuple[int, int, int]:
    return (-(-N // knobs.rows), 1, 1)


def problems(dtype: str, n: int, N: int, K: int, ldx: int, x_ptr: int = 0, w_ptr: int = 0) -> list[str]:
    """Why these kernels cannot run a product (empty: they can); :data:`SHAPE_RULES`."""
    out = []
    if dtype not in DT_CODES:
        out.append(f"dtype {dtype!r} (bfloat16 / float16 only)")
    if not 1 <= n <= MAX_ROWS:
        out.append(f"n {n} not in 1..{MAX_ROWS}")
    if N < 1 or K < 32 or K % 32:
        out.append(f"N {N}, K {K}: needs N >= 1 and K a positive multiple of 32")
    if ldx < K or ldx % 8:
        out.append(f"ldx {ldx}: needs ldx >= K and ldx % 8 == 0")
    if x_ptr % 16 or w_ptr % 16:
        out.append("X and W must be 16-byte aligned")
    return out


def check(dtype: str, n: int, N: int, K: int, ldx: int, x_ptr: int = 0, w_ptr: int = 0) -> None:
    """ValueError naming each rule a product breaks."""
    if p := problems(dtype, n, N, K, ldx, x_ptr, w_ptr):
        raise ValueError("dense_decode: " + "; ".join(p))


def pick(times: Mapping[DenseKnobs, float], primary: DenseKnobs) -> DenseKnobs:
    """The fastest build of ``times`` (seconds); ``primary`` on a tie or when it is the only one measured."""
    if not times or times.get(primary, float("inf")) <= min(times.values()):
        return primary
    return min(times, key=lambda kn: times[kn])


class DenseDecode:
    """The decode-GEMM kernels for one dtype on one device: the primary build (:class:`DenseKnobs`) and the
    ``candidates`` :meth:`tune` may choose per shape instead (all with the primary's k_per_warp: the same bits)."""

    def __init__(self, device: CudaDevice, dtype: str, knobs: DenseKnobs = DEFAULT_KNOBS,
                 candidates: Sequence[DenseKnobs] = ()) -> None:
        if dtype not in DT_CODES:
            raise ValueError(f"the dense decode GEMM runs bfloat16 / float16, not {dtype!r}")
        builds = [knobs, *(c for c in candidates if c != knobs)]
        if bad := [c for c in builds if c.k_per_warp != knobs.k_per_warp]:
            raise ValueError(f"dense_decode candidates {bad} split K differently from {knobs}: their results would "
                             "not have the same bits")
        self.device, self.dtype, self.knobs = device, dtype, knobs
        self.modules: dict[DenseKnobs, Module] = {
            c: load_module(SOURCE, (f"-DDT={DT_CODES[dtype]}", *c.options), device.arch) for c in dict.fromkeys(builds)}
        self.choice: dict[tuple[int, int], DenseKnobs] = {}  # (N, K) -> the build tune() picked

    def knobs_for(self, N: int, K: int) -> DenseKnobs:
        return self.choice.get((N, K), self.knobs)

    def tune(self, shapes: Mapping[tuple[int, int], Sequence[int]], x: int, ldx: int, out: int,
             rows: Sequence[int] = (1,), reps: int = 2) -> dict[tuple[int, int], dict[DenseKnobs, float]]:
        """Time every build on each shape and keep the fastest in :attr:`choice`. ``shapes``: (N, K) -> weight
        pointers of that shape (a model's layers: one call per weight, rotating, so the stream comes from memory
        as in a step); ``x`` (T ``[16, ldx]``, ldx >= every K) and ``out`` (float32 ``[16, max N]``): scratch
        device buffers. Each build's calls are captured in a CUDA graph and its replay timed with events (no host
        launch cost in the figure), summed over ``rows``. Returns the seconds per call of every (shape, build)."""
        dev, result = self.device, {}
        for (N, K), ptrs in shapes.items():
            times: dict[DenseKnobs, float] = {}
            for kn in self.modules:
                def body(kn: DenseKnobs = kn, N: int = N, K: int = K, ptrs: Sequence[int] = ptrs) -> None:
                    for n in rows:
                        for w in ptrs:
                            self.launch(n, x, ldx, w, N, K, out, N, True, knobs=kn)

                body()  # loads the kernel, checks every launch
                times[kn] = graph_replay_seconds(dev, body, reps) / (len(ptrs) * len(rows))
            self.choice[(N, K)] = pick(times, self.knobs)
            result[(N, K)] = times
        return result

    def launch(self, n: int, x: int, ldx: int, w: int, N: int, K: int, out: int, ldo: int, out_f32: bool,
               residual: int = 0, ldr: int = 0, bias: int = 0, knobs: DenseKnobs | None = None) -> None:
        """``out = X @ W.T (+ bias) (+ residual)`` (device pointers; see the module docstring for shapes) with the
        build ``knobs`` (default: the one :meth:`tune` chose for (N, K), else the primary). ValueError before any
        launch for a product :func:`check` refuses."""
        check(self.dtype, n, N, K, ldx, x, w)
        kn = knobs or self.knobs_for(N, K)
        self.modules[kn].kernel(kn.kernel).launch(
            self.device, grid(N, kn), (32 * warps_for(K, kn), 1, 1), 0,
            [("ptr", x), ("i64", ldx), ("ptr", w), ("i32", N), ("i32", K), ("i32", n), ("ptr", bias),
             ("ptr", residual), ("i64", ldr), ("ptr", out), ("i64", ldo), ("i32", int(out_f32))], pdl=True)
