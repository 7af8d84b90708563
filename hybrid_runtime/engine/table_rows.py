"""Embedding-table lookups read from the bundle's file with ``pread``, not through a memory mapping.

A segment that starts with ``Gather(table, input_ids)`` on a table stored as external data (the embedding,
131 MB for the 334M benchmark model) would have onnxruntime memory-map the table and read a row per token.
A page fault in a file mapping maps the cached folio around the row, up to 2 MB on current kernels, so one
decode step at batch 16 left 20-28 MB of the table resident and a 512-token prefill of prompts spread over
the vocabulary could map most of it: resident memory that rises and falls with every step and sits on top
of everything else at the process's peak (``FileMappings.release`` dropped the pages after each run, but
the peak had been reached by then).

:func:`split_table_gathers` rewrites such a segment at load: the table's initializer is removed and the
``Gather`` becomes an ``Identity`` of a new graph input ``<table>.rows`` ``[num_tokens, width]``;
:class:`TableLookup` fills that input with one ``pread`` per token from the table's bytes in the external
data file into a buffer of the context (4 KB per token; the bytes stay in the page cache, not in this
process). The segment's other initializers keep their external data (onnxruntime reads them from the
bundle's folder, ``session.model_external_initializers_file_folder_path``). The rows are the bytes the
``Gather`` would have read, so the segment's outputs are bit-identical.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import helper

from .base import ShapeError

ROWS_SUFFIX = ".rows"
# A table smaller than this stays inside the graph (mapping it costs at most this much).
MIN_TABLE_BYTES = 1 << 20


@dataclass(eq=False)
class TableLookup:
    """Rows of one ``[num_rows, width]`` table of a bundle file, read by index into a caller's buffer.

    ``ids_input``: the graph input that held the indices; ``keep_ids``: whether the rewritten graph still
    reads it (another node than the removed ``Gather`` consumes it); ``rows_input``: the graph input that
    now takes the rows."""

    ids_input: str
    rows_input: str
    keep_ids: bool
    path: Path
    offset: int
    num_rows: int
    width: int
    dtype: np.dtype

    def __post_init__(self) -> None:
        self._fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        self._row_bytes = self.width * self.dtype.itemsize
        size = os.fstat(self._fd).st_size
        if self.offset < 0 or self.offset + self.num_rows * self._row_bytes > size:
            os.close(self._fd)
            raise ValueError(f"{self.path}: table {self.rows_input.removesuffix(ROWS_SUFFIX)} at bytes "
                             f"{self.offset}+{self.num_rows * self._row_bytes} lies outside the file ({size} bytes)")

    def buffer(self, max_tokens: int) -> np.ndarray:
        """A buffer for the rows of up to ``max_tokens`` indices (pass it to :meth:`read`)."""
        return np.empty((max_tokens, self.width), self.dtype)

    def read(self, ids: np.ndarray, buf: np.ndarray) -> np.ndarray:
        """``table[ids]`` into the first ``len(ids)`` rows of ``buf`` (returned as a view of it)."""
        n = len(ids)
        if n > len(buf):
            raise ShapeError(f"{n} indices for a row buffer of {len(buf)}")
        if n and (int(ids.min()) < 0 or int(ids.max()) >= self.num_rows):
            raise ShapeError(f"table {self.rows_input.removesuffix(ROWS_SUFFIX)}: index outside 0..{self.num_rows - 1}")
        out = buf[:n]
        mv = memoryview(out.reshape(-1).view(np.uint8))
        rb, fd, base = self._row_bytes, self._fd, self.offset
        for i, t in enumerate(ids.tolist()):
            if os.preadv(fd, [mv[i * rb:(i + 1) * rb]], base + t * rb) != rb:
                raise OSError(f"{self.path}: short read of table row {t}")
        return out

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __del__(self) -> None:
        with contextlib.suppress(OSError, AttributeError):  # (a lookup whose __post_init__ failed)
            self.close()


def _external(init: onnx.TensorProto) -> dict[str, str] | None:
    if init.data_location != onnx.TensorProto.EXTERNAL:
        return None
    return {e.key: e.value for e in init.external_data}


def split_table_gathers(model_path: str | Path) -> tuple[onnx.ModelProto, list[TableLookup]] | None:
    """The segment at ``model_path`` with every ``Gather`` of an external-data table (axis 0, at least
    :data:`MIN_TABLE_BYTES`, indexed by a graph input) replaced by a rows input, and a lookup per table;
    None when there is nothing to split (or the file layout is not the one this reads)."""
    model_path = Path(model_path)
    if not hasattr(os, "preadv"):
        return None
    model = onnx.load(model_path, load_external_data=False)
    g = model.graph
    inits = {i.name: i for i in g.initializer}
    graph_inputs = {i.name: i for i in g.input}
    lookups: list[TableLookup] = []
    for node in list(g.node):
        if node.op_type != "Gather" or node.domain not in ("", "ai.onnx") or len(node.input) != 2:
            continue
        table, ids = node.input
        init, ext = inits.get(table), _external(inits[table]) if table in inits else None
        axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
        if init is None or ext is None or ids not in graph_inputs or axis != 0 or len(init.dims) != 2:
            continue
        dtype = np.dtype(helper.tensor_dtype_to_np_dtype(init.data_type))
        num_rows, width = (int(d) for d in init.dims)
        nbytes = num_rows * width * dtype.itemsize
        if nbytes < MIN_TABLE_BYTES or int(ext.get("length", nbytes)) != nbytes or "location" not in ext:
            continue
        if sum(x == table for n in g.node for x in n.input) != 1:  # the table feeds another node too: keep it
            continue
        location = (model_path.parent / ext["location"]).resolve()
        if model_path.parent.resolve() not in location.parents:
            continue
        rows = table + ROWS_SUFFIX
        g.input.append(helper.make_tensor_value_info(rows, init.data_type, ["num_tokens", width]))
        at = list(g.node).index(node)
        g.node.remove(node)
        g.node.insert(at, helper.make_node("Identity", [rows], list(node.output), name=node.name or rows))
        g.initializer.remove(init)
        del inits[table]
        lookups.append(TableLookup(ids, rows, True, location, int(ext.get("offset", 0)), num_rows, width, dtype))
    if not lookups:
        return None
    for lk in lookups:  # an index input that no node reads any more leaves the graph
        lk.keep_ids = any(lk.ids_input in n.input for n in g.node)
        if not lk.keep_ids and graph_inputs[lk.ids_input] in g.input:
            g.input.remove(graph_inputs[lk.ids_input])
    return model, lookups
