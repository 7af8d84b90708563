"""Embedding-table lookups read from the bundle's file with ``pread``, not through a memory mapping.

A segment that starts with ``Gather(table, input_ids)`` on a table stored as external data (the embedding,
131 MB for the 334M benchmark model) would have onnxruntime memory-map the table and read a row per token.
A page fault in a file mapping maps the cached folio around the row, up to 2 MB on current kernels, so one
decode step at batch 16 left 20-28 MB of the table resident and a 512-token prefill of prompts spread over
the vocabulary could map most of it: resident memory that rises and falls with every step and sits on top
of everything else at the process's peak (``FileMappings.release`` dropped the pages after each run, but
the peak had been reached by then).

:func:`split_table_gathers` rewrites such a segment at load: the table's initializer is removed and the
``Gather`` becomes an ``Identity`` of a new graph input ``<table>.rows`` ``[num_tokens, width]`` (at the
protobuf wire level, :mod:`..onnx_proto`: every other field of the segment is copied as it was);
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

from .. import onnx_proto as pb
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


@dataclass
class _Node:
    inputs: list[str]
    outputs: list[str]
    name: str
    op_type: str
    domain: str
    axis: int


def _node(buf: bytes) -> _Node:  # NodeProto: input 1, output 2, name 3, op_type 4, attribute 5, domain 7
    axis = next((pb.integer(a, 3) for a in pb.messages(buf, 5) if pb.text(a, 1) == "axis"), 0)
    return _Node(pb.strings(buf, 1), pb.strings(buf, 2), pb.text(buf, 3), pb.text(buf, 4), pb.text(buf, 7), axis)


@dataclass
class _Init:
    name: str
    dims: list[int]
    data_type: int
    external: dict[str, str] | None


def _init(buf: bytes) -> _Init:  # TensorProto: dims 1, data_type 2, name 8, external_data 13, data_location 14
    ext = None
    if pb.integer(buf, 14) == pb.EXTERNAL:
        ext = {pb.text(e, 1): pb.text(e, 2) for e in pb.messages(buf, 13)}
    return _Init(pb.text(buf, 8), pb.ints(buf, 1), pb.integer(buf, 2), ext)


_GRAPH, _NODE, _INIT, _INPUT = 7, 1, 5, 11  # ModelProto.graph, GraphProto.node / initializer / input


def split_table_gathers(model_path: str | Path) -> tuple[bytes, list[TableLookup]] | None:
    """The segment at ``model_path`` (serialised) with every ``Gather`` of an external-data table (axis 0,
    at least :data:`MIN_TABLE_BYTES`, indexed by a graph input) replaced by a rows input, and a lookup per
    table; None when there is nothing to split (or the file layout is not the one this reads)."""
    model_path = Path(model_path)
    if not hasattr(os, "preadv"):
        return None
    model = list(pb.fields(model_path.read_bytes()))
    at_graph = next((k for k, f in enumerate(model) if f[0] == _GRAPH), None)
    if at_graph is None:
        return None
    graph: list[bytes | None] = []  # the graph's fields, encoded; None = removed
    nodes: dict[int, _Node] = {}  # field index -> node
    inits: dict[str, tuple[int, _Init]] = {}
    graph_inputs: dict[str, int] = {}
    graph_bytes = model[at_graph][2]
    if not isinstance(graph_bytes, bytes):
        return None
    for k, (n, _, value, raw) in enumerate(pb.fields(graph_bytes)):
        graph.append(raw)
        if not isinstance(value, bytes):
            continue
        if n == _NODE:
            nodes[k] = _node(value)
        elif n == _INIT:
            init = _init(value)
            inits[init.name] = (k, init)
        elif n == _INPUT:
            graph_inputs[pb.text(value, 1)] = k
    lookups: list[TableLookup] = []
    added: list[bytes] = []
    for k, node in list(nodes.items()):
        if node.op_type != "Gather" or node.domain not in ("", "ai.onnx") or len(node.inputs) != 2:
            continue
        table, ids = node.inputs
        if table not in inits:
            continue
        at_init, init = inits[table]
        ext = init.external
        if ext is None or ids not in graph_inputs or node.axis != 0 or len(init.dims) != 2:
            continue
        try:
            dtype = pb.np_dtype(init.data_type)
        except KeyError:
            continue
        num_rows, width = init.dims
        nbytes = num_rows * width * dtype.itemsize
        if nbytes < MIN_TABLE_BYTES or int(ext.get("length", nbytes)) != nbytes or "location" not in ext:
            continue
        if sum(x == table for nd in nodes.values() for x in nd.inputs) != 1:  # the table feeds another node too
            continue
        location = (model_path.parent / ext["location"]).resolve()
        if model_path.parent.resolve() not in location.parents:
            continue
        rows = table + ROWS_SUFFIX
        added.append(pb.field_bytes(_INPUT, pb.make_tensor_value_info(rows, init.data_type, ["num_tokens", width])
                                    .encode()))
        nodes[k] = _Node([rows], node.outputs, node.name or rows, "Identity", "", 0)
        graph[k] = pb.field_bytes(_NODE, pb.make_node("Identity", [rows], node.outputs, name=node.name or rows)
                                  .encode())
        graph[at_init] = None
        del inits[table]
        lookups.append(TableLookup(ids, rows, True, location, int(ext.get("offset", 0)), num_rows, width, dtype))
    if not lookups:
        return None
    for lk in lookups:  # an index input that no node reads any more leaves the graph
        lk.keep_ids = any(lk.ids_input in nd.inputs for nd in nodes.values())
        if not lk.keep_ids:
            graph[graph_inputs[lk.ids_input]] = None
    new_graph = b"".join(f for f in graph if f is not None) + b"".join(added)
    model[at_graph] = (_GRAPH, 2, new_graph, pb.field_bytes(_GRAPH, new_graph))
    return b"".join(f[3] for f in model), lookups
