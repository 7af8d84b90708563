"""Decoupled echo for memory experiments on Triton itself (no project code).

Streams ``max_tokens`` responses, one every ``token_ms``, one character of the prompt each, the last with
the FINAL flag; polls ``is_cancelled()`` between responses and ends a cancelled request with a flags-only
FINAL. One worker thread sends every request's responses (``execute`` returns at once), as a real decoupled
LLM model does. An empty prompt or ``max_tokens <= 0`` is answered with an error response. Parameters
(config.pbtxt): ``token_ms``; ``zero_byte_outputs`` (finish_reason is a zero-element tensor until the final
response); ``metrics_per_token`` (three custom-metric calls per response); ``cancelled_final_with_data`` (a
cancelled request ends with a final response that has outputs); ``hold_requests`` (each request object is
kept until its final response and the request's ``is_cancelled()`` is polled, as hybrid_llm's CancelWatcher
does).
"""

import collections
import json
import os
import sys
import threading
import time

for _entry in reversed([p for p in os.environ.get("HYBRID_LLM_SYS_PATH", "").split(os.pathsep) if p]):
    if _entry not in sys.path:  # numpy from the launching interpreter's environment (deploy.triton.server_env)
        sys.path.insert(0, _entry)

import numpy as np  # noqa: E402
import triton_python_backend_utils as pb_utils  # noqa: E402

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


class TritonPythonModel:
    def initialize(self, args):
        params = {k: v["string_value"] for k, v in json.loads(args["model_config"]).get("parameters", {}).items()}
        self.token_s = float(params.get("token_ms", "20")) / 1000.0
        self.zero_byte = params.get("zero_byte_outputs", "false").lower() == "true"
        self.cancel_with_data = params.get("cancelled_final_with_data", "false").lower() == "true"
        self.hold_requests = params.get("hold_requests", "false").lower() == "true"
        self.metrics = None
        if params.get("metrics_per_token", "false").lower() == "true":
            fams = (pb_utils.MetricFamily(name="echo_itl_seconds", description="itl",
                                          kind=pb_utils.MetricFamily.HISTOGRAM),
                    pb_utils.MetricFamily(name="echo_tokens_total", description="tokens",
                                          kind=pb_utils.MetricFamily.COUNTER),
                    pb_utils.MetricFamily(name="echo_live", description="live", kind=pb_utils.MetricFamily.GAUGE))
            self.metrics = (fams, fams[0].Metric(labels={"model": "echo"}, buckets=[0.001, 0.01, 0.1, 1.0]),
                            fams[1].Metric(labels={"model": "echo"}), fams[2].Metric(labels={"model": "echo"}))
        self.live = collections.deque()  # [sender, text, n, sent, request or None]
        self.cv = threading.Condition()
        self.stop = False
        self.worker = threading.Thread(target=self._loop, daemon=True)
        self.worker.start()

    def _response(self, text, tid, reason):
        reasons = [reason.encode()] if reason else ([] if self.zero_byte else [b""])
        return pb_utils.InferenceResponse(output_tensors=[
            pb_utils.Tensor("text_output", np.array([text.encode()], dtype=np.object_)),
            pb_utils.Tensor("output_ids", np.array([tid], dtype=np.int32)),
            pb_utils.Tensor("finish_reason", np.array(reasons, dtype=np.object_))])

    def execute(self, requests):
        for req in requests:
            sender = req.get_response_sender()
            try:
                text = pb_utils.get_input_tensor_by_name(req, "text_input").as_numpy().reshape(-1)[0].decode()
                mt = pb_utils.get_input_tensor_by_name(req, "max_tokens")
                n = int(mt.as_numpy().reshape(-1)[0]) if mt is not None else 8
                if not text or n <= 0:
                    raise ValueError("empty prompt or max_tokens <= 0")
            except Exception as e:
                sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(f"invalid request: {e}")),
                            flags=FINAL)
                continue
            with self.cv:
                self.live.append([sender, text, n, 0, req if self.hold_requests else None])
                self.cv.notify()
        return None

    def _loop(self):
        while True:
            with self.cv:
                while not self.live and not self.stop:
                    self.cv.wait()
                if self.stop:
                    return
                batch = list(self.live)
            for item in batch:
                sender, text, n, sent, request = item
                if (request or sender).is_cancelled():
                    if self.cancel_with_data:
                        sender.send(self._response("", sent, "cancelled"), flags=FINAL)
                    else:
                        sender.send(flags=FINAL)
                    done = True
                else:
                    last = sent + 1 >= n
                    sender.send(self._response(text[sent % len(text)], sent, "length" if last else None),
                                flags=FINAL if last else 0)
                    item[3] = sent + 1
                    done = last
                    if self.metrics is not None:
                        self.metrics[1].observe(self.token_s)
                        self.metrics[2].increment(1)
                        self.metrics[3].set(len(batch))
                if done:
                    with self.cv:
                        self.live.remove(item)
            time.sleep(self.token_s)

    def finalize(self):
        with self.cv:
            self.stop = True
            self.cv.notify()
        self.worker.join(5)
