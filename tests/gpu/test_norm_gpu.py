"""fused.cu's add + RMSNorm (``rmsnorm_rows`` for float32 slots, ``rmsnorm_rows_t`` for slots in the bundle dtype)
on the GPU against a float64 numpy reference, at 1, 16 and 8192 rows, 1 and 9 slots (the last one gated by
sigmoid(sg), as a shared expert run as GEMMs is), float32 and bf16 slots:

* x_out = x + the slots in slot order within float32 summation error, h within one rounding to the bundle dtype;
* a row's bits do not depend on the block size (every power of two the kernel takes), on how many rows share the
  launch (row r of 8192 == the same row alone, the first 16 == a 16-row launch), nor on the load path (16-byte
  vectors vs the scalar path a misaligned row start takes);
* bf16 slots give the bits of float32 slots holding the same values (the sum is float32 in both);
* the head's row selection (no residual write) and the "add"-only launch (no h).

The numpy model of the block-size invariance runs on any machine: tests/unit/test_norm_tree.py."""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

DT = {"float32": 0, "float16": 1, "bfloat16": 2}
EPS = 1e-6
H = 2048  # Qwen3.5-35B-A3B
BLOCKS = (128, 256, 512)  # every block rmsnorm_rows takes at H = 2048 (512 groups of 4 columns, <= 4 per thread)


_MODS: dict = {}


def fused(dev, dtype: str):
    from hybrid_runtime.cuda.kernels import load_module

    if dtype not in _MODS:
        _MODS[dtype] = load_module("fused.cu", (f"-DDT={DT[dtype]}",), dev.arch)
    return _MODS[dtype]


def rounded(a: np.ndarray, dtype: str) -> np.ndarray:
    from hybrid_runtime.weights_io import bf16_to_f32, f32_to_bf16_bits

    a = np.asarray(a, np.float32)
    if dtype == "bfloat16":
        return bf16_to_f32(f32_to_bf16_bits(a))
    if dtype == "float16":
        return a.astype(np.float16).astype(np.float32)
    return a


def up(dev, a: np.ndarray, dtype: str = "float32"):
    from hybrid_runtime.cuda.backend import to_dtype

    return dev.upload(to_dtype(a, dtype), dtype=dtype)


def bits(a: np.ndarray) -> np.ndarray:
    a = np.ascontiguousarray(a)
    return a.view(np.uint32 if a.dtype.itemsize == 4 else np.uint16)


