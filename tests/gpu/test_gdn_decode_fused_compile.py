"""The fused GDN decode pair (ops/cuda/gdn.cu ``gdn_conv_gates_decode`` + ``gdn_decode_norm``) without a GPU:

* NVRTC compiles it for sm_90 without spilling, for every activation / output dtype and the head shapes of the
  model family (dk = dv = 128), the tests' (16 x 12, 64 x 64, 8 x 8, 32 x 32); a shape outside the rule has no
  ``gdn_decode_norm`` (the host rule is the kernel's ``FUSED_OK``);
* the gate math is fused.cu's, text for text; the PTX waits for the previous kernel (PDL) before any global access
  and leaves ptxas nothing to contract, so the bits are fixed by the source;
* a numpy model of ``gdn_decode_norm``'s thread -> (row, column) mapping covers each head's state exactly once,
  and gives every element the thread role it has in ``gdn_decode`` (so the reductions are the same);
* the launches' argument lists match the kernels' parameters, and the ``cuda`` backend's pipeline, run on fakes,
  launches two GDN kernels per layer in decode steps (four with ``fused_gdn_decode=False``) and the same ones as
  before in prefill, with the pointers the four launches used.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterator
from importlib import resources
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from test_cuda_compile import check_log, nvrtc_or_skip
from test_cuda_compile import ptx as compute_90_ptx

DECODE_KERNELS = ("gdn_conv_decode", "gdn_conv_gates_decode", "gdn_decode", "gdn_decode_norm")

# (DT, OT, DK, DV, KW): the backend's builds (float32 u and core, o in the bundle dtype), then CudaGdn's own
# (o in the activation dtype)
VARIANTS = [(0, ot, dk, dv, kw) for ot in (0, 1, 2) for dk, dv, kw in ((128, 128, 4), (16, 12, 3), (64, 64, 4))]
VARIANTS += [(1, 1, 128, 128, 4), (2, 2, 128, 128, 4), (0, 2, 8, 8, 4), (0, 2, 32, 32, 4), (2, 2, 16, 12, 1)]


def _opts(dt: int, ot: int, dk: int, dv: int, kw: int) -> tuple[str, ...]:
    return (f"-DDT={dt}", f"-DOT={ot}", f"-DDK={dk}", f"-DDV={dv}", f"-DKW={kw}")


def _entries(log: str) -> dict[str, str]:
    """ptxas's verbose log cut per kernel: name -> its lines."""
    parts = re.split(r"(?=ptxas info\s+: Compiling entry function ')", log)
    out = {}
    for p in parts:
        m = re.match(r"ptxas info\s+: Compiling entry function '(\w+)'", p)
        if m:
            out[m.group(1)] = p
    return out


@pytest.mark.parametrize("variant", VARIANTS)
def test_fused_decode_kernels_compile_without_spills(variant: tuple[int, ...]) -> None:
    nvrtc_or_skip()
    from hybrid_runtime.cuda.gdn import fused_threads
    from hybrid_runtime.cuda.kernels import compile_log, source

    log = compile_log(source("gdn.cu"), "gdn.cu", _opts(*variant), "sm_90")
    ent = _entries(log)
    for k in DECODE_KERNELS:
        assert k in ent, f"{k} missing from the build {variant}"
        check_log(ent[k])  # registers <= 255, no spills (the decode kernels; gdn_prefill is not this test's)
    regs = int(re.search(r"Used (\d+) registers", ent["gdn_decode_norm"]).group(1))  # type: ignore[union-attr]
    dv = variant[3]
    assert regs * fused_threads(dv) <= 65536, "one gdn_decode_norm CTA must fit an SM's register file"
    print(f"{variant}: gdn_decode_norm {regs} registers x {fused_threads(dv)} threads")


def test_a_head_outside_the_rule_has_no_fused_kernel() -> None:
    nvrtc_or_skip()
    from hybrid_runtime.cuda.gdn import fused_decode_fits
    from hybrid_runtime.cuda.kernels import compile_log, source

    for dk, dv in ((128, 160), (192, 64)):
        assert not fused_decode_fits(dk, dv)
        ent = _entries(compile_log(source("gdn.cu"), "gdn.cu", _opts(0, 2, dk, dv, 4), "sm_90"))
        assert "gdn_decode" in ent and "gdn_conv_gates_decode" in ent and "gdn_decode_norm" not in ent


