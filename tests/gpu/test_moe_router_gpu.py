"""The fused decode MoE router (``cuda/moe_router.py``, ``ops/cuda/moe_router.cu``) on the GPU:

* logits against a float64 ``h @ w.T`` of the same bf16/fp16 operands, within float32 accumulation of the
  products (``|err| <= 2e-5 * sum_k |h_k w_k|`` per logit), padding rows exactly 0, nothing written past E_pad
  or past the step's tokens (canaries), h's columns past H never read (NaN canaries);
* routing == ``fused.cu``'s ``moe_route`` run on OUR logits, bit for bit: pair_e, pair_w's bits, expert_off,
  active, the same set of pairs per expert; with and without the folded shared expert, renormalised or not,
  n = 16, 7, 2, 1 (largest first: later steps run over stale buffers), every rows-per-CTA knob, bf16 and fp16;
* batch invariance: a token's logits (and routing) have the same bits alone, in any step, at any row;
* the CTA counter: two launches in a row, knobs sharing one workspace, a CUDA graph replayed 3 times (inputs
  changed between replays) all route, and leave the counter at 0;
* NaN / inf activations never produce an expert outside 0 .. E_all-1;
* the backend (default bf16 model): decode with the fused router tracks the cuBLASLt + moe_route decode,
  graphs captured and replayed.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

DT = {"float16": 1, "bfloat16": 2}
NAN_BITS = {"bfloat16": 0x7FC0, "float16": 0x7E00}
CANARY = -7777.0
# H, E (routed experts), E_pad (router rows), k
SHAPES = {"a35b": (2048, 256, 264, 8), "small": (128, 8, 16, 2), "odd": (160, 61, 64, 4),
          "noshared": (2048, 256, 256, 8), "wide": (4096, 64, 72, 6)}  # wide: 4 k blocks per warp, 2 rounds
NS = (16, 7, 2, 1)


@pytest.fixture(scope="module")
def dev():
    import torch

    torch.cuda.init()
    from hybrid_runtime.cuda.driver import CudaDevice

    return CudaDevice(0)


def host_bits(x: np.ndarray, dtype: str) -> np.ndarray:
    from hybrid_runtime.cuda.backend import to_dtype

    b = to_dtype(x, dtype)
    return b if dtype == "bfloat16" else b.view(np.uint16)


def bits_to_f64(bits: np.ndarray, dtype: str) -> np.ndarray:
    from hybrid_runtime.weights_io import bf16_to_f32

    if dtype == "bfloat16":
        return bf16_to_f32(bits).astype(np.float64)
    return bits.view(np.float16).astype(np.float64)


class Rig:
    """Router weights (random rows 0..E, zero padding), the kernel, our outputs and moe_route's (r_*)."""

    def __init__(self, dev, dtype: str, shape: str, rows: int = 8, ld: int | None = None, ldh: int | None = None,
                 seed: int = 1) -> None:
        from hybrid_runtime.cuda.backend import fill_random
        from hybrid_runtime.cuda.driver import DeviceArray
        from hybrid_runtime.cuda.kernels import load_module
        from hybrid_runtime.cuda.moe_router import MoERouter, RouteBuffers

        self.dev, self.dtype, self.shape = dev, dtype, shape
        H, E, e_pad, k = SHAPES[shape]
        self.H, self.E, self.e_pad, self.k = H, E, e_pad, k
        self.ld, self.ldh = ld or e_pad, ldh or H
        self.fused = load_module("fused.cu", (f"-DDT={DT[dtype]}",), dev.arch)
        self.router = MoERouter(dev, dtype, rows)
        self.w = dev.zeros((e_pad, H), dtype)
        live = min(E + 1, e_pad)  # the experts' rows and the shared gate's; the rest stays zero
        fill_random(dev, self.fused, DeviceArray(self.w.ptr, (live, H), dtype, dev.ordinal), seed, 1.0 / np.sqrt(H))
        self.w64 = np.asarray(dev.download(self.w), np.float64)
        P, ea = 16 * (k + 1), E + 2
        self.b = {name: dev.empty(shape_, dt) for name, shape_, dt in (
            ("logits", (16, self.ld), "float32"), ("pw", (P,), "float32"), ("pe", (P,), "int32"),
            ("pl", (P,), "int32"), ("off", (ea,), "int32"), ("active", (ea,), "int32"),
            ("r_pw", (P,), "float32"), ("r_pe", (P,), "int32"), ("r_pl", (P,), "int32"), ("r_off", (ea,), "int32"),
            ("r_active", (ea,), "int32"))}
        self.ws = dev.zeros((4,), "int32")
        b = self.b
        self.bufs = RouteBuffers(b["pw"].ptr, b["pe"].ptr, b["off"].ptr, b["pl"].ptr, b["active"].ptr, self.ws.ptr)

    def h_device(self, h_bits: np.ndarray):
        """h [n, ldh] on the device, exactly n rows (columns past H: NaN, which no logit may see)."""
        n = len(h_bits)
        full = np.full((n, self.ldh), NAN_BITS[self.dtype], np.uint16)
        full[:, :self.H] = h_bits
        return self.dev.upload(full, dtype=self.dtype)

    def poison(self) -> None:
        """Our outputs to 0xFF bytes (int -1, float NaN), the logits to CANARY."""
        for name in ("pw", "pe", "pl", "off", "active"):
            self.dev.memset_d8(self.b[name].ptr, 0xFF, self.b[name].nbytes)
        lg = self.b["logits"]
        self.fused.kernel("fill_f32").launch(self.dev, (-(-lg.size // 256), 1, 1), (256, 1, 1), 0,
                                             [("ptr", lg.ptr), ("f32", CANARY), ("i64", lg.size)])

    def launch(self, n: int, h_ptr: int, renorm: bool, fold: bool) -> None:
        self.router.launch(n, h_ptr, self.ldh, self.w, self.b["logits"].ptr, self.ld, self.E, self.k, renorm, fold,
                           self.bufs)

    def reference_route(self, n: int, renorm: bool, fold: bool) -> None:
        """fused.cu's moe_route on the logits our kernel wrote."""
        b = self.b
        self.fused.kernel("moe_route").launch(
            self.dev, (1, 1, 1), (1024, 1, 1), 0,
            [("ptr", b["logits"].ptr), ("i32", self.ld), ("i32", n), ("i32", self.E), ("i32", self.k),
             ("i32", int(renorm)), ("i32", int(fold)), ("ptr", b["r_pw"].ptr), ("ptr", b["r_pe"].ptr),
             ("ptr", b["r_off"].ptr), ("ptr", b["r_pl"].ptr), ("ptr", b["r_active"].ptr)])

    def fetch(self) -> dict[str, np.ndarray]:
        self.dev.synchronize()
        out = {name: self.dev.download(a) for name, a in self.b.items()}
        out["ws"] = self.dev.download(self.ws)
        return out

    def run(self, h_bits: np.ndarray, renorm: bool = True, fold: bool = True) -> dict[str, np.ndarray]:
        n = len(h_bits)
        self.poison()
        hd = self.h_device(h_bits)
        self.launch(n, hd.ptr, renorm, fold)
        self.reference_route(n, renorm, fold)
        out = self.fetch()
        del hd
        return out


def check_routing(got: dict[str, np.ndarray], n: int, E: int, k: int, fold: bool, label: str) -> None:
    """Ours == moe_route's on the same logits, bit for bit (pair_list: the same pairs per expert)."""
    kk, e_all = k + int(fold), E + int(fold)
    P = n * kk
    assert np.array_equal(got["pe"][:P], got["r_pe"][:P]), label
    assert ((got["pe"][:P] >= 0) & (got["pe"][:P] < e_all)).all(), label
    np.testing.assert_array_equal(got["pw"][:P].view(np.uint32), got["r_pw"][:P].view(np.uint32), err_msg=label)
    assert np.array_equal(got["off"][:e_all + 1], got["r_off"][:e_all + 1]), label
    assert got["off"][e_all] == P, label
    na = int(got["r_active"][e_all])
    assert got["active"][e_all] == na and np.array_equal(got["active"][:na], got["r_active"][:na]), label
    off = got["off"]
    for e in range(e_all):
        mine, theirs = np.sort(got["pl"][off[e]:off[e + 1]]), np.sort(got["r_pl"][off[e]:off[e + 1]])
        assert np.array_equal(mine, theirs), (label, e)
        assert (got["pe"][mine] == e).all(), (label, e)
    if fold:
        assert (got["pe"][:P].reshape(n, kk)[:, k] == E).all(), label  # the shared expert: slot k of every token


def check_logits(rig: Rig, got: dict[str, np.ndarray], h_bits: np.ndarray, label: str) -> None:
    n, e_pad = len(h_bits), rig.e_pad
    lg = got["logits"]
    h64 = bits_to_f64(h_bits, rig.dtype)
    ref = h64 @ rig.w64.T
    bound = np.abs(h64) @ np.abs(rig.w64).T  # sum_k |h_k w_k|: the scale of float32 accumulation error
    err = np.abs(lg[:n, :e_pad] - ref)
    worst = float((err / np.maximum(bound, 1e-30)).max())
    assert (err <= 2e-5 * bound + 1e-30).all(), (label, worst)
    assert not lg[:n, rig.E + 1:e_pad].any(), label  # the router's zero padding rows: written, exactly 0
    assert (lg[:n, e_pad:] == CANARY).all() and (lg[n:] == CANARY).all(), label  # nothing else


CASES = [("bfloat16", "a35b", 8), ("bfloat16", "a35b", 4), ("bfloat16", "a35b", 16), ("float16", "a35b", 8),
         ("bfloat16", "small", 8), ("float16", "odd", 16), ("bfloat16", "odd", 4), ("bfloat16", "wide", 8)]


@pytest.mark.parametrize("dtype,shape,rows", CASES)
def test_logits_and_routing_match_a_reference_and_moe_route(dev, dtype: str, shape: str, rows: int) -> None:
    rig = Rig(dev, dtype, shape, rows, ld=SHAPES[shape][2] + 8, ldh=SHAPES[shape][0] + 16)
    rng = np.random.default_rng(rows + len(shape))
    for n in NS:
        h_bits = host_bits(rng.standard_normal((n, rig.H)).astype(np.float32), dtype)
        for fold in (True, False):
            for renorm in (True, False):
                label = f"{dtype} {shape} rows={rows} n={n} fold={fold} renorm={renorm}"
                got = rig.run(h_bits, renorm, fold)
                check_logits(rig, got, h_bits, label)
                check_routing(got, n, rig.E, rig.k, fold, label)
                assert got["ws"][0] == 0, label  # the last CTA reset the counter


def test_a_router_without_a_shared_gate_row(dev) -> None:
    """E_pad == E (no shared expert): every row is an expert's, no fold."""
    rig = Rig(dev, "bfloat16", "noshared")
    rng = np.random.default_rng(3)
    for n in NS:
        h_bits = host_bits(rng.standard_normal((n, rig.H)).astype(np.float32), "bfloat16")
        got = rig.run(h_bits, True, False)
        check_logits(rig, got, h_bits, f"noshared n={n}")
        check_routing(got, n, rig.E, rig.k, False, f"noshared n={n}")


def test_a_tokens_bits_do_not_depend_on_the_step(dev) -> None:
    """Token 0 alone == inside 2-, 7- and 16-token steps; one h row copied into all 16 rows gives 16 identical
    logit rows, equal to that token's row in the mixed step (the row position does not matter either)."""
    rig = Rig(dev, "bfloat16", "a35b")
    rng = np.random.default_rng(7)
    h16 = host_bits(rng.standard_normal((16, rig.H)).astype(np.float32), "bfloat16")
    full = rig.run(h16)
    kk = rig.k + 1
    for n in (1, 2, 7):
        part = rig.run(np.ascontiguousarray(h16[:n]))
        assert np.array_equal(part["logits"][:n].view(np.uint32), full["logits"][:n].view(np.uint32)), n
        assert np.array_equal(part["pe"][:n * kk], full["pe"][:n * kk]), n
        assert np.array_equal(part["pw"][:n * kk].view(np.uint32), full["pw"][:n * kk].view(np.uint32)), n
    same = rig.run(np.ascontiguousarray(np.tile(h16[5], (16, 1))))
    rows = same["logits"][:16].view(np.uint32)
    assert (rows == rows[0]).all()
    assert np.array_equal(rows[0], full["logits"][5].view(np.uint32))
    assert np.array_equal(same["pe"][:16 * kk].reshape(16, kk), np.tile(full["pe"][5 * kk:6 * kk], (16, 1)))


def test_back_to_back_launches_and_knobs_sharing_a_workspace(dev) -> None:
    """Each launch finds the counter at 0 and leaves it there: outputs poisoned between launches come back."""
    from hybrid_runtime.cuda.moe_router import MoERouter

    rig = Rig(dev, "bfloat16", "a35b")
    rng = np.random.default_rng(11)
    h_bits = host_bits(rng.standard_normal((16, rig.H)).astype(np.float32), "bfloat16")
    first = rig.run(h_bits)
    hd = rig.h_device(h_bits)
    for _ in range(2):  # twice in a row, no synchronisation in between, then poisoned and once more
        rig.launch(16, hd.ptr, True, True)
    rig.poison()
    rig.launch(16, hd.ptr, True, True)
    again = rig.fetch()
    for name in ("logits", "pe", "pw", "off", "active"):
        assert np.array_equal(again[name].view(np.uint32), first[name].view(np.uint32)), name
    assert again["ws"][0] == 0
    for rows in (16, 4, 8):  # other grid sizes on the same workspace
        rig.router = MoERouter(dev, "bfloat16", rows)
        got = rig.run(h_bits)
        check_routing(got, 16, rig.E, rig.k, True, f"rows={rows}")
        # a logit's k order depends on H alone, not on which CTA computes its row: the same bits
        assert np.array_equal(got["logits"].view(np.uint32), first["logits"].view(np.uint32)), rows
        assert np.array_equal(got["pe"], first["pe"]) and got["ws"][0] == 0, rows


def test_a_captured_graph_replays_with_new_inputs(dev) -> None:
    from hybrid_runtime.cuda.driver import CudaGraph

    rig = Rig(dev, "bfloat16", "a35b")
    rng = np.random.default_rng(13)
    n = 8
    hd = rig.h_device(host_bits(rng.standard_normal((n, rig.H)).astype(np.float32), "bfloat16"))
    rig.launch(n, hd.ptr, True, True)  # warm-up, eager
    dev.synchronize()
    graph = CudaGraph(dev, lambda: rig.launch(n, hd.ptr, True, True))
    try:
        for rep in range(3):
            h_bits = host_bits(rng.standard_normal((n, rig.H)).astype(np.float32), "bfloat16")
            full = np.full((n, rig.ldh), NAN_BITS["bfloat16"], np.uint16)
            full[:, :rig.H] = h_bits
            dev.copy_htod(hd.ptr, full)
            rig.poison()
            graph.launch()
            rig.reference_route(n, True, True)
            got = rig.fetch()
            check_logits(rig, got, h_bits, f"replay {rep}")
            check_routing(got, n, rig.E, rig.k, True, f"replay {rep}")
            assert got["ws"][0] == 0, rep
            eager = rig.run(h_bits)
            for name in ("logits", "pe", "pw", "off"):
                assert np.array_equal(got[name].view(np.uint32), eager[name].view(np.uint32)), (rep, name)
    finally:
        graph.destroy()


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_nan_and_inf_activations_route_to_valid_experts(dev, dtype: str) -> None:
    rig = Rig(dev, dtype, "a35b")
    rng = np.random.default_rng(17)
    h_bits = host_bits(rng.standard_normal((8, rig.H)).astype(np.float32), dtype)
    h_bits[2] = NAN_BITS[dtype]  # every logit of token 2 is NaN
    h_bits[5, 100] = 0x7F80 if dtype == "bfloat16" else 0x7C00  # +inf: logits +-inf, NaN on the zero rows
    for fold in (True, False):
        got = rig.run(h_bits, True, fold)
        kk, e_all = rig.k + int(fold), rig.E + int(fold)
        assert np.isnan(got["logits"][2, :rig.e_pad]).all()
        pe = got["pe"][:8 * kk]
        assert ((pe >= 0) & (pe < e_all)).all(), pe
        assert np.array_equal(pe, got["r_pe"][:8 * kk])
        np.testing.assert_array_equal(got["pw"][:8 * kk], got["r_pw"][:8 * kk])  # NaN == NaN here
        assert got["off"][e_all] == 8 * kk and np.array_equal(got["off"][:e_all + 1], got["r_off"][:e_all + 1])
        assert sorted(got["pl"][:8 * kk].tolist()) == list(range(8 * kk))
        for t in (0, 1, 3, 4, 6, 7):  # the finite tokens route as usual
            assert np.isfinite(got["pw"][t * kk:(t + 1) * kk]).all(), t


def test_backend_decode_with_the_fused_router_tracks_the_cublaslt_router(tmp_path_factory: pytest.TempPathFactory,
                                                                          default_checkpoint: Path) -> None:
    """The default bf16 model (H 128, 8 experts + the folded shared one, top-2): fused_router on vs off, graphs
    captured in both, teacher-forced on the same tokens. Prefill never takes the kernel (the same bits); decode
    logits stay within router-rounding noise of the cuBLASLt + moe_route path, replayed from graphs."""
    from runner_cases import Driver, scattered_tables
    from test_cuda_backend import _bundles

    from hybrid_runtime.config import Manifest
    from hybrid_runtime.cuda.backend import CudaBackend
    from hybrid_runtime.runner import ModelRunner

    root = tmp_path_factory.mktemp("fused_router")
    _, gpu_b = _bundles(root, default_checkpoint, "bfloat16", max_seq_len=512, max_input_len=384, max_num_tokens=256)
    m = Manifest.load(gpu_b)
    runners = []
    for fused in (False, True):
        be = CudaBackend(gpu_b, m, device="cuda", fused_router=fused)
        assert (be.moe_router is not None) == fused
        r = ModelRunner(gpu_b, m, backend=be)
        be.capture_graphs(r._forward)
        runners.append(r)
    rng = np.random.default_rng(23)
    prompts = [rng.integers(3, m.model.vocab_size, int(n)).tolist() for n in rng.integers(8, 100, 6)]
    slots = [0, 3, 5, 1, 7, 2]
    tables = scattered_tables(m, [len(p) + 24 for p in prompts], seed=6)
    drv = Driver(runners, slots, tables, prompts)
    for a, b in drv.prefill(chunk=32):
        assert np.array_equal(a, b)
    agree = total = 0
    worst = 0.0
    for _ in range(20):
        a, b = drv.decode()
        assert np.isfinite(b).all()
        agree += int((a.argmax(1) == b.argmax(1)).sum())
        total += a.shape[0]
        worst = max(worst, float(np.abs(a - b).max() / max(np.abs(a).max(), 1e-30)))
    fused_be = runners[1].backend
    assert fused_be.graph_stats.replays, "the fused-router decode steps were not replayed from graphs"  # type: ignore
    assert agree / total >= 0.95, f"{agree}/{total}"
    assert worst < 0.05, worst
