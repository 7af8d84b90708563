"""Serving on a device: the memory budget (gpu_memory_fraction), the device parameters of a model instance,
and what the engine does when its device is lost (sticky CUDA error) or a launch fails (non-sticky).

Host logic only: the faults come from the host backend's test-only hook, which simulates them (a test
double at the device boundary; the real sticky fault is made on the GPU in tests/gpu/)."""

from __future__ import annotations

from pathlib import Path

import pytest

from deploy.triton import write_model_repository
from deploy.triton_adapter import ParameterError, instance_device, parse_parameters
from hybrid_runtime.backend import DeviceLost
from hybrid_runtime.config import ConfigError
from hybrid_runtime.cuda.driver import CudaError, is_sticky
from hybrid_runtime.cuda.memory import GIB, plan_memory
from hybrid_runtime.sampling import RequestValidationError, SamplingParams
from hybrid_runtime.serving import FAULT_ENV, GenerationRequest, RuntimeOptions, ServingEngine
from tests.serving_cases import Collect

MiB = 1 << 20


# ---- the memory budget ------------------------------------------------------------------------------

def test_the_pool_is_the_bundles_when_it_fits() -> None:
    p = plan_memory(80 * GIB, 140 * GIB, fraction=0.9, state_bytes=2 * GIB, page_bytes=MiB, pages_wanted=1000,
                    min_pages=10, reserve_bytes=512 * MiB)
    assert p.pages == 1000 and not p.capped
    assert p.budget_bytes == int(80 * GIB * 0.9) - 512 * MiB
    assert "1000 pages" in p.describe()


def test_a_pool_larger_than_the_budget_is_capped_to_it() -> None:
    p = plan_memory(10 * GIB, 140 * GIB, fraction=0.5, state_bytes=1 * GIB, page_bytes=MiB, pages_wanted=10**6,
                    min_pages=10, reserve_bytes=512 * MiB)
    assert p.capped
    assert p.pages == (5 * GIB - 512 * MiB - 1 * GIB) // MiB
    assert p.pages * MiB + p.state_bytes <= p.budget_bytes < (p.pages + 1) * MiB + p.state_bytes
    assert "capped" in p.describe()


def test_state_slots_that_do_not_fit_fail_with_what_to_change() -> None:
    with pytest.raises(ConfigError, match="lower max_batch_size, raise gpu_memory_fraction"):
        plan_memory(4 * GIB, 140 * GIB, fraction=0.9, state_bytes=8 * GIB, page_bytes=MiB, pages_wanted=10,
                    min_pages=1)


def test_a_pool_too_small_for_one_sequence_fails_with_what_to_change() -> None:
    with pytest.raises(ConfigError, match=r"one sequence of max_seq_len needs 2049.*--max-seq-len"):
        plan_memory(2 * GIB, 140 * GIB, fraction=0.9, state_bytes=0, page_bytes=MiB, pages_wanted=4096,
                    min_pages=2049, reserve_bytes=512 * MiB)


@pytest.mark.parametrize("fraction", [0.0, -0.1, 1.5])
def test_fraction_outside_0_1_is_refused(fraction: float) -> None:
    with pytest.raises(ConfigError, match="gpu_memory_fraction"):
        plan_memory(GIB, GIB, fraction=fraction, state_bytes=0, page_bytes=1, pages_wanted=1, min_pages=0)


def test_runtime_options_refuse_a_bad_fraction() -> None:
    with pytest.raises(ConfigError, match="gpu_memory_fraction"):
        RuntimeOptions(gpu_memory_fraction=1.2)


# ---- the device of a model instance -------------------------------------------------------------------

def _params(tmp_path: Path, **values: str):
    return parse_parameters({"parameters": {"engine_dir": {"string_value": str(tmp_path)},
                                            **{k: {"string_value": v} for k, v in values.items()}}}, tmp_path)


def test_device_and_fraction_parameters(tmp_path: Path) -> None:
    p = _params(tmp_path, device="cuda:1", gpu_memory_fraction="0.75")
    assert (p.device, p.gpu_memory_fraction) == ("cuda:1", 0.75)
    opts = p.runtime_options("CPU", 0)
    assert (opts.device, opts.gpu_memory_fraction) == ("cuda:1", 0.75)
    defaults = _params(tmp_path)
    assert (defaults.device, defaults.gpu_memory_fraction) == ("auto", 0.9)


@pytest.mark.parametrize(("key", "value"), [("device", "gpu"), ("device", "cpu:1"), ("gpu_memory_fraction", "2"),
                                            ("gpu_memory_fraction", "most")])
def test_bad_device_parameters_fail_the_load(tmp_path: Path, key: str, value: str) -> None:
    with pytest.raises(ParameterError, match=key):
        _params(tmp_path, **{key: value})


@pytest.mark.parametrize(("device", "kind", "dev_id", "want"), [
    ("auto", "GPU", 3, "cuda:3"),  # a KIND_GPU instance runs on its own GPU
    ("cuda", "GPU", 1, "cuda:1"),
    ("cuda:0", "GPU", 1, "cuda:0"),  # an explicit ordinal is kept
    ("cpu", "GPU", 1, "cpu"),
    ("auto", "CPU", 0, "auto"),  # left to the runtime: a cuda bundle on GPU 0, else the CPU
    ("cuda:2", "CPU", 0, "cuda:2"),  # KIND_CPU instances placed by hand
])
def test_instance_device(device: str, kind: str, dev_id: int, want: str) -> None:
    assert instance_device(device, kind, dev_id) == want