class Case:
    """Inputs of one (rows, slots) case: x [n, H] float32, y [n, ny, H] (values the slot dtype holds exactly),
    sg [n, 8] (the gate logit in column 3), w [H]; the float64 reference."""

    def __init__(self, n: int, ny: int, slot_dtype: str, gated: bool, seed: int = 0, hidden: int = H) -> None:
        rng = np.random.default_rng(seed + 1000 * ny + n)
        self.n, self.ny, self.H, self.gated, self.slot_dtype = n, ny, hidden, gated, slot_dtype
        self.x = (rng.standard_normal((n, hidden)) * 2).astype(np.float32)
        scale = np.exp(rng.standard_normal((n, ny, 1)))  # slots of different magnitudes: the order matters
        self.y = rounded(rng.standard_normal((n, ny, hidden)) * scale, slot_dtype)
        self.sg = rng.standard_normal((n, 8)).astype(np.float32)
        self.w = (1 + 0.1 * rng.standard_normal(hidden)).astype(np.float32)

    def reference(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(v, h, mag): v = x + slots (the last gated) and h in float64; mag = |x| + sum |slot| per element."""
        y = self.y.astype(np.float64)
        terms = y.copy()
        if self.gated:
            terms[:, -1] *= (1.0 / (1.0 + np.exp(-self.sg[:, 3].astype(np.float64))))[:, None]
        v = self.x.astype(np.float64) + terms.sum(1)
        h = v / np.sqrt((v * v).mean(1, keepdims=True) + EPS) * self.w.astype(np.float64)
        return v, h, np.abs(self.x) + np.abs(terms).sum(1)


def launch(dev, mod, case: Case, block: int, *, entry: str | None = None, slot_dtype: str | None = None,
           h_dtype: str, rows=None, n_out: int | None = None, write_x: bool = True, want_h: bool = True,
           x_offset: int = 0) -> tuple[np.ndarray | None, np.ndarray | None]:
    """One launch on fresh device copies: (x_out, h) as downloaded. ``x_offset`` floats of padding before x's
    first row (4 bytes: every row start misaligned for 16-byte loads -> the scalar path)."""
    n, Hc = case.n, case.H
    sd = slot_dtype or case.slot_dtype
    entry = entry or ("rmsnorm_rows" if sd == "float32" else "rmsnorm_rows_t")
    xbuf = np.concatenate([np.zeros(x_offset, np.float32), case.x.ravel()])
    xd = up(dev, xbuf)
    yd = up(dev, case.y.reshape(n, -1), sd) if case.ny else None
    sgd, wd = up(dev, case.sg), up(dev, case.w)
    n_out = n if n_out is None else n_out
    h = dev.empty((n_out, Hc), h_dtype) if want_h else None
    rd = dev.upload(np.asarray(rows, np.int32)) if rows is not None else None
    xp = xd.ptr + 4 * x_offset
    mod.kernel(entry).launch(dev, (n_out, 1, 1), (block, 1, 1), 0,
                             [("ptr", xp), ("ptr", yd.ptr if yd is not None else 0), ("i32", case.ny),
                              ("ptr", sgd.ptr + 12 if case.gated else 0), ("i64", 8), ("ptr", wd.ptr),
                              ("ptr", xp if write_x else 0), ("ptr", h.ptr if h is not None else 0),
                              ("ptr", rd.ptr if rd is not None else 0), ("i32", n_out), ("i32", Hc),
                              ("f32", EPS)])
    dev.synchronize()
    xo = dev.download(xd)[x_offset:].reshape(n, Hc) if write_x else None
    ho = dev.download(h) if h is not None else None
    del xd, yd, sgd, wd, rd
    return xo, ho


def check_numerics(case: Case, xo: np.ndarray, ho: np.ndarray, h_dtype: str, label: str) -> None:
    v, h_ref, mag = case.reference()
    # float32 sums of ny + 1 terms in slot order (one fma for the gated slot): |err| <= (ny + 1) u sum|terms|
    bound = (case.ny + 1) * 2.0 ** -24 * mag + 1e-30
    assert (np.abs(xo - v) <= bound).all(), (label, float((np.abs(xo - v) / bound).max()))
    # h: the float32 norm (rsqrtf: a few ulp) then one rounding to h's dtype (bf16: <= 2^-8 relative; fp32: none)
    rel = {"float32": 2e-6, "bfloat16": 2.0 ** -8 + 2e-6, "float16": 2.0 ** -11 + 2e-6}[h_dtype]
    err = np.abs(ho.astype(np.float64) - h_ref)
    tol = rel * np.abs(h_ref) + 1e-6 * np.abs(h_ref).max()
    assert (err <= tol).all(), (label, float((err / tol).max()))


# (bundle dtype = h's dtype, slot dtype): float32 bundles (parity), bf16 decode (float32 slots), bf16 prefill
COMBOS = [("float32", "float32"), ("bfloat16", "float32"), ("bfloat16", "bfloat16")]


@pytest.mark.parametrize("n", [1, 16, 8192])
@pytest.mark.parametrize("ny,gated", [(1, False), (9, False), (9, True)])
@pytest.mark.parametrize("bundle,slots", COMBOS)
def test_add_rmsnorm_matches_float64(dev, n: int, ny: int, gated: bool, bundle: str, slots: str) -> None:
    from hybrid_runtime.cuda.backend import norm_block

    case = Case(n, ny, slots, gated)
    mod = fused(dev, bundle)
    block, _ = norm_block(H, n)
    xo, ho = launch(dev, mod, case, block, h_dtype=bundle)
    check_numerics(case, xo, ho, bundle, f"{bundle}/{slots} n={n} ny={ny} gated={gated} block={block}")


@pytest.mark.parametrize("bundle,slots", COMBOS)
def test_a_rows_bits_depend_on_neither_the_block_nor_the_other_rows(dev, bundle: str, slots: str) -> None:
    """8192 rows at every block size, the first 16 rows alone and row 0 alone: the same x_out and h bits."""
    mod = fused(dev, bundle)
    big = Case(8192, 9, slots, True, seed=3)
    ref_x, ref_h = launch(dev, mod, big, 256, h_dtype=bundle)
    for block in BLOCKS:
        xo, ho = launch(dev, mod, big, block, h_dtype=bundle)
        assert np.array_equal(bits(xo), bits(ref_x)) and np.array_equal(bits(ho), bits(ref_h)), block
    for m in (16, 1):
        small = Case(m, 9, slots, True)
        small.x, small.y, small.sg = big.x[:m].copy(), big.y[:m].copy(), big.sg[:m].copy()
        small.w = big.w
        for block in (512, 128):
            xo, ho = launch(dev, mod, small, block, h_dtype=bundle)
            assert np.array_equal(bits(xo), bits(ref_x[:m])) and np.array_equal(bits(ho), bits(ref_h[:m])), \
                (m, block)


def test_bf16_slots_give_the_bits_of_float32_slots_holding_the_same_values(dev) -> None:
    mod = fused(dev, "bfloat16")
    for n, ny, gated in ((8192, 9, True), (16, 9, False), (1, 1, False)):
        case = Case(n, ny, "bfloat16", gated, seed=5)  # values bf16 holds exactly
        a = launch(dev, mod, case, 256, h_dtype="bfloat16", slot_dtype="bfloat16")
        b = launch(dev, mod, case, 512, h_dtype="bfloat16", slot_dtype="float32")
        assert np.array_equal(bits(a[0]), bits(b[0])) and np.array_equal(bits(a[1]), bits(b[1])), (n, ny, gated)


@pytest.mark.parametrize("bundle,slots", COMBOS)
def test_scalar_path_gives_the_vector_paths_bits(dev, bundle: str, slots: str) -> None:
    """x one float off 16-byte alignment (every row start misaligned): the scalar loads, the same bits. And a width
    that is not a multiple of 4 (the tail group) against float64."""
    mod = fused(dev, bundle)
    case = Case(64, 9, slots, True, seed=7)
    vx, vh = launch(dev, mod, case, 512, h_dtype=bundle)
    sx, sh = launch(dev, mod, case, 128, h_dtype=bundle, x_offset=1)
    assert np.array_equal(bits(vx), bits(sx)) and np.array_equal(bits(vh), bits(sh))
    odd = Case(16, 9, slots, True, seed=8, hidden=98)
    xo, ho = launch(dev, mod, odd, 32, h_dtype=bundle)
    check_numerics(odd, xo, ho, bundle, "H=98")


@pytest.mark.parametrize("bundle", ["float32", "bfloat16"])
def test_head_rows_and_add_only(dev, bundle: str) -> None:
    mod = fused(dev, bundle)
    case = Case(40, 0, "float32", False, seed=9)  # no slots: the head's plain norm of x
    rows = [39, 3, 17]
    xo, ho = launch(dev, mod, case, 512, h_dtype=bundle, rows=rows, n_out=3, write_x=False)
    assert xo is None
    sub = Case(3, 0, "float32", False)
    sub.x, sub.w = case.x[rows], case.w
    check_numerics(sub, sub.x, ho, bundle, "head rows")
    _, ref_h = launch(dev, mod, sub, 128, h_dtype=bundle, write_x=False)
    assert np.array_equal(bits(ho), bits(ref_h))  # selected rows == the same rows in their own launch
    add = Case(300, 1, "float32", False, seed=10)
    xo, ho = launch(dev, mod, add, 256, h_dtype=bundle, want_h=False)  # "add": x += y, no norm
    assert ho is None
    assert np.array_equal(bits(xo), bits(add.x + add.y[:, 0]))  # one float32 add per element: exact in numpy
