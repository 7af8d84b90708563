"""A representative run of every kernel, without PyTorch (so the sanitizer reports only our kernels).

    compute-sanitizer --tool memcheck  --error-exitcode 99 python3 tests/gpu/sanitize_workload.py
    compute-sanitizer --tool racecheck --error-exitcode 99 python3 tests/gpu/sanitize_workload.py --small

Checks each result against the numpy operators too; exits 1 on a wrong result.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np
from gdn_cases import Shape, Twin, bf16_bits, bits_to_f32, rel

from hybrid_runtime.cuda.attention import CudaDecodeAttention
from hybrid_runtime.cuda.driver import CudaDevice
from hybrid_runtime.cuda.state import DeviceKVCache
from hybrid_runtime.kv_cache import KVLayout
from hybrid_runtime.ops.attention import decode_attention_single


def attention_case(dev: CudaDevice, be: CudaDecodeAttention, rng: np.random.Generator, lens: list[int], hq: int,
                   hkv: int, hd: int, ps: int, dtype: str) -> list[str]:
    need = [-(-n // ps) for n in lens]
    pages = sum(need) + 2
    perm = rng.permutation(pages)
    starts = np.cumsum([0, *need])
    tables = [perm[starts[i]:starts[i + 1]].astype(np.int64) for i in range(len(lens))]

    def arr(shape):
        x = rng.standard_normal(shape).astype(np.float32)
        if dtype == "bfloat16":
            b = bf16_bits(x)
            return dev.upload(b, dtype="bfloat16"), bits_to_f32(b)
        if dtype == "float16":
            h = x.astype(np.float16)
            return dev.upload(h), h.astype(np.float32)
        return dev.upload(x), x

    (k_d, k), (v_d, v), (q_d, q) = arr((pages, ps, hkv, hd)), arr((pages, ps, hkv, hd)), arr((len(lens), hq, hd))
    want = decode_attention_single(q, k, v, tables, lens)
    bad = []
    for mode in ("off", "on"):
        disp = be.dispatcher(mode)
        out = dev.download(disp.run(q_d, k_d, v_d, tables, lens))
        err = rel(out, want)
        tol = {"bfloat16": 2e-2, "float16": 4e-3, "float32": 1e-4}[dtype]
        tag = f"attention {dtype} Hq={hq} Hkv={hkv} hd={hd} ps={ps} lens={lens} mode={mode} {dict(disp.plans)}"
        print(f"{tag}: rel err {err:.2e}")
        if not err < tol:
            bad.append(tag)
    return bad


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--small", action="store_true", help="shorter contexts (racecheck is slow)")
    args = ap.parse_args()
    long = 700 if args.small else 5000
    dev = CudaDevice(0)
    be = CudaDecodeAttention(dev)
    rng = np.random.default_rng(0)
    bad: list[str] = []
    bad += attention_case(dev, be, rng, [long, 1, 300], 16, 2, 256, 16, "bfloat16")  # mma, multi + empty chunks
    bad += attention_case(dev, be, rng, [long // 2, 37], 32, 8, 128, 64, "float16")
    bad += attention_case(dev, be, rng, [600, 5], 12, 4, 80, 32, "bfloat16")  # partial swizzle group
    bad += attention_case(dev, be, rng, [900, 2], 8, 2, 64, 16, "float32")  # portable kernel

    # KV write through a page table
    layout = KVLayout(num_pages=12, page_size=16, num_kv_heads=2, head_dim=64, dtype=np.float16)
    kv = DeviceKVCache(dev, layout)
    table = [5, 0, 9, 3]
    knew = rng.standard_normal((50, 2, 64)).astype(np.float16)
    vnew = rng.standard_normal((50, 2, 64)).astype(np.float16)
    kv.write(0, table, 3, dev.upload(knew), dev.upload(vnew))
    kb, vb = (dev.download(a) for a in kv.buffers(0))
    rows = kv.rows(table, 3, 50)
    ok = np.array_equal(kb.reshape(-1, 2, 64)[rows], knew) and np.array_equal(vb.reshape(-1, 2, 64)[rows], vnew)
    print(f"kv write: {'ok' if ok else 'MISMATCH'}")
    if not ok:
        bad.append("kv write")

    # GDN: prefill (window shorter and longer than K-1), decode with padding rows, reset + reuse
    for act, shape in (("bfloat16", Shape()), ("float16", Shape(nk=2, nv=4, dk=128, dv=128))):
        tw = Twin(dev, shape, num_slots=12, act=act, seed=3)
        o, o_ref = tw.prefill([4, 9, 0], [2, 40 if args.small else 130, 7])
        errs = [rel(o, o_ref)]
        slots = np.array([9, tw.sink, 4, 0, tw.sink])
        for _ in range(3):
            o, o_ref = tw.decode(slots)
            errs.append(rel(o[slots != tw.sink], o_ref[slots != tw.sink]))
        tw.reset(4)
        o, o_ref = tw.prefill([4], [5])
        errs.append(rel(o, o_ref))
        conv, rec = tw.state()
        live = np.array([0, 4, 9])
        errs += [rel(conv[live], tw.conv_np[live]), rel(rec[live], tw.rec_np[live])]
        print(f"gdn {act} {shape}: max rel err {max(errs):.2e}")
        if not max(errs) < 1e-2:
            bad.append(f"gdn {act}")
    dev.synchronize()
    print("FAILED: " + "; ".join(bad) if bad else "all results match the numpy operators")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
