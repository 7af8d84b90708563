"""onnx_proto: the runtime's own ONNX protobuf writer gives the messages onnx.helper gives, its reader splits
any message into fields that join back to the same bytes, and the serving process never imports onnx."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from hybrid_runtime import onnx_proto as pb
from hybrid_runtime.config import Manifest
from hybrid_runtime.ops import attention_ort, gdn_ort, moe


def _lines(m: onnx.ModelProto) -> list[str]:
    """The model as text, without explicitly empty domains (onnx.helper writes ``domain: ""``; a field left
    out reads the same)."""
    return [line for line in str(m).splitlines() if line.strip() != 'domain: ""']


def test_writer_matches_onnx_helper() -> None:
    attrs = {"i": 3, "neg": -1, "f": 0.5, "s": "gated_delta", "ints": [0, -2, 1 << 40], "floats": [1.5, -2.0]}
    arrs = {"c_f": np.arange(6, dtype=np.float32).reshape(2, 3), "c_i": np.array([-1, 7], np.int64),
            "c_s": np.array(2.5, np.float32), "c_u8": np.array([1, 255], np.uint8)}
    ours = pb.make_model(pb.make_graph(
        [pb.make_node("Custom", ["x", "c_f"], ["y"], name="n0", domain="com.microsoft", **attrs),
         pb.make_node("Identity", ["y"], ["z"])], "g",
        [pb.make_tensor_value_info("x", pb.FLOAT, ["T", 3])], [pb.make_tensor_value_info("z", pb.FLOAT, ["T", 3])],
        [pb.from_array(a, n) for n, a in arrs.items()] + [pb.external_tensor("w", [4, 3], pb.UINT8, "w.bin")]),
        opset_imports=[pb.make_opsetid("", 17), pb.make_opsetid("com.microsoft", 1)], ir_version=8)
    ext = TensorProto(name="w", data_type=TensorProto.UINT8, dims=[4, 3], data_location=TensorProto.EXTERNAL)
    ext.external_data.add(key="location", value="w.bin")
    ref = helper.make_model(helper.make_graph(
        [helper.make_node("Custom", ["x", "c_f"], ["y"], name="n0", domain="com.microsoft", **attrs),
         helper.make_node("Identity", ["y"], ["z"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["T", 3])],
        [helper.make_tensor_value_info("z", TensorProto.FLOAT, ["T", 3])],
        [numpy_helper.from_array(a, n) for n, a in arrs.items()] + [ext]),
        opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)],
        producer_name="hybrid-runtime")
    ref.ir_version = 8
    assert _lines(onnx.load_from_string(ours.SerializeToString())) == _lines(ref)


def test_reader_splits_and_rejoins(tmp_path: Path) -> None:
    m = helper.make_model(helper.make_graph(
        [helper.make_node("Gather", ["t", "ids"], ["x"], axis=-1)], "g",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, ["n"])],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 2])],
        [numpy_helper.from_array(np.ones((3, 2), np.float32), "t")]))
    data = m.SerializeToString()
    parts = list(pb.fields(data))
    assert b"".join(p[3] for p in parts) == data
    graph = next(v for n, _, v, _ in parts if n == 7)
    assert isinstance(graph, bytes)
    (node,) = pb.messages(graph, 1)
    (attr,) = pb.messages(node, 5)
    assert pb.text(node, 4) == "Gather" and pb.strings(node, 1) == ["t", "ids"]
    assert pb.text(attr, 1) == "axis" and pb.integer(attr, 3) == -1
    (init,) = pb.messages(graph, 5)
    assert pb.ints(init, 1) == [3, 2] and pb.integer(init, 2) == TensorProto.FLOAT
    with pytest.raises(ValueError):
        list(pb.fields(data[:-1]))


def test_runtime_graphs_are_valid_onnx(default_bundle: Path) -> None:
    cfg = Manifest.load(default_bundle).model
    for model in (gdn_ort.decode_graph(cfg), gdn_ort.prefill_graph(cfg),
                  attention_ort._graph(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, 2)):
        onnx.checker.check_model(onnx.load_from_string(model.SerializeToString()))
    layer = cfg.ffn_types.index("moe")
    parsed = onnx.load_from_string(moe.moe_graph(cfg, layer).SerializeToString())
    external = [t for t in parsed.graph.initializer if t.data_location == TensorProto.EXTERNAL]
    assert {t.name for t in external} >= {"router", "w1_0", "w2_0"}
    assert all(e.key == "location" for t in external for e in t.external_data)


def test_serving_process_does_not_import_onnx(default_bundle: Path) -> None:
    code = ("import sys; from pathlib import Path; "
            "from hybrid_runtime.serving import RuntimeOptions, ServingEngine; "
            f"e = ServingEngine(Path({str(default_bundle)!r}), RuntimeOptions()).start(); e.shutdown(); "
            "print(sorted(m for m in ('onnx', 'ml_dtypes', 'google.protobuf') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    assert out.stdout.strip().splitlines()[-1] == "[]"
