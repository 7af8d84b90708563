"""The serving loop: one engine thread per model instance owns every context, cache and buffer.

Callers (Triton's ``execute``, the offline CLI, tests) use the thread-safe :meth:`ServingEngine.submit`
and :meth:`ServingEngine.cancel`; both only validate and enqueue (invariant 1). Each request's events are
delivered by calling its ``sink`` from the engine thread: zero or more token events, then exactly one
final event — finished with a reason, an error, or cancelled (invariant 7). A sink that raises is taken
as a client that went away: the request is cancelled and its slot and pages are freed.
"""

from __future__ import annotations

import itertools
import logging
import os
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from threadpoolctl import threadpool_limits

from .backend import FAULT_KINDS, DeviceLost, SampleRow
from .config import BundleError, ConfigError, Manifest
from .engine.base import PINNING_MODES, Phase
from .host_memory import HeapTrimmer
from .kv_cache import KVLayout
from .metrics import Metrics
from .ops.base import SeqStep, parse_device
from .runner import PACKED_WEIGHTS, InFlight, ModelRunner
from .sampler import TokenLogprobs, make_rng
from .sampling import RequestValidationError, SamplingParams
from .scheduler import Batch, Scheduler, Sequence
from .tokenizer import IncrementalDetokenizer, StopStringMatcher, Tokenizer

log = logging.getLogger("hybrid_runtime.serving")

# Test-only: "KIND@N" makes the engine's step number N (from 0, prefill and decode steps alike) fail with a
# backend fault of KIND (backend.FAULT_KINDS: "sticky" loses the device, "launch" fails that step only).
FAULT_ENV = "HYBRID_LLM_INJECT_FAULT"


def _fault_from_env() -> tuple[str, int] | None:
    text = os.environ.get(FAULT_ENV, "").strip()
    if not text:
        return None
    kind, _, at = text.partition("@")
    if kind not in FAULT_KINDS or not at.isdigit():
        raise ConfigError(f"{FAULT_ENV}={text!r}: expected KIND@STEP with KIND one of {FAULT_KINDS}, e.g. sticky@20")
    return kind, int(at)

MULTI_BLOCK_MODES = ("auto", "on", "off")
# Async scheduling: while a decode step runs on the device, the engine thread prepares the next one (same
# sequences, token ids patched in once the step's are known) and, once it is launched, handles the finished
# step's tokens (detokenisation, stop strings, events) while the device runs it. "auto" = on where the backend
# can prepare a step ahead (cuda bundles), off elsewhere; "on" also runs the lookahead's bookkeeping on a host
# backend (no overlap there: tests); "off" = one step at a time.
ASYNC_SCHEDULING_MODES = ("auto", "on", "off")


