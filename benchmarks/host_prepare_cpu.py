"""``CudaBackend.prepare`` on the CPU, no GPU needed (issue 15: the host time of a served decode step).

``python3 -m benchmarks.host_prepare_cpu [--batches 1 8 64] [--context 1024] [--reps 2000]``

``prepare`` is host-only (validation, the step's one upload packed into pinned memory, the attention plan and
graph choice), so it runs unchanged on a *stub* backend: a :class:`~hybrid_runtime.cuda.backend.CudaBackend`
built with ``object.__new__`` that holds only what ``prepare`` reads (config and limits of the Qwen3.5-35B-A3B
shape as ``benchmarks.gpu_host_profile`` builds it, H200-like device limits, a host array for the pinned
upload, dummy graphs for every decode class so the replay path is taken). Per batch size it prints the median
time of ``prepare`` and of the helpers it calls with the arguments it passes them (``slot_mapping``,
``_check_slots``, the sampling words, ``DecodeBatch`` + ``choose``, ``pack``).

``--dump FILE`` instead runs a fixed set of random steps (decode and prefill, padding rows, logprobs rows, seeds
past 2**32, every validation error) through ``prepare`` and pickles what comes out of each: the uploaded bytes,
the context's fields, the chosen plan and graph key, the counters, or the exception's type and message. Run it
on two trees and compare the files (``--compare A B``) to show a change of ``prepare`` is bit-identical.
"""

from __future__ import annotations

import argparse
import os
import pickle
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import numpy as np

# Device limits of the H200 as cuda/driver.py queries them (both decode-attention families opted in).
H200 = dict(name="cuda:0 NVIDIA H200", sm_count=132, max_grid_x=2**31 - 1, max_grid_y=65535, max_grid_z=65535,
            max_threads_per_block=1024, max_shared_mem_per_block=48 * 1024, max_shared_mem_optin=227 * 1024,
            max_shared_mem_per_sm=228 * 1024)


