"""table_rows: a segment's embedding Gather split out of the graph and read with pread gives the same bits,
keeps no mapping of the table, and refuses indices outside it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from hybrid_runtime.engine.base import ShapeError
from hybrid_runtime.engine.ort_session import cpu_session, session_options
from hybrid_runtime.engine.table_rows import ROWS_SUFFIX, split_table_gathers

ROWS, WIDTH = 5000, 64  # 1.3 MB: over MIN_TABLE_BYTES


def _segment(folder: Path, *, ids_also_used: bool = False) -> Path:
    rng = np.random.default_rng(0)
    table = numpy_helper.from_array(rng.standard_normal((ROWS, WIDTH)).astype(np.float32), "embed_tokens")
    scale = numpy_helper.from_array(rng.standard_normal((WIDTH, 3 * WIDTH)).astype(np.float32), "w")
    nodes = [helper.make_node("Gather", ["embed_tokens", "input_ids"], ["x"]),
             helper.make_node("MatMul", ["x", "w"], ["y"])]
    outs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 3 * WIDTH])]
    if ids_also_used:
        nodes.append(helper.make_node("Cast", ["input_ids"], ["ids_f"], to=TensorProto.FLOAT))
        outs.append(helper.make_tensor_value_info("ids_f", TensorProto.FLOAT, ["n"]))
    graph = helper.make_graph(nodes, "seg", [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["n"])],
                              outs, [table, scale])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path = folder / "embed.onnx"
    onnx.save_model(model, path, save_as_external_data=True, all_tensors_to_one_file=True,
                    location="embed.onnx.data", size_threshold=0)
    return path


def _session(path: Path):
    split = split_table_gathers(path)
    assert split is not None
    model, lookups = split
    opts = session_options(0)
    opts.add_session_config_entry("session.model_external_initializers_file_folder_path", str(path.parent))
    return cpu_session(model, opts), lookups


@pytest.mark.parametrize("ids_also_used", [False, True])
def test_split_gather_reads_the_same_rows_as_the_graph(tmp_path: Path, ids_also_used: bool) -> None:
    path = _segment(tmp_path, ids_also_used=ids_also_used)
    ref = cpu_session(path, session_options(0))
    sess, lookups = _session(path)
    (lk,) = lookups
    assert lk.rows_input == "embed_tokens" + ROWS_SUFFIX and lk.keep_ids == ids_also_used
    assert ("input_ids" in {i.name for i in sess.get_inputs()}) == ids_also_used
    ids = np.array([0, ROWS - 1, 7, 7, 4242], np.int64)
    buf = lk.buffer(8)
    feeds = {lk.rows_input: lk.read(ids, buf)}
    if ids_also_used:
        feeds["input_ids"] = ids
    for got, want in zip(sess.run(None, feeds), ref.run(None, {"input_ids": ids})):
        assert np.array_equal(got, want)
    mapped = [line for line in Path("/proc/self/maps").read_text().splitlines() if str(tmp_path) in line]
    assert len(mapped) <= 1  # (the reference session's mapping of the table)
    with pytest.raises(ShapeError):
        lk.read(np.array([ROWS], np.int64), buf)
    with pytest.raises(ShapeError):
        lk.read(np.arange(9, dtype=np.int64), buf)


def test_small_or_inline_tables_stay_in_the_graph(tmp_path: Path) -> None:
    table = numpy_helper.from_array(np.ones((10, 4), np.float32), "embed_tokens")
    graph = helper.make_graph([helper.make_node("Gather", ["embed_tokens", "input_ids"], ["x"])], "seg",
                              [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["n"])],
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 4])], [table])
    onnx.save_model(helper.make_model(graph), tmp_path / "small.onnx")
    assert split_table_gathers(tmp_path / "small.onnx") is None
