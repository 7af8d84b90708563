"""``gdn_decode_cluster`` and ``gdn_decode_cluster_head`` (a GDN layer's whole decode step in one clustered launch:
128-thread CTAs, or one CTA per value head) against the fused pair (``gdn_conv_gates_decode`` +
``gdn_decode_norm``) they replace on sm_90+, on the GPU.

Kernels: identical copies of the same state through both, B = 1, 3, 16, 64 rows on scattered slots (padding rows
on the sink), three steps in a row, the backend's build (float32 u and core, o in float32 / bfloat16), head shapes
with clusters of 8 (Qwen3.5: 16 key / 32 value heads x 128), 4 (two value heads of 64 columns; one value head per
key head of 128) and 8 one-group CTAs (8 value heads of 32 per key head, conv K = 3): conv and recurrent state, the
core and o **bit-identical** (the cluster kernel runs the pair's arithmetic, in the same order); the same in a
captured CUDA graph replayed step after step. A shape outside the rule has no cluster kernel and the call says so.

Backend: ``CudaBackend(fused_gdn_decode="cluster" / "cluster_head" / "auto")`` vs ``"pair"`` on the same bundle,
graphs captured, teacher-forced: one kernel fewer per GDN layer in every decode graph of a cluster build, the same
prefill bits, and bit-identical decode logits and state.

    pytest -m gpu tests/gpu/test_gdn_decode_cluster_gpu.py
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gdn_cases import Shape
from test_gdn_decode_fused_gpu import _bundle, same_bits

pytestmark = pytest.mark.gpu

EPS = 1e-6
SHAPES = {"qwen35_128x128": Shape(nk=16, nv=32, dk=128, dv=128, K=4),  # clusters of 8, 32 q/k channels a CTA
          "64x64": Shape(nk=2, nv=4, dk=64, dv=64, K=4),  # clusters of 4 (2 heads x 2 groups), 32 q/k channels a CTA
          "gr1_128": Shape(nk=4, nv=4, dk=128, dv=128, K=4),  # one value head a key head: 4 CTAs, 64 channels
          "gr8_32": Shape(nk=1, nv=8, dk=32, dv=32, K=3)}  # 8 value heads of one group: 8 CTAs, 8 channels; K 3


@pytest.fixture(scope="module")
def dev():
    import torch

    torch.cuda.init()
    from hybrid_runtime.cuda.driver import CudaDevice

    d = CudaDevice(0)
    if d.compute_capability < (9, 0):
        pytest.skip(f"thread-block clusters need sm_90+, this is {d.arch}")
    return d


KINDS = ("pair", "cluster", "cluster_head")


class Layer:
    """One GDN layer with identical state caches: ``pair`` runs the fused pair, ``cluster`` / ``cluster_head`` the
    one launch of either build."""

    def __init__(self, dev, shape: Shape, num_slots: int, out: str, seed: int) -> None:
        from hybrid_runtime.cuda.gdn import CudaGdn
        from hybrid_runtime.cuda.state import DeviceStateCache
        from hybrid_runtime.state_cache import StateLayout

        self.dev, self.s, self.out = dev, shape, out
        self.rng = np.random.default_rng(seed)
        self.layout = StateLayout(num_slots, (shape.K - 1, shape.C), (shape.nv, shape.dk, shape.dv))
        conv_np, rec_np = self.layout.allocate()
        conv_np[:] = self.rng.standard_normal(conv_np.shape, np.float32)
        rec_np[:] = 0.1 * self.rng.standard_normal(rec_np.shape, np.float32)
        self.caches = {k: DeviceStateCache(dev, self.layout, layers=[0]) for k in KINDS}
        for c in self.caches.values():
            c.upload_layer(0, conv_np, rec_np)
        self.gdn = CudaGdn(dev, self.layout, shape.nk, act_dtype="float32", out_dtype=out)
        assert self.gdn.fused_decode_ok and self.gdn.cluster_decode_ok and self.gdn.cluster_head_decode_ok
        s = shape
        self.w = dev.upload((0.5 * self.rng.standard_normal((s.C, s.K))).astype(np.float32))
        self.nea = dev.upload((-np.exp(0.3 * self.rng.standard_normal(s.nv))).astype(np.float32))
        self.dtb = dev.upload(self.rng.standard_normal(s.nv).astype(np.float32))
        self.norm = dev.upload((1.0 + 0.2 * self.rng.standard_normal(s.dv)).astype(np.float32))
        self.P = s.C + s.nv * s.dv + 2 * s.nv  # p = [u | z | b | a]
        self.stride = self.P + 8  # rows of a wider buffer, as the backend's projection arena

    def buffers(self, B: int) -> dict:
        d, s = self.dev, self.s
        vd = s.nv * s.dv
        return {"g": d.empty((B, s.nv), "float32"), "beta": d.empty((B, s.nv), "float32"),
                "x": d.empty((B, s.C), "float32"), "core": d.empty((B, vd), "float32"), "o": d.empty((B, vd), self.out)}

    def launch(self, kind: str, p_ptr: int, slots_ptr: int, B: int, buf: dict) -> None:
        s, c = self.s, self.caches[kind]
        C, vd, nv = s.C, s.nv * s.dv, s.nv
        if kind == "pair":
            self.gdn.conv_gates_decode(c.conv[0], slots_ptr, p_ptr, self.stride, self.w, buf["x"].ptr, B, p_ptr,
                                       self.stride, C + vd, C + vd + nv, self.nea.ptr, self.dtb.ptr, buf["g"].ptr,
                                       buf["beta"].ptr)
            self.gdn.delta_norm_decode(c.recurrent[0], slots_ptr, buf["x"].ptr, buf["g"].ptr, buf["beta"].ptr,
                                       p_ptr + 4 * C, self.stride, self.norm.ptr, EPS, buf["o"].ptr, B,
                                       core_ptr=buf["core"].ptr)
        else:
            self.gdn.cluster_decode(c.conv[0], c.recurrent[0], slots_ptr, p_ptr, self.stride, self.w, B, p_ptr,
                                    self.stride, C + vd, C + vd + nv, self.nea.ptr, self.dtb.ptr, p_ptr + 4 * C,
                                    self.stride, self.norm.ptr, EPS, buf["o"].ptr, core_ptr=buf["core"].ptr,
                                    head=kind == "cluster_head")

    def check(self, tag: str, bufs: dict, live: np.ndarray) -> None:
        d = self.dev
        keep = np.arange(self.layout.rows) != self.layout.sink  # padding rows race on the sink
        for kind in bufs:
            if kind == "pair":
                continue
            for k in ("core", "o"):
                a, b = d.download(bufs["pair"][k]), d.download(bufs[kind][k])
                assert np.isfinite(b[live]).all(), f"{tag}: {kind} {k} not finite"
                assert same_bits(a[live], b[live]), f"{tag}: {kind} {k} differs"
            for a, b in zip(self.caches["pair"].download_layer(0), self.caches[kind].download_layer(0)):
                assert same_bits(a[keep], b[keep]), f"{tag}: {kind} state differs"


def _slots(rng: np.random.Generator, B: int, num_slots: int, sink: int) -> np.ndarray:
    pad = {1: 0, 3: 1, 16: 2, 64: 3}[B]
    live = rng.choice(num_slots, size=B - pad, replace=False)
    slots = np.concatenate([live, np.full(pad, sink)]).astype(np.int64)
    rng.shuffle(slots)
    return slots


@pytest.mark.parametrize("B", [1, 3, 16, 64])
@pytest.mark.parametrize("out", ["float32", "bfloat16"])
@pytest.mark.parametrize("shape_name", list(SHAPES))
def test_cluster_kernel_gives_the_pairs_bits(dev, shape_name: str, out: str, B: int) -> None:
    num_slots = 80
    lay = Layer(dev, SHAPES[shape_name], num_slots, out, seed=B + 7 * len(shape_name))
    rng = np.random.default_rng(B)
    for step in range(3):
        slots = _slots(rng, B, num_slots, lay.layout.sink)
        p_np = rng.standard_normal((B, lay.stride)).astype(np.float32)
        p_np[0, lay.s.C + lay.s.nv * lay.s.dv + lay.s.nv] = 25.0  # a + dt_bias > 20: softplus' linear branch
        p, sl = dev.upload(p_np), dev.upload(slots.astype(np.int32))
        bufs = {k: lay.buffers(B) for k in KINDS}
        for kind in KINDS:
            lay.launch(kind, p.ptr, sl.ptr, B, bufs[kind])
        lay.check(f"{shape_name}/{out}/B={B}/step {step}", bufs, slots != lay.layout.sink)


@pytest.mark.parametrize("kind", ["cluster", "cluster_head"])
def test_cluster_kernel_in_a_graph_replays_the_pairs_bits(dev, kind: str) -> None:
    """Captured in a CUDA graph and replayed step after step (the state carried from replay to replay) against
    eager launches of the pair on the copy."""
    from hybrid_runtime.cuda.driver import CudaGraph

    lay = Layer(dev, SHAPES["qwen35_128x128"], 8, "bfloat16", seed=1)
    B = 4
    slots = np.array([5, 0, 7, 2], np.int64)  # no padding row: every row is compared
    p = dev.upload(np.random.default_rng(2).standard_normal((B, lay.stride)).astype(np.float32))
    sl = dev.upload(slots.astype(np.int32))
    bufs = {k: lay.buffers(B) for k in ("pair", kind)}
    live = np.ones(B, bool)
    lay.launch(kind, p.ptr, sl.ptr, B, bufs[kind])  # eager first: loads the kernel outside the capture
    lay.launch("pair", p.ptr, sl.ptr, B, bufs["pair"])
    lay.check("eager", bufs, live)
    graph = CudaGraph(dev, lambda: lay.launch(kind, p.ptr, sl.ptr, B, bufs[kind]))
    try:
        for step in (1, 2):
            graph.launch()
            lay.launch("pair", p.ptr, sl.ptr, B, bufs["pair"])
            lay.check(f"replay {step}", bufs, live)
    finally:
        graph.destroy()


def test_a_shape_outside_the_rule_has_no_cluster_kernel(dev) -> None:
    from hybrid_runtime.cuda.gdn import CudaGdn
    from hybrid_runtime.state_cache import StateLayout

    s = Shape(nk=1, nv=4, dk=16, dv=12, K=3)  # 12 columns: no whole 32-column group
    layout = StateLayout(4, (s.K - 1, s.C), (s.nv, s.dk, s.dv))
    g = CudaGdn(dev, layout, s.nk, act_dtype="float32")
    assert g.fused_decode_ok and not g.cluster_decode_ok and not g.cluster_head_decode_ok
    conv = dev.empty((layout.rows, s.K - 1, s.C), "float32")
    rec = dev.empty((layout.rows, s.nv, s.dk, s.dv), "float32")
    w = dev.empty((s.C, s.K), "float32")
    for head in (False, True):
        with pytest.raises(ValueError, match="no cluster decode kernel"):
            g.cluster_decode(conv, rec, 0, 0, s.C, w, 1, 0, s.C, 0, 0, 0, 0, 0, 0, 0, EPS, 0, head=head)


# ---------------------------------------------------------------------------------------- the whole backend


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("gdn_cluster")


@pytest.mark.parametrize("mode", ["cluster", "cluster_head", "auto"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("case", ["default_model", "heads_128"])
def test_backend_cluster_decode_gives_the_pairs_logits(dev, root: Path, default_checkpoint: Path, case: str,
                                                       dtype: str, mode: str) -> None:
    from runner_cases import Driver, scattered_tables

    from hybrid_runtime.config import Manifest
    from hybrid_runtime.cuda.backend import CudaBackend, gdn_decode_path
    from hybrid_runtime.runner import ModelRunner

    gpu_b = _bundle(root, case, dtype, default_checkpoint)
    m = Manifest.load(gpu_b)
    L = len(m.model.linear_layers)
    assert L > 0
    runners, backends = [], []
    for gmode in ("pair", mode):
        be = CudaBackend(gpu_b, m, device="cuda", fused_gdn_decode=gmode)
        assert be.fused_gdn_decode and be.gdn_decode == gmode
        r = ModelRunner(gpu_b, m, backend=be)
        be.capture_graphs(r._forward)
        runners.append(r)
        backends.append(be)
    two, one = (b.graph_stats.captured for b in backends)
    assert two and two.keys() == one.keys()
    k_ = backends[1].gdn_k
    for k in two:  # (bucket, blocks): one launch fewer per GDN layer where the bucket runs a cluster build
        fewer = gdn_decode_path(mode, k[0], k_.cluster_decode_ok, k_.cluster_head_decode_ok) != "pair"
        assert two[k] - one[k] == (L if fewer else 0), (k, two, one)
    rng = np.random.default_rng(31)
    prompts = [rng.integers(3, m.model.vocab_size, int(n)).tolist() for n in (5, 37, 20, 61, 9)]
    slots = [0, 3, 5, 1, 7]
    tables = scattered_tables(m, [len(p) + 16 for p in prompts], seed=2)
    drv = Driver(runners, slots, tables, prompts)
    for a, b in drv.prefill(chunk=12):
        assert np.array_equal(a, b)
    for step in range(12):
        a, b = drv.decode()
        assert np.isfinite(b).all() and np.array_equal(a, b), f"decode step {step}: logits differ"
    for layer in m.model.linear_layers:
        for x, y in zip(runners[0].ops.state_arrays(layer), runners[1].ops.state_arrays(layer)):
            assert np.array_equal(x[slots], y[slots]), f"layer {layer}: state differs"
