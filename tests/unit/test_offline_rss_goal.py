"""The offline benchmark's peak-RSS goal line (issue 18: the 334M shape at batch 16 within 1.5 GB) and the RSS
breakdown's report: ratios from the measured bytes, printed only where the model has a goal at that batch."""

from __future__ import annotations

import pytest

from benchmarks.offline import RSS_GOALS, rss_goal_line
from benchmarks.rss_breakdown import report


def test_goal_line_ratio_and_verdict() -> None:
    batch, goal = RSS_GOALS["qwen3-next-334m"]
    assert (batch, goal) == (16, 1.5e9)
    over = rss_goal_line("qwen3-next-334m", 16, 1_554_526_208)
    assert over is not None and "1482.5 MiB" in over and "1430.5 MiB" in over and "**1.036x**" in over
    assert over.endswith("(not met)")
    under = rss_goal_line("qwen3-next-334m", 16, int(goal) - 1)
    assert under is not None and under.endswith("(met)") and "**1.000x**" in under
    assert rss_goal_line("qwen3-next-334m", 4, 1) is None  # the goal is at batch 16 only
    assert rss_goal_line("default", 16, 1) is None


def _stage(rss: float, anon: float, hwm: float | None = None) -> dict[str, float]:
    return {"VmRSS": rss, "VmHWM": rss if hwm is None else hwm, "RssAnon": anon, "RssFile": rss - anon}


def test_breakdown_report_splits_the_load_and_names_the_goal() -> None:
    res = {"stages": {"imports": _stage(80.0, 30.0), "loaded": _stage(1450.0, 1393.0),
                      "warm": _stage(1477.0, 1418.0), "workload": _stage(1482.0, 1423.0, 1484.0)},
           "held": {"weights": 1147.5, "state": 150.5, "kv": 51.0},
           "growth": {"segment": 14.0, "attention": 15.0}, "max_num_tokens": 128}
    text = report("qwen3-next-334m", 16, res)
    cells = [[c.strip() for c in line.strip().strip("|").split("|")] for line in text.splitlines()
             if line.startswith("| ")]
    rows = {c[0]: c[1] for c in cells if len(c) == 2}
    assert float(rows["rest of the load (the sessions' own heap, library code first run)"]) \
        == pytest.approx(1450.0 - 80.0 - 1147.5 - 150.5 - 51.0)
    assert float(rows["serving: RSS growth after load"]) == pytest.approx(32.0)
    assert float(rows["peak growth after load (VmHWM), raised during:"]) == pytest.approx(34.0)
    assert float(rows["&nbsp; attention operator"]) == pytest.approx(15.0)
    assert float(rows["&nbsp; MoE operator"]) == 0.0  # a piece that raised nothing
    assert float(rows["transient above the final RSS"]) == pytest.approx(2.0)
    assert text.endswith(f"**{1484.0 * 2**20 / 1.5e9:.3f}x**")
    assert "goal" not in report("qwen3-next-334m", 4, res)  # no goal at batch 4
    assert "warm-up" not in text.splitlines()[0]
    assert "load-time warm-up" in report("qwen3-next-334m", 16, {**res, "warmup": True}).splitlines()[0]


SMAPS = """\
55d0c0000000-55d0c2000000 rw-p 00000000 00:00 0                          [heap]
Size:              32768 kB
Rss:               30720 kB
Anonymous:         30720 kB
7f0000000000-7f0008000000 rw-p 00000000 00:00 0
Size:             131072 kB
Rss:              129024 kB
7f0008000000-7f0009000000 rw-p 00000000 00:00 0
Rss:                2048 kB
7f1000000000-7f1002000000 r-xp 00000000 08:01 4242                       /venv/lib/onnxruntime/capi/ort.so
Rss:               26624 kB
7f1002000000-7f1002100000 r--p 02000000 08:01 4242                       /venv/lib/onnxruntime/capi/ort.so
Rss:                 512 kB
7f2000000000-7f2000100000 r--p 00000000 08:01 99                         /data/my bundle/weights (deleted)
Rss:                1024 kB
7ffc00000000-7ffc00021000 rw-p 00000000 00:00 0                          [stack]
Rss:                 132 kB
"""