@dataclass(frozen=True, slots=True)
class RuntimeOptions:
    """Deployment options (the model parameters of config.pbtxt map onto these)."""

    max_batch_size: int = 0  # 0 = the bundle's
    multi_block_mode: str = "auto"
    profile_pinning: str = "per_context"
    default_max_tokens: int = 16
    kv_cache_bytes: int = 0  # 0 = the bundle's page count
    intra_op_threads: int = 0  # 0 = onnxruntime's default (all cores)
    seed: int = 0  # seeds the generators of unseeded sampled requests
    # BLAS threads for the numpy operators. 1 by default: decode-sized matmuls are microseconds of work,
    # and handing them to a BLAS thread pool costs more than it saves (measured 20x slower on 2 cores).
    numpy_threads: int = 1
    # Where the work runs: "auto" (a cuda or tensorrt bundle on the GPU, an onnxruntime bundle's stateful operators
    # on the CPU) | "cpu" (numpy operators; a tensorrt bundle then takes the host path: segment outputs copied to
    # the host) | "cuda" | "cuda:N" (the GPU; for an onnxruntime bundle: its operators; a tensorrt bundle runs
    # device-resident, cuda/trt_backend.py).
    device: str = "auto"
    # cuda bundles: the share of the GPU memory left free after the weights and static buffers that the
    # state slots and KV pages may take (the KV pool is the bundle's, capped to fit; see cuda/memory.py).
    # 0 = no budget: the bundle's page count exactly.
    gpu_memory_fraction: float = 0.9
    # Seconds between the engine thread's glibc malloc_trim(0) calls (host_memory.HeapTrimmer): freed memory that
    # glibc keeps in its arenas (the working set of the longest request so far) goes back to the system instead of
    # staying resident for the process's life. 0 = never. ~11 ms per trim on the 2-core CI machine under a soak.
    heap_trim_interval_s: float = 60.0
    # Run synthetic requests at start() before serving: one prompt of the largest prefill and a full batch of
    # shorter ones, each decoding two tokens. The allocators (onnxruntime's arenas, glibc's heaps, CUDA graphs
    # of a cuda bundle) then reach their working size at load, not an hour into serving, so the process's memory
    # is flat from the first request (the 2-hour soak's arena doubling after warm-up). Metrics start at zero after.
    warmup: bool = True
    # GPTQ cuda bundles: which packed weights stay packed on the GPU (runner.PACKED_WEIGHTS: auto | off | linears |
    # experts | all | dual); "off" dequantises them at load; "auto" = "dual" for a GPTQ cuda bundle (prefill as
    # "off", decode steps of <= 16 rows on the packed projections), else "off". Measured (35B-A3B, int4):
    # benchmarks/results/gpu_decode_step_quant_h200.md.
    packed_weights: str = "auto"
    # ASYNC_SCHEDULING_MODES: prepare the next decode step while this one runs on the device (cuda bundles).
    async_scheduling: str = "auto"

    def __post_init__(self) -> None:
        if self.device != "auto":
            parse_device(self.device)  # ConfigError unless auto | cpu | cuda | cuda:N
        if self.multi_block_mode not in MULTI_BLOCK_MODES:
            raise ConfigError(f"multi_block_mode={self.multi_block_mode!r}: choose one of "
                              f"{', '.join(MULTI_BLOCK_MODES)}")
        if self.profile_pinning not in PINNING_MODES:
            raise ConfigError(f"profile_pinning={self.profile_pinning!r}: choose one of {', '.join(PINNING_MODES)}")
        if self.packed_weights not in PACKED_WEIGHTS:
            raise ConfigError(f"packed_weights={self.packed_weights!r}: choose one of {', '.join(PACKED_WEIGHTS)}")
        if self.async_scheduling not in ASYNC_SCHEDULING_MODES:
            raise ConfigError(f"async_scheduling={self.async_scheduling!r}: choose one of "
                              f"{', '.join(ASYNC_SCHEDULING_MODES)}")
        if not 0.0 <= self.gpu_memory_fraction <= 1.0:
            raise ConfigError(f"gpu_memory_fraction={self.gpu_memory_fraction}: give a number in [0, 1] (0 = the "
                              f"bundle's KV page count, no budget)")
        if not self.heap_trim_interval_s >= 0:
            raise ConfigError(f"heap_trim_interval_s={self.heap_trim_interval_s}: give seconds >= 0 (0 = never trim)")
        if self.max_batch_size < 0 or self.default_max_tokens < 1 or self.kv_cache_bytes < 0 or self.numpy_threads < 1:
            raise ConfigError(f"invalid runtime options {self}")


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """One client request: text ``prompt`` or token ``prompt_ids`` (exactly one of them)."""

    request_id: str
    prompt: str | None = None
    prompt_ids: tuple[int, ...] | None = None
    params: SamplingParams = field(default_factory=SamplingParams)


@dataclass(frozen=True, slots=True)
class Event:
    """A token event (``final`` False) or the one final event of a request.

    ``logprobs`` is empty unless the request's ``params.logprobs`` is set; then a token event carries one
    entry per id in ``token_ids`` and the final event one per id in ``output_ids`` (all generated tokens,
    an EOS included, the way ``output_ids`` covers the ids that had no token event).
    """

    request_id: str
    text: str = ""
    token_ids: tuple[int, ...] = ()
    final: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "cancelled" | "error"
    error: str | None = None
    output_ids: tuple[int, ...] = ()  # all generated ids (final event only)
    num_prompt_tokens: int = 0
    logprobs: tuple[TokenLogprobs, ...] = ()


Sink = Callable[[Event], None]


@dataclass(eq=False, slots=True)
class _Live:
    """Per-request serving state beside the scheduler's :class:`Sequence`."""

    seq: Sequence
    sink: Sink
    detok: IncrementalDetokenizer
    stops: StopStringMatcher
    rng: np.random.Generator
    seed: int  # the device sampler's counter-based generator key (the request's seed, or a random one)
    eos: frozenset[int]
    t_submit: float
    t_last: float = 0.0
    text: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprobs] | None = None  # None: the request asked for none


@dataclass(slots=True)
class _Flight:
    """A step on the device: its batch, the requests of its logit rows (in order), the runner's handle."""

    batch: Batch
    lives: list[_Live]
    step: InFlight
    t0: float


@dataclass(slots=True)
class _Ahead:
    """The decode step prepared while the one before it runs (async scheduling), not launched yet."""

    batch: Batch
    lives: list[_Live]
    rows: list[SampleRow]
    ctx: object | None  # the backend's prepared context (None on a host backend: prepared at launch)