def stub_backend(cfg: Any, max_batch: int, max_seq_len: int, num_pages: int, *, page_size: int = 16,
                 max_num_tokens: int | None = None, batch_invariant: bool = True, prefill_kernel: bool = True,
                 dtype: str = "bfloat16", mode: str = "auto") -> Any:
    """A CudaBackend holding only what ``prepare`` reads; every decode class of every bucket has a (dummy) graph."""
    from types import SimpleNamespace

    from hybrid_runtime.config import Limits
    from hybrid_runtime.cuda.backend import CudaBackend
    from hybrid_runtime.cuda.graphs import GraphStats, decode_buckets
    from hybrid_runtime.cuda.prefill_attention import CudaPrefillAttention, choose_prefill_variant
    from hybrid_runtime.cuda.stepio import InputLayout
    from hybrid_runtime.ops.dispatcher import MULTI, SINGLE, DecodeAttentionDispatcher, DeviceLimits
    from hybrid_runtime.state_cache import StateLayout

    limits = DeviceLimits(**H200, optin_set=frozenset({SINGLE, MULTI}))
    be = object.__new__(CudaBackend)
    be.cfg = cfg
    be.lim = Limits(max_batch_size=max_batch, max_input_len=max_seq_len - 1, max_seq_len=max_seq_len,
                    max_num_tokens=max_num_tokens or max_batch, page_size=page_size, num_kv_pages=num_pages,
                    num_state_slots=max_batch)
    be.dtype = dtype
    be.buckets = decode_buckets(max_batch)
    be.T_max = max(be.lim.max_num_tokens, be.buckets[-1])
    be.R_max = max(max_batch, be.buckets[-1])
    be.table_stride = -(-max_seq_len // page_size)
    be.in_layout = InputLayout(be.T_max, be.R_max, be.table_stride)
    be.host_in = SimpleNamespace(array=np.zeros(be.in_layout.nbytes, np.uint8), ptr=0)
    be._host_in_spare = SimpleNamespace(array=np.zeros(be.in_layout.nbytes, np.uint8), ptr=0)  # prepare_ahead's
    be.state_layout = StateLayout.for_model(cfg, max_batch)
    be.num_pages = num_pages
    be.sink_page = num_pages
    be.prefill_attn = None
    group = cfg.num_heads // max(1, cfg.num_kv_heads)
    if prefill_kernel and cfg.attention_layers:
        pa = object.__new__(CudaPrefillAttention)
        pa.device = SimpleNamespace(limits=limits)
        pa.variant = choose_prefill_variant(dtype, cfg.head_dim, group)
        be.prefill_attn = pa
    ws = max(64 << 20, max_batch * cfg.num_heads * 64 * (cfg.head_dim + 2) * 4)
    be.dispatcher = DecodeAttentionDispatcher(mode, limits, ws, {SINGLE: lambda *a: None, MULTI: lambda *a: None})
    be.dispatcher.batch_invariant = batch_invariant
    be.graphs = {(b, k): object() for b in be.buckets for k in (1, 2, 4, 8, 16, 32, 64, 128)}
    be.graph_stats = GraphStats()
    be.graphs_on = True
    be.prefill_plans = 0
    be.timings = Counter()
    return be


def decode_step(be: Any, B: int, context: int, seed: int = 0, logprobs: bool = False) -> tuple[list, list]:
    """``B`` sequences at ``context`` (the new token's position is context - 1), as gpu_host_profile builds them:
    page tables of int64 arrays drawn from the pool, one sampling row each (seeded, counter = context)."""
    from hybrid_runtime.backend import SampleRow
    from hybrid_runtime.ops.base import SeqStep
    from hybrid_runtime.sampling import SamplingParams

    rng = np.random.default_rng(seed)
    ps = be.lim.page_size
    per = -(-(context + ps) // ps)
    perm = rng.permutation(be.num_pages)[:B * per]
    steps = [SeqStep(b, np.asarray(perm[b * per:(b + 1) * per], np.int64), context - 1,
                     [int(rng.integers(0, be.cfg.vocab_size))]) for b in range(B)]
    rows = [SampleRow(SamplingParams(logprobs=2 if logprobs else None), seed=b, counter=context,
                      logprobs=2 if logprobs else None) for b in range(B)]
    return steps, rows


def _median_us(fn: Callable[[], Any], reps: int) -> float:
    """Median wall time of ``fn`` in µs (``QUANTILE`` in the environment: that quantile instead, e.g. 0.1 on a
    shared, noisy machine)."""
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    q = float(os.environ.get("QUANTILE", "0.5"))
    return (statistics.median(ts) if q == 0.5 else sorted(ts)[int(q * (len(ts) - 1))]) * 1e6


def pieces(be: Any, steps: list, rows: list) -> dict[str, Callable[[], Any]]:
    """The helpers ``prepare`` calls for this decode step, with the arguments it passes (the batch versions
    where this tree has them)."""
    from hybrid_runtime.backend import check_steps, slot_mapping
    from hybrid_runtime.cuda import sampler
    from hybrid_runtime.cuda.graphs import bucket_for, choose
    from hybrid_runtime.cuda.stepio import ROW_WORDS, StepInputs, pack
    from hybrid_runtime.engine import Phase
    from hybrid_runtime.ops.dispatcher import DecodeBatch
    from hybrid_runtime.ops.gdn import _check_slots

    cfg, lim = be.cfg, be.lim
    B = len(steps)
    n = bucket_for(B, be.buckets)
    bounds = np.arange(B + 1, dtype=np.int64)
    positions = np.array([s.start_pos for s in steps], np.int64)
    slots = np.concatenate([np.array([s.slot for s in steps], np.int64), np.full(n - B, be.state_layout.sink)])
    lens = [s.start_pos + 1 for s in steps] + [1] * (n - B)
    tables = [np.asarray(s.page_table, np.int64) for s in steps] + [np.array([be.sink_page])] * (n - B)

    def words() -> np.ndarray:
        if hasattr(sampler, "rows_params"):
            return sampler.rows_params(rows, n)
        params = np.zeros((n, ROW_WORDS), np.int32)
        params[:, 0] = 1
        params[:, 7] = -1
        for r, sr in enumerate(rows):
            params[r] = sampler.row_params(sr.params, sr.seed, sr.counter, sr.logprobs)
        return params

    def plan() -> Any:
        batch = DecodeBatch(tuple(lens), tuple(tables), cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                            lim.page_size, be.dtype, be.num_pages + 1)
        return choose(batch, n, be.dispatcher, lambda k: k in be.graphs, True)

    choice = plan()
    p = choice.plan
    inputs = StepInputs(np.zeros(n, np.int64), positions, positions, np.arange(n + 1), slots, np.arange(n),
                        words(), lens, tables, p.chunk_len if p else 0, seq_chunks=p.seq_chunks if p else None)
    return {
        "check_steps": lambda: check_steps(Phase.DECODE, steps),
        "slot_mapping": lambda: slot_mapping(steps, positions, bounds, lim.page_size, be.num_pages),
        "_check_slots": lambda: _check_slots(slots, be.state_layout.rows, n),
        "sampling words": words,
        "DecodeBatch+choose": plan,
        "pack": lambda: pack(be.in_layout, be.host_in.array, inputs),
    }


def timing(batches: list[int], context: int, reps: int) -> None:
    from benchmarks.gpu_decode_step import qwen35_moe_config
    from hybrid_runtime.engine import Phase

    cfg = qwen35_moe_config(4)
    maxB = max(batches)
    per = -(-(context + 16) // 16)
    be = stub_backend(cfg, maxB, context + 64, maxB * per)
    print(f"CudaBackend.prepare on the CPU (stub backend; Qwen3.5-35B-A3B shape, context {context}, median of "
          f"{reps}), us")
    for B in batches:
        steps, rows = decode_step(be, B, context, seed=B)
        for _ in range(20):
            be.prepare(Phase.DECODE, steps, rows, False)
        total = _median_us(lambda s=steps, r=rows: be.prepare(Phase.DECODE, s, r, False), reps)
        parts = {k: _median_us(f, reps) for k, f in pieces(be, steps, rows).items()}
        print(f"B={B}: prepare {total:.1f} | " + ", ".join(f"{k} {v:.1f}" for k, v in parts.items()), flush=True)


def _outcome(be: Any, phase: Any, steps: list, rows: list | None) -> dict[str, Any]:
    """Everything ``prepare`` produced for one step, or the exception it raised."""
    try:
        ctx = be.prepare(phase, steps, rows, False)
    except Exception as e:  # the exception is the outcome being recorded
        return {"error": (type(e).__name__, str(e), getattr(e, "reasons", None))}
    up = bytes(be.host_in.array[:ctx.upload_bytes])
    out = {k: v for k, v in vars(ctx).items() if k not in ("rows", "batch", "graph", "upload_bytes", "prefill")}
    out["upload"] = up
    out["graph"] = ctx.graph is not None
    out["batch"] = None if ctx.batch is None else (ctx.batch.context_lens, [t.tolist() for t in ctx.batch.page_tables],
                                                   ctx.batch.problems)
    out["prefill"] = None if ctx.prefill is None else repr(ctx.prefill)
    out["stats"] = (dict(be.graph_stats.replays), dict(be.graph_stats.eager), dict(be.dispatcher.plans),
                    dict(be.dispatcher.fallbacks), dict(be.dispatcher.errors), be.prefill_plans)
    return out


def cases(seed: int = 0, n: int = 1000) -> list[tuple[str, dict[str, Any], str, list, list | None]]:
    """Random decode and prefill steps with every kind of row and error, as (name, backend kwargs, phase name,
    steps, rows); page tables as lists or int64 arrays, as the scheduler and tests pass them."""
    from hybrid_runtime.backend import SampleRow
    from hybrid_runtime.ops.base import SeqStep
    from hybrid_runtime.sampling import SamplingParams

    rng = np.random.default_rng(seed)
    out = []
    num_pages, ps, max_seq = 3000, 16, 1088
    for i in range(n):
        decode = rng.random() < 0.6
        B = int(rng.integers(1, 12 if decode else 5)) if rng.random() < 0.7 else int(rng.integers(12, 41))
        kw: dict[str, Any] = dict(batch_invariant=bool(rng.random() < 0.8), prefill_kernel=bool(rng.random() < 0.7),
                                  mode=str(rng.choice(["auto", "on", "off"])))
        perm = [int(x) for x in rng.permutation(num_pages)]
        steps, rows = [], []
        for b in range(B):
            k = 1 if decode else int(rng.integers(1, 40))
            start = int(rng.integers(0, max_seq - k))
            if rng.random() < 0.1:
                start = int(rng.choice([0, 15, 16, 63, 64, max_seq - k]))
            need = -(-(start + k) // ps)
            extra = min(int(rng.integers(0, 3)), max_seq // ps - need)
            table = perm[:need + extra]
            perm = perm[need + extra:] or [int(x) for x in rng.permutation(num_pages)]
            table = table if rng.random() < 0.5 else np.asarray(table, np.int64)
            ids = [int(x) for x in rng.integers(0, 248320, k)]
            steps.append(SeqStep(b if rng.random() < 0.995 else 0, table, start, ids,
                                 need_logits=decode or bool(rng.random() < 0.7)))
        for _s in steps if decode else [s for s in steps if s.need_logits]:
            temp = float(rng.choice([0.0, 0.7, 1.0, 1.3, 1e-3]))
            top_p = float(rng.choice([1.0, 0.9, 0.37, 1e-4]))
            lp = None if rng.random() < 0.6 else int(rng.integers(0, 21))
            p = SamplingParams(temperature=temp, top_k=int(rng.choice([0, 1, 5, 50])), top_p=top_p, logprobs=lp)
            seed_ = int(rng.choice([0, 1, 2**32 - 1, 2**32, 2**32 + 5, 2**63 - 1, int(rng.integers(0, 2**62))]))
            rows.append(SampleRow(p, seed=seed_, counter=int(rng.integers(0, 2**33)), logprobs=lp))
        rows_: list | None = rows
        err = rng.random()
        name = "ok"
        if err < 0.35:  # one error (or a borderline case) per case
            kind = int(rng.integers(0, 13))
            s = steps[int(rng.integers(0, len(steps)))]
            if kind == 0:
                s.page_table = list(s.page_table)[:max(0, -(-(s.start_pos + len(s.token_ids)) // ps) - 1)]
                name = "table too short"
            elif kind == 1:
                t = list(s.page_table)
                t[int(rng.integers(0, len(t)))] = int(rng.choice([-1, num_pages, num_pages + 1, 2**40]))
                s.page_table = t if rng.random() < 0.5 else np.asarray(t, np.int64)
                name = "page out of pool"
            elif kind == 2:
                s.slot = int(rng.choice([-1, B + 20, 10**6]))
                name = "bad slot"
            elif kind == 3:
                s.token_ids = [*s.token_ids[:-1], int(rng.choice([-1, 248320]))]
                name = "bad token"
            elif kind == 4:
                s.start_pos = max_seq - len(s.token_ids) + int(rng.integers(1, 3))
                name = "position past max_seq_len"
            elif kind == 5:
                rows_ = rows[:-1]
                name = "rows short"
            elif kind == 6:
                rows_ = None
                name = "no rows"
            elif kind == 7:
                s.page_table = list(s.page_table) + [0] * (70 - len(s.page_table))
                name = "table longer than the stride"
            elif kind == 8:
                s.token_ids = [1, 2]
                name = "two tokens"
            elif kind == 9:
                s.start_pos = -1
                name = "negative position"
            elif kind == 10:
                steps = []
                name = "empty"
            elif kind == 11:
                t = list(s.page_table)
                t[-1] = int(rng.choice([-5, num_pages + 3]))  # past the pages used: no error
                s.page_table = t
                name = "junk past the used pages"
            else:
                s.page_table = []
                name = "empty table"
        out.append((f"{i}:{name}", kw, "DECODE" if decode else "PREFILL", steps, rows_))
    for B in (1, 8, 64):  # the timed shapes, with and without logprobs
        out.append((f"timed:{B}", {}, "DECODE", *decode_step(_timed_backend(), B, 1024, seed=B)))
        out.append((f"timed-lp:{B}", {}, "DECODE", *decode_step(_timed_backend(), B, 1024, seed=B, logprobs=True)))
    return out


def _timed_backend() -> Any:
    from benchmarks.gpu_decode_step import qwen35_moe_config

    return stub_backend(qwen35_moe_config(4), 64, 1088, 64 * 65)


def dump(path: str) -> None:
    from benchmarks.gpu_decode_step import qwen35_moe_config
    from hybrid_runtime.engine import Phase

    cfg = qwen35_moe_config(4)
    res = []
    for name, kw, phase, steps, rows in cases():
        if name.startswith("timed"):
            be = _timed_backend()
        else:
            be = stub_backend(cfg, 40, 1088, 3000, max_num_tokens=800, **kw)
        # stale bytes in the pinned mirror: a change in which bytes a step writes shows in its upload
        be.host_in.array[:] = np.random.default_rng(len(res)).integers(0, 256, be.host_in.array.size, np.uint8)
        res.append((name, _outcome(be, Phase[phase], steps, rows)))
    with open(path, "wb") as f:
        pickle.dump(res, f)
    errs = Counter(o["error"][0] for _, o in res if "error" in o)
    print(f"{len(res)} cases, {len(res) - sum(errs.values())} prepared, errors {dict(errs)} -> {path}")


def compare(a: str, b: str) -> int:
    with open(a, "rb") as f:
        ra = pickle.load(f)
    with open(b, "rb") as f:
        rb = pickle.load(f)
    bad = [na for (na, oa), (nb, ob) in zip(ra, rb, strict=True) if na != nb or oa != ob]
    print(f"{len(ra)} cases, {len(bad)} differ" + (f": {bad[:10]}" if bad else ""))
    return 1 if bad else 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=2000)
    ap.add_argument("--dump", metavar="FILE")
    ap.add_argument("--compare", nargs=2, metavar=("A", "B"))
    args = ap.parse_args()
    if args.compare:
        sys.exit(compare(*args.compare))
    if args.dump:
        dump(args.dump)
        return
    timing(args.batches, args.context, args.reps)


if __name__ == "__main__":
    main()
