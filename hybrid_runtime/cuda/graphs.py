"""Which decode steps replay which CUDA graph: batch-size buckets and attention plan classes (host logic
only; tested on any machine).

Design (how plans and graphs meet). A decode graph is captured per (bucket, plan class):

* **Bucket**: the batch is padded to the smallest bucket (1, 2, 4, 8, 16, 32, 64, ... capped at, and
  including, max_batch_size) that holds it; padding rows use the state sink slot, a KV sink page and
  greedy sampling, and their results are dropped.
* **Plan class**: the decode-attention grid. The dispatcher plans the real (padded) batch as always; its
  chunk count is rounded down to a power of two, and :func:`~hybrid_runtime.ops.dispatcher.fixed_grid_plan`
  gives the launch with exactly that many chunks, a fixed K/V tile, and the chunk length read by the
  kernels from device memory (step data, like the contexts and page tables). So a captured launch stays
  valid while the contexts grow, and a bucket needs at most 8 graphs. With the dispatcher's
  ``batch_invariant`` split the class is the grid's chunk count rounded *up* to a power of two (2 .. 64;
  :func:`~hybrid_runtime.ops.dispatcher.sequence_plan`): each sequence keeps its own chunk length (step data
  too) and the trailing chunks a shorter sequence leaves empty merge as exact zeros, so a replay gives the bits
  an eager step gives.
* **Guard**: every class plan is validated against the device limits and the workspace before capture
  (and the launch guard re-checks each launch while capturing); a class that fails is not captured. At
  replay the class plan is validated again against the step's real batch; a step whose class has no
  graph, or fails, runs eagerly with the dispatcher's plan, and :class:`GraphStats` counts why.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from ..ops.dispatcher import (
    CHUNK_ALIGN,
    DecodeAttentionDispatcher,
    DecodeBatch,
    LaunchPlan,
    fixed_grid_plan,
    graph_blocks,
    next_pow2,
    plan,
    sequence_plan,
    validate,
)

GraphKey = tuple[int, int]  # (bucket, chunks per sequence)


def decode_buckets(max_batch_size: int) -> list[int]:
    """Powers of two below ``max_batch_size``, then ``max_batch_size`` itself."""
    if max_batch_size < 1:
        raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
    out, b = [], 1
    while b < max_batch_size:
        out.append(b)
        b *= 2
    return [*out, max_batch_size]


def bucket_for(n: int, buckets: list[int]) -> int | None:
    """The smallest bucket holding ``n`` rows (None if none does)."""
    return next((b for b in buckets if b >= n), None)


def class_blocks(dispatcher: DecodeAttentionDispatcher, batch_at_max: DecodeBatch) -> list[int]:
    """The chunk counts graphs are captured for, for one bucket: 1, 2, 4, ... up to the largest class the
    dispatcher picks for any context up to the longest (``batch_at_max``: the bucket's batch at max_seq_len).
    Every context length is swept in steps of the chunk alignment, since chunk alignment can make a shorter
    context split into more chunks than the longest one (1024 tokens: 8 chunks of 128; 1088: 6 of 192)."""
    from dataclasses import replace

    longest = max(batch_at_max.context_lens)
    B = batch_at_max.batch_size
    top = 1
    seq = dispatcher.batch_invariant and dispatcher.mode != "off"
    for n in sorted({*range(CHUNK_ALIGN, longest + 1, CHUNK_ALIGN), longest}):
        b = replace(batch_at_max, context_lens=(n,) * B, page_tables=batch_at_max.page_tables)
        p = sequence_plan(b, dispatcher.limits) if seq else plan(b, dispatcher.mode, dispatcher.limits,
                                                                   dispatcher.workspace_capacity)
        top = max(top, p.blocks_per_seq)
    if seq:  # the sequence split's classes: 2, 4, ... up to the power of two that holds the most chunks
        return [1 << i for i in range(1, next_pow2(top).bit_length())]
    out, blocks = [], 1
    while blocks <= graph_blocks(top):
        out.append(blocks)
        blocks *= 2
    return out


@dataclass
class GraphStats:
    """What the metrics show: the captured keys, replays per key, eager decode steps by reason, classes the
    guard refused at capture."""

    captured: dict[GraphKey, int] = field(default_factory=dict)  # key -> nodes in the graph
    replays: Counter = field(default_factory=Counter)
    eager: Counter = field(default_factory=Counter)
    refused: Counter = field(default_factory=Counter)

    def snapshot(self) -> dict:
        name = lambda k: f"b{k[0]}x{k[1]}"  # noqa: E731
        return {"captured": {name(k): v for k, v in sorted(self.captured.items())},
                "replays": {name(k): v for k, v in sorted(self.replays.items())},
                "eager": dict(self.eager), "refused": dict(self.refused)}


@dataclass(frozen=True)
class DecodeChoice:
    """How a decode step runs: ``key`` (None: eagerly) and the attention ``plan`` its launches use."""

    key: GraphKey | None
    plan: LaunchPlan | None
    reason: str = ""


def choose(batch: DecodeBatch | None, bucket: int, dispatcher: DecodeAttentionDispatcher,
           has_graph: Callable[[GraphKey], bool], graphs_on: bool) -> DecodeChoice:
    """Plan a padded decode batch (``batch`` None: a model without attention layers) and pick its graph.

    The step's attention plan is its class plan whenever that validates for this batch — replayed from a graph
    or launched eagerly alike, so a graph replay and an eager step compute the same numbers — and the
    dispatcher's own plan otherwise. Raises the dispatcher's DecodeAttentionError when no plan at all fits
    (the step fails, eager or not)."""
    if batch is None:
        key = (bucket, 1)
        if graphs_on and has_graph(key):
            return DecodeChoice(key, None)
        return DecodeChoice(None, None, "graphs_off" if not graphs_on else "no_graph")
    p = dispatcher.select(batch)
    if p.seq_chunks is not None:  # the batch-invariant split: the class holds every chunk (rounded up)
        blocks = next_pow2(p.blocks_per_seq)
        gp = sequence_plan(batch, dispatcher.limits, blocks)
    else:
        blocks = graph_blocks(p.blocks_per_seq)
        gp = fixed_grid_plan(batch, blocks, dispatcher.limits)
    if validate(gp, batch, dispatcher.limits, dispatcher.workspace_capacity):
        return DecodeChoice(None, p, "class_plan_invalid")
    key = (bucket, blocks)
    if not graphs_on:
        return DecodeChoice(None, gp, "graphs_off")
    if not has_graph(key):
        return DecodeChoice(None, gp, "no_graph")
    return DecodeChoice(key, gp)
