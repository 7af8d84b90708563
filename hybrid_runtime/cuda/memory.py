"""GPU memory budget of a ``cuda`` backend: how many KV pages (and whether the state slots) fit.

Host logic only (tested on the CPU). The backend loads the weights and its static buffers first, asks the
driver for the free memory, and calls :func:`plan_memory`: ``gpu_memory_fraction`` of what is free then
(minus a reserve for the CUDA graphs and the libraries' workspaces, which come after) is the budget of the
GDN state slots and the KV pages -- the idea of vLLM's ``gpu_memory_utilization`` and TensorRT-LLM's
``kv_cache_free_gpu_mem_fraction``. The state slots are fixed by ``max_batch_size``; the KV pool is the
bundle's page count (or ``kv_cache_bytes``'s), capped to what fits. A budget that cannot hold the state
slots, or a KV pool too small for one sequence of ``max_seq_len``, fails the load with a message that says
what to change.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config import ConfigError

GIB = 1 << 30
# CUDA graphs of every decode bucket and class, cuBLASLt's workspace and the driver's own allocations after
# the KV pool is made (measured on the H200: see the README's GPU serving section).
DEFAULT_RESERVE_BYTES = 512 << 20


@dataclass(frozen=True, slots=True)
class MemoryPlan:
    """The sizes chosen at load (all in bytes, except the page counts)."""

    free_bytes: int  # free device memory after weights and static buffers
    total_bytes: int
    fraction: float
    reserve_bytes: int
    budget_bytes: int  # fraction x free - reserve: for state slots + KV pages
    state_bytes: int
    page_bytes: int
    pages_wanted: int
    pages: int  # KV pages allocated (without the sink page)

    @property
    def kv_bytes(self) -> int:
        return self.pages * self.page_bytes

    @property
    def capped(self) -> bool:
        return self.pages < self.pages_wanted

    def describe(self) -> str:
        g = GIB
        return (f"GPU memory: {self.free_bytes / g:.2f} of {self.total_bytes / g:.2f} GiB free after weights; "
                f"gpu_memory_fraction {self.fraction:g} - {self.reserve_bytes / g:.2f} GiB reserve = "
                f"{self.budget_bytes / g:.2f} GiB budget: state slots {self.state_bytes / g:.2f} GiB, KV "
                f"{self.pages} pages = {self.kv_bytes / g:.2f} GiB"
                + (f" (capped from the {self.pages_wanted} asked for)" if self.capped else ""))


def plan_memory(free_bytes: int, total_bytes: int, *, fraction: float, state_bytes: int, page_bytes: int,
                pages_wanted: int, min_pages: int, reserve_bytes: int = DEFAULT_RESERVE_BYTES) -> MemoryPlan:
    """Size the KV pool. ``page_bytes``: one page over all attention layers (K and V); ``min_pages``: the
    pages one sequence of ``max_seq_len`` needs (a smaller pool could never finish such a request).

    ``fraction`` in (0, 1]. Raises ConfigError when the state slots do not fit or the pool would be smaller
    than ``min_pages``.
    """
    if not 0.0 < fraction <= 1.0:
        raise ConfigError(f"gpu_memory_fraction={fraction}: give a number in (0, 1], e.g. 0.9")
    if pages_wanted < 1 or page_bytes < 0 or state_bytes < 0 or min_pages < 0:
        raise ValueError("pages_wanted >= 1, and sizes >= 0")
    budget = int(free_bytes * fraction) - reserve_bytes
    g = GIB
    if state_bytes > budget:
        raise ConfigError(
            f"the GDN state slots need {state_bytes / g:.2f} GiB but gpu_memory_fraction {fraction:g} of the "
            f"{free_bytes / g:.2f} GiB free after the weights leaves {max(budget, 0) / g:.2f} GiB (after a "
            f"{reserve_bytes / g:.2f} GiB reserve for graphs and workspaces): lower max_batch_size, raise "
            f"gpu_memory_fraction, or use a GPU with more memory")
    fit = (budget - state_bytes) // page_bytes if page_bytes else pages_wanted
    pages = int(min(pages_wanted, fit))
    if pages < min_pages:
        raise ConfigError(
            f"the KV pool would hold {pages} pages ({max(pages, 0) * page_bytes / g:.2f} GiB), but one sequence of "
            f"max_seq_len needs {min_pages}: gpu_memory_fraction {fraction:g} of the {free_bytes / g:.2f} GiB "
            f"free after the weights, minus {state_bytes / g:.2f} GiB of state slots, is too little. Raise "
            f"gpu_memory_fraction, lower max_batch_size or rebuild the bundle with a smaller --max-seq-len")
    return MemoryPlan(free_bytes, total_bytes, fraction, reserve_bytes, budget, state_bytes, page_bytes,
                      pages_wanted, pages)
