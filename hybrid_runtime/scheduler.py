"""Continuous-batching scheduler: plain Python over integers; it never touches tensors.

Policy: admit waiting sequences in arrival order while a state slot is free, the batch has room and
the KV pool can *reserve* pages for the sequence's whole length (prompt + max_tokens, capped at
max_seq_len) — so a running sequence can always grow and nothing is preempted. Requests that do not fit
yet wait; they are never rejected for lack of room. Pages are allocated on growth, within the
reservation. Prefill chunks (up to ``max_num_tokens`` tokens per step) go first; otherwise every running
sequence decodes one token together. A sequence's slot and pages are released by :meth:`finish`, which
the serving loop calls only between steps — after the sequence's last step has finished.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from .config import Limits
from .engine.base import Phase
from .kv_cache import PageAllocator
from .runner import SeqStep
from .sampling import SamplingParams
from .state_cache import SlotAllocator


class SeqState(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False, slots=True)
class Sequence:
    """One request's generation state as the scheduler sees it."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    max_len: int  # prompt + generated tokens never exceed this
    state: SeqState = SeqState.WAITING
    slot: int = -1
    reserved_pages: int = 0
    num_prefilled: int = 0
    output_ids: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def in_prefill(self) -> bool:
        return self.num_prefilled < len(self.prompt_ids)


@dataclass(slots=True)
class Batch:
    phase: Phase
    seqs: list[Sequence]
    steps: list[SeqStep]


# A prompt chunk that stops short of the prompt's end stops at a multiple of this many tokens. The
# chunked kernels (the CPU GDN's 64-token delta-rule chunks) then see a prompt cut at the same places
# whatever shares its step, so its prefill has the same bits alone and in a batch (batch invariance).
PREFILL_ALIGN = 64


class Scheduler:
    """Owns the waiting queue, the running list, the slot allocator and the page allocator."""

    def __init__(self, limits: Limits, max_batch_size: int, num_kv_pages: int,
                 on_admit: Callable[[int], None]) -> None:
        self.limits = limits
        self.max_batch_size = max_batch_size
        self.slots = SlotAllocator(limits.num_state_slots)
        self.pages = PageAllocator(num_kv_pages, limits.page_size)
        self._on_admit = on_admit
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._reserved = 0
        self._last: Phase | None = None  # the phase of the batch schedule() returned last

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def find(self, request_id: str) -> Sequence | None:
        for s in (*self.running, *self.waiting):
            if s.request_id == request_id:
                return s
        return None

    def remove_waiting(self, seq: Sequence) -> None:
        self.waiting.remove(seq)
        seq.state = SeqState.FINISHED

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.max_batch_size and self.slots.num_free:
            seq = self.waiting[0]
            need = self.pages.pages_needed(seq.max_len)
            if self._reserved + need > self.pages.num_pages:
                break  # in order: a later, smaller request does not overtake this one
            self.waiting.popleft()
            seq.slot = self.slots.allocate(seq.request_id)
            self._on_admit(seq.slot)  # zero conv + recurrent state before the first prefill
            seq.reserved_pages, self._reserved = need, self._reserved + need
            seq.state = SeqState.RUNNING
            self.running.append(seq)

    def schedule(self) -> Batch | None:
        """The next batch, or None when there is nothing to run.

        Prefill chunks and decode steps alternate while both have work: after a prefill step, the sequences
        already decoding get a decode step before the next chunk, so a long prompt (many chunks of
        ``max_num_tokens``) delays their next token by one chunk at most, not by its whole prefill.
        """
        self._admit()
        if not self.running:
            return None
        prefilling = [s for s in self.running if s.in_prefill]
        decoding = [s for s in self.running if not s.in_prefill]
        if prefilling and not (decoding and self._last == Phase.PREFILL):
            self._last = Phase.PREFILL
            budget, seqs, steps = self.limits.max_num_tokens, [], []
            for s in prefilling:
                left = len(s.prompt_ids) - s.num_prefilled
                n = min(left, budget)
                if n < left and self.limits.max_num_tokens >= PREFILL_ALIGN:
                    n -= n % PREFILL_ALIGN  # see PREFILL_ALIGN
                if n <= 0:
                    break
                end = s.num_prefilled + n
                self.pages.allocate(s.request_id, end)
                table = self.pages.table_view(s.request_id)
                steps.append(SeqStep(s.slot, table, s.num_prefilled, s.prompt_ids[s.num_prefilled:end],
                                     need_logits=end == len(s.prompt_ids)))
                seqs.append(s)
                budget -= n
            return Batch(Phase.PREFILL, seqs, steps)
        steps = []
        for s in decoding:
            self.pages.allocate(s.request_id, s.num_tokens)
            steps.append(SeqStep(s.slot, self.pages.table_view(s.request_id), s.num_tokens - 1, [s.output_ids[-1]]))
        self._last = Phase.DECODE
        return Batch(Phase.DECODE, decoding, steps)

    def schedule_ahead(self, batch: Batch, finishing: set[str]) -> Batch | None:
        """The decode step that follows ``batch`` while ``batch`` still runs (async scheduling, serving.py), or
        None when the next step is not a plain continuation: ``batch`` is not a DECODE step, a request waits for
        admission, a running sequence is still in prefill, or every sequence finishes.

        ``finishing``: request ids whose token from ``batch`` is their last by length (max_tokens / max_seq_len:
        known before the token is). Each remaining sequence decodes the token ``batch`` is drawing, not yet in
        ``output_ids``: its position is ``num_tokens`` and its ``token_ids`` a placeholder ``[0]`` that the caller
        replaces once the token is known (or throws the step away). The pages for that position are allocated
        here, within the sequence's reservation, exactly as :meth:`schedule` would allocate them one step later.
        """
        if batch.phase != Phase.DECODE or self.waiting:
            return None
        if any(s.in_prefill for s in self.running) or len(self.running) != len(batch.seqs):
            return None
        seqs = [s for s in batch.seqs if s.state == SeqState.RUNNING and s.request_id not in finishing]
        if not seqs:
            return None
        steps = []
        for s in seqs:
            self.pages.allocate(s.request_id, s.num_tokens + 1)
            steps.append(SeqStep(s.slot, self.pages.table_view(s.request_id), s.num_tokens, [0]))
        self._last = Phase.DECODE
        return Batch(Phase.DECODE, seqs, steps)

    def advance(self, batch: Batch) -> None:
        """Record that ``batch`` ran: prefill chunks are now in the cache."""
        if batch.phase == Phase.PREFILL:
            for s, st in zip(batch.seqs, batch.steps):
                s.num_prefilled += len(st.token_ids)

    def finish(self, seq: Sequence) -> None:
        """Release a running sequence's slot and pages (call only between steps)."""
        if seq.state != SeqState.RUNNING:
            return
        self.running.remove(seq)
        self.slots.free(seq.slot)
        if seq.request_id in self.pages:
            self.pages.free(seq.request_id)
        self._reserved -= seq.reserved_pages
        seq.state = SeqState.FINISHED

    @property
    def pages_in_use(self) -> int:
        return self.pages.num_used
