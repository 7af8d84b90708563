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
from functools import partial

import triton_python_backend_utils as pb_utils

from deploy.heap_debug import HeapMonitor
from deploy.inflight import CancelWatcher, SendQueue
from deploy.triton_adapter import (
    LogprobsEncoder,
    Reply,
    ReplyBuilder,
    configure_logging,
    parse_parameters,
    parse_request,
    triton_error,
)
from deploy.triton_metrics import TritonMetrics
from hybrid_runtime.sampling import RequestValidationError
from hybrid_runtime.serving import Event, ServingEngine

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
        self.heap = None if self.params.heap_debug_dir is None else \
            HeapMonitor(self.params.heap_debug_dir, self.params.heap_snapshot_period_s).start()
        # One engine (its own thread, caches and contexts) per model instance; see config.pbtxt for
        # one instance per GPU. A bad bundle or a max_batch_size above the bundle's raises here, and
        # Triton reports the message as the model's load failure.
        self.engine = ServingEngine(self.params.engine_dir, self.params.runtime_options()).start()
        self.logprobs = LogprobsEncoder(self.engine.tokenizer.token_bytes)
        name, version = args["model_name"], args["model_version"]
        self.watcher = CancelWatcher(lambda request: request.is_cancelled(), self.engine.cancel,
                                     model_ready=lambda: pb_utils.is_model_ready(name, version)).start()
        self.metrics = TritonMetrics(pb_utils, self.engine.stats, {"model": name, "version": version},
                                     heap=None if self.heap is None else self.heap.stats).start()
        # A send that fails means the client is gone: cancel the request (its slot and pages are freed).
        self.sends = SendQueue(lambda request_id, _exc: self.engine.cancel(request_id)).start()
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

    def finalize(self) -> None:
        # Every in-flight request gets its final "cancelled" response; then the queue is drained.
        log.info("finalize: %d request(s) in flight", len(self.watcher))
        self.engine.shutdown()
        self.sends.close()
        self.watcher.stop()
        self.metrics.stop()
        if self.heap is not None:
            self.heap.stop()
        log.info("finalize: done")
