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


# A served burst after the engine's warm-up (a process of its own: the logger severity and the arena are global).
# Its prefill steps pack long prompts' last chunks with other prompts' first tokens: the shape that made the
# shared arena extend 14 minutes into a 2-hour soak when the warm-up had no such step.
BURST = r"""
import sys
import numpy as np
import onnxruntime
onnxruntime.set_default_logger_severity(1)
from hybrid_runtime.sampling import SamplingParams
from hybrid_runtime.serving import GenerationRequest, RuntimeOptions, ServingEngine, generate

eng = ServingEngine(sys.argv[1], RuntimeOptions(intra_op_threads=1))
if sys.argv[2] == "without-packed-step":
    steps = eng.warmup_long_steps
    eng.warmup_long_steps = lambda: [s for s in steps() if not (s[0].name == "PREFILL" and len(s[1]) == 2)]
eng.start()
print("=== warm-up done", file=sys.stderr, flush=True)
rng = np.random.default_rng(0)
lens, news = [18, 448, 26, 20, 1021, 700, 64, 1024, 3, 900], [8, 4, 16, 2, 1, 32, 8, 2, 64, 4]
reqs = [GenerationRequest(f"r{i}", prompt_ids=tuple(int(t) for t in rng.integers(3, 2000, n)),
                          params=SamplingParams(max_tokens=m, ignore_eos=True))
        for i, (n, m) in enumerate(zip(lens, news))]
for r in range(3):
    generate(eng, reqs[r:] + reqs[:r])
eng.shutdown()
"""


def _extensions_after_warmup(bundle: object, mode: str) -> list[str]:
    out = subprocess.run([sys.executable, "-c", BURST, str(bundle), mode], capture_output=True, text=True, timeout=300,
                         check=True)
    after = out.stderr.split("=== warm-up done", 1)
    assert len(after) == 2, out.stderr[-2000:]
    return re.findall(r"Extending BFCArena.*rounded_bytes:(\d+)", after[1])


def test_warmup_sizes_the_arena_for_served_load(default_checkpoint, tmp_path) -> None:
    """After ServingEngine's warm-up a burst of mixed long and short prompts extends onnxruntime's arena no more (the
    RSS at load is the RSS under load); without the warm-up's packed prefill step the same burst extends it. The
    bundle has `make build`'s limits (max_input_len 1024, max_seq_len 2048: contexts long enough for attention's
    blocks to reach their cap), as the soak serves."""
    from builder.bundle import BuildOptions, build_bundle

    bundle = tmp_path / "default"
    build_bundle(default_checkpoint, bundle, BuildOptions(), progress=lambda _m: None)
    assert _extensions_after_warmup(bundle, "full") == []
    assert _extensions_after_warmup(bundle, "without-packed-step"), "the burst no longer needs the step"
