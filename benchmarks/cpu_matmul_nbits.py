"""One onnxruntime MatMulNBits (int4, block 128, float32 or int8 activations) against the float32 MatMul of the same
shape, per number of rows M, on the CPU: what a quantized segment's projection costs as the batch grows.

    python -m benchmarks.cpu_matmul_nbits [--threads 2] [--shapes 6176x1024,1024x4096,512x1024] [--rows 1,4,16,128]

Shapes N x K are the ``qwen3-next-334m`` bench model's (GDN in_proj, its out_proj-sized 1024 x 4096, an expert's
512 x 1024). Random weights and codes; each figure the mean of 30 calls after 5, microseconds.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np


def _model(N: int, K: int, bits: int = 0, accuracy: int = 0) -> Any:
    """An onnx ModelProto of one MatMul (bits 0) or MatMulNBits."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["M", K])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["M", N])
    if not bits:
        init = [numpy_helper.from_array(rng.random((K, N), dtype=np.float32), "W")]
        node = helper.make_node("MatMul", ["x", "W"], ["y"])
        ops = [helper.make_opsetid("", 17)]
    else:
        bs = 128
        init = [numpy_helper.from_array(rng.integers(0, 256, (N, K // bs, bs * bits // 8), dtype=np.uint8), "B"),
                numpy_helper.from_array(rng.random(N * (K // bs), dtype=np.float32) * 0.01, "s")]
        node = helper.make_node("MatMulNBits", ["x", "B", "s"], ["y"], domain="com.microsoft", K=K, N=N, bits=bits,
                                block_size=bs, accuracy_level=accuracy)
        ops = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(helper.make_graph([node], "g", [x], [y], init), opset_imports=ops)


def time_us(model: Any, M: int, K: int, threads: int, reps: int = 30) -> float:
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    s = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    x = np.random.default_rng(1).random((M, K), dtype=np.float32)
    for _ in range(5):
        s.run(None, {"x": x})
    t = time.perf_counter()
    for _ in range(reps):
        s.run(None, {"x": x})
    return (time.perf_counter() - t) / reps * 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--shapes", default="6176x1024,1024x4096,512x1024")
    ap.add_argument("--rows", default="1,4,16,128")
    a = ap.parse_args()
    import onnxruntime as ort

    rows = [int(m) for m in a.rows.split(",")]
    print(f"onnxruntime {ort.__version__}, {a.threads} threads; us per call\n")
    print("| N x K | M | fp32 MatMul | int4, fp32 activations | int4, int8 activations |")
    print("|---|---|---|---|---|")
    for shape in a.shapes.split(","):
        N, K = (int(v) for v in shape.split("x"))
        models = (_model(N, K), _model(N, K, 4, 0), _model(N, K, 4, 4))
        for M in rows:
            f, a32, a8 = (time_us(m, M, K, a.threads) for m in models)
            print(f"| {N} x {K} | {M} | {f:.0f} | {a32:.0f} ({a32 / f:.2f}x) | {a8:.0f} ({a8 / f:.2f}x) |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
