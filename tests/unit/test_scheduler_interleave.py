"""Scheduling while a long prompt prefills: prefill chunks and decode steps alternate, so the requests already
decoding wait one chunk at most for their next token (not the whole prefill), and nothing else changes: the
prompt is still cut into aligned chunks of at most max_num_tokens, and prefill alone runs chunk after chunk."""

from __future__ import annotations

from hybrid_runtime.config import Limits
from hybrid_runtime.engine import Phase
from hybrid_runtime.sampling import SamplingParams
from hybrid_runtime.scheduler import Scheduler, Sequence

LIM = Limits(max_batch_size=4, max_input_len=4096, max_seq_len=4608, max_num_tokens=512, page_size=16,
             num_kv_pages=4 * 288, num_state_slots=4)


def _seq(rid: str, prompt: int, new: int) -> Sequence:
    return Sequence(rid, list(range(3, 3 + prompt)), SamplingParams(max_tokens=new), max_len=prompt + new)


def _run(sched: Scheduler, steps: int, arrive: dict[int, Sequence] | None = None) -> list[tuple[Phase, list[str]]]:
    """Drive the scheduler as the engine does (a token for every decoded row and every finished prompt)."""
    log = []
    for i in range(steps):
        if arrive and i in arrive:
            sched.add(arrive[i])
        batch = sched.schedule()
        if batch is None:
            break
        sched.advance(batch)
        for seq, st in zip(batch.seqs, batch.steps):
            if batch.phase == Phase.DECODE or st.need_logits:
                seq.output_ids.append(7)
                if len(seq.output_ids) >= seq.params.max_tokens:
                    sched.finish(seq)
        log.append((batch.phase, [s.request_id for s in batch.seqs]))
    return log


def test_a_long_prompt_delays_running_requests_by_one_chunk_at_most() -> None:
    sched = Scheduler(LIM, 4, LIM.num_kv_pages, lambda _slot: None)
    sched.add(_seq("running", 16, 200))
    long = _seq("long", 4000, 8)  # 8 chunks of 512 (the last one shorter)
    log = _run(sched, 400, arrive={3: long})
    # every step of the long prompt's prefill is followed by a decode step of the running request
    chunks = [i for i, (ph, ids) in enumerate(log) if ph == Phase.PREFILL and "long" in ids]
    assert len(chunks) == 8
    for i in chunks[:-1]:
        assert log[i + 1] == (Phase.DECODE, ["running"]), log[i:i + 2]
    # so between two tokens of the running request there is at most one prefill step
    gaps, since = [], 0
    for ph, ids in log[1:]:
        if ph == Phase.DECODE and "running" in ids:
            gaps.append(since)
            since = 0
        elif "running" not in ids:
            since += 1
    assert max(gaps) == 1
    assert long.num_prefilled == 4000 and len(long.output_ids) == 8


def test_prefill_alone_runs_chunk_after_chunk_and_chunks_stay_aligned() -> None:
    sched = Scheduler(LIM, 4, LIM.num_kv_pages, lambda _slot: None)
    sched.add(_seq("a", 1500, 2))
    sizes = []
    while True:
        batch = sched.schedule()
        if batch.phase != Phase.PREFILL:
            break
        sizes.append(len(batch.steps[0].token_ids))
        sched.advance(batch)
        if batch.steps[0].need_logits:
            sched.running[0].output_ids.append(7)
    assert sizes == [512, 512, 476]
    assert batch.phase == Phase.DECODE  # then decoding


def test_decode_steps_carry_only_decoding_sequences() -> None:
    sched = Scheduler(LIM, 4, LIM.num_kv_pages, lambda _slot: None)
    sched.add(_seq("r", 16, 50))
    _run(sched, 3)
    sched.add(_seq("p", 2000, 4))
    first = sched.schedule()  # the new prompt's first chunk
    assert first.phase == Phase.PREFILL and [s.request_id for s in first.seqs] == ["p"]
    sched.advance(first)
    second = sched.schedule()
    assert second.phase == Phase.DECODE and [s.request_id for s in second.seqs] == ["r"]
    assert all(len(st.token_ids) == 1 for st in second.steps)