# ---------------------------------------------------------------------------------------- the source's macros


def _macros(dk: int, dv: int) -> dict[str, int]:
    """RM, FCG, NTF of gdn.cu evaluated for a head shape (C division)."""
    from hybrid_runtime.cuda.kernels import source

    src = source("gdn.cu")
    env: dict[str, int] = {"DK": dk, "DV": dv}
    for name in ("RM", "FCG", "NTF"):
        expr = re.search(rf"^#define {name} (.*?)\s*$", src, re.M).group(1)  # type: ignore[union-attr]
        env[name] = int(eval(expr.replace("/", "//"), {}, env))  # our own source; names limited to env
    return env


def test_host_rule_and_thread_count_are_the_kernels() -> None:
    from hybrid_runtime.cuda.gdn import fused_decode_fits, fused_threads
    from hybrid_runtime.cuda.kernels import source

    src = source("gdn.cu")
    rule = re.search(r"^#define FUSED_OK (.*?)\s*$", src, re.M).group(1)  # type: ignore[union-attr]
    rule = rule.replace("&&", "and").replace("||", "or")
    for dk in (8, 16, 20, 64, 128, 132, 192, 256):
        for dv in (4, 8, 12, 32, 36, 64, 96, 124, 128, 132, 160, 256):
            assert fused_decode_fits(dk, dv) == bool(eval(rule, {}, {"DK": dk, "DV": dv})), (dk, dv)
            assert fused_threads(dv) == _macros(dk, dv)["NTF"]
    assert fused_threads(128) == 512 and fused_threads(12) == 128 and fused_threads(64) == 256


