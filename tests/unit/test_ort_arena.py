"""The shared onnxruntime CPU arena's extend strategy (issue 21): tensors that grow by one size after another must
not leave one arena region per size behind."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from hybrid_runtime.engine.ort_session import ARENA_NEXT_POWER_OF_TWO, ARENA_SAME_AS_REQUESTED, arena_extend_strategy

# A process of its own: the arena is registered once per process, by the first session_options() call.
SCRIPT = r"""
import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper
from hybrid_runtime.engine.ort_session import cpu_session, session_options

ort.set_default_logger_severity(1)  # the arena logs each extension at INFO
x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n"])
y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n"])
graph = helper.make_graph([helper.make_node("Relu", ["x"], ["t"]), helper.make_node("Neg", ["t"], ["y"])], "g", [x],
                          [y])
session = cpu_session(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), session_options(1))
for n in [1000] + [550_000 + 32_000 * i for i in range(8)]:  # a tensor one size larger per run, as a sequence grows
    session.run(None, {"x": np.ones(n, np.float32)})
"""


def _arena_mib(extend: str | None) -> float:
    env = {k: v for k, v in os.environ.items() if k != "HYBRID_LLM_ORT_ARENA_EXTEND"}
    if extend:
        env["HYBRID_LLM_ORT_ARENA_EXTEND"] = extend
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=120,
                         check=True)
    return sum(int(n) for n in re.findall(r"Extended allocation by (\d+) bytes", out.stderr)) / 2**20


def test_arena_strategy_defaults_to_next_power_of_two(monkeypatch) -> None:
    monkeypatch.delenv("HYBRID_LLM_ORT_ARENA_EXTEND", raising=False)
    assert arena_extend_strategy() == ARENA_NEXT_POWER_OF_TWO
    monkeypatch.setenv("HYBRID_LLM_ORT_ARENA_EXTEND", "same")
    assert arena_extend_strategy() == ARENA_SAME_AS_REQUESTED


def test_growing_tensors_do_not_pile_up_arena_regions() -> None:
    """Peak need ~6 MiB (two 3 MiB tensors): exact-size regions add up to ~40 MiB, doubling regions to <= 16."""
    doubling, exact = _arena_mib(None), _arena_mib("same")
    assert doubling <= 16.0, f"{doubling:.1f} MiB of arena regions"
    assert exact >= 30.0, f"{exact:.1f} MiB: the exact-size strategy no longer piles up regions (update this test)"
