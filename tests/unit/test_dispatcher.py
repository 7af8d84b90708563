"""The guarded decode-attention dispatcher: plans, limits, fallbacks, and that no invalid plan launches."""

from __future__ import annotations

import logging
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from hybrid_runtime.ops import dispatcher as dmod
from hybrid_runtime.ops.dispatcher import (
    MULTI,
    SINGLE,
    DecodeAttentionDispatcher,
    DecodeAttentionError,
    DecodeBatch,
    DeviceLimits,
    LaunchPlan,
    limits_for,
    make_plan,
    plan,
    resident_ctas_per_sm,
    smem_bytes,
    validate,
)

H200 = DeviceLimits("sim-h200", sm_count=132, optin_set=frozenset({SINGLE, MULTI}))
BIG_WS = 1 << 30


class Recorder:
    """Kernels that record the plan they were launched with and return zeros of the right shape."""

    def __init__(self) -> None:
        self.calls: list[LaunchPlan] = []

    def __call__(self, p: LaunchPlan, q: np.ndarray, *rest: object) -> np.ndarray:
        self.calls.append(p)
        return np.zeros(q.shape, np.float32)

    def kernels(self) -> dict:
        return {SINGLE: self, MULTI: self}


def fake_inputs(lens: list[int], hq: int = 4, hkv: int = 1, hd: int = 128, ps: int = 64,
                dtype: str = "float32", extra_pages: int = 0) -> tuple:
    """q, k/v pools (zero-stride views, no memory), contiguous page tables, lengths."""
    need = [-(-n // ps) for n in lens]
    pool = sum(need) + extra_pages
    buf = np.lib.stride_tricks.as_strided(np.zeros(1, dtype), (max(pool, 1), ps, hkv, hd), (0, 0, 0, 0))
    starts = np.cumsum([0, *need])
    tables = [np.arange(starts[i], starts[i + 1]) for i in range(len(lens))]
    return np.zeros((len(lens), hq, hd), np.float32), buf, buf, tables, np.array(lens)


def make(mode: str = "on", limits: DeviceLimits = H200, ws: int = BIG_WS) -> tuple:
    rec = Recorder()
    return DecodeAttentionDispatcher(mode, limits, ws, rec.kernels()), rec


def within_limits(p: LaunchPlan, batch: DecodeBatch, lim: DeviceLimits, ws: int) -> bool:
    """Independent restatement of every launch limit (not via validate())."""
    grids = [p.grid] + ([p.reduce_grid] if p.kernel == MULTI else [])
    caps = (lim.max_grid_x, lim.max_grid_y, lim.max_grid_z)
    smem_cap = lim.max_shared_mem_optin if p.kernel in lim.optin_set else lim.max_shared_mem_per_block
    need_ws = batch.batch_size * batch.num_q_heads * p.blocks_per_seq * (batch.head_dim + 2) * 4
    return (all(1 <= d <= c for g in grids for d, c in zip(g, caps))
            and p.grid == (p.blocks_per_seq, batch.num_kv_heads, batch.batch_size)
            and 1 <= p.block_threads <= lim.max_threads_per_block
            and (p.kernel == SINGLE or 1 <= p.reduce_threads <= lim.max_threads_per_block)
            and (p.kernel == SINGLE or p.reduce_threads in (128, 256))  # whole 16-thread groups, 8 or 16
            and p.smem_bytes <= min(smem_cap, lim.max_shared_mem_optin)
            and (p.kernel == SINGLE or need_ws <= p.workspace_bytes <= ws)
            and (p.kernel == MULTI) == (p.blocks_per_seq > 1)
            and p.blocks_per_seq * p.chunk_len >= max(batch.context_lens)  # every token in some chunk
            and (p.kernel == SINGLE or p.chunk_len % min(64, lim.min_chunk_tokens) == 0))


# ---------------------------------------------------------------- heuristic


def test_chunks_are_aligned_and_cover_every_token() -> None:
    for lens in ([32768], [100, 7], [129], [64 * 65 + 1], [0]):
        b = DecodeBatch(tuple(lens), tuple(np.arange(-(-max(n, 1) // 16)) for n in lens), 16, 2, 256, 16,
                        "bfloat16", 4096)
        for blocks in (2, 3, 66, 1 << 20):
            p = make_plan(b, blocks, H200)
            assert p.blocks_per_seq <= blocks and p.blocks_per_seq * p.chunk_len >= max(lens)
            assert p.kernel == SINGLE or (p.chunk_len % 64 == 0 and (p.blocks_per_seq - 1) * p.chunk_len < max(lens))


def test_plan_heuristic() -> None:
    b = DecodeBatch.from_arrays(*fake_inputs([32768], hq=16, hkv=2, hd=256)[:2], [np.arange(128)], [32768])
    auto = plan(b, "auto", H200, BIG_WS)
    # 210 KB of shared memory per CTA: one per SM, so 2 kv heads x 66 chunks would be one wave of 132 SMs;
    # chunks are whole multiples of 64 tokens: 66 ragged chunks of 497 become 64 of 512
    assert resident_ctas_per_sm(b, H200) == 1
    assert auto.kernel == MULTI and auto.blocks_per_seq == 64 and auto.grid == (64, 2, 1)
    assert auto.chunk_len == 512 and auto.chunk_len * auto.blocks_per_seq == 32768
    assert auto.workspace_bytes == 1 * 16 * 64 * 258 * 4 and auto.reduce_grid == (1, 16, 4)
    assert auto.reduce_threads == 128  # 8 groups of 16 threads load 64 chunks in one round trip
    assert plan(b, "auto", H200, auto.workspace_bytes // 2).blocks_per_seq == 32  # capped by workspace
    assert plan(b, "auto", replace(H200, sm_count=2), BIG_WS).kernel == SINGLE  # SMs already busy
    assert plan(b, "off", H200, BIG_WS).kernel == SINGLE
    # 32q/8kv/d128: 104 KB per CTA, two per SM: 8 kv heads x 33 chunks fill the 264 slots (32 once aligned)
    b128 = DecodeBatch.from_arrays(*fake_inputs([32768], hq=32, hkv=8, hd=128, dtype="float16")[:2],
                                   [np.arange(512)], [32768])
    assert resident_ctas_per_sm(b128, H200) == 2 and plan(b128, "auto", H200, BIG_WS).blocks_per_seq == 32
    # one kv head: 128 chunks, merged by 16 groups
    b1kv = DecodeBatch.from_arrays(*fake_inputs([32768], hq=8, hkv=1, hd=128)[:2], [np.arange(128)], [32768])
    p1kv = plan(b1kv, "auto", H200, BIG_WS)
    assert p1kv.blocks_per_seq == 128 and p1kv.reduce_threads == 256
    # batch 64 x 2 kv heads = 128 CTAs already fill the wave: auto keeps one block, on still splits
    q, k, _, t, lens = fake_inputs([8192] * 64, hq=16, hkv=2, hd=256, dtype="float16")
    b64 = DecodeBatch.from_arrays(q, k, t, lens)
    assert plan(b64, "auto", H200, BIG_WS).kernel == SINGLE and plan(b64, "on", H200, BIG_WS).blocks_per_seq == 2
    # chunks of at least min_chunk_tokens (64 on the GPU): 100 tokens is one chunk
    q, k, _, t, _ = fake_inputs([100] * 2, hd=64)
    short = DecodeBatch.from_arrays(q, k, t, [100, 100])
    assert plan(short, "auto", H200, BIG_WS).kernel == SINGLE and plan(short, "on", H200, BIG_WS).kernel == SINGLE
    q, k, _, t, _ = fake_inputs([128], hd=64)
    on = plan(DecodeBatch.from_arrays(q, k, t, [128]), "on", H200, 0)
    assert on.kernel == MULTI and on.blocks_per_seq == 2  # "on" leaves the workspace to the guard
    with pytest.raises(ValueError):
        plan(short, "sometimes", H200, BIG_WS)  # type: ignore[arg-type]


def test_limits_cached_per_device() -> None:
    calls: list[int] = []

    def query(i: int) -> DeviceLimits:
        calls.append(i)
        return replace(H200, name=f"gpu{i}")

    key = ("test_dispatcher", 0)
    assert limits_for(key, lambda: query(0)).name == "gpu0"
    assert limits_for(key, lambda: query(0)) is limits_for(key, lambda: query(0))
    assert limits_for(("test_dispatcher", 1), lambda: query(1)).name == "gpu1"
    assert calls == [0, 1]
    assert DeviceLimits.cpu().sm_count >= 1 and MULTI in DeviceLimits.cpu().optin_set


# ---------------------------------------------------------------- each reason, targeted


def test_grid_x_halves_blocks() -> None:
    d, rec = make("on", replace(H200, max_grid_x=2))
    d.run(*fake_inputs([32768], hq=2, hkv=1))
    assert [p.blocks_per_seq for p in rec.calls] == [2] and d.fallbacks["grid_x"] >= 1
    assert d.plans == {MULTI: 1}


def test_workspace_falls_back_to_fewer_blocks_then_single() -> None:
    args = fake_inputs([32768], hq=2, hkv=1, hd=64)
    d, rec = make("on", ws=2 * 66 * 4 * 10)  # room for 10 blocks of partials
    d.run(*args)
    assert rec.calls[-1].kernel == MULTI and rec.calls[-1].blocks_per_seq <= 10 and d.fallbacks["workspace"]
    d, rec = make("on", ws=0)
    d.run(*args)
    assert rec.calls[-1].kernel == SINGLE and d.fallbacks["workspace"] >= 1 and d.plans == {SINGLE: 1}


def test_reduction_grid_y_falls_back_to_single() -> None:
    d, rec = make("on", replace(H200, max_grid_y=4))
    d.run(*fake_inputs([4096], hq=8, hkv=2))  # reduction grid y = 8 q heads; attention grid y = 2
    assert rec.calls[-1].kernel == SINGLE and d.fallbacks["grid_y"] == 1


def test_smem_attr_not_set_on_this_device_falls_back() -> None:
    # The multi-GPU field case: opt-in set for multi-block on another device, not on this one.
    lim = replace(H200, optin_set=frozenset({SINGLE}))
    d, rec = make("on", lim)
    d.run(*fake_inputs([4096], hq=8, hkv=1, hd=256))  # fp32, G=8, hd=256: > 48 KiB even at tile 16
    assert rec.calls[-1].kernel == SINGLE and d.fallbacks["smem_attr_not_set"] == 1


@pytest.mark.parametrize("reason, limits, kwargs", [
    ("grid_z", replace(H200, max_grid_z=2), {"lens": [10, 10, 10]}),
    ("threads", replace(H200, max_threads_per_block=64), {}),
    ("smem_optin", replace(H200, max_shared_mem_per_block=1024, max_shared_mem_optin=1024), {}),
    ("smem_attr_not_set", replace(H200, optin_set=frozenset()), {"hq": 8, "hd": 256}),
    ("head_dim", H200, {"hd": 72}),
    ("dtype", H200, {"dtype": "float64"}),
    ("gqa", H200, {"hq": 3, "hkv": 2}),
    ("grid_zero", H200, {"lens": []}),
])
def test_unfixable_reasons_raise_without_launch(reason: str, limits: DeviceLimits, kwargs: dict) -> None:
    d, rec = make("on", limits)
    lens = kwargs.pop("lens", [4096])
    with pytest.raises(DecodeAttentionError) as err:
        d.run(*fake_inputs(lens, **kwargs))
    assert reason in err.value.reasons and d.fallbacks[reason] >= 1 and d.errors[reason] >= 1
    assert rec.calls == [] and not d.plans and reason in str(err.value)


def test_bad_page_tables_raise_without_launch() -> None:
    for reason, mutate in [("page_index", lambda t: t[0].__setitem__(-1, 10_000)),
                           ("page_index", lambda t: t[1].__setitem__(0, -1)),
                           ("page_table", lambda t: t.__setitem__(0, t[0][:-1]))]:
        d, rec = make("auto")
        q, k, v, tables, lens = fake_inputs([700, 70])
        mutate(tables)
        with pytest.raises(DecodeAttentionError) as err:
            d.run(q, k, v, tables, lens)
        assert err.value.reasons == (reason,) and d.fallbacks[reason] == 1 and rec.calls == []
    d, rec = make("auto")
    q, k, v, tables, _ = fake_inputs([5])
    with pytest.raises(DecodeAttentionError, match="context_len"):
        d.run(q, k, v, tables, [0])
    assert d.fallbacks["context_len"] == 1 and d.errors["context_len"] == 1
    with pytest.raises(DecodeAttentionError, match="shape"):
        d.run(q, k, v, tables, [5, 5])
    assert d.errors["shape"] == 1 and rec.calls == []


def test_beam_width_rejected() -> None:
    d, rec = make("auto")
    q, k, _, tables, lens = fake_inputs([100])
    batch = replace(DecodeBatch.from_arrays(q, k, tables, lens), beam_width=2)
    with pytest.raises(DecodeAttentionError):
        d.select(batch)
    assert d.fallbacks["beam_width"] == 1 and rec.calls == []


def test_bfloat16_supported() -> None:
    ml_dtypes = pytest.importorskip("ml_dtypes")
    d, rec = make("on")
    d.run(*fake_inputs([4096], dtype=ml_dtypes.bfloat16))
    p = rec.calls[-1]
    assert p.kernel == MULTI and p.smem_bytes == smem_bytes(4, 128, 2, p.kv_tile)  # sized for 2-byte K/V


def test_validate_catches_inconsistent_hand_made_plans() -> None:
    q, k, _, t, lens = fake_inputs([8192], hq=4, hkv=2)
    batch = DecodeBatch.from_arrays(q, k, t, lens)
    good = make_plan(batch, 8, H200)
    assert validate(good, batch, H200, BIG_WS) == []
    for bad in (replace(good, grid=(8, 1, 1)), replace(good, workspace_bytes=16), replace(good, smem_bytes=64),
                replace(good, kernel=SINGLE), replace(good, reduce_grid=None), replace(good, blocks_per_seq=0),
                replace(good, chunk_len=1), replace(good, reduce_threads=100), replace(good, reduce_threads=512)):
        assert "plan_inconsistent" in validate(bad, batch, H200, BIG_WS), bad
    assert "grid_zero" in validate(replace(good, grid=(0, 2, 1), blocks_per_seq=0), batch, H200, BIG_WS)


def test_invalid_planner_output_never_reaches_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """Even a planner gone wrong (huge split: 512 chunks of 64 tokens) only ever launches validated plans."""
    monkeypatch.setattr(dmod, "plan", lambda b, m, lim, ws: make_plan(b, 1 << 20, lim))
    lim = replace(H200, max_grid_x=100)
    d, rec = make("auto", lim, ws=1 << 20)
    args = fake_inputs([32768, 77], hq=4, hkv=2)
    d.run(*args)
    batch = DecodeBatch.from_arrays(*args[:2], args[3], args[4])
    assert len(rec.calls) == 1 and within_limits(rec.calls[0], batch, lim, 1 << 20)
    assert d.fallbacks["grid_x"] >= 1 and d.fallbacks["workspace"] >= 1


def test_logs_once_per_reason_and_plan_at_debug(caplog: pytest.LogCaptureFixture) -> None:
    d, _ = make("on", replace(H200, max_grid_y=4))
    with caplog.at_level(logging.DEBUG, logger="hybrid_runtime.dispatcher"):
        for _ in range(3):
            d.run(*fake_inputs([4096], hq=8, hkv=2))
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "grid_y" in warnings[0].getMessage()
    assert d.fallbacks["grid_y"] == 3 and d.plans == {SINGLE: 3}
    assert sum("plan" in r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG) == 3


def test_numpy_kernels_through_dispatcher_match() -> None:
    rng = np.random.default_rng(3)
    lens, ps, hkv, G, hd = [3000, 1, 600], 64, 2, 4, 128
    need = [-(-n // ps) for n in lens]
    kb = rng.standard_normal((sum(need), ps, hkv, hd)).astype(np.float32)
    vb = rng.standard_normal(kb.shape).astype(np.float32)
    tables = np.split(rng.permutation(sum(need)), np.cumsum(need)[:-1])
    q = rng.standard_normal((3, hkv * G, hd)).astype(np.float32)
    on, off = DecodeAttentionDispatcher("on"), DecodeAttentionDispatcher("off")
    out_on, out_off = on.run(q, kb, vb, tables, lens), off.run(q, kb, vb, tables, lens)
    assert on.plans == {MULTI: 1} and off.plans == {SINGLE: 1}
    np.testing.assert_allclose(out_on, out_off, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError):
        DecodeAttentionDispatcher("auto", kernels={SINGLE: Recorder()})


# ---------------------------------------------------------------- property


def _mostly(real: int, *tight: int) -> st.SearchStrategy[int]:
    """Usually the real limit, sometimes a tight simulated one, so that both launches and fallbacks occur."""
    return st.one_of(st.just(real), st.just(real), st.sampled_from(tight))


limits_st = st.builds(
    DeviceLimits, name=st.just("sim"), sm_count=st.integers(1, 264),
    max_grid_x=_mostly(2**31 - 1, 1, 2, 3, 5, 16), max_grid_y=_mostly(65535, 1, 2, 4),
    max_grid_z=_mostly(65535, 1, 3, 8), max_threads_per_block=_mostly(1024, 32, 64, 128),
    max_shared_mem_per_block=_mostly(49152, 2048, 16384),
    max_shared_mem_optin=_mostly(232448, 4096, 49152, 101376),
    optin_set=st.sets(st.sampled_from([SINGLE, MULTI])).map(frozenset))


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lim=limits_st, mode=st.sampled_from(["auto", "on", "off"]),
       ws=st.sampled_from([0, 1000, 65536, 1 << 20, 1 << 26, 1 << 30]),
       lens=st.lists(st.one_of(st.integers(1, 600), st.integers(1, 32768)), min_size=1, max_size=6),
       hkv=st.sampled_from([1, 2, 4]), group=st.sampled_from([1, 2, 4, 8]),
       hd=st.sampled_from([16, 64, 80, 96, 128, 160, 192, 256, 72, 320]),
       dtype=st.sampled_from(["float32", "float16"]), ps=st.sampled_from([16, 64, 256]),
       corrupt=st.sampled_from([None, None, None, "high", "negative"]))
def test_property_only_valid_plans_launch(lim: DeviceLimits, mode: str, ws: int, lens: list[int], hkv: int,
                                          group: int, hd: int, dtype: str, ps: int, corrupt: str | None) -> None:
    rec = Recorder()
    d = DecodeAttentionDispatcher(mode, lim, ws, rec.kernels())  # type: ignore[arg-type]
    q, k, v, tables, arr = fake_inputs(lens, hq=hkv * group, hkv=hkv, hd=hd, ps=ps, dtype=dtype)
    if corrupt:
        tables[-1][-1] = k.shape[0] if corrupt == "high" else -1
    batch = DecodeBatch.from_arrays(q, k, tables, arr)
    try:
        out = d.run(q, k, v, tables, arr)
    except DecodeAttentionError as err:
        assert rec.calls == [] and err.reasons and not d.plans
        event(f"raised {sorted(err.reasons)[0]}")
        # Raising is only allowed when even the single-block plan is invalid.
        assert validate(make_plan(batch, 1, lim), batch, lim, ws)
        return
    assert out.shape == q.shape and len(rec.calls) == 1 and corrupt is None
    p = rec.calls[0]
    assert within_limits(p, batch, lim, ws), (p, lim)
    event(f"{p.kernel} after {sorted(d.fallbacks)}" if d.fallbacks else p.kernel)
    assert mode != "off" or p.kernel == SINGLE
