"""The fused GDN decode pair (``gdn_conv_gates_decode`` + ``gdn_decode_norm``) against the four launches it replaces
(fused.cu ``gdn_gates``, ``gdn_conv_decode``, ``gdn_decode``, fused.cu ``gated_rmsnorm``), on the GPU.

Kernels: the same inputs and identical copies of the same state through both, B = 1, 3, 16 rows on scattered
slots (padding rows on the sink), three steps in a row, the backend's configuration (float32 u and core, o in
the bundle dtype: float32, bfloat16, float16), head shapes 128 x 128 (Qwen3.5), 16 x 12 (conv K = 3), 64 x 64:
g, beta, the conv output, conv and recurrent state and the core bit-identical; o within 1e-5 relative (float32)
or one ulp (16-bit); both within the usual tolerance of the numpy operators.

Backend: ``CudaBackend(fused_gdn_decode=True)`` vs ``False`` on the same bundle, graphs captured, teacher-forced:
2 kernels fewer per GDN layer in every decode graph, the same prefill bits, decode logits within float32 /
bf16 rounding, and the decode profile without gdn_gates / gated_rmsnorm launches.

    pytest -m gpu tests/gpu/test_gdn_decode_fused_gpu.py
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from gdn_cases import Shape, rel

pytestmark = pytest.mark.gpu

DT_CODES = {"float32": 0, "float16": 1, "bfloat16": 2}
EPS = 1e-6
REF_TOL = {"float32": 1e-4, "float16": 2e-3, "bfloat16": 1e-2}  # vs numpy (test_gdn_gpu's O_TOL)
SHAPES = {"qwen35_128x128": Shape(nk=16, nv=32, dk=128, dv=128, K=4), "k3_16x12": Shape(nk=1, nv=4, dk=16, dv=12, K=3),
          "64x64": Shape(nk=2, nv=4, dk=64, dv=64, K=4)}
REPORT = Path(os.environ.get("GPU_REPORT_DIR", "/tmp")) / "gdn_decode_fused_report.json"
_report: dict[str, object] = {}


def _record(key: str, value: object) -> None:
    _report[key] = value
    REPORT.write_text(json.dumps(_report, indent=1, default=str))
    print(f"[gdn-fused] {key}: {value}")


@pytest.fixture(scope="module")
def dev():
    import torch

    torch.cuda.init()
    from hybrid_runtime.cuda.driver import CudaDevice

    return CudaDevice(0)


def bits(a: np.ndarray) -> np.ndarray:
    """The raw bits of a float32 / float16 host array (bfloat16 downloads arrive as exact float32)."""
    a = np.ascontiguousarray(a)
    return a.view(np.uint32 if a.dtype == np.float32 else np.uint16)


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and bool(np.array_equal(bits(a), bits(b)))


def ulps16(a: np.ndarray, b: np.ndarray, dtype: str) -> int:
    """Largest distance in units of the last place between two arrays of 16-bit values (bf16 as float32)."""
    def key(x: np.ndarray) -> np.ndarray:
        u = (bits(x) >> 16).astype(np.int64) if dtype == "bfloat16" else bits(x).astype(np.int64)
        return np.where(u & 0x8000, -(u & 0x7FFF), u)

    return int(np.abs(key(a) - key(b)).max()) if a.size else 0


class Pair:
    """One GDN layer with two identical state caches: ``old`` runs the four launches, ``new`` the fused pair
    (the backend's build of CudaGdn: act float32, o in ``out``); a numpy twin follows the live rows."""

    def __init__(self, dev, shape: Shape, num_slots: int, out: str, seed: int) -> None:
        from hybrid_runtime.cuda.gdn import CudaGdn
        from hybrid_runtime.cuda.kernels import load_module
        from hybrid_runtime.cuda.state import DeviceStateCache
        from hybrid_runtime.state_cache import StateLayout

        self.dev, self.s, self.out = dev, shape, out
        self.rng = np.random.default_rng(seed)
        self.layout = StateLayout(num_slots, (shape.K - 1, shape.C), (shape.nv, shape.dk, shape.dv))
        self.conv_np, self.rec_np = self.layout.allocate()
        self.conv_np[:] = self.rng.standard_normal(self.conv_np.shape, np.float32)
        self.rec_np[:] = 0.1 * self.rng.standard_normal(self.rec_np.shape, np.float32)
        self.old = DeviceStateCache(dev, self.layout, layers=[0])
        self.new = DeviceStateCache(dev, self.layout, layers=[0])
        for c in (self.old, self.new):
            c.upload_layer(0, self.conv_np, self.rec_np)
        self.gdn = CudaGdn(dev, self.layout, shape.nk, act_dtype="float32", out_dtype=out)
        assert self.gdn.fused_decode_ok
        self.fused = load_module("fused.cu", (f"-DDT={DT_CODES[out]}",), dev.arch)
        s = shape
        self.w_np = (0.5 * self.rng.standard_normal((s.C, s.K))).astype(np.float32)
        self.nea_np = (-np.exp(0.3 * self.rng.standard_normal(s.nv))).astype(np.float32)
        self.dtb_np = self.rng.standard_normal(s.nv).astype(np.float32)
        self.norm_np = (1.0 + 0.2 * self.rng.standard_normal(s.dv)).astype(np.float32)
        self.w, self.nea, self.dtb, self.norm = (dev.upload(a) for a in (self.w_np, self.nea_np, self.dtb_np,
                                                                          self.norm_np))
        self.P = s.C + s.nv * s.dv + 2 * s.nv  # p = [u | z | b | a]
        self.stride = self.P + 8  # rows of a wider buffer, as the backend's projection arena

    def step(self, slots: np.ndarray) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """One decode step through both paths (and the numpy twin); returns name -> (old, new) host arrays,
        plus "ref": (numpy o, numpy core)."""
        from hybrid_runtime.ops import gdn as ref
        from hybrid_runtime.program import Op, apply_op

        d, s, B = self.dev, self.s, len(slots)
        C, vd, nv, dv = s.C, s.nv * s.dv, s.nv, s.dv
        off_b, off_a = C + vd, C + vd + nv
        p_np = self.rng.standard_normal((B, self.stride)).astype(np.float32)
        p_np[0, off_a] = 25.0  # a + dt_bias > 20: softplus' linear branch
        p = d.upload(p_np)
        sl = d.upload(np.asarray(slots, np.int32))
        out = {}
        for name, cache in (("old", self.old), ("new", self.new)):
            g, beta = d.empty((B, nv), "float32"), d.empty((B, nv), "float32")
            x, core = d.empty((B, C), "float32"), d.empty((B, vd), "float32")
            o = d.empty((B, vd), self.out)
            if name == "old":
                self.fused.kernel("gdn_gates").launch(
                    d, (-(-B * nv // 256), 1, 1), (256, 1, 1), 0,
                    [("ptr", p.ptr), ("i64", self.stride), ("i32", off_b), ("i32", off_a), ("ptr", self.nea.ptr),
                     ("ptr", self.dtb.ptr), ("ptr", g.ptr), ("ptr", beta.ptr), ("i32", B), ("i32", nv)], pdl=True)
                self.gdn.conv_decode(cache.conv[0], sl.ptr, p, self.w, x, B, u_stride=self.stride)
                self.gdn.delta_decode(cache.recurrent[0], sl.ptr, x, g, beta, core, B)
                self.fused.kernel("gated_rmsnorm").launch(
                    d, (B, -(-nv // 4), 1), (128, 1, 1), 0,
                    [("ptr", core.ptr), ("ptr", p.ptr + 4 * C), ("i64", self.stride), ("ptr", self.norm.ptr),
                     ("ptr", o.ptr), ("i32", B), ("i32", nv), ("i32", dv), ("f32", EPS)], pdl=True)
            else:
                self.gdn.conv_gates_decode(cache.conv[0], sl.ptr, p.ptr, self.stride, self.w, x.ptr, B, p.ptr,
                                           self.stride, off_b, off_a, self.nea.ptr, self.dtb.ptr, g.ptr, beta.ptr)
                self.gdn.delta_norm_decode(cache.recurrent[0], sl.ptr, x.ptr, g.ptr, beta.ptr, p.ptr + 4 * C,
                                           self.stride, self.norm.ptr, EPS, o.ptr, B, core_ptr=core.ptr)
            conv_s, rec_s = cache.download_layer(0)
            out[name] = {"g": d.download(g), "beta": d.download(beta), "x": d.download(x), "core": d.download(core),
                         "o": d.download(o), "conv": conv_s, "rec": rec_s}
        # the numpy operators on the live rows' twin state
        env = {"p": p_np[:, :self.P]}
        apply_op(Op("gdn_gates", ("p",), ("u", "z", "g", "beta"), ("a", "b"),
                    {"conv_dim": C, "value_dim": vd, "nv": nv}), env, {"a": self.nea_np, "b": self.dtb_np})
        core_ref = ref.gdn_decode(self.conv_np, self.rec_np, np.asarray(slots, np.int64), env["u"], env["g"],
                                  env["beta"], self.w_np, s.nk, s.dk, s.nv, s.dv)
        env["c"] = core_ref
        apply_op(Op("gated_rmsnorm", ("c", "z"), ("o",), ("w",), {"nv": nv, "dv": dv, "eps": EPS}), env,
                 {"w": self.norm_np})
        res = {k: (out["old"][k], out["new"][k]) for k in out["old"]}
        res["ref"] = (env["o"], core_ref)
        return res


def _slots(rng: np.random.Generator, B: int, num_slots: int, sink: int) -> np.ndarray:
    """B rows on scattered live slots, any order; B = 3 has one padding row, B = 16 two (on the sink)."""
    pad = {1: 0, 3: 1, 16: 2}.get(B, 0)
    live = rng.choice(num_slots, size=B - pad, replace=False)
    slots = np.concatenate([live, np.full(pad, sink)]).astype(np.int64)
    rng.shuffle(slots)
    return slots


@pytest.mark.parametrize("B", [1, 3, 16])
@pytest.mark.parametrize("out", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("shape_name", list(SHAPES))
def test_fused_pair_matches_the_four_launches(dev, shape_name: str, out: str, B: int) -> None:
    num_slots = 40
    pair = Pair(dev, SHAPES[shape_name], num_slots, out, seed=B + 7 * len(shape_name))
    rng = np.random.default_rng(B)
    sink = pair.layout.sink
    keep = np.arange(pair.layout.rows) != sink  # padding rows race on the sink: every other row is compared
    exact_o = total_o = 0
    worst_o = 0.0
    for step in range(3):
        slots = _slots(rng, B, num_slots, sink)
        live = slots != sink
        r = pair.step(slots)
        tag = f"{shape_name}/{out}/B={B}/step {step}"
        # the gates do not depend on the state: every row, bit for bit
        assert same_bits(*r["g"]) and same_bits(*r["beta"]), f"{tag}: gates differ"
        for k in ("x", "core"):  # per row from its slot's state: the live rows
            a, b = r[k]
            assert same_bits(a[live], b[live]), f"{tag}: {k} differs"
        for k in ("conv", "rec"):
            a, b = r[k]
            assert same_bits(a[keep], b[keep]), f"{tag}: {k} state differs"
        (o_old, o_new), (o_ref, core_ref) = r["o"], r["ref"]
        o_old, o_new = o_old[live], o_new[live]
        assert np.isfinite(o_new).all()
        if out == "float32":
            err = float(np.max(np.abs(o_new - o_old) / np.maximum(np.abs(o_old), 1e-30)))
            assert np.allclose(o_new, o_old, rtol=1e-5, atol=1e-7 * float(np.abs(o_old).max())), f"{tag}: {err}"
        else:
            err = float(ulps16(o_new, o_old, out))
            assert err <= 1, f"{tag}: o differs by {err} ulp"
        worst_o = max(worst_o, err)
        exact_o += int(np.sum(bits(o_new) == bits(o_old)))
        total_o += o_new.size
        # both agree with the numpy operators (float32 arithmetic order, then o's rounding)
        assert rel(r["core"][1][live], core_ref[live]) < REF_TOL["float32"], f"{tag}: core vs numpy"
        assert rel(o_new.astype(np.float32), o_ref[live]) < REF_TOL[out], f"{tag}: o vs numpy"
    _record(f"kernels/{shape_name}/{out}/B={B}", {"o_bit_identical_share": exact_o / total_o,
                                                 "o_worst": worst_o})


def test_fused_pair_in_a_graph_replays_the_same_bits(dev) -> None:
    """The pair captured in a CUDA graph (a programmatic edge between its two nodes) and replayed, step after step,
    against eager launches of the four-launch path on the copy: the same state, gates, core; o within one ulp."""
    from hybrid_runtime.cuda.driver import CudaGraph

    s = SHAPES["qwen35_128x128"]
    pair = Pair(dev, s, 8, "bfloat16", seed=1)
    d, B = dev, 4
    slots = np.array([5, 0, 7, 2], np.int64)  # no padding row: every row is compared
    C, vd, nv = s.C, s.nv * s.dv, s.nv
    p_np = np.random.default_rng(2).standard_normal((B, pair.stride)).astype(np.float32)
    p, sl = d.upload(p_np), d.upload(slots.astype(np.int32))
    g, beta = d.empty((B, nv), "float32"), d.empty((B, nv), "float32")
    x, core, o = d.empty((B, C), "float32"), d.empty((B, vd), "float32"), d.empty((B, vd), "bfloat16")
    g2, b2 = d.empty((B, nv), "float32"), d.empty((B, nv), "float32")
    x2, core2, o2 = d.empty((B, C), "float32"), d.empty((B, vd), "float32"), d.empty((B, vd), "bfloat16")

    def fused() -> None:
        pair.gdn.conv_gates_decode(pair.new.conv[0], sl.ptr, p.ptr, pair.stride, pair.w, x.ptr, B, p.ptr,
                                   pair.stride, C + vd, C + vd + nv, pair.nea.ptr, pair.dtb.ptr, g.ptr, beta.ptr)
        pair.gdn.delta_norm_decode(pair.new.recurrent[0], sl.ptr, x.ptr, g.ptr, beta.ptr, p.ptr + 4 * C,
                                   pair.stride, pair.norm.ptr, EPS, o.ptr, B, core_ptr=core.ptr)

    def four() -> None:
        pair.fused.kernel("gdn_gates").launch(
            d, (-(-B * nv // 256), 1, 1), (256, 1, 1), 0,
            [("ptr", p.ptr), ("i64", pair.stride), ("i32", C + vd), ("i32", C + vd + nv), ("ptr", pair.nea.ptr),
             ("ptr", pair.dtb.ptr), ("ptr", g2.ptr), ("ptr", b2.ptr), ("i32", B), ("i32", nv)], pdl=True)
        pair.gdn.conv_decode(pair.old.conv[0], sl.ptr, p, pair.w, x2, B, u_stride=pair.stride)
        pair.gdn.delta_decode(pair.old.recurrent[0], sl.ptr, x2, g2, b2, core2, B)
        pair.fused.kernel("gated_rmsnorm").launch(
            d, (B, -(-nv // 4), 1), (128, 1, 1), 0,
            [("ptr", core2.ptr), ("ptr", p.ptr + 4 * C), ("i64", pair.stride), ("ptr", pair.norm.ptr),
             ("ptr", o2.ptr), ("i32", B), ("i32", nv), ("i32", s.dv), ("f32", EPS)], pdl=True)

    def check(step: int) -> None:
        for a, b in ((g, g2), (beta, b2), (x, x2), (core, core2)):
            assert same_bits(d.download(a), d.download(b)), f"step {step}"
        assert ulps16(d.download(o), d.download(o2), "bfloat16") <= 1, f"step {step}"
        for a, b in zip(pair.new.download_layer(0), pair.old.download_layer(0)):
            assert same_bits(a, b), f"step {step}"

    fused()  # eager first: loads the kernels and checks the launches outside the capture
    four()
    check(0)
    graph = CudaGraph(d, fused)  # capture only: nothing runs
    try:
        for step in (1, 2):  # each replay starts from the state the previous one left
            graph.launch()
            four()
            check(step)
    finally:
        graph.destroy()


# ---------------------------------------------------------------------------------------- the whole backend


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("gdn_fused")


def _bundle(root: Path, case: str, dtype: str, default_checkpoint: Path) -> Path:
    from builder.bundle import BuildOptions, build_bundle

    if case == "default_model":  # qwen3_next MoE, GDN 2 key / 4 value heads x 32
        ckpt = default_checkpoint
    else:  # qwen3_5 dense, GDN 1 key / 2 value heads x 128: the 4-group CTA of the production shape
        from tests import hf_models as hm
        from tests.conftest import write_tiny_tokenizer

        ckpt = root / f"ckpt_{case}"
        if not (ckpt / "config.json").exists():
            raw = hm.tiny_raw_config("qwen3_5", linear_num_key_heads=1, linear_num_value_heads=2,
                                     linear_key_head_dim=128, linear_value_head_dim=128)
            hm.write_numpy_checkpoint(ckpt, raw, seed=5)
            write_tiny_tokenizer(ckpt, hm.VOCAB)
    out = root / f"{case}_cuda_{dtype}"
    if not (out / "manifest.json").exists():
        build_bundle(ckpt, out, BuildOptions(backend="cuda", dtype=dtype, max_batch_size=16, max_input_len=200,
                                             max_seq_len=256, max_num_tokens=64, page_size=16),
                     progress=lambda _m: None)
    return out


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("case", ["default_model", "heads_128"])
def test_backend_fused_decode_matches_four_launches(root: Path, default_checkpoint: Path, case: str,
                                                    dtype: str) -> None:
    from runner_cases import Driver, scattered_tables

    from hybrid_runtime.config import Manifest
    from hybrid_runtime.cuda.backend import CudaBackend
    from hybrid_runtime.engine import Phase
    from hybrid_runtime.runner import ModelRunner, SeqStep

    gpu_b = _bundle(root, case, dtype, default_checkpoint)
    m = Manifest.load(gpu_b)
    L = len(m.model.linear_layers)
    assert L > 0
    runners, backends = [], []
    for fused in (False, True):
        be = CudaBackend(gpu_b, m, device="cuda", fused_gdn_decode=fused)
        assert be.fused_gdn_decode == fused
        r = ModelRunner(gpu_b, m, backend=be)
        be.capture_graphs(r._forward)
        runners.append(r)
        backends.append(be)
    four, two = (b.graph_stats.captured for b in backends)
    assert four and four.keys() == two.keys()
    assert all(four[k] - two[k] == 2 * L for k in four), (four, two)
    rng = np.random.default_rng(31)
    prompts = [rng.integers(3, m.model.vocab_size, int(n)).tolist() for n in (5, 37, 20, 61, 9)]
    slots = [0, 3, 5, 1, 7]
    tables = scattered_tables(m, [len(p) + 16 for p in prompts], seed=2)
    drv = Driver(runners, slots, tables, prompts)
    for a, b in drv.prefill(chunk=12):  # prefill: the same kernels on both, from the same state (<= 64 tokens)
        assert np.array_equal(a, b)
    agree = total = 0
    worst = scale = 0.0
    identical = True
    for _ in range(12):
        a, b = drv.decode()
        assert np.isfinite(b).all()
        agree += int((a.argmax(1) == b.argmax(1)).sum())
        total += a.shape[0]
        worst = max(worst, float(np.abs(a - b).max()))
        scale = max(scale, float(np.abs(a).max()))
        identical &= bool(np.array_equal(a, b))
    state_err = 0.0
    for layer in m.model.linear_layers:
        (c4, r4), (c2, r2) = runners[0].ops.state_arrays(layer), runners[1].ops.state_arrays(layer)
        state_err = max(state_err, rel(c2[slots], c4[slots]), rel(r2[slots], r4[slots]))
    _record(f"backend/{case}/{dtype}", {"graph_nodes": {str(k): (four[k], two[k]) for k in four},
                                        "decode_logits_identical": identical, "max_logit_diff": worst,
                                        "max_logit": scale, "greedy_agree": f"{agree}/{total}",
                                        "state_rel_err": state_err})
    if dtype == "float32":
        assert worst <= 1e-5 * max(1.0, scale) and state_err < 1e-5
    else:  # a 1-ulp bf16 difference in o would reach later layers: rounding-sized, not more
        assert agree >= 0.95 * total and worst <= 2e-2 * max(1.0, scale) and state_err < 1e-2
    # where the kernels went: the fused decode step runs no gdn_gates / gated_rmsnorm
    steps = [SeqStep(s, t, p, [tok]) for s, t, p, tok in zip(drv.slots, drv.tables, drv.pos, drv.next_tok)]
    for be, r, fused in zip(backends, runners, (False, True)):
        prof = be.profile_step(be.prepare(Phase.DECODE, steps, None, False), r._forward)
        assert prof["gdn"][0] == L
        assert ("gdn_gates" in prof, "gated_rmsnorm" in prof) == (not fused, not fused), prof
        if not fused:
            assert prof["gdn_gates"][0] == prof["gated_rmsnorm"][0] == L
