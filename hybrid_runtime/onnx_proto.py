"""The few ONNX protobuf messages the runtime writes and reads, without the ``onnx`` package.

The CPU operators build small graphs at load (GDN, paged attention, MoE) and the engine rewrites the first
segment's embedding ``Gather`` (:mod:`.engine.table_rows`). ``import onnx`` costs the serving process about
11 MiB of resident memory (the package, ml_dtypes and protobuf's runtime) for work that is a few hundred
bytes of protobuf wire format; onnxruntime parses the bytes itself. So the runtime writes the messages here
and the ``onnx`` package stays a dependency of the builder and the tests (which check that these bytes
parse with ``onnx`` and pass its checker).

Writer: :func:`make_node`, :func:`make_tensor_value_info`, :func:`make_graph`, :func:`make_model`,
:func:`make_opsetid` and :func:`from_array` mirror ``onnx.helper`` / ``onnx.numpy_helper`` for the fields
used here; :class:`Tensor` is an initializer (inline raw data or external data) that stays editable until
the model is serialised. Reader: :func:`fields` splits a message into its fields (wire level), enough to
read a segment and write it back with a few fields changed (every other field is copied as it was).
Field numbers are those of ``onnx/onnx.proto``.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

# TensorProto.DataType
FLOAT, UINT8, INT8, INT32, INT64, BOOL, FLOAT16, DOUBLE, BFLOAT16 = 1, 2, 3, 6, 7, 9, 10, 11, 16
EXTERNAL = 1  # TensorProto.DataLocation
_NP = {np.dtype(np.float32): FLOAT, np.dtype(np.uint8): UINT8, np.dtype(np.int8): INT8, np.dtype(np.int32): INT32,
       np.dtype(np.int64): INT64, np.dtype(np.bool_): BOOL, np.dtype(np.float16): FLOAT16,
       np.dtype(np.float64): DOUBLE}
_FROM = {v: k for k, v in _NP.items()}
# AttributeProto.AttributeType
_A_FLOAT, _A_INT, _A_STRING, _A_FLOATS, _A_INTS = 1, 2, 3, 6, 7
_VARINT, _I64, _LEN, _I32 = 0, 1, 2, 5  # wire types


def np_dtype(data_type: int) -> np.dtype:
    """numpy dtype of a TensorProto data type (KeyError for one the runtime does not use)."""
    return _FROM[data_type]


# ---- writing ----------------------------------------------------------------------------------------------
def _varint(v: int) -> bytes:
    v &= (1 << 64) - 1  # negative int64: ten bytes, two's complement
    out = bytearray()
    while True:
        b, v = v & 0x7F, v >> 7
        out.append(b | (0x80 if v else 0))
        if not v:
            return bytes(out)


def _key(num: int, wire: int) -> bytes:
    return _varint(num << 3 | wire)


def _int(num: int, v: int) -> bytes:
    return _key(num, _VARINT) + _varint(int(v))


def _bytes(num: int, data: bytes | str) -> bytes:
    data = data.encode() if isinstance(data, str) else data
    return _key(num, _LEN) + _varint(len(data)) + data


def _packed(num: int, values: Sequence[int]) -> bytes:
    return _bytes(num, b"".join(_varint(int(v)) for v in values))


def _entry(num: int, key: str, value: str) -> bytes:  # StringStringEntryProto
    return _bytes(num, _bytes(1, key) + _bytes(2, value))


@dataclass
class Tensor:
    """An initializer: ``raw`` bytes inline, or ``external`` (key, value) pairs (``location``, ``offset``,
    ``length``) naming where its data is (then ``data_location`` is EXTERNAL)."""

    name: str
    data_type: int
    dims: list[int]
    raw: bytes = b""
    external: list[tuple[str, str]] | None = None

    @property
    def is_external(self) -> bool:
        return self.external is not None

    def encode(self) -> bytes:
        out = (_packed(1, self.dims) if self.dims else b"") + _int(2, self.data_type) + _bytes(8, self.name)
        if self.external is None:
            return out + _bytes(9, self.raw)
        return out + b"".join(_entry(13, k, v) for k, v in self.external) + _int(14, EXTERNAL)


def from_array(arr: np.ndarray, name: str) -> Tensor:
    """An inline initializer holding ``arr`` (little-endian raw data, as ``onnx.numpy_helper.from_array``)."""
    arr = np.asarray(arr)
    return Tensor(name, _NP[arr.dtype], [int(d) for d in arr.shape], np.ascontiguousarray(arr).astype(
        arr.dtype.newbyteorder("<"), copy=False).tobytes())


def external_tensor(name: str, dims: Sequence[int], data_type: int = FLOAT,
                    location: str = "added-at-session-creation") -> Tensor:
    """An initializer whose data lies outside the graph (a file range, or an OrtValue added to the session)."""
    return Tensor(name, data_type, [int(d) for d in dims], external=[("location", location)])


@dataclass
class Node:
    op_type: str
    inputs: list[str]
    outputs: list[str]
    name: str = ""
    domain: str = ""
    attrs: dict = field(default_factory=dict)

    def encode(self) -> bytes:
        out = b"".join(_bytes(1, i) for i in self.inputs) + b"".join(_bytes(2, o) for o in self.outputs)
        if self.name:
            out += _bytes(3, self.name)
        out += _bytes(4, self.op_type)
        for k in sorted(self.attrs):  # as onnx.helper.make_node: attributes sorted by name
            out += _bytes(5, _attribute(k, self.attrs[k]))
        return out + (_bytes(7, self.domain) if self.domain else b"")


def _attribute(name: str, v: object) -> bytes:
    out = _bytes(1, name)
    if isinstance(v, bool | int | np.integer):
        return out + _int(3, int(v)) + _int(20, _A_INT)
    if isinstance(v, float | np.floating):
        return out + _key(2, _I32) + struct.pack("<f", float(v)) + _int(20, _A_FLOAT)
    if isinstance(v, str | bytes):
        return out + _bytes(4, v) + _int(20, _A_STRING)
    if isinstance(v, list | tuple) and all(isinstance(x, int | np.integer) for x in v):
        return out + _packed(8, v) + _int(20, _A_INTS)
    if isinstance(v, list | tuple):
        return out + _bytes(7, struct.pack(f"<{len(v)}f", *v)) + _int(20, _A_FLOATS)
    raise TypeError(f"attribute {name}: {type(v).__name__} is not written by this encoder")


def make_node(op_type: str, inputs: Sequence[str], outputs: Sequence[str], name: str = "", domain: str = "",
              **attrs: object) -> Node:
    return Node(op_type, list(inputs), list(outputs), name, domain, dict(attrs))


@dataclass
class ValueInfo:
    """A graph input or output: a tensor of ``elem_type`` whose dims are ints or symbolic names."""

    name: str
    elem_type: int
    shape: list[int | str]

    def encode(self) -> bytes:
        dims = b"".join(_bytes(1, _bytes(2, d) if isinstance(d, str) else _int(1, d)) for d in self.shape)
        return _bytes(1, self.name) + _bytes(2, _bytes(1, _int(1, self.elem_type) + _bytes(2, dims)))


def make_tensor_value_info(name: str, elem_type: int, shape: Sequence[int | str]) -> ValueInfo:
    return ValueInfo(name, elem_type, list(shape))


@dataclass
class Graph:
    nodes: list[Node]
    name: str
    inputs: list[ValueInfo]
    outputs: list[ValueInfo]
    initializers: list[Tensor]

    def encode(self) -> bytes:
        return (b"".join(_bytes(1, n.encode()) for n in self.nodes) + _bytes(2, self.name)
                + b"".join(_bytes(5, t.encode()) for t in self.initializers)
                + b"".join(_bytes(11, v.encode()) for v in self.inputs)
                + b"".join(_bytes(12, v.encode()) for v in self.outputs))


def make_graph(nodes: Sequence[Node], name: str, inputs: Sequence[ValueInfo], outputs: Sequence[ValueInfo],
               initializers: Sequence[Tensor] = ()) -> Graph:
    return Graph(list(nodes), name, list(inputs), list(outputs), list(initializers))


def make_opsetid(domain: str, version: int) -> tuple[str, int]:
    return domain, version


@dataclass
class Model:
    graph: Graph
    opsets: list[tuple[str, int]]
    ir_version: int = 8
    producer_name: str = "hybrid-runtime"

    def SerializeToString(self) -> bytes:  # (the name of onnx.ModelProto's method, which cpu_session calls)
        return (_int(1, self.ir_version) + _bytes(2, self.producer_name) + _bytes(7, self.graph.encode())
                + b"".join(_bytes(8, (_bytes(1, d) if d else b"") + _int(2, v)) for d, v in self.opsets))


def make_model(graph: Graph, opset_imports: Sequence[tuple[str, int]], ir_version: int = 8,
               producer_name: str = "hybrid-runtime") -> Model:
    return Model(graph, list(opset_imports), ir_version, producer_name)


# ---- reading ----------------------------------------------------------------------------------------------
Field = tuple[int, int, int | bytes, bytes]  # (number, wire type, value, the field's whole encoding)


def _read_varint(buf: bytes, i: int) -> tuple[int, int]:
    v = shift = 0
    while True:
        b = buf[i]
        i += 1
        v |= (b & 0x7F) << shift
        if b < 0x80:
            return v, i
        shift += 7


def fields(buf: bytes) -> Iterator[Field]:
    """The fields of one message in wire order: a varint's value, a length-delimited field's bytes; fixed
    32/64-bit values as their raw bytes. ValueError on groups (not used by ONNX) or a truncated message."""
    i, n = 0, len(buf)
    while i < n:
        start = i
        key, i = _read_varint(buf, i)
        num, wire = key >> 3, key & 7
        if wire == _VARINT:
            value, i = _read_varint(buf, i)
        elif wire == _LEN:
            size, i = _read_varint(buf, i)
            value, i = buf[i:i + size], i + size
        elif wire in (_I64, _I32):
            width = 8 if wire == _I64 else 4
            value, i = buf[i:i + width], i + width
        else:
            raise ValueError(f"protobuf wire type {wire} (field {num}) is not read here")
        if i > n:
            raise ValueError("truncated protobuf message")
        yield num, wire, value, buf[start:i]


def field_bytes(num: int, data: bytes) -> bytes:
    """One length-delimited field: to add a sub-message (a node, an input) to a message being rewritten."""
    return _bytes(num, data)


def messages(buf: bytes, num: int) -> list[bytes]:
    """The values of a repeated length-delimited field (sub-messages, strings as bytes)."""
    return [v for n, w, v, _ in fields(buf) if n == num and w == _LEN and isinstance(v, bytes)]


def strings(buf: bytes, num: int) -> list[str]:
    return [v.decode() for v in messages(buf, num)]


def text(buf: bytes, num: int) -> str:
    """A string field ("" when absent)."""
    return next(iter(strings(buf, num)), "")


def integer(buf: bytes, num: int, default: int = 0) -> int:
    """An int64 / int32 / enum field (the last occurrence, as protobuf reads it; ``default`` when absent)."""
    vals = [v for n, w, v, _ in fields(buf) if n == num and w == _VARINT and isinstance(v, int)]
    return _signed(vals[-1]) if vals else default


def ints(buf: bytes, num: int) -> list[int]:
    """A repeated int64 field, packed or not."""
    out: list[int] = []
    for n, w, v, _ in fields(buf):
        if n == num and isinstance(v, int):
            out.append(_signed(v))
        elif n == num and w == _LEN and isinstance(v, bytes):
            i = 0
            while i < len(v):
                x, i = _read_varint(v, i)
                out.append(_signed(x))
    return out


def _signed(v: int) -> int:
    return v - (1 << 64) if v >= 1 << 63 else v