@pytest.mark.parametrize("dk,dv", [(128, 128), (16, 12), (64, 64), (8, 8), (32, 32), (128, 96), (20, 36)])
def test_thread_mapping_covers_the_state_once(dk: int, dv: int) -> None:
    """gdn_decode_norm thread tid: group cg = tid >> 7, t = tid & 127, column j = 32 cg + 4 (t & 7) (a float4),
    rows (t >> 3) + 16 m, m < RM; row group 0 stages its 4 outputs, thread tid < DV writes o[tid]. The same
    element's thread in gdn_decode (grid x = ceil(DV/32)): CTA x = cg, thread t: the roles are identical."""
    M = _macros(dk, dv)
    RM, NTF = M["RM"], M["NTF"]
    assert dv % 4 == 0
    state = np.zeros((dk, dv), np.int64)
    staged = np.zeros(dv, np.int64)
    written = np.zeros(dv, np.int64)
    fused_role: dict[tuple[int, int], tuple[int, int]] = {}
    for tid in range(NTF):
        cg, t = tid >> 7, tid & 127
        tc, rg = t & 7, t >> 3
        j = 32 * cg + 4 * tc
        if j < dv:  # dv % 4 == 0: the whole float4 is inside
            assert j % 4 == 0 and j + 3 < dv
            for m in range(RM):
                i = rg + 16 * m
                if i < dk:
                    state[i, j:j + 4] += 1
                    for c in range(4):
                        fused_role[(i, j + c)] = (cg, t)
            if rg == 0:
                staged[j:j + 4] += 1
        if tid < dv:
            written[tid] += 1
    assert (state == 1).all(), "every state element loaded and stored by exactly one thread"
    assert (staged == 1).all() and (written == 1).all()
    decode_role: dict[tuple[int, int], tuple[int, int]] = {}
    for bx in range(-(-dv // 32)):
        for t in range(128):
            j = 32 * bx + 4 * (t & 7)
            for m in range(RM):
                i = (t >> 3) + 16 * m
                if j < dv and i < dk:
                    for c in range(4):
                        decode_role[(i, j + c)] = (bx, t)
    assert fused_role == decode_role
    # the norm: each warp sums column d in lane d % 32, in the order gated_rmsnorm does (d = lane + 32 k)
    lanes = [[d for d in range(dv) if d % 32 == lane] for lane in range(32)]
    assert sorted(d for ls in lanes for d in ls) == list(range(dv))


# ---------------------------------------------------------------------------------------- the gate math


def _body(src: str, fn: str) -> str:
    return re.search(rf"float {fn}\(float x\) \{{ return (.*?); \}}", src).group(1)  # type: ignore[union-attr]


def test_gate_math_is_fused_cu_s() -> None:
    from hybrid_runtime.cuda.kernels import source

    fused, gates = source("fused.cu"), source("gdn_gates.cuh")
    assert _body(gates, "gdn_sigmoidf") == _body(fused, "sigmoidf_")
    assert _body(gates, "gdn_softplusf") == _body(fused, "softplusf_")
    want_g = re.search(r"g\[i\] = (.*?);", fused).group(1).replace("softplusf_", "gdn_softplusf")  # type: ignore
    want_b = re.search(r"beta\[i\] = (.*?);", fused).group(1).replace("sigmoidf_", "gdn_sigmoidf")  # type: ignore
    assert re.search(r"g\[j\] = (.*?);", gates).group(1) == want_g  # type: ignore[union-attr]
    assert re.search(r"beta\[j\] = (.*?);", gates).group(1) == want_b  # type: ignore[union-attr]
    raw = resources.files("hybrid_runtime.ops").joinpath("cuda", "gdn.cu").read_text(encoding="utf-8")
    assert '#include "gdn_gates.cuh"' in raw and "gdn_gate(" in source("gdn.cu")


# ---------------------------------------------------------------------------------------- PTX


def _ptx(name: str, opts: tuple[str, ...]) -> str:
    """PTX of ops/cuda/<name> for compute_90."""
    from hybrid_runtime.cuda.kernels import source

    return compute_90_ptx(source(name), name, opts)


def _entry(ptx: str, name: str) -> list[str]:
    m = re.search(rf"\.entry {name}\((.*?)\n}}\n", ptx, re.S)
    assert m, f"{name} not in the PTX"
    return [line.strip() for line in m.group(0).split("\n")]


def _contractible(lines: list[str]) -> list[str]:
    """add / sub .f32 with an operand from a plain mul.f32: PTX lets ptxas fuse those into an fma (or not)."""
    defs = {}
    for line in lines:
        m = re.match(r"(\S+)\s+(%f\d+),", line)
        if m:
            defs[m.group(2)] = m.group(1)
    out = []
    for line in lines:
        m = re.match(r"(?:add|sub)\.f32\s+%f\d+,\s*(\S+),\s*(\S+);", line)
        if m and any(defs.get(op.rstrip(",")) == "mul.f32" for op in m.groups()):
            out.append(line)
    return out


@pytest.mark.parametrize("variant", [(0, 2, 128, 128, 4), (0, 0, 16, 12, 3), (0, 1, 64, 64, 4), (2, 2, 8, 8, 4)])
def test_ptx_waits_before_dependent_access_and_pins_the_rounding(variant: tuple[int, ...]) -> None:
    """The fused pair runs as programmatic dependents: before griddepcontrol.wait they may only LOAD (the state,
    the conv windows, weights and slots, which no earlier kernel of the step writes) - never store or do atomics -
    and gdn_decode_norm does issue its state loads there (the point of the split)."""
    nvrtc_or_skip()
    ptx = _ptx("gdn.cu", _opts(*variant))
    for k in ("gdn_conv_gates_decode", "gdn_decode_norm"):  # launched as programmatic dependents
        body = _entry(ptx, k)
        waits = [i for i, line in enumerate(body) if line.startswith("griddepcontrol.wait")]
        assert waits, f"{k} never waits for the kernel before it"
        before = body[: waits[-1]]  # the text up to the main path's wait (an early-exit path waits before it)
        bad = [line for line in before if re.match(r"(@!?%p\d+\s+)?(st|atom|red)\.global", line)]
        assert bad == [], f"{k} writes global memory before griddepcontrol.wait: {bad}"
        if k == "gdn_decode_norm":
            loads = [line for line in before if re.match(r"(@!?%p\d+\s+)?ld\.global(?!\.nc)", line)]
            assert loads, f"{k}: the state is not read before the wait"
        assert any(line.startswith("griddepcontrol.launch_dependents") for line in body)
    for k in ("gdn_conv_decode", "gdn_decode"):  # launched normally (CudaGdn.decode, the four-launch path)
        assert not any("griddepcontrol" in line for line in _entry(ptx, k))
    for k in DECODE_KERNELS:
        assert _contractible(_entry(ptx, k)) == [], k
    fptx = _ptx("fused.cu", (f"-DDT={variant[1]}",))
    for k in ("gdn_gates", "gated_rmsnorm"):  # the kernels the fused pair must match bit for bit
        assert _contractible(_entry(fptx, k)) == [], k


_INT_OPS = ("cvt", "mul.wide", "add.s", "add.u", "shl", "and", "or", "mul.lo", "cvta", "sub.s", "mad", "setp", "selp.b",
            "shr", "neg.s", "mov.u", "min", "max", "not", "xor", "rem", "div.s", "div.u")


def _stored_value_trees(lines: list[str]) -> list[str]:
    """The expression tree of every float32 value a kernel stores to global memory (PTX dataflow; leaves: loads
    by kind, constants; a register defined on several paths becomes PHI{its definitions}; integer work is "int")."""
    defs: dict[str, list[tuple[str, list[str]]]] = {}
    for line in lines:
        m = re.match(r"(@!?%p\d+\s+)?([a-z][\w.]*)\s+(.*);$", line)
        if not m or m.group(2).startswith(("st.", "bra", "bar", "ret", "griddepcontrol")):
            continue
        ops = [x.strip() for x in re.split(r",(?![^\[]*\])", m.group(3))]
        defs.setdefault(ops[0].split("|")[0], []).append((m.group(2), ops[1:]))
    memo: dict[str, str] = {}
    active: set[str] = set()

    def one(op: str, args: list[str]) -> str:
        if op.startswith("ld."):
            return ".".join(op.split(".")[:2])
        if op.startswith("shfl"):
            return f"shfl({ex(args[0])},{args[1]})"
        if op.startswith(("mov.b32", "mov.f32")):
            return ex(args[0])
        if op.startswith(_INT_OPS):
            return "int"
        return op + "(" + ",".join(ex(a) for a in args) + ")"

    def ex(r: str) -> str:
        if not r.startswith("%"):
            return r
        ds = defs.get(r, [])
        if not r.startswith("%f") and not any(op.startswith(("shfl", "mov.b32")) for op, _ in ds):
            return "int"  # integer work (float bits reach the integer registers only through mov.b32 / shfl)
        if r in memo:
            return memo[r]
        if r in active:
            return "LOOP"
        active.add(r)
        alts = sorted({one(op, a) for op, a in ds})
        active.discard(r)
        memo[r] = alts[0] if len(alts) == 1 else "PHI{" + "|".join(alts) + "}"
        return memo[r]

    out = []
    for line in lines:
        m = re.match(r"(@!?%p\d+\s+)?st\.global\.(?:v4\.)?f32\s+\[[^\]]*\],\s*(.*);$", line)
        if m:
            out += [ex(v) for v in re.findall(r"%f\d+", m.group(2))]
    return out


@pytest.mark.parametrize("variant", [(0, 2, 128, 128, 4), (0, 0, 128, 128, 4), (2, 2, 128, 128, 4), (0, 1, 64, 64, 4)])
def test_fused_kernel_stores_gdn_decode_s_arithmetic(variant: tuple[int, ...]) -> None:
    """The state (and core) values gdn_decode_norm stores are computed by the same PTX arithmetic as gdn_decode's:
    equal multisets of expression trees (the gated norm's o, the trees with its rsqrt, left out). With no
    contractible mul + add/sub in either (test above), the PTX fixes the bits: the state is gdn_decode's."""
    nvrtc_or_skip()
    ptx = _ptx("gdn.cu", _opts(*variant))
    old = _stored_value_trees(_entry(ptx, "gdn_decode"))
    new = [t for t in _stored_value_trees(_entry(ptx, "gdn_decode_norm")) if "rsqrt" not in t]
    dk, dv = variant[2], variant[3]
    # a float4 per row a thread owns, and its 4 outputs when they are float32 (DT = 0; 16-bit stores are not here)
    per_thread = 4 * _macros(dk, dv)["RM"] + (4 if variant[0] == 0 else 0)
    assert len(old) == len(new) == per_thread
    assert Counter(old) == Counter(new)
    assert not any("LOOP" in t for t in old + new)


@pytest.mark.parametrize("variant", [(0, 2, 128, 128, 4), (0, 1, 16, 12, 3), (2, 2, 64, 64, 4)])
def test_fused_conv_stores_gdn_conv_decode_s_and_gdn_gates_arithmetic(variant: tuple[int, ...]) -> None:
    """gdn_conv_gates_decode stores what gdn_conv_decode stores (x, the window) and what fused.cu's gdn_gates stores
    (g, beta), each value by the same PTX arithmetic."""
    nvrtc_or_skip()
    ptx = _ptx("gdn.cu", _opts(*variant))
    fused = _ptx("fused.cu", (f"-DDT={variant[1]}",))
    new = Counter(_stored_value_trees(_entry(ptx, "gdn_conv_gates_decode")))
    conv = Counter(_stored_value_trees(_entry(ptx, "gdn_conv_decode")))
    gates = Counter(_stored_value_trees(_entry(fused, "gdn_gates")))
    assert len(gates) == 2 and new == conv + gates


# ---------------------------------------------------------------------------------------- launches (no GPU)


class _Kernel:
    def __init__(self, name: str, log: list[dict[str, Any]]) -> None:
        self.name, self.log = name, log

    def launch(self, device: Any, grid: Any, block: Any, smem: int, args: list[tuple[str, Any]],
               pdl: bool = False) -> None:
        self.log.append({"kernel": self.name, "grid": tuple(grid), "block": tuple(block), "smem": smem,
                         "args": list(args), "pdl": pdl})


class _Module:
    def __init__(self, log: list[dict[str, Any]]) -> None:
        self.log = log

    def kernel(self, name: str) -> _Kernel:
        return _Kernel(name, self.log)


class _FakeDevice:
    """Hands out increasing fake addresses (256-byte aligned); nothing is allocated."""

    ordinal = 0

    def __init__(self) -> None:
        self.next = 1 << 24

    def empty(self, shape: Any, dtype: Any, stream_ordered: bool = False) -> Any:
        from hybrid_runtime.cuda.driver import DeviceArray

        a = DeviceArray(self.next, shape, dtype, 0)
        self.next += -(-max(a.nbytes, 1) // 256) * 256
        return a


def _kernel_params(name: str) -> list[str]:
    """Argument kinds of ``extern "C"`` kernel ``name`` in gdn.cu, from its parameter list."""
    from hybrid_runtime.cuda.kernels import source

    src = source("gdn.cu")
    m = re.search(rf"\b{name}\((.*?)\)\s*\{{", src, re.S)
    assert m, name
    kinds = []
    for p in m.group(1).split(","):
        p = " ".join(p.split())
        kinds.append("ptr" if "*" in p else "i64" if p.startswith("long long") else "f32" if p.startswith("float")
                     else "i32")
    return kinds


def _gdn_on_fakes(log: list[dict[str, Any]], nk: int, nv: int, dk: int, dv: int, K: int, slots: int = 8) -> Any:
    from hybrid_runtime.cuda.gdn import CudaGdn, fused_decode_fits
    from hybrid_runtime.state_cache import StateLayout

    layout = StateLayout(slots, (K - 1, 2 * nk * dk + nv * dv), (nv, dk, dv))
    g = CudaGdn.__new__(CudaGdn)  # the launch code only needs the shape, a module and a device
    g.device, g.layout, g.module, g.chunk_module = _FakeDevice(), layout, _Module(log), None
    g.nk, g.nv, g.dk, g.dv, g.K, g.C = nk, nv, dk, dv, K, layout.conv_shape[1]
    g.act_dtype, g.out_dtype, g.prefill_mode, g.chunk = "float32", "bfloat16", "chunked", 16
    g.fused_decode_ok = fused_decode_fits(dk, dv)
    g.conv_row = layout.conv_row_bytes // layout.itemsize
    g.rec_row = layout.recurrent_row_bytes // layout.itemsize
    return g


@pytest.mark.parametrize("shape", [(16, 32, 128, 128, 4), (1, 4, 16, 12, 3), (2, 4, 64, 64, 4)])
def test_fused_launches_match_the_kernel_signatures(shape: tuple[int, ...]) -> None:
    from hybrid_runtime.cuda.gdn import CONV_THREADS, fused_threads

    nk, nv, dk, dv, K = shape
    log: list[dict[str, Any]] = []
    g = _gdn_on_fakes(log, *shape)
    conv, rec = g.device.empty((9, K - 1, g.C), "float32"), g.device.empty((9, nv, dk, dv), "float32")
    cw = g.device.empty((g.C, K), "float32")
    B = 3
    g.conv_gates_decode(conv, 100, 200, g.C + 40, cw, 300, B, 200, g.C + 40, g.C + 10, g.C + 10 + nv, 400, 500,
                        600, 700)
    g.delta_norm_decode(rec, 100, 300, 600, 700, 240, g.C + 40, 800, 1e-6, 900, B, core_ptr=1000)
    cg, dn = log
    assert cg["kernel"] == "gdn_conv_gates_decode" and dn["kernel"] == "gdn_decode_norm"
    assert cg["pdl"] and dn["pdl"]
    assert cg["grid"] == (-(-g.C // CONV_THREADS) + 1, B, 1) and cg["block"] == (CONV_THREADS, 1, 1)
    assert dn["grid"] == (1, nv, B) and dn["block"] == (fused_threads(dv), 1, 1) and dn["smem"] == 0
    for rec_ in (cg, dn):
        assert [k for k, _ in rec_["args"]] == _kernel_params(rec_["kernel"]), rec_["kernel"]
    names = ("u", "conv_w", "conv", "conv_row", "slots", "x_out", "B", "C", "u_stride", "p", "p_stride", "off_b",
             "off_a", "neg_exp_a", "dt_bias", "g", "beta", "NV")
    a = dict(zip(names, (v for _, v in cg["args"])))
    assert (a["u"], a["p"], a["u_stride"], a["p_stride"], a["off_b"], a["off_a"]) == (200, 200, g.C + 40, g.C + 40,
                                                                                        g.C + 10, g.C + 10 + nv)
    assert (a["conv"], a["conv_row"], a["x_out"], a["B"], a["C"], a["NV"]) == (conv.ptr, g.conv_row, 300, B, g.C, nv)
    names = ("x", "gdec", "beta", "slots", "rec", "rec_row", "z", "z_stride", "norm_w", "eps", "o", "core", "B",
             "NK", "NV")
    a = dict(zip(names, (v for _, v in dn["args"])))
    assert (a["x"], a["gdec"], a["beta"], a["rec"], a["rec_row"]) == (300, 600, 700, rec.ptr, g.rec_row)
    assert (a["z"], a["z_stride"], a["norm_w"], a["eps"], a["o"], a["core"]) == (240, g.C + 40, 800, 1e-6, 900, 1000)
    assert (a["B"], a["NK"], a["NV"]) == (B, nk, nv)
    # the four-launch path's kernels too (their signatures are unchanged)
    log.clear()
    g.conv_decode(conv, 100, SimpleNamespace(ptr=200), cw, SimpleNamespace(ptr=300), B, u_stride=g.C + 40)
    g.delta_decode(rec, 100, SimpleNamespace(ptr=300), SimpleNamespace(ptr=600), SimpleNamespace(ptr=700),
                   SimpleNamespace(ptr=1000), B)
    for rec_ in log:
        assert [k for k, _ in rec_["args"]] == _kernel_params(rec_["kernel"]) and not rec_["pdl"]


def test_fused_decode_refuses_shapes_outside_the_rule() -> None:
    log: list[dict[str, Any]] = []
    g = _gdn_on_fakes(log, 1, 2, 128, 160, 4)
    rec = g.device.empty((9, 2, 128, 160), "float32")
    with pytest.raises(ValueError, match="no fused decode kernel"):
        g.delta_norm_decode(rec, 1, 2, 3, 4, 5, 6, 7, 1e-6, 8, 1)
    assert log == []


class _FakeBackend:
    """The parts of CudaBackend the pipeline pieces touch, on fake memory; GEMMs and norms are only logged."""

    from hybrid_runtime.cuda.backend import CudaBackend as _B

    _op, gdn, segment, _alloc_arena, _arena_shapes, _launch, _prof, _ptr = (
        _B._op, _B.gdn, _B.segment, _B._alloc_arena, _B._arena_shapes, _B._launch, _B._prof, _B._ptr)

    def __init__(self, cfg: Any, fused: bool, dtype: str = "bfloat16") -> None:
        from hybrid_runtime.cuda.driver import DeviceArray
        from hybrid_runtime.cuda.stepio import InputLayout
        from hybrid_runtime.pipeline import plan_segments
        from hybrid_runtime.program import runtime_weight_specs, segment_program

        self.log: list[dict[str, Any]] = []
        self.cfg, self.dtype, self.es = cfg, dtype, 2
        self.dev = _FakeDevice()
        self.T_max = self.R_max = 16
        self.moe_prefill = self.moe_router = None  # what _alloc_arena asks about the MoE paths
        self._alloc_arena()
        self.fused = _Module(self.log)
        self.inp = SimpleNamespace(ptr=self.dev.empty((1 << 16,), "uint8").ptr)
        self.in_layout = InputLayout(self.T_max, self.R_max, 4)
        self.programs = [(p, segment_program(cfg, p)) for p in plan_segments(cfg)]
        self.w: dict[str, Any] = {}
        for s in runtime_weight_specs(cfg, 64):
            self.w[s.name] = self.dev.empty(s.shape, dtype if s.matrix else "float32")
        for i in cfg.linear_layers:
            self.w[f"layers.{i}.linear_attn.conv1d"] = self.dev.empty((cfg.conv_dim, cfg.conv_kernel), "float32")
        nk, nv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.gdn_k = _gdn_on_fakes(self.log, nk, nv, dk, dv, cfg.conv_kernel, slots=8)
        self.gdn_k.out_dtype = dtype
        conv = {i: DeviceArray(self.dev.empty((1,), "uint8").ptr, (9, cfg.conv_kernel - 1, cfg.conv_dim), "float32",
                               0) for i in cfg.linear_layers}
        rec = {i: DeviceArray(self.dev.empty((1,), "uint8").ptr, (9, nv, dk, dv), "float32", 0)
               for i in cfg.linear_layers}
        self.state = SimpleNamespace(conv=conv, recurrent=rec)
        self.gdn_ws = None
        self.fused_gdn_decode = fused and self.gdn_k.fused_decode_ok
        self._profile = None

    def _gemm(self, x: Any, weight: Any, out: Any, residual: Any = None, bias: Any = None,
              decode: bool = False) -> None:
        self.log.append({"kernel": "gemm", "x": x, "weight": weight.ptr, "out": out})

    def _rmsnorm(self, x: Any, w: Any, h: Any, n: int, **kw: Any) -> None:
        self.log.append({"kernel": "rmsnorm_rows"})

    def moe(self, layer: int, ctx: Any, h: Any) -> Any:
        from hybrid_runtime.cuda.backend import MoEOut

        return MoEOut(self.arena.bufs["y"].ptr, self.ny)

    def attention(self, layer: int, ctx: Any, out: Any) -> Any:  # pragma: no cover - the config has none
        raise AssertionError("no attention layers here")

    def inputs(self, ctx: Any) -> dict[str, Any]:
        return {}

    def head(self, ctx: Any, x: Any) -> None:
        return None


def _gdn_config() -> Any:
    from benchmarks.gpu_decode_step import qwen35_moe_config

    cfg = qwen35_moe_config(3)  # Qwen3.5-35B-A3B's GDN layers (16 key / 32 value heads x 128), no attention
    assert cfg.linear_layers == (0, 1, 2) and not cfg.attention_layers
    return cfg


def _run(be: _FakeBackend, phase: Any, n: int) -> Iterator[dict[str, Any]]:
    from hybrid_runtime.cuda.backend import CudaCtx
    from hybrid_runtime.runner import ModelRunner

    ctx = CudaCtx(phase, n, n, n if phase.name == "DECODE" else 2, n, n, n if phase.name == "PREFILL" else 1, None,
                  None, n, None, False)
    runner = SimpleNamespace(backend=be, cfg=be.cfg, plans=[p for p, _ in be.programs])
    be.log.clear()
    ModelRunner._forward(runner, ctx)  # type: ignore[arg-type]
    return iter(list(be.log))


GDN_KERNELS = {"gdn_gates", "gated_rmsnorm", "gdn_conv_decode", "gdn_decode", "gdn_conv_gates_decode",
               "gdn_decode_norm", "gdn_conv_prefill", "gdn_conv_window", "gdn_prefill"}


def test_backend_decode_launches_two_gdn_kernels_per_layer() -> None:
    from hybrid_runtime.engine import Phase

    cfg = _gdn_config()
    L = len(cfg.linear_layers)
    per_layer = {}
    for fused in (True, False):
        be = _FakeBackend(cfg, fused)
        names = [r["kernel"] for r in _run(be, Phase.DECODE, 4) if r["kernel"] in GDN_KERNELS]
        per_layer[fused] = names[:len(names) // L]
        assert names == per_layer[fused] * L
    assert per_layer[True] == ["gdn_conv_gates_decode", "gdn_decode_norm"]
    assert per_layer[False] == ["gdn_gates", "gdn_conv_decode", "gdn_decode", "gated_rmsnorm"]
    for fused in (True, False):  # prefill: the same launches whatever the flag
        be = _FakeBackend(cfg, fused)
        names = [r["kernel"] for r in _run(be, Phase.PREFILL, 10) if r["kernel"] in GDN_KERNELS]
        assert names == ["gdn_gates", "gdn_conv_prefill", "gdn_conv_window", "gdn_prefill", "gated_rmsnorm"] * L


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_backend_fused_decode_reads_and_writes_what_the_four_launches_did(dtype: str) -> None:
    """Per layer, the fused pair's pointers are the old launches': the gates from p's b and a columns with the
    layer's neg_exp_a / dt_bias into the arena's g / beta, conv and state of that layer, z = p's z columns, the
    layer's norm weight and eps, o into the buffer out_proj then reads (the core written too)."""
    from hybrid_runtime.engine import Phase

    cfg = _gdn_config()
    n = 4
    C, vd, nv = cfg.conv_dim, cfg.value_dim, cfg.linear_num_value_heads
    old = {}
    for fused in (False, True):
        be = _FakeBackend(cfg, fused, dtype)
        A, w = be.arena.bufs, be.w
        recs = list(_run(be, Phase.DECODE, n))
        by = [r for r in recs if r["kernel"] in GDN_KERNELS]
        gemms = [r for r in recs if r["kernel"] == "gemm"]
        for li, layer in enumerate(cfg.linear_layers):
            la = f"layers.{layer}.linear_attn."
            proj = A["proj"]
            out_proj = next(r for r in gemms if r["weight"] == w[la + "out_proj"].ptr)
            assert out_proj["x"].ptr == A["o"].ptr and out_proj["x"].cols == nv * cfg.linear_value_head_dim
            assert out_proj["x"].dtype == dtype
            if not fused:
                gates, conv, delta, norm = by[4 * li:4 * li + 4]
                ga = [v for _, v in gates["args"]]
                assert ga[:6] == [proj.ptr, proj.shape[1], C + vd, C + vd + nv, w[la + "neg_exp_a"].ptr,
                                  w[la + "dt_bias"].ptr]
                old[layer] = {"g": ga[6], "beta": ga[7], "conv": [v for _, v in conv["args"]],
                              "delta": [v for _, v in delta["args"]], "norm": [v for _, v in norm["args"]]}
                continue
            cg, dn = by[2 * li:2 * li + 2]
            a, o = [v for _, v in cg["args"]], old[layer]
            # conv part == gdn_conv_decode's arguments, then p, its stride, off_b, off_a, the weights, g, beta, nv
            assert a[:9] == o["conv"]
            assert a[9:] == [proj.ptr, proj.shape[1], C + vd, C + vd + nv, w[la + "neg_exp_a"].ptr,
                             w[la + "dt_bias"].ptr, o["g"], o["beta"], nv]
            d = [v for _, v in dn["args"]]
            # x, g, beta, slots, rec, rec_row == gdn_decode's; z, z stride, norm weight, eps == gated_rmsnorm's
            assert d[:6] == o["delta"][:6]
            assert d[6:10] == [o["norm"][1], o["norm"][2], o["norm"][3], o["norm"][8]]
            assert d[6] == proj.ptr + 4 * C and d[8] == w[la + "norm"].ptr
            assert np.float32(d[9]) == np.float32(cfg.rms_norm_eps)
            assert d[10] == o["norm"][4] == A["o"].ptr  # o: where gated_rmsnorm wrote it
            assert d[11] == o["delta"][6] == o["norm"][0] == A["core"].ptr  # the core: where gdn_decode wrote it
            assert d[12:] == [n, cfg.linear_num_key_heads, nv]