def test_mappings_group_resident_memory_by_mapping() -> None:
    from benchmarks.rss_breakdown import mappings

    m = mappings(SMAPS)
    assert m == pytest.approx({"[heap]": 30.0, "[anonymous]": 128.0, "ort.so": 26.5, "weights (deleted)": 1.0,
                               "[stack]": 132 / 1024})
    live = mappings()  # this process: every resident page belongs to some mapping
    from benchmarks.rss_breakdown import status

    assert sum(live.values()) == pytest.approx(status()["VmRSS"], abs=4.0)


def test_breakdown_report_lists_the_largest_mappings() -> None:
    res = {"stages": {"imports": _stage(80.0, 30.0), "loaded": _stage(1450.0, 1393.0),
                      "workload": _stage(1482.0, 1423.0, 1484.0)},
           "held": {"weights": 1147.5}, "growth": {}, "max_num_tokens": 128,
           "mappings": {f"lib{i}.so": float(i) for i in range(1, 16)} | {"[anonymous]": 1375.0}}
    text = report("qwen3-next-334m", 16, res)
    rows = [line for line in text.splitlines() if line.startswith("| ")]
    i = rows.index("| resident after the workload, by mapping | MiB |")
    listed = rows[i + 1:i + 15]
    assert listed[0] == "| [anonymous] | 1375.0 |" and listed[1] == "| lib15.so | 15.0 |"
    assert listed[12] == "| 4 other mappings | 10.0 |"  # lib1..lib4 (the 12 largest are named)
    assert text.endswith(f"**{1484.0 * 2**20 / 1.5e9:.3f}x**")  # the verdict stays the last line
    assert "by mapping" not in report("qwen3-next-334m", 16, {k: v for k, v in res.items() if k != "mappings"})


def test_bench_kv_pool_holds_every_workload_at_once() -> None:
    """The bench bundles' KV pool is a token budget (not 16 slots x max_seq_len): it must still admit every
    workload of the benchmark in one go (the scheduler reserves each sequence's whole length at admission, so a
    smaller pool would make sequences wait and the batch-16 decode would not be a batch of 16)."""
    from benchmarks.offline import BATCHES, NEW, PREFILL_BATCH, PREFILL_LEN, PROMPT, _build_options

    lim = _build_options().limits()

    def pages(n_tokens: int) -> int:
        return -(-min(n_tokens, lim.max_seq_len) // lim.page_size)

    for batch in BATCHES:
        assert batch * pages(PROMPT + NEW) <= lim.num_kv_pages
    assert PREFILL_BATCH * pages(PREFILL_LEN + 1) <= lim.num_kv_pages
    assert max(BATCHES) * pages(PROMPT + NEW) == lim.num_kv_pages  # and not more: 192 pages, 36 MiB for the 334M
    assert lim.num_kv_pages < lim.num_state_slots * pages(lim.max_seq_len)  # below the builder's default (272)


def test_serving_imports_leave_out_what_the_cpu_path_never_runs() -> None:
    """A CPU serving process (and the benchmarks' workers, whose RSS is measured) does not import
    ``subprocess`` / ``ctypes.util`` (with shutil, tempfile, bz2, lzma: 1.2 MiB of RSS) nor torch; the
    heap trim still finds glibc's malloc_trim without them."""
    import subprocess
    import sys

    code = ("import sys, benchmarks.offline, benchmarks.rss_breakdown\n"
            "from hybrid_runtime import backend\n"
            "from hybrid_runtime.serving import ServingEngine\n"
            "from hybrid_runtime.host_memory import release_free_heap\n"
            "trimmed = release_free_heap()\n"
            "print(sorted(m for m in ('subprocess', 'ctypes.util', 'tempfile', 'torch') if m in sys.modules), trimmed)")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout.split()
    assert out[0] == "[]"
    assert out[-1] == ("True" if sys.platform.startswith("linux") else out[-1])


def test_ours_worker_times_the_decode_steps(default_bundle) -> None:
    """The offline benchmark's worker attributes the decode steps' time to the pipeline's pieces whichever entry the
    serving loop runs a step through (it went from runner.step to launch / collect with async scheduling, and the
    worker's hook on runner.step then timed nothing: `make bench` failed on a division by zero)."""
    from benchmarks.offline import worker_ours

    res = worker_ours(default_bundle, 2)
    split = res["split"]
    assert set(split) == {"segments", "gdn", "attention", "moe"}
    assert all(v > 0 for v in split.values()) and sum(split.values()) <= 1.0, split
    assert res["decode_tps"] > 0 and res["prefill_tps"] > 0 and res["peak_rss"] > 0
