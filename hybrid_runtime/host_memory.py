"""Host buffers that are resident from the start.

``np.zeros`` of a large array is ``calloc``: the kernel maps zero pages lazily, and a page enters the
process's resident set only when it is first written. A KV page pool handed out lowest index first is
then touched a little further every time the number of pages in use reaches a new high, and the
serving process's RSS creeps up for hours (a 4-user soak kept finding new highs after 2 hours) until
the whole pool is resident. :func:`resident_zeros` writes every page once at allocation, so the pool's
memory is committed at load — what ``kv_cache_bytes`` asks for is what RSS shows from the first
request on, and growth after warm-up means a leak, not a pool filling up.

``resident_rows`` leaves the rows after the first ``resident_rows`` lazily mapped: for buffers whose last
rows are only touched by code that this process may never run (the state pool's padding-sink row, written
only by padded decode rows of the CUDA kernels, 1 MiB per GDN layer of the 334M benchmark model).
"""

from __future__ import annotations

from typing import Any

import numpy as np


def resident_zeros(shape: tuple[int, ...] | int, dtype: Any = np.float32,
                   resident_rows: int | None = None) -> np.ndarray:
    """A zero-filled array whose pages are all resident (written once here, not on first use); with
    ``resident_rows``, only those first rows (along axis 0) are, and the rest are zero pages mapped lazily."""
    if resident_rows is None:
        out = np.empty(shape, dtype)
        out.fill(0)
        return out
    out = np.zeros(shape, dtype)  # calloc: untouched pages stay out of the resident set
    out[:resident_rows].fill(0)
    return out
