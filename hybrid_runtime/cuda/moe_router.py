"""The MoE router of decode steps in one launch (``ops/cuda/moe_router.cu`` ``moe_router_route``): the router GEMM
(float32 logits ``[n, ld]``, every one of the ``E_pad`` router rows) and ``fused.cu``'s ``moe_route`` (softmax,
top-k, grouping by expert) for ``n <= 16`` token rows, instead of a cuBLASLt GEMM + a one-CTA ``moe_route``.

Grid ``ceil(E_pad / rows_per_cta)`` CTAs of :data:`THREADS` threads (``rows_per_cta`` 4, 8 or 16: 66, 33 or 17
CTAs for the Qwen3.5-35B-A3B router, E_pad 264). Each CTA computes its router rows for all tokens on the tensor
cores (one m16n8k16 tile per 8 rows; H in blocks of 32 k, block b on warp b % 32, the warps summed in order),
so a logit's sum order is fixed by H alone: a token's logits have the same bits whatever else shares the step
(batch invariance by construction). The CTA that finishes last (an atomic counter in a 16-byte ``workspace``,
which that CTA resets to 0: stream order and CUDA graph replays always find it 0) routes: the outputs are
``moe_route``'s bit for bit given the same logits (``pair_w``, ``pair_e``, ``expert_off``, ``active``, the same pairs
per expert in ``pair_list``). Launched as a programmatic dependent (``pdl=True``): the weights are loaded before
``griddepcontrol.wait``, so the kernel's DRAM read overlaps the previous kernel's tail.

Shapes it takes (:func:`shape_problems` names the rule a shape breaks; :meth:`MoERouter.launch` raises
ValueError): bfloat16 / float16 h and router weights; 1 <= n <= :data:`MAX_TOKENS`; H % 32 == 0; ldh >= H and
ldh % 8 == 0; h and the weights 16-byte aligned; ld >= E_pad; 1 <= k <= min(31, E); E + fold_shared <= E_pad and
<= 1024. float32 bundles keep the cuBLASLt GEMM + ``moe_route`` (their parity tests compare float32 logits).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .driver import CudaDevice, DeviceArray
from .kernels import Kernel, load_module

SOURCE = "moe_router.cu"
KERNEL = "moe_router_route"
DT_CODES = {"float16": 1, "bfloat16": 2}
THREADS = 1024  # every CTA (any may be the last): one warp per token in the routing, moe_route's 1024-thread scans
WARPS = THREADS // 32
K_BLOCK = 32  # k per block: two m16n8k16 steps; block b belongs to warp b % WARPS
ROWS_PER_CTA = (4, 8, 16)  # the knob (-DMR_ROWS)
DEFAULT_ROWS_PER_CTA = 8
MAX_TOKENS = 16  # token rows (the M = 16 side of the MMA tile)
MAX_EXPERTS = 1024  # E + fold_shared: one scan thread per expert
MAX_TOPK = 31
WORKSPACE_BYTES = 16  # workspace[0]: the CTA counter (0 between launches); 16 bytes keep what follows aligned


def tiles_per_cta(rows_per_cta: int) -> int:
    """m16n8k16 tiles (8 router rows each) one CTA runs."""
    return -(-rows_per_cta // 8)


def grid_size(e_pad: int, rows_per_cta: int = DEFAULT_ROWS_PER_CTA) -> int:
    """CTAs of one launch: ``ceil(E_pad / rows_per_cta)``."""
    return -(-e_pad // rows_per_cta)


def cta_rows(e_pad: int, rows_per_cta: int = DEFAULT_ROWS_PER_CTA) -> list[range]:
    """The router rows (logit columns) CTA ``c`` writes, for every ``c``: ``[c * rows, min(E_pad, (c + 1) * rows))``
    (the kernel's phase-1 bounds: ``r < MR_ROWS && row0 + r < e_pad``)."""
    return [range(c * rows_per_cta, min(e_pad, (c + 1) * rows_per_cta)) for c in range(grid_size(e_pad, rows_per_cta))]


def smem_bytes(n: int, num_experts: int, fold_shared: bool, rows_per_cta: int = DEFAULT_ROWS_PER_CTA) -> int:
    """Dynamic shared memory of a launch: the warps' accumulators (phase 1, ``32 x tiles x 16 x 8`` float32) or
    the last CTA's copy of the logits (phase 2, ``n x (E + fold_shared)`` float32), whichever is larger."""
    return max(WARPS * tiles_per_cta(rows_per_cta) * 128 * 4, n * (num_experts + int(fold_shared)) * 4)


MAX_SMEM = smem_bytes(MAX_TOKENS, MAX_EXPERTS, False, max(ROWS_PER_CTA))  # what the kernel is opted in to


def shape_problems(dtype: str, n: int, hidden: int, e_pad: int, num_experts: int, k: int, fold_shared: bool,
                   ldh: int | None = None, ld: int | None = None) -> list[str]:
    """The rules a launch shape breaks (empty: the kernel takes it). ``ldh`` / ``ld`` default to H / E_pad."""
    ldh = hidden if ldh is None else ldh
    ld = e_pad if ld is None else ld
    r = []
    if dtype not in DT_CODES:
        r.append(f"dtype {dtype!r} is not bfloat16 / float16 (float32 bundles keep the cuBLASLt router GEMM)")
    if not 1 <= n <= MAX_TOKENS:
        r.append(f"n = {n} token rows: 1 <= n <= {MAX_TOKENS}")
    if hidden < K_BLOCK or hidden % K_BLOCK:
        r.append(f"H = {hidden}: a positive multiple of {K_BLOCK}")
    if ldh < hidden or ldh % 8:
        r.append(f"ldh = {ldh}: >= H and a multiple of 8 (16-byte rows of h)")
    if ld < e_pad:
        r.append(f"ld = {ld} < E_pad = {e_pad}: a logits row holds every router row")
    if not 1 <= k <= min(MAX_TOPK, num_experts):
        r.append(f"k = {k}: 1 <= k <= min({MAX_TOPK}, E = {num_experts})")
    e_all = num_experts + int(fold_shared)
    if num_experts < 1 or e_all > e_pad:
        r.append(f"E + fold_shared = {e_all}: 1 <= E and E + fold_shared <= E_pad = {e_pad} (the shared gate's row)")
    if e_all > MAX_EXPERTS:
        r.append(f"E + fold_shared = {e_all} > {MAX_EXPERTS}")
    return r


def supported(dtype: str, hidden: int, e_pad: int, num_experts: int, k: int) -> bool:
    """Whether a model's router runs here for every decode batch of up to :data:`MAX_TOKENS` rows, folded shared
    expert or not (the backend's gate)."""
    return not any(shape_problems(dtype, n, hidden, e_pad, num_experts, k, fold)
                   for n in (1, MAX_TOKENS) for fold in (False, True) if not fold or num_experts < e_pad)


@dataclass(frozen=True)
class RouteBuffers:
    """Device pointers of the routing outputs (``moe_route``'s contract; kk = k + fold_shared, E_all = E +
    fold_shared): ``pair_w`` float32 ``[n*kk]``, ``pair_e`` / ``pair_list`` int32 ``[n*kk]``, ``expert_off`` /
    ``active`` int32 ``[E_all + 1]``; ``workspace``: :data:`WORKSPACE_BYTES`, zeroed once at allocation."""

    pair_w: int
    pair_e: int
    expert_off: int
    pair_list: int
    active: int
    workspace: int


class MoERouter:
    """``moe_router_route`` for one dtype and ``rows_per_cta`` on one device (see the module docstring)."""

    def __init__(self, device: CudaDevice, dtype: str, rows_per_cta: int = DEFAULT_ROWS_PER_CTA) -> None:
        if dtype not in DT_CODES:
            raise ValueError(f"the fused MoE router runs bfloat16 / float16, not {dtype!r}")
        if rows_per_cta not in ROWS_PER_CTA:
            raise ValueError(f"rows_per_cta must be one of {ROWS_PER_CTA}, not {rows_per_cta}")
        self.device, self.dtype, self.rows_per_cta = device, dtype, rows_per_cta
        self.module = load_module(SOURCE, options(dtype, rows_per_cta), device.arch)
        self.kernel: Kernel = self.module.kernel(KERNEL)
        if MAX_SMEM > 48 * 1024:  # the largest phase 2 (16 tokens x 1024 experts) is past the default 48 KB
            self.kernel.set_max_dynamic_smem(device, MAX_SMEM)

    def launch(self, n: int, h: int, ldh: int, router: DeviceArray, logits: int, ld: int, num_experts: int, k: int,
               renorm: bool, fold_shared: bool, bufs: RouteBuffers) -> None:
        """Logits ``[n, ld]`` (float32, columns ``0 .. E_pad-1``) of h (``[n, ldh]`` in the router's dtype, device
        pointer) against ``router`` (``[E_pad, H]``: the experts' rows, then the shared gate's, then zeros), then
        routing into ``bufs`` exactly as ``moe_route(logits, ld, n, E, k, renorm, fold_shared)``. ValueError for a
        shape the kernel does not take (:func:`shape_problems`)."""
        if router.ndim != 2:
            raise ValueError(f"router weights must be [E_pad, H], got {router.shape}")
        e_pad, hidden = router.shape
        reasons = shape_problems(router.dtype.name, n, hidden, e_pad, num_experts, k, fold_shared, ldh, ld)
        if router.dtype.name != self.dtype:
            reasons.append(f"router weights are {router.dtype.name}, this kernel was built for {self.dtype}")
        if h % 16 or router.ptr % 16:
            reasons.append("h and the router weights must be 16-byte aligned")
        if logits % 4 or bufs.workspace % 4:
            reasons.append("logits and the workspace must be 4-byte aligned")
        if reasons:
            raise ValueError("moe_router_route: " + "; ".join(reasons))
        smem = smem_bytes(n, num_experts, fold_shared, self.rows_per_cta)
        self.kernel.launch(self.device, (grid_size(e_pad, self.rows_per_cta), 1, 1), (THREADS, 1, 1), smem,
                           args(n, h, ldh, router.ptr, hidden, e_pad, logits, ld, num_experts, k, renorm, fold_shared,
                                bufs), pdl=True)


def options(dtype: str, rows_per_cta: int = DEFAULT_ROWS_PER_CTA) -> tuple[str, ...]:
    """NVRTC options of one build (also what the compile tests use)."""
    return (f"-DDT={DT_CODES[dtype]}", f"-DMR_ROWS={rows_per_cta}")


def args(n: int, h: int, ldh: int, w: int, hidden: int, e_pad: int, logits: int, ld: int, num_experts: int, k: int,
         renorm: bool, fold_shared: bool, bufs: RouteBuffers) -> Sequence[tuple[str, int]]:
    """The kernel's parameters, in its order."""
    return [("ptr", h), ("i64", ldh), ("ptr", w), ("i32", hidden), ("i32", e_pad), ("ptr", logits), ("i32", ld),
            ("i32", n), ("i32", num_experts), ("i32", k), ("i32", int(renorm)), ("i32", int(fold_shared)),
            ("ptr", bufs.pair_w), ("ptr", bufs.pair_e), ("ptr", bufs.expert_off), ("ptr", bufs.pair_list),
            ("ptr", bufs.active), ("ptr", bufs.workspace)]
