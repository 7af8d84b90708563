"""Triton Python-backend adapter for the hybrid LLM serving engine (decoupled).

Thin on purpose: ``execute`` parses each request into a GenerationRequest, submits it to the
ServingEngine and returns at once. The engine thread turns each event into a reply and queues it; one
sender thread sends them through the requests' response_senders (in order), so the engine never waits
on Triton's IPC. Parsing and reply building live in ``deploy.triton_adapter``,
sending and cancellation polling in ``deploy.inflight`` (both unit-tested without a server), metrics
mirroring in ``deploy.triton_metrics``.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
from functools import partial

# The stub's interpreter ignores PYTHONPATH and sees only its own site-packages (measured on the GPU machine):
# put the launching interpreter's search path first (deploy.triton.server_env passes it), so the stub imports
# the same project and packages (a venv, PYTHONPATH directories) as the process that started the server.
for _entry in reversed([p for p in os.environ.get("HYBRID_LLM_SYS_PATH", "").split(os.pathsep) if p]):
    if _entry not in sys.path:
        sys.path.insert(0, _entry)

import triton_python_backend_utils as pb_utils  # noqa: E402

from deploy.heap_debug import HeapMonitor  # noqa: E402
from deploy.inflight import CancelWatcher, SendQueue, TerminationSignals  # noqa: E402
from deploy.triton_adapter import (  # noqa: E402
    LogprobsEncoder,
    Reply,
    ReplyBuilder,
    configure_logging,
    parse_parameters,
    parse_request,
    triton_error,
)
from deploy.triton_metrics import TritonMetrics  # noqa: E402
from hybrid_runtime.sampling import RequestValidationError  # noqa: E402
from hybrid_runtime.serving import Event, ServingEngine  # noqa: E402

log = logging.getLogger("deploy.model")

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
def _error(message: str, code: str) -> pb_utils.InferenceResponse:
    # The stub adds TritonError to pb_utils only after this module is imported: look the code up now.
    name, text = triton_error(message, code)
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(text, getattr(pb_utils.TritonError, name)))


def _send(sender, reply: Reply) -> None:
    if reply.error is not None:
        response = _error(reply.error, reply.error_code)
    else:
        response = pb_utils.InferenceResponse(
            output_tensors=[pb_utils.Tensor(name, value) for name, value in reply.outputs.items()])
    sender.send(response, flags=FINAL if reply.final else 0)


def _input(request: pb_utils.InferenceRequest, name: str):
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return None if tensor is None else tensor.as_numpy()


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        config = json.loads(args["model_config"])
        if not pb_utils.using_decoupled_model_transaction_policy(config):
            raise pb_utils.TritonModelException("hybrid_llm streams tokens: set model_transaction_policy "
                                                "{ decoupled: true } in config.pbtxt")
        self.params = parse_parameters(config, args["model_repository"])
        configure_logging(self.params.log_level, args["model_instance_name"])
        # Heap debugging (heap_debug_dir) starts first, so that everything the model allocates is traced.
        # On a CPU instance it also logs onnxruntime's arena extensions (into the server log; the soak adds them up).
        self.heap = None if self.params.heap_debug_dir is None else \
            HeapMonitor(self.params.heap_debug_dir, self.params.heap_snapshot_period_s,
                        onnxruntime_arena_log=args.get("model_instance_kind", "CPU") == "CPU").start()
        import numpy

        if int(numpy.__version__.split(".")[0]) >= 2:  # measured with nvidia-pytriton 0.7.0's stub: deploy/README.md
            log.warning("numpy %s in the Python-backend stub: with tritonserver 2.51's stub (nvidia-pytriton 0.7.0) "
                        "numpy 2.5 turned every BYTES input (text_input, sampling_parameters) into garbage and "
                        "aborted the stub; numpy 1.26 works. See deploy/README.md", numpy.__version__)
        # One engine (its own thread, caches and contexts) per model instance; see config.pbtxt for
        # one instance per GPU. A bad bundle or a max_batch_size above the bundle's raises here, and
        # Triton reports the message as the model's load failure.
        name, version = args["model_name"], args["model_version"]
        self.name = name
        options = self.params.runtime_options(args.get("model_instance_kind", "CPU"),
                                              int(args.get("model_instance_device_id", 0) or 0))
        self.engine = ServingEngine(self.params.engine_dir, options, on_fatal=self._on_fatal).start()
        self.logprobs = LogprobsEncoder(self.engine.tokenizer.token_bytes)
        # Diagnostics of the stub's threads (benchmarks/gpu_serve.py --variants), not deployment settings:
        # HYBRID_LLM_SWITCH_INTERVAL (sys.setswitchinterval), HYBRID_LLM_WATCH_PERIOD / HYBRID_LLM_METRICS_PERIOD
        # (seconds between the cancel watcher's / the metrics thread's rounds), HYBRID_LLM_SEND_GATE=0 (responses
        # sent without waiting for the engine's device wait).
        if os.environ.get("HYBRID_LLM_SWITCH_INTERVAL"):
            sys.setswitchinterval(float(os.environ["HYBRID_LLM_SWITCH_INTERVAL"]))
        # Shutdown with requests in flight (deploy/README.md): SIGTERM / SIGINT sent to this stub drains them
        # without asking Triton anything; model readiness is the fallback when only the server got the signal.
        self.signals = TerminationSignals()
        self.signals.install()
        self.watcher = CancelWatcher(lambda request: request.is_cancelled(), self.engine.cancel,
                                     period_s=float(os.environ.get("HYBRID_LLM_WATCH_PERIOD") or 0.05),
                                     model_ready=lambda: pb_utils.is_model_ready(name, version),
                                     terminated=self.signals.received).start()
        self.metrics = TritonMetrics(pb_utils, self.engine.stats, {"model": name, "version": version},
                                     period_s=float(os.environ.get("HYBRID_LLM_METRICS_PERIOD") or 0.5),
                                     heap=None if self.heap is None else self.heap.stats).start()
        # A send that fails means the client is gone: cancel the request (its slot and pages are freed).
        # (the sender builds responses while the engine waits on its GPU: SendQueue's gate)
        gate = None if os.environ.get("HYBRID_LLM_SEND_GATE") == "0" else self.engine.device_wait
        self.sends = SendQueue(lambda request_id, _exc: self.engine.cancel(request_id), gate=gate).start()
        lim = self.engine.manifest.limits
        log.info("serving %s: max_batch_size %d (bundle %d), max_input_len %d, max_seq_len %d, %s, %s",
                 self.params.engine_dir, self.engine.max_batch_size, lim.max_batch_size, lim.max_input_len,
                 lim.max_seq_len, self.params.profile_pinning, f"multi_block_mode={self.params.multi_block_mode}")

    def execute(self, requests: list) -> None:
        for request in requests:
            self._submit(request)
        return None  # decoupled: responses go through each request's response_sender

    def _submit(self, request: pb_utils.InferenceRequest) -> None:
        sender = request.get_response_sender()
        request_id = self.engine.new_request_id()
        try:
            parsed = parse_request(partial(_input, request), self.params.default_max_tokens)
            prompt_text = ""
            if parsed.prepend_prompt:
                prompt_text = parsed.prompt if parsed.prompt is not None else \
                    self.engine.tokenizer.decode(parsed.prompt_ids or ())
            builder = ReplyBuilder(parsed, prompt_text, self.metrics.observe, self.logprobs)
            self.watcher.add(request_id, request)  # before submit: the final event may come at once
            self.engine.submit(parsed.generation_request(request_id), partial(self._on_event, sender, builder))
            self.watcher.arm(request_id)
        except RequestValidationError as e:
            self.watcher.remove(request_id)
            self.metrics.count_rejected(e.code)
            sender.send(_error(str(e), e.code), flags=FINAL)
        except Exception as e:  # a bug: still give this request its one final response
            log.exception("request %s failed before submission", request_id)
            self.watcher.remove(request_id)
            sender.send(_error(f"{type(e).__name__}: {e}", "internal"), flags=FINAL)

    def _on_event(self, sender, builder: ReplyBuilder, ev: Event) -> None:
        """Runs on the engine thread: build the reply and queue it for the sender thread."""
        reply = builder.on_event(ev)
        if ev.final:  # unwatch before the final send: Triton frees the request's response factory then
            self.watcher.remove(ev.request_id)
            self.metrics.poke()
        if reply is not None:
            self.sends.put(ev.request_id, partial(_send, sender, reply))

    def _on_fatal(self, error: BaseException) -> None:
        """The engine stopped for good (its GPU context is lost, or its thread died); every request in
        flight has had its error response. Unload this model so that readiness probes see it (the server
        and its other models stay up); an operator or orchestrator restarts it. Runs on the engine thread:
        the unload request goes from a thread of its own (Triton calls finalize while it unloads)."""
        log.critical("model instance unusable (%s: %s): unloading model %r so that it reports not ready; "
                     "restart the server or POST /v2/repository/models/%s/load to load it again",
                     type(error).__name__, error, self.name, self.name)

        def unload() -> None:
            try:
                pb_utils.unload_model(self.name)
            except Exception as e:  # e.g. --model-control-mode=none: the model cannot unload itself
                log.error("could not unload model %r (%s): it stays READY but refuses every request; run "
                          "tritonserver with --model-control-mode=explicit (see deploy/README.md)", self.name, e)

        threading.Thread(target=unload, name="hybrid-unload", daemon=True).start()

    def finalize(self) -> None:
        # Every in-flight request gets its final "cancelled" response; then the queue is drained.
        log.info("finalize: %d request(s) in flight", len(self.watcher))
        self.engine.shutdown()
        self.sends.close()
        self.watcher.stop()
        self.metrics.stop()
        if self.heap is not None:
            self.heap.stop()
        self.signals.uninstall()
        log.info("finalize: done")