def test_gpu_instance_group_in_the_repository_copy(tmp_path: Path) -> None:
    repo = write_model_repository(tmp_path / "repo", {"device": "auto"}, instance_kind="gpu")
    text = (repo / "hybrid_llm" / "config.pbtxt").read_text()
    assert "KIND_GPU" in text and "KIND_CPU" not in text
    with pytest.raises(ValueError, match="cpu or gpu"):
        write_model_repository(tmp_path / "repo2", {}, instance_kind="tpu")


# ---- sticky errors ------------------------------------------------------------------------------------

def test_sticky_codes_are_found_through_the_exception_chain() -> None:
    assert is_sticky(CudaError("cuStreamSynchronize", 700, "CUDA_ERROR_ILLEGAL_ADDRESS"))
    assert not is_sticky(CudaError("cuLaunchKernelEx", 1, "CUDA_ERROR_INVALID_VALUE"))
    try:
        try:
            raise CudaError("cuStreamSynchronize", 719, "CUDA_ERROR_LAUNCH_FAILED")
        except CudaError as e:
            raise RuntimeError("step failed") from e
    except RuntimeError as wrapped:
        assert is_sticky(wrapped)
    assert not is_sticky(ValueError("not a CUDA error"))


def _submit(eng: ServingEngine, sink: Collect, n: int, max_tokens: int) -> None:
    for i in range(n):
        eng.submit(GenerationRequest(f"r{i}", prompt_ids=tuple(range(3, 12 + i)),
                                     params=SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0)),
                   sink)


def test_a_lost_device_fails_every_request_and_stops_the_engine(default_bundle: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(FAULT_ENV, "sticky@6")  # 4 prefill steps at most, then decode steps of all 4
    fatal: list[BaseException] = []
    eng = ServingEngine(default_bundle, RuntimeOptions(), on_fatal=fatal.append)
    sink = Collect(4)
    _submit(eng, sink, 4, max_tokens=40)  # queued before the thread starts: all in flight at the fault
    eng.start()
    assert sink.done.wait(60), "a request never had its final event"
    eng._thread.join(10)  # type: ignore[union-attr]
    assert not eng._thread.is_alive()  # type: ignore[union-attr]
    for ev in sink.finals.values():
        assert ev.finish_reason == "error" and "device failure" in (ev.error or ""), ev
        assert "restarted" in (ev.error or "")
    assert len(fatal) == 1 and isinstance(fatal[0], DeviceLost)
    assert isinstance(eng.fatal, DeviceLost)
    assert eng.scheduler.running == [] and eng.scheduler.slots.num_free == eng.manifest.limits.num_state_slots
    with pytest.raises(RequestValidationError, match="device failure") as e:
        eng.submit(GenerationRequest("late", prompt_ids=(3, 4, 5), params=SamplingParams(max_tokens=2)), sink)
    assert e.value.code == "unavailable"
    eng.shutdown()


def test_a_failed_launch_fails_only_that_step(default_bundle: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(FAULT_ENV, "launch@6")
    fatal: list[BaseException] = []
    eng = ServingEngine(default_bundle, RuntimeOptions(), on_fatal=fatal.append)
    sink = Collect(4)
    _submit(eng, sink, 4, max_tokens=40)
    eng.start()
    try:
        assert sink.done.wait(60)
        reasons = sorted((ev.finish_reason or "") for ev in sink.finals.values())
        assert "error" in reasons
        errors = [ev.error for ev in sink.finals.values() if ev.finish_reason == "error"]
        assert all("injected launch failure" in (e or "") for e in errors)
        assert fatal == [] and eng.fatal is None
        again = Collect(1)
        eng.submit(GenerationRequest("after", prompt_ids=(3, 4, 5), params=SamplingParams(max_tokens=3)), again)
        assert again.done.wait(30) and again.finals["after"].finish_reason == "length"
    finally:
        eng.shutdown()


def test_a_malformed_fault_spec_is_refused(default_bundle: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(FAULT_ENV, "explode@x")
    with pytest.raises(ConfigError, match=FAULT_ENV):
        ServingEngine(default_bundle, RuntimeOptions())


# ---- dummy-weight bundles (benchmarks and load tests of a shape without its checkpoint) ---------------

def test_a_dummy_weight_cuda_bundle_has_no_weights(default_checkpoint: Path, tmp_path: Path) -> None:
    from builder.bundle import BuildOptions, build_bundle, verify_checksums
    from hybrid_runtime.config import DUMMY_WEIGHTS, Manifest

    out = tmp_path / "dummy"
    build_bundle(default_checkpoint, out, BuildOptions(backend="cuda", dummy_weights=True), progress=lambda _m: None)
    m = Manifest.load(out)
    assert m.backend == "cuda" and m.state_weights == DUMMY_WEIGHTS and m.toolkit["weights"] == "dummy"
    assert not list(out.glob("*.safetensors"))
    assert (out / "tokenizer.json").is_file() and verify_checksums(out, m) == []
    with pytest.raises(ConfigError, match="--backend cuda only"):
        build_bundle(default_checkpoint, tmp_path / "x", BuildOptions(dummy_weights=True), progress=lambda _m: None)
