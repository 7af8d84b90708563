"""A GPTQ int4 checkpoint served on the GPU by a live tritonserver: issue 20's deployment (a quantized hybrid MoE
model behind Triton) on the ``cuda`` backend. The bf16 ``cuda`` bundle of a Qwen3.5-MoE GPTQ checkpoint (the tests'
own round-to-nearest packer; experts kept packed, the default of GPTQ cuda bundles: the int4 decode MoE and the
packed grouped GEMMs read them) in a KIND_GPU instance:

* two greedy streams submitted together give, token for token, what the same bundle gives in an offline
  ServingEngine on the GPU, one request at a time (the same kernels; the decode step is batch-invariant, so
  sharing steps changes no token);
* a request with an out-of-vocabulary id, sent while a stream runs, gets its own error and the stream finishes;
* the instance is a GPU one (the server's log), and the server exits with code 0.

Needs the nvidia-pytriton 0.7.0 wheel (tritonserver 2.51 and its Python backend; its stub needs numpy < 2, see
benchmarks/results/gpu_serve_h200.md) and tritonclient with its gRPC client (python-rapidjson too) beside the GPU;
skipped cleanly without them. Passed on an H100 (2026-12-05, 21 s).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

NEW_TOKENS = 24


def _server_or_skip() -> None:
    from deploy.triton import TritonError, find_triton

    try:
        find_triton()
    except TritonError as e:
        pytest.skip(f"no tritonserver: {e}")
    try:
        import tritonclient.grpc  # noqa: F401 - raises RuntimeError (not ImportError) when grpc support is missing
    except (ImportError, RuntimeError) as e:
        pytest.skip(f"tritonclient's gRPC client unavailable: {e}")


def test_gptq_int4_cuda_bundle_served_on_the_gpu(tmp_path: Path) -> None:
    _server_or_skip()
    import tests.gptq_cases as gc
    from client.lib import ClientError, generate_stream_grpc
    from deploy.triton import TritonServer
    from hybrid_runtime.config import Manifest
    from hybrid_runtime.sampling import SamplingParams
    from hybrid_runtime.serving import GenerationRequest, RuntimeOptions, ServingEngine, generate

    bundle = gc.packed_experts_bundle(tmp_path, dtype="bfloat16", bits=4)
    m = Manifest.load(bundle)
    assert m.backend == "cuda" and m.quantization is not None and m.quantization.modules
    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, m.model.vocab_size, n).tolist() for n in (19, 7)]
    greedy = {"temperature": 0, "ignore_eos": True}

    engine = ServingEngine(bundle, RuntimeOptions()).start()
    try:
        assert engine.runner.device.startswith("cuda")
        want = [list(generate(engine, [GenerationRequest(f"r{i}", prompt_ids=tuple(p), params=SamplingParams(
            max_tokens=NEW_TOKENS, ignore_eos=True))])[0].output_ids) for i, p in enumerate(prompts)]
    finally:
        engine.shutdown()
    assert all(len(w) == NEW_TOKENS for w in want)

    log = tmp_path / "tritonserver.log"
    server = TritonServer(parameters={"engine_dir": str(bundle)}, instance_kind="gpu", exit_timeout_s=10,
                          log_path=log)
    server.start()
    try:
        server.wait("ready", timeout=300)
        gens = [generate_stream_grpc(server.grpc_url, input_ids=p, max_tokens=NEW_TOKENS, sampling=greedy,
                                     timeout=120) for p in prompts]
        next(iter(gens[0]))  # the first stream is running
        with pytest.raises(ClientError):
            generate_stream_grpc(server.grpc_url, input_ids=[m.model.vocab_size + 5], max_tokens=4,
                                 timeout=60).wait()
        got = [g.wait() for g in gens]
        for i, (r, w) in enumerate(zip(got, want)):
            assert r.finish_reason == "length", (i, r.finish_reason)
            assert list(r.output_ids) == w, (i, list(r.output_ids), w)
    finally:
        code = server.stop(timeout=60)
        tail = server.log_tail(40)
        text = log.read_text(errors="replace") if log.exists() else ""
        server.cleanup()
    assert code == 0, tail
    assert "GPU device" in text, "the instance was not a KIND_GPU one"