class ServingEngine:
    """Loads a bundle and serves requests from its own engine thread."""

    def __init__(self, bundle_dir: str | Path, options: RuntimeOptions | None = None,
                 on_fatal: Callable[[BaseException], None] | None = None) -> None:
        """``on_fatal(error)`` is called once, from the engine thread, when the engine stops for good: its
        device was lost (:class:`DeviceLost`) or the thread died of a bug. Every request in flight has had
        its final (error) event by then; it must not block (Triton's model unloads itself from it)."""
        self.options = opts = options or RuntimeOptions()
        self._on_fatal = on_fatal
        self.bundle_dir = Path(bundle_dir)
        self.manifest = m = Manifest.load(self.bundle_dir)
        lim = m.limits
        if opts.max_batch_size > lim.max_batch_size:
            raise BundleError(f"max_batch_size={opts.max_batch_size} exceeds the bundle's {lim.max_batch_size} "
                              f"({self.bundle_dir}); lower it or rebuild with --max-batch-size {opts.max_batch_size}")
        self.max_batch_size = opts.max_batch_size or lim.max_batch_size
        for wa in m.workarounds:
            log.info("bundle workaround %s: %s", wa["id"], wa["action"])
        num_pages = lim.num_kv_pages
        if opts.kv_cache_bytes:
            cfg = m.model
            kv_dtype = np.float16 if m.backend == "cuda" and m.dtype != "float32" else np.float32  # bytes per value
            num_pages = KVLayout.pages_for_budget(opts.kv_cache_bytes, len(cfg.attention_layers), lim.page_size,
                                                  cfg.num_kv_heads, cfg.head_dim, kv_dtype).num_pages
        # Process-wide (BLAS pools are global); this process serves one model instance.
        self._blas_limit = threadpool_limits(limits=opts.numpy_threads, user_api="blas")
        self.tokenizer = Tokenizer.from_dir(self.bundle_dir, eos_token_ids=m.model.eos_token_ids)
        self.runner = ModelRunner(self.bundle_dir, m, pinning=opts.profile_pinning,
                                  multi_block_mode=opts.multi_block_mode, num_kv_pages=num_pages,
                                  intra_op_threads=opts.intra_op_threads, device=opts.device,
                                  gpu_memory_fraction=opts.gpu_memory_fraction or None,
                                  packed_weights=opts.packed_weights)
        # On admission a slot's state is zeroed by the operators that own it (host or device buffers). The
        # page pool is what the backend allocated (a cuda backend caps it to its memory budget).
        self.scheduler = Scheduler(lim, self.max_batch_size, self.runner.num_kv_pages, self.runner.ops.reset_slot)
        self.metrics = Metrics()
        self._trimmer = HeapTrimmer(opts.heap_trim_interval_s)
        self._inbox: queue.Queue[tuple[str, object]] = queue.Queue()
        self._live: dict[str, _Live] = {}
        self._seeds = np.random.SeedSequence(opts.seed)
        self._ids = itertools.count()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.fatal: BaseException | None = None
        self._steps_run = 0
        self._fault = _fault_from_env()
        self.async_scheduling = (opts.async_scheduling == "on" or
                                 (opts.async_scheduling == "auto" and self.runner.supports_ahead))
        if self.async_scheduling:
            log.info("async scheduling on: the next decode step is prepared while this one runs%s",
                     "" if self.runner.supports_ahead else " (host backend: bookkeeping only, no overlap)")
        if self._fault is not None:
            log.warning("TEST fault injection armed: a %r fault at engine step %d (%s)", *self._fault, FAULT_ENV)

    # ---- public, thread-safe ---------------------------------------------------------------------
    def start(self) -> ServingEngine:
        """Warm up (``options.warmup``), then start the engine thread."""
        if self.options.warmup:
            self._warmup()
        self._thread = threading.Thread(target=self._loop, name="hybrid-engine", daemon=True)
        self._thread.start()
        return self

    def submit(self, req: GenerationRequest, sink: Sink) -> int:
        """Validate and enqueue; returns the prompt length. Raises RequestValidationError (nothing queued)."""
        try:
            return self._submit(req, sink)
        except RequestValidationError as e:
            with self.metrics.lock:
                self.metrics.rejected[e.code] += 1
            raise

    def _submit(self, req: GenerationRequest, sink: Sink) -> int:
        if self.fatal is not None:
            raise RequestValidationError(self._fatal_text(), code="unavailable")
        if self._stop.is_set():
            raise RequestValidationError("the model is shutting down", code="unavailable")
        ids = self._prompt_ids(req)
        lim = self.manifest.limits
        if len(ids) > lim.max_input_len:
            raise RequestValidationError(f"prompt is {len(ids)} tokens, over max_input_len={lim.max_input_len}",
                                         field="text_input")
        room = lim.max_seq_len - len(ids)
        if req.params.max_tokens > room:
            raise RequestValidationError(f"max_tokens={req.params.max_tokens} with a {len(ids)}-token prompt exceeds "
                                         f"max_seq_len={lim.max_seq_len} (at most {room})", field="max_tokens")
        pages = self.scheduler.pages  # page_size and num_pages never change: safe to read here
        need = pages.pages_needed(len(ids) + req.params.max_tokens)
        if need > pages.num_pages:
            raise RequestValidationError(f"prompt + max_tokens need {need} KV pages, the pool has {pages.num_pages}; "
                                         f"lower max_tokens or raise kv_cache_bytes", field="max_tokens")
        self._inbox.put(("add", (req, ids, sink, time.perf_counter())))
        return len(ids)

    def cancel(self, request_id: str) -> None:
        self._inbox.put(("cancel", request_id))

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine thread; every in-flight request gets a final "cancelled" event."""
        self._stop.set()
        self._inbox.put(("wake", None))
        if self._thread is not None:
            self._thread.join(timeout)

    def stats(self) -> dict:
        return self.metrics.snapshot()

    @property
    def device_wait(self) -> threading.Event | None:
        """Set while the engine thread blocks on its device with the GIL released (cuda backends; None for
        host backends). An adapter's GIL-bound threads (the response sender) work in that window, so they do
        not stretch the engine's host work between steps."""
        return getattr(self.runner.backend, "device_wait", None)

    def new_request_id(self) -> str:
        return f"req-{next(self._ids)}"

    def warmup_plan(self) -> list[list[int]]:
        """Prompt lengths of the scheduled warm-up rounds (each round's sequences run together to completion).

        Round 1: one prompt of the largest prefill chunk (``max_num_tokens``, within ``max_input_len``).
        Round 2: ``max_batch_size`` prompts sharing that chunk (a many-sequence prefill, then a full-batch
        decode). Both are capped so that their KV pages fit the pool; each sequence decodes two tokens.
        :meth:`warmup_long_steps` adds the longest contexts.
        """
        lim, pages = self.manifest.limits, self.scheduler.pages
        new = 2
        longest = min(lim.max_num_tokens, lim.max_input_len, lim.max_seq_len - new,
                      pages.num_pages * pages.page_size - new)
        rounds = [[longest]] if longest >= 1 else []
        b = self.max_batch_size
        each = min(lim.max_num_tokens // b, lim.max_input_len, lim.max_seq_len - new,
                   (pages.num_pages // b) * pages.page_size - new)
        if b > 1 and each >= 1:
            rounds.append([each] * b)
        return rounds

    def warmup_long_steps(self) -> list[tuple[Phase, list[SeqStep]]]:
        """The warm-up's direct steps at the longest contexts, which the scheduled rounds do not reach: the last
        prefill chunk of a ``max_input_len`` prompt (``max_num_tokens`` queries over the whole prompt), a prefill
        step of that prompt's last 64 tokens beside the first ``max_num_tokens - 64`` of another, a prefill step of
        ``max_batch_size`` sequences (that prompt's last tokens beside one token each of the others), then a
        decode step of as many rows at context ``max_seq_len`` as the page pool holds (at least one row, at the
        longest context the pool holds). Attention's intermediates grow with the context, so these are the
        step's largest. Synthetic: free slots and pages while nothing is admitted, token id 0, the KV and
        state they read are whatever the pool holds (their outputs are discarded; admission zeroes a slot, and
        a sequence reads only the KV positions it wrote)."""
        lim, pages = self.manifest.limits, self.scheduler.pages
        ps, total = pages.page_size, pages.num_pages
        out: list[tuple[Phase, list[SeqStep]]] = []
        prompt = min(lim.max_input_len, total * ps)
        chunk = min(lim.max_num_tokens, prompt)
        per_prompt = -(-prompt // ps)
        if prompt > chunk:  # a prompt of one chunk is round 1's
            out.append((Phase.PREFILL, [SeqStep(0, list(range(per_prompt)), prompt - chunk, [0] * chunk)]))
        # A step that packs the few last tokens of a long prompt with many first tokens of another: attention's
        # queries are padded to the step's longest chunk over its longest context (blocks capped at
        # attention_ort._MAX_PARTIALS), and onnxruntime's arena had no free region for it after the steps above:
        # served, this shape doubled the arena 14 minutes into a soak.
        tail = min(64, chunk // 2)
        head_pages = -(-(chunk - tail) // ps)
        if self.max_batch_size > 1 and prompt > tail and tail >= 1 and per_prompt + head_pages <= total:
            out.append((Phase.PREFILL, [SeqStep(0, list(range(per_prompt)), prompt - tail, [0] * tail),
                                        SeqStep(1, list(range(per_prompt, per_prompt + head_pages)), 0,
                                                [0] * (chunk - tail))]))
        # The widest padding: a full batch in one prefill step, one sequence with the rest of the step's tokens at
        # the end of the long prompt, the others one token each. Attention pads every sequence's queries to the
        # longest chunk, so its prefill output buffer (and the padded query copy) reach batch x chunk rows only
        # here: served, such a step grew the buffer by 580 KB after the warm-up of a 2-hour soak (issue 21).
        b = self.max_batch_size
        if b > 2 and chunk > b and per_prompt + b - 1 <= total:
            long = chunk - (b - 1)
            out.append((Phase.PREFILL, [SeqStep(0, list(range(per_prompt)), prompt - long, [0] * long)]
                        + [SeqStep(i, [per_prompt + i - 1], 0, [0]) for i in range(1, b)]))
        ctx = min(lim.max_seq_len, total * ps)
        per = -(-ctx // ps)
        rows = max(1, min(self.max_batch_size, total // per))
        out.append((Phase.DECODE, [SeqStep(r, list(range(r * per, (r + 1) * per)), ctx - 1, [0])
                                   for r in range(rows)]))
        return out

    def _warmup(self) -> None:
        """Run :meth:`warmup_plan`'s rounds through the scheduler and :meth:`warmup_long_steps` straight on the
        runner, synchronously (before the engine thread exists), then zero the metrics.

        Greedy, EOS ignored, a fixed seed: the engine's seed stream for unseeded requests is not touched, and
        injected test faults (counted in engine steps) count from the first served step.
        """
        t0 = time.perf_counter()
        fault, self._fault = self._fault, None
        params = SamplingParams(max_tokens=2, temperature=0.0, seed=0, ignore_eos=True)
        vocab = self.manifest.model.vocab_size
        rng = np.random.default_rng(0)
        steps = 0
        try:
            for r, lengths in enumerate(self.warmup_plan()):
                for i, n in enumerate(lengths):
                    ids = rng.integers(0, vocab, n).tolist()
                    self._admit(GenerationRequest(f"warmup-{r}-{i}", prompt_ids=tuple(ids), params=params),
                                ids, _discard, t0)
                while self._live:
                    batch = self.scheduler.schedule()
                    if batch is None:
                        raise RuntimeError(f"warm-up round {r} ({lengths}) could not be scheduled")
                    self._step(batch)
                    steps += 1
                    if self.fatal is not None:
                        raise RuntimeError(f"warm-up failed: {self._fatal_text()}")
                failed = self.metrics.finished.get("error", 0)
                if failed:
                    raise RuntimeError(f"warm-up round {r} ({lengths}): {failed} sequence(s) failed; see the log")
            if self.scheduler.slots.num_used or self.scheduler.pages.num_used:
                raise RuntimeError("warm-up: slots or pages still in use after its rounds")
            for phase, seq_steps in self.warmup_long_steps():
                try:
                    self.runner.step(phase, seq_steps, [SampleRow(params, np.random.default_rng(0))] * len(seq_steps))
                except DeviceLost as e:
                    self.fatal = e
                    raise RuntimeError(f"warm-up failed: {self._fatal_text()}") from e
                except Exception as e:
                    raise RuntimeError(f"warm-up {phase.name.lower()} step of {len(seq_steps)} sequence(s) at "
                                       f"context {seq_steps[0].start_pos + len(seq_steps[0].token_ids)} failed: "
                                       f"{type(e).__name__}: {e}") from e
                steps += 1
        finally:
            for live in list(self._live.values()):
                self._final(live, "cancelled")
            self._fault = fault
        self._steps_run = 0
        self.metrics = Metrics()
        self._update_gauges()
        log.info("warm-up: %d steps in %.2f s", steps, time.perf_counter() - t0)

    # ---- validation ----------------------------------------------------------------------------
    def _prompt_ids(self, req: GenerationRequest) -> list[int]:
        if (req.prompt is None) == (req.prompt_ids is None):
            raise RequestValidationError("give exactly one of a text prompt or prompt token ids", field="text_input")
        if req.prompt is not None:
            if not req.prompt:
                raise RequestValidationError("the prompt is empty", field="text_input")
            ids = self.tokenizer.encode(req.prompt)
            if not ids:
                raise RequestValidationError("the prompt encodes to no tokens", field="text_input")
            return ids
        ids = [int(t) for t in req.prompt_ids or ()]
        if not ids:
            raise RequestValidationError("input_ids is empty", field="input_ids")
        vocab = self.manifest.model.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise RequestValidationError(f"input_ids out of range 0..{vocab - 1}: {bad[:5]}", field="input_ids")
        return ids

    # ---- engine thread -------------------------------------------------------------------------
    def _loop(self) -> None:
        pending: _Flight | None = None  # the step the device is running (async scheduling: launched ahead)
        try:
            while not self._stop.is_set():
                if pending is None:
                    self._drain(block=not self.scheduler.running and not self.scheduler.waiting)
                    batch = self.scheduler.schedule()
                    if batch is not None:
                        pending = self._launch(batch)
                if pending is not None:
                    pending = self._complete(pending, self.async_scheduling)
                self._update_gauges()
                if self._trimmer.maybe_trim():
                    with self.metrics.lock:
                        self.metrics.heap_trims, self.metrics.heap_trim_seconds = \
                            self._trimmer.trims, self._trimmer.seconds
        except BaseException as e:  # a bug: fail every request loudly rather than hang them
            log.exception("engine thread died")
            self.fatal = e
        finally:
            if pending is not None:  # stopped with a step on the device: let it end before anything is freed
                try:
                    self.runner.collect(pending.step)
                except Exception:
                    log.debug("the step in flight at shutdown failed", exc_info=True)
            self._drain(block=False)
            for live in list(self._live.values()):
                self._final(live, "cancelled" if self.fatal is None else "error",
                            None if self.fatal is None else self._fatal_text())
            self._update_gauges()
            if self.fatal is not None and self._on_fatal is not None:
                try:
                    self._on_fatal(self.fatal)
                except Exception:
                    log.exception("on_fatal callback failed")

    def _fatal_text(self) -> str:
        e = self.fatal
        if isinstance(e, DeviceLost):
            return f"device failure: {e}; this model instance cannot serve until it is restarted"
        return f"engine failure: {e!r}"

    def _drain(self, block: bool) -> None:
        while True:
            try:
                kind, item = self._inbox.get(timeout=0.1) if block else self._inbox.get_nowait()
            except queue.Empty:
                return
            block = False
            if kind == "add":
                self._admit(*item)  # type: ignore[misc]
            elif kind == "cancel":
                live = self._live.get(item)  # type: ignore[arg-type]
                if live is not None:
                    self._final(live, "cancelled")

    def _admit(self, req: GenerationRequest, ids: list[int], sink: Sink, t0: float) -> None:
        if req.request_id in self._live:
            self._send(sink, Event(req.request_id, final=True, finish_reason="error",
                                   error=f"request id {req.request_id!r} is already in flight"))
            return
        seq = Sequence(req.request_id, ids, req.params, max_len=len(ids) + req.params.max_tokens)
        eos = frozenset() if req.params.ignore_eos else frozenset(self.tokenizer.eos_token_ids)
        seed = req.params.seed if req.params.seed is not None else int(
            self._seeds.spawn(1)[0].generate_state(2, np.uint32).astype(np.uint64) @ np.array([1, 1 << 32], np.uint64))
        live = _Live(seq, sink, IncrementalDetokenizer(self.tokenizer, ids), StopStringMatcher(req.params.stop),
                     make_rng(req.params.seed, self._seeds), seed, eos, t0,
                     logprobs=None if req.params.logprobs is None else [])
        self._live[req.request_id] = live
        self.scheduler.add(seq)
        with self.metrics.lock:
            self.metrics.prompt_tokens += len(ids)

    def _step(self, batch: Batch) -> None:
        """Run one step to the end, its tokens handled (the warm-up's synchronous steps)."""
        flight = self._launch(batch)
        if flight is not None:
            self._complete(flight, ahead=False)

    def _count_step(self) -> None:
        """Engine steps are numbered for the test-only fault injection (FAULT_ENV)."""
        if self._fault is not None and self._steps_run == self._fault[1]:
            self.runner.backend.inject_fault(self._fault[0])  # type: ignore[attr-defined]
        self._steps_run += 1

    def _sample_rows(self, lives: list[_Live], ahead: int = 0) -> list[SampleRow]:
        """The sampling rows of ``lives``' next tokens (``ahead``: tokens drawn before it not yet in output_ids)."""
        return [SampleRow(lv.seq.params, lv.rng, lv.seed, len(lv.seq.prompt_ids) + len(lv.seq.output_ids) + ahead,
                          lv.seq.params.logprobs) for lv in lives]

    def _launch(self, batch: Batch) -> _Flight | None:
        """Enqueue ``batch`` on the device (a host backend runs it here). None when it failed at once: a device
        lost stops the engine, any other error fails the batch's sequences only."""
        t0 = time.perf_counter()
        lives = [self._live[s.request_id] for s, st in zip(batch.seqs, batch.steps) if st.need_logits]
        rows = self._sample_rows(lives)
        self._count_step()
        try:
            return _Flight(batch, lives, self.runner.launch(batch.phase, batch.steps, rows), t0)
        except Exception as e:
            self._step_failed(batch, e)
            return None

    def _step_failed(self, batch: Batch, e: Exception) -> None:
        if isinstance(e, DeviceLost):  # nothing runs on this device again: fail everything, stop (on_fatal)
            log.critical("%s step lost the device; failing all %d request(s) in flight and stopping: %s",
                         batch.phase.name, len(self._live), e)
            self.fatal = e
            self._stop.set()
            return
        # e.g. a decode batch no attention plan fits: fail these, keep serving
        log.error("%s step failed for %d sequences: %s", batch.phase.name, len(batch.seqs), e)
        for seq in batch.seqs:
            live = self._live.get(seq.request_id)
            if live is not None and live.seq is seq:
                self._final(live, "error", f"{type(e).__name__}: {e}")

    def _complete(self, flight: _Flight, ahead: bool) -> _Flight | None:
        """Wait for ``flight`` and hand its tokens to their requests. With ``ahead`` (async scheduling), the next
        decode step is prepared while the device runs this one and launched before the tokens are handled;
        returns it (the step now in flight), or None when the next step must be scheduled afresh."""
        nxt = self._plan_ahead(flight) if ahead else None
        try:
            result = self.runner.collect(flight.step)
        except Exception as e:
            self._drop_ahead(nxt)
            self._step_failed(flight.batch, e)
            return None
        batch = flight.batch
        self.scheduler.advance(batch)
        tokens = result.tokens.tolist()
        launched, failed = None, None
        if nxt is not None:
            try:
                launched = self._launch_ahead(nxt, flight, tokens)
            except Exception as e:  # reported after this step's tokens are handed out
                failed = e
        if flight.lives:
            now = time.perf_counter()
            lps = result.logprobs or [None] * len(flight.lives)
            for live, tok, lp in zip(flight.lives, tokens, lps):
                # a request finished while its step ran (a stop string one step earlier, a cancel, a client
                # gone: async scheduling) has no use for this token; its slot and pages were freed between
                # steps, and nothing reuses them before this step is collected (schedule_ahead)
                if self._live.get(live.seq.request_id) is live:
                    self._on_token(live, int(tok), now, lp)
        phase = batch.phase.name.lower()
        with self.metrics.lock:
            self.metrics.steps[phase] += 1
            self.metrics.step_seconds[phase] += time.perf_counter() - flight.t0
            self.metrics.step_tokens[phase] += sum(len(st.token_ids) for st in batch.steps)
            if nxt is not None:
                self.metrics.async_steps["launched" if launched is not None else "dropped"] += 1
        if failed is not None:
            self._step_failed(nxt.batch, failed)  # type: ignore[union-attr]
            return None
        if launched is not None:
            self._drain(block=False)  # arrivals and cancels while the device runs the next step
        return launched

    def _plan_ahead(self, flight: _Flight) -> _Ahead | None:
        """The decode step after ``flight`` (a decode step on the device), prepared now: the same sequences but
        those its token finishes by length, one position on, token ids to be patched in. None when the next
        step is not that (a prefill, an admission, a finished batch) or the backend refused it (the normal path
        then schedules it and reports the error)."""
        if flight.batch.phase != Phase.DECODE or not self._inbox.empty():
            return None
        finishing = {lv.seq.request_id for lv in flight.lives
                     if self._at_length(lv, len(lv.seq.output_ids) + 1, lv.seq.num_tokens + 1)}
        batch = self.scheduler.schedule_ahead(flight.batch, finishing)
        if batch is None:
            return None
        lives = [self._live[s.request_id] for s in batch.seqs]
        rows = self._sample_rows(lives, ahead=1)
        ctx = None
        if self.runner.supports_ahead:
            try:
                ctx = self.runner.prepare_ahead(batch.steps, rows)
            except Exception as e:
                log.debug("decode step not prepared ahead (%s); it is scheduled after this one", e)
                return None
        return _Ahead(batch, lives, rows, ctx)

    def _drop_ahead(self, nxt: _Ahead | None) -> None:
        if nxt is not None and nxt.ctx is not None:
            self.runner.abandon(nxt.ctx)

    def _launch_ahead(self, nxt: _Ahead, flight: _Flight, tokens: list[int]) -> _Flight | None:
        """Launch ``nxt`` with the token ids ``flight`` drew, unless one of them stops its sequence (an EOS or
        stop token: the step is dropped and scheduled afresh) or a request arrived or was cancelled meanwhile.
        Stop strings are matched after the launch: such a sequence's row is computed and its token dropped. A failed
        launch raises (the caller fails the step's sequences once the tokens before it are handed out)."""
        drawn = {id(lv): t for lv, t in zip(flight.lives, tokens)}
        ids = []
        for lv in nxt.lives:
            t = drawn[id(lv)]
            if self._stop_token(lv, t, len(lv.seq.output_ids) + 1):
                self._drop_ahead(nxt)
                return None
            ids.append(t)
        if not self._inbox.empty():
            self._drop_ahead(nxt)
            return None
        t0 = time.perf_counter()
        self._count_step()
        if nxt.ctx is not None:
            step = self.runner.launch_ahead(nxt.ctx, ids)
        else:  # a host backend: the step runs here
            for st, t in zip(nxt.batch.steps, ids):
                st.token_ids[0] = t
            step = self.runner.launch(Phase.DECODE, nxt.batch.steps, nxt.rows)
        return _Flight(nxt.batch, nxt.lives, step, t0)

    def _on_token(self, live: _Live, tok: int, now: float, lp: TokenLogprobs | None = None) -> None:
        seq, p = live.seq, live.seq.params
        seq.output_ids.append(tok)
        if live.logprobs is not None and lp is not None:
            live.logprobs.append(lp)
        with self.metrics.lock:
            self.metrics.tokens_generated += 1
            (self.metrics.itl if live.t_last else self.metrics.ttft).observe(now - (live.t_last or live.t_submit))
        live.t_last = now
        n = len(seq.output_ids)
        stop_tok = self._stop_token(live, tok, n)
        text, hit = ("", False) if stop_tok else live.stops.feed(live.detok.push(tok))
        if hit and n <= p.min_tokens:
            hit = False  # stop strings count only after min_tokens
        done = stop_tok or hit or self._at_length(live, n, seq.num_tokens)
        if done and not hit:
            text += live.stops.feed(live.detok.flush())[0] + live.stops.flush()
        if text or not done:
            live.text.append(text)
            ev = Event(seq.request_id, text=text, token_ids=(tok,), logprobs=() if lp is None else (lp,))
            if not self._send(live.sink, ev):
                self._final(live, "cancelled")
                return
        if done:
            self._final(live, "stop" if stop_tok or hit else "length")

    @staticmethod
    def _stop_token(live: _Live, tok: int, n: int) -> bool:
        """Whether ``tok``, the request's ``n``-th output token, ends it (EOS or a stop token, past min_tokens)."""
        p = live.seq.params
        return n > p.min_tokens and (tok in live.eos or tok in p.stop_token_ids)

    def _at_length(self, live: _Live, n: int, total: int) -> bool:
        """Whether a request with ``n`` output tokens and ``total`` tokens in all has reached its length
        (max_tokens, or the bundle's max_seq_len)."""
        return n >= live.seq.params.max_tokens or total >= self.manifest.limits.max_seq_len

    def _final(self, live: _Live, reason: str, error: str | None = None) -> None:
        """Send the one final event, then release the slot and pages (we are between steps)."""
        seq = live.seq
        if self._live.pop(seq.request_id, None) is None:
            return
        if seq in self.scheduler.waiting:
            self.scheduler.remove_waiting(seq)
        else:
            self.scheduler.finish(seq)
        self._send(live.sink, Event(seq.request_id, text="".join(live.text), final=True, finish_reason=reason,
                                    error=error, output_ids=tuple(seq.output_ids),
                                    num_prompt_tokens=len(seq.prompt_ids), logprobs=tuple(live.logprobs or ())))
        with self.metrics.lock:
            self.metrics.finished[reason] += 1

    def _send(self, sink: Sink, ev: Event) -> bool:
        try:
            sink(ev)
            return True
        except Exception as e:  # the client went away: its request is cancelled, the server goes on
            log.info("sink for %s failed (%s); cancelling it", ev.request_id, e)
            return False

    def _update_gauges(self) -> None:
        s, d, m = self.scheduler, self.runner.dispatcher, self.metrics
        with m.lock:
            m.requests_running, m.requests_waiting = len(s.running), len(s.waiting)
            m.slots_in_use, m.kv_pages_in_use = s.slots.num_used, s.pages.num_used
            m.profile_switches = self.runner.profile_switches
            m.attention_plans, m.attention_fallbacks = d.plans.copy(), d.fallbacks.copy()
            gs = getattr(self.runner.backend, "graph_stats", None)
            if gs is not None:
                m.cuda_graphs_captured = len(gs.captured)
                m.graph_replays = Counter({f"b{k[0]}x{k[1]}": v for k, v in gs.replays.items()})
                m.decode_eager = gs.eager.copy()


def _discard(ev: Event) -> None:
    """The warm-up's sink."""


def generate(engine: ServingEngine, requests: list[GenerationRequest], timeout: float = 600.0) -> list[Event]:
    """Submit all requests at once to a started engine and wait for their final events (input order).

    A request that fails validation gets a final "error" event instead of raising.
    """
    done = threading.Event()
    finals: dict[str, Event] = {}
    lock = threading.Lock()

    def sink(ev: Event) -> None:
        if ev.final:
            with lock:
                finals[ev.request_id] = ev
                if len(finals) == len(requests):
                    done.set()

    for r in requests:
        try:
            engine.submit(r, sink)
        except RequestValidationError as e:
            sink(Event(r.request_id, final=True, finish_reason="error", error=str(e)))
    if requests and not done.wait(timeout):
        raise TimeoutError(f"{len(requests) - len(finals)} requests did not finish within {timeout} s")
    return [finals[r.request_id] for r in requests]
