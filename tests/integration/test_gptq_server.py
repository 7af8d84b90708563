"""A GPTQ int4 bundle served by a live tritonserver (what ``make serve ENGINE=...`` runs): one greedy request
gives the tokens of the float model of the dequantised weights run offline."""

from __future__ import annotations

from pathlib import Path

import pytest

from builder.bundle import BuildOptions, build_bundle
from client.lib import generate_stream_grpc
from deploy.triton import TritonServer
from hybrid_runtime.config import Manifest
from hybrid_runtime.sampling import SamplingParams
from hybrid_runtime.serving import GenerationRequest, RuntimeOptions, ServingEngine, generate
from tests.gptq_pack import write_gptq_checkpoint

pytestmark = pytest.mark.integration

PROMPT = "The quick brown fox jumps over the lazy dog."


def test_gptq_bundle_served_equals_float_model_offline(default_checkpoint: Path, tmp_path: Path) -> None:
    write_gptq_checkpoint(default_checkpoint, tmp_path / "gptq", tmp_path / "dequant", bits=4, group_size=32,
                          sym=False, desc_act=True, fmt="gptq")
    opts = BuildOptions(max_batch_size=4, max_input_len=128, max_seq_len=256)
    build_bundle(tmp_path / "gptq", tmp_path / "bq", opts, progress=lambda _m: None)
    build_bundle(tmp_path / "dequant", tmp_path / "bf", opts, progress=lambda _m: None)
    assert Manifest.load(tmp_path / "bq").quantization.modules
    engine = ServingEngine(tmp_path / "bf", RuntimeOptions()).start()
    try:
        (want,) = generate(engine, [GenerationRequest("f", prompt=PROMPT,
                                                      params=SamplingParams(max_tokens=16, ignore_eos=True))])
    finally:
        engine.shutdown()
    server = TritonServer(parameters={"engine_dir": str(tmp_path / "bq")}, exit_timeout_s=3,
                          log_path=tmp_path / "tritonserver.log")
    server.start()
    try:
        server.wait("ready", timeout=120)
        gen = generate_stream_grpc(server.grpc_url, PROMPT, timeout=60, max_tokens=16,
                                   sampling={"temperature": 0, "ignore_eos": True})
        list(gen)
        assert gen.result.finish_reason == "length"
        assert gen.result.output_ids == list(want.output_ids)
    finally:
        code = server.stop()
        tail = server.log_tail(30)
        server.cleanup()
    assert code == 0, tail
