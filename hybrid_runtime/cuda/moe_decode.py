"""The MoE of decode steps on tensor cores (``ops/cuda/moe_decode.cu``): the routed experts of a step whose experts
have few pairs each (1-3 at decode batch sizes), with the WEIGHTS as the mma.sync M operand and the pairs as N
("swap AB"), so an expert with one pair fills one of 8 columns rather than one of 128 rows.

Two guarded launches on the device's stream, both programmatic dependents (``pdl=True``), after a routing
kernel (fused.cu's ``moe_route`` or moe_gemm.cu's ``moe_topk`` + ``moe_group``: the same buffers, bit for bit):

1. ``moe_dec_gate_up`` grid :func:`grid` ``("gate_up", ...) = (I / gu_cols, min(E_all, n * kk))``: CTA (x, j)
   computes act columns ``[x * gu_cols, +gu_cols)`` of every pair of expert ``active[j]``:
   ``act[p, i] = T(silu(Wg[e] . h_t) * (Wu[e] . h_t))`` (``act`` T ``[n*kk, I]``), SwiGLU in registers.
2. ``moe_dec_down`` grid ``(H / dn_rows, min(E_all, n * kk))``: CTA (x, j) computes y rows ``[x * dn_rows,
   +dn_rows)``: ``y[t, slot, r] = pair_w[p] * (Wd[e] . act_p)[r]`` (float32 ``y [n, ny, H]``, one slot per pair).

CTAs ``j >= active[E_all]`` (experts without pairs) exit at once. Each CTA streams its weight rows once per
pass of up to ``8 * gcap`` pairs (:func:`groups_per_pass`; more passes only for an expert with more pairs,
rare at decode) through a cp.async ring, with the pass's h / act rows in the same stages, and accumulates
mma.sync m16n8k16 tiles in float32 (bf16 / fp16 inputs).

Batch invariance by construction: every output element is one pair's dot product accumulated in an order fixed
by the shape and the build knobs alone (k tiles in order, each warp its k16 steps of every tile, the warps'
sums added in warp order): never by how many pairs the expert has or which pass, group or column its pair
lands in. A token's act and y have the same bits whatever else shares the step.

Build knobs (:class:`DecodeKnobs`, -D macros of the source): act columns per gate_up CTA, y rows per down CTA,
the two rings' depths, k per stage, groups per pass held in registers, warps. :data:`KNOB_SETS` are the ones
the benchmark (``benchmarks/gpu_moe_decode.py``; H200 results in ``benchmarks/results/gpu_moe_decode_h200.md``)
compares and the compile test checks. Shapes: bf16 / fp16,
H % 64 == 0, I % 64 == 0, E_all <= 1024 (:func:`check_shape`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from .driver import CudaDevice
from .kernels import Module, load_module
from .moe_prefill import MoEBuffers

SOURCE = "moe_decode.cu"
DT_CODES = {"float16": 1, "bfloat16": 2}
MAX_EXPERTS = 1024  # E_all: moe_route / moe_group's limit
GROUP = 8  # pairs per mma n-tile
SHAPE_RULES = "bfloat16 or float16, H % 64 == 0, I % 64 == 0, H > 0, I > 0"


@dataclass(frozen=True)
class DecodeKnobs:
    """One build of ``moe_decode.cu``. ``gu_cols``: act columns per gate_up CTA (its 2 * gu_cols weight rows);
    ``dn_rows``: y rows per down CTA; ``gu_stages`` / ``dn_stages``: ring depths; ``bk``: k elements per stage;
    ``gmax``: groups of 8 pairs per pass held in registers (a pass covers up to 8 * gmax pairs); ``warps``;
    ``early`` 1: the first pass issues its prologue weight copies as soon as the expert id is read, before the
    pair lists; ``pf_mb`` > 0: gate_up prefetches the step's down weights into L2 (bulk prefetch) when they total
    at most ``pf_mb`` MiB; ``dn_pre`` 1: down reads its expert and issues its prologue weight copies before its wait
    for gate_up (only as part of a "both" launch). None changes a result bit."""

    gu_cols: int = 16
    gu_stages: int = 6
    dn_rows: int = 64
    dn_stages: int = 4
    bk: int = 128
    gmax: int = 4
    warps: int = 4
    early: int = 0
    pf_mb: int = 0
    dn_pre: int = 0

    def __post_init__(self) -> None:
        problems = []
        if self.gu_cols not in (8, 16, 32):
            problems.append(f"gu_cols {self.gu_cols} not in (8, 16, 32) (a divisor of 64: I % 64 == 0 shapes)")
        if self.dn_rows not in (16, 32, 64):
            problems.append(f"dn_rows {self.dn_rows} not in (16, 32, 64)")
        if self.bk not in (64, 128):
            problems.append(f"bk {self.bk} not in (64, 128)")
        if not 1 <= self.gmax <= 4:
            problems.append(f"gmax {self.gmax} not in 1..4")
        if self.warps < 1 or (self.bk // 16) % self.warps:
            problems.append(f"warps {self.warps}: (bk / 16) % warps must be 0")
        if self.gu_stages < 2 or self.dn_stages < 2:
            problems.append("stages must be >= 2")
        if self.early not in (0, 1) or not 0 <= self.pf_mb <= 1024 or self.dn_pre not in (0, 1):
            problems.append(f"early {self.early} / dn_pre {self.dn_pre} not 0/1 or pf_mb {self.pf_mb} not in 0..1024")
        for rows in (2 * self.gu_cols, self.dn_rows):
            if (rows * (self.bk // 8)) % self.threads:
                problems.append(f"{rows} rows x {self.bk // 8} chunks do not divide among {self.threads} threads")
        if problems:
            raise ValueError("moe_decode knobs: " + "; ".join(problems))

    @property
    def threads(self) -> int:
        return 32 * self.warps

    @property
    def options(self) -> tuple[str, ...]:
        return (f"-DMD_GU_COLS={self.gu_cols}", f"-DMD_GU_STAGES={self.gu_stages}", f"-DMD_DN_ROWS={self.dn_rows}",
                f"-DMD_DN_STAGES={self.dn_stages}", f"-DMD_BK={self.bk}", f"-DMD_GMAX={self.gmax}",
                f"-DMD_WARPS={self.warps}", f"-DMD_EARLY={self.early}", f"-DMD_PF_DOWN={int(self.pf_mb > 0)}",
                f"-DMD_DN_PRE={self.dn_pre}")

    def rows(self, kind: str) -> int:
        """Weight rows per CTA of ``kind`` ("gate_up": 2 * gu_cols, "down": dn_rows)."""
        return 2 * self.gu_cols if kind == "gate_up" else self.dn_rows

    def stages(self, kind: str) -> int:
        return self.gu_stages if kind == "gate_up" else self.dn_stages


DEFAULT_KNOBS = DecodeKnobs()
# The builds the benchmark compares (and the compile test checks): name -> knobs.
KNOB_SETS: dict[str, DecodeKnobs] = {
    "default": DEFAULT_KNOBS,
    # twice the CTAs (8 act columns / 32 y rows each), a deeper gate_up ring
    "fine": DecodeKnobs(gu_cols=8, gu_stages=8, dn_rows=32, dn_stages=4),
    # half-size stages, twice as many of them (finer-grained release of the ring)
    "bk64": DecodeKnobs(gu_stages=12, dn_stages=8, bk=64),
    # at most 16 pairs per pass: less shared memory past 8 tokens, a deeper gate_up ring
    "g2": DecodeKnobs(gu_stages=7, gmax=2),
    # the weight stream starts before the pair lists are read (H200: 2-10 % slower, its one prologue group
    # delays the first stage)
    "early": DecodeKnobs(early=1),
    # gate_up brings the down weights into L2 when the step's fit 24 / 40 MiB (batch 1: 9 x 2 MiB; H200: 9 %
    # slower at batch 1, no change past it)
    "pf24": DecodeKnobs(pf_mb=24),
    "pf40": DecodeKnobs(pf_mb=40),
    # down's expert read and prologue weight copies before its wait for gate_up (MD_DN_PRE)
    "dnpre": DecodeKnobs(dn_pre=1),
    # 32 act columns (64 weight rows) per gate_up CTA, a 4-deep ring: half the gate_up CTAs, each streaming twice
    # the rows (H200, 64 tokens: 350.6 vs 382.0 us for the pair, 96% of copy bandwidth; none at 8 tokens). The
    # backend's build for decode steps of more than 16 rows.
    "many": DecodeKnobs(gu_cols=32, gu_stages=4),
}


def supported(dtype: str, hidden: int, inter: int) -> bool:
    """Whether these kernels run this shape (:data:`SHAPE_RULES`): bf16 / fp16, H % 64 == 0, I % 64 == 0."""
    return dtype in DT_CODES and hidden > 0 and inter > 0 and hidden % 64 == 0 and inter % 64 == 0


def check_shape(dtype: str, hidden: int, inter: int, e_all: int = 1, kk: int = 1, ldh: int | None = None,
                ny: int | None = None) -> None:
    """ValueError naming the rule a shape breaks: :data:`SHAPE_RULES`, 1 <= E_all <= 1024, 1 <= kk <= 32,
    ldh >= H and ldh % 8 == 0 (16-byte h rows), ny >= kk."""
    problems = []
    if not supported(dtype, hidden, inter):
        problems.append(f"dtype {dtype!r}, H {hidden}, I {inter}: needs {SHAPE_RULES}")
    if not 1 <= e_all <= MAX_EXPERTS:
        problems.append(f"E_all {e_all}: needs 1 <= E_all <= {MAX_EXPERTS}")
    if not 1 <= kk <= 32:
        problems.append(f"kk {kk}: needs 1 <= kk <= 32")
    if ldh is not None and (ldh < hidden or ldh % 8):
        problems.append(f"ldh {ldh}: needs ldh >= H and ldh % 8 == 0")
    if ny is not None and ny < kk:
        problems.append(f"ny {ny}: needs ny >= kk {kk}")
    if problems:
        raise ValueError("moe_decode: " + "; ".join(problems))


def groups_per_pass(n: int, gmax: int) -> int:
    """gcap: groups of 8 pairs one pass covers for a step of ``n`` tokens. An expert has at most n pairs (top-k
    picks distinct experts, the shared expert is one pair per token), so min(gmax, ceil(n / 8)) groups hold
    every expert's pairs in one pass whenever n <= 8 * gmax; it sizes the shared memory, not the arithmetic."""
    if n < 1:
        raise ValueError(f"need at least one token, got {n}")
    return max(1, min(gmax, -(-n // GROUP)))


def ny_grid(n: int, kk: int, e_all: int) -> int:
    """CTA rows of both grids: at most min(E_all, n * kk) experts have pairs."""
    return max(1, min(e_all, n * kk))


def grid(kind: str, n: int, kk: int, e_all: int, hidden: int, inter: int,
         knobs: DecodeKnobs = DEFAULT_KNOBS) -> tuple[int, int, int]:
    """Launch grid of ``kind`` ("gate_up" or "down"): (I / gu_cols or H / dn_rows, :func:`ny_grid`, 1)."""
    if kind == "gate_up":
        return (inter // knobs.gu_cols, ny_grid(n, kk, e_all), 1)
    if kind == "down":
        return (hidden // knobs.dn_rows, ny_grid(n, kk, e_all), 1)
    raise ValueError(f"kind {kind!r}: 'gate_up' or 'down'")


def stage_bytes(kind: str, gcap: int, knobs: DecodeKnobs = DEFAULT_KNOBS) -> int:
    """One ring stage: the CTA's weight rows and 8 * gcap B rows, bk elements (2 bytes) each."""
    return (knobs.rows(kind) + GROUP * gcap) * knobs.bk * 2


def smem_bytes(kind: str, gcap: int, knobs: DecodeKnobs = DEFAULT_KNOBS) -> int:
    """Dynamic shared memory of one CTA: the ring, or the warps' partial sums that reuse it after the last k
    tile (warps x m-tiles x gcap fragments of 32 lanes x 16 bytes) if larger."""
    ring = knobs.stages(kind) * stage_bytes(kind, gcap, knobs)
    red = knobs.warps * (knobs.rows(kind) // 16) * gcap * 32 * 16
    return max(ring, red)


def bytes_in_flight(kind: str, gcap: int = 1, knobs: DecodeKnobs = DEFAULT_KNOBS) -> int:
    """Weight bytes one CTA keeps in flight in steady state: stages - 1 ring stages of weight rows."""
    return (knobs.stages(kind) - 1) * knobs.rows(kind) * knobs.bk * 2


class MoEDecode:
    """The decode MoE kernels of one build (:class:`DecodeKnobs`) for one dtype on one device."""

    def __init__(self, device: CudaDevice, dtype: str, **knobs: int) -> None:
        """``knobs``: :class:`DecodeKnobs` fields (ValueError for a bad set); compiles (cached) and loads."""
        if dtype not in DT_CODES:
            raise ValueError(f"the decode tensor-core MoE runs bfloat16 / float16, not {dtype!r}")
        self.device, self.dtype = device, dtype
        self.knobs = DecodeKnobs(**knobs)
        self.module: Module = load_module(SOURCE, (f"-DDT={DT_CODES[dtype]}", *self.knobs.options), device.arch)
        self.max_smem: dict[str, int] = {}
        for kind, name in (("gate_up", "moe_dec_gate_up"), ("down", "moe_dec_down")):
            need = smem_bytes(kind, self.knobs.gmax, self.knobs)  # the largest (gcap = gmax)
            if need > 48 * 1024:
                self.module.kernel(name).set_max_dynamic_smem(device, need)
            self.max_smem[kind] = need

    @property
    def label(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in asdict(self.knobs).items())

    def launch(self, n: int, h: int, ldh: int, gate_up: int, down: int, hidden: int, inter: int, kk: int, ny: int,
               e_all: int, bufs: MoEBuffers, parts: str = "both") -> None:
        """The routed experts of a step after routing: h (T ``[n, ldh]``), stacked weights ``gate_up``
        ``[E_all, 2I, H]`` and ``down`` ``[E_all, H, I]`` (device pointers) -> ``bufs.act`` (T ``[n*kk, I]``),
        ``bufs.y`` (float32 ``[n, ny, H]``: slots ``kk .. ny-1`` untouched). Reads ``bufs.pair_w``,
        ``pair_list``, ``expert_off``, ``active`` (E_all + 1 entries each of the last two). ``parts``:
        "both", or "gate_up" / "down" alone (benchmarks)."""
        check_shape(self.dtype, hidden, inter, e_all, kk, ldh, ny)
        if parts not in ("both", "gate_up", "down"):
            raise ValueError(f"parts {parts!r}: 'both', 'gate_up' or 'down'")
        if parts == "down" and self.knobs.dn_pre:
            raise ValueError("a dn_pre build's down kernel reads the routing before its wait: it must follow its "
                             "gate_up (parts='both')")
        kn = self.knobs
        gcap = groups_per_pass(n, kn.gmax)
        if parts in ("both", "gate_up"):
            self.module.kernel("moe_dec_gate_up").launch(
                self.device, grid("gate_up", n, kk, e_all, hidden, inter, kn), (kn.threads, 1, 1),
                smem_bytes("gate_up", gcap, kn),
                [("ptr", h), ("i64", ldh), ("ptr", gate_up), ("i32", hidden), ("i32", inter), ("i32", kk),
                 ("i32", e_all), ("i32", gcap), ("ptr", bufs.expert_off), ("ptr", bufs.pair_list),
                 ("ptr", bufs.active), ("ptr", bufs.act), ("ptr", down if kn.pf_mb else 0),
                 ("i64", kn.pf_mb << 20)], pdl=True)
        if parts in ("both", "down"):
            self.module.kernel("moe_dec_down").launch(
                self.device, grid("down", n, kk, e_all, hidden, inter, kn), (kn.threads, 1, 1),
                smem_bytes("down", gcap, kn),
                [("ptr", bufs.act), ("ptr", down), ("ptr", bufs.pair_w), ("i32", hidden), ("i32", inter),
                 ("i32", kk), ("i32", ny), ("i32", e_all), ("i32", gcap), ("ptr", bufs.expert_off),
                 ("ptr", bufs.pair_list), ("ptr", bufs.active), ("ptr", bufs.y)], pdl=True)
