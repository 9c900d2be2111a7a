"""A GGUF file, parsed with every count and length checked against the bytes that remain.

The `gguf` package's GGUFReader trusts the file: a 58-byte file whose one metadata array claims
2^60 elements keeps it looping and allocating. This pre-parser reads the header, the metadata and
the tensor table itself, refuses anything that cannot fit in the file before acting on it, and
memory-maps the data: a tensor is dequantized (with `gguf.quants.dequantize`) only when asked for,
one at a time, so reading a model never holds more than the tensor being read.

Layout (little-endian; https://github.com/ggml-org/ggml/blob/master/docs/gguf.md):
  "GGUF" u32 version, u64 tensor_count, u64 kv_count,
  kv_count x (string key, u32 type, value), tensor_count x (string name, u32 n_dims,
  n_dims x u64 ne (fastest-moving first), u32 ggml type, u64 offset), padding to the alignment,
  then the tensor data (offsets are relative to its start).
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from kiln.compiler.export.checkpoint import CheckpointError

VERSIONS = (2, 3)          # v1 counted in u32 and predates every published model
MAX_DIMS = 4               # GGML_MAX_DIMS
MAX_TENSORS = 100_000      # the largest published models hold a few thousand
DEFAULT_ALIGNMENT = 32
STRING, ARRAY = 8, 9
SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
         7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
# the fewest bytes one metadata entry / tensor-table entry can take: bounds the counts up front
MIN_KV_BYTES = 8 + 4 + 1
MIN_TENSOR_BYTES = 8 + 4 + 8 + 4 + 8


class GGUFError(CheckpointError):
    """The GGUF file is damaged, truncated, or not one kiln can read."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]     # numpy order (slowest first): [out, in] for a linear, as HF stores it
    ggml_type: int
    start: int                 # absolute byte offset in the file
    nbytes: int

    @property
    def type_name(self) -> str:
        return _type_name(self.ggml_type)


class _Cursor:
    """Reads forward through the mapped file; every read checks it fits in what remains."""

    def __init__(self, buf, name: str):
        self.buf, self.pos, self.size, self.name = buf, 0, len(buf), name

    @property
    def remaining(self) -> int:
        return self.size - self.pos

    def need(self, n: int, what: str) -> None:
        if n > self.remaining:
            raise GGUFError(f"{self.name} is damaged or truncated: {what} needs {n} bytes at offset "
                            f"{self.pos}, the file has {self.remaining} left")

    def unpack(self, fmt: str, what: str):
        n = struct.calcsize(fmt)
        self.need(n, what)
        values = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += n
        return values[0] if len(values) == 1 else values

    def string(self, what: str) -> str:
        length = self.unpack("<Q", what)
        self.need(length, what)
        raw = self.buf[self.pos:self.pos + length]
        self.pos += length
        return raw.decode("utf-8", errors="replace")

    def count(self, what: str, min_bytes: int) -> int:
        """A u64 element count, refused if that many elements cannot fit in the rest of the file."""
        n = self.unpack("<Q", what)
        if n * min_bytes > self.remaining:
            raise GGUFError(f"{self.name} is damaged: {what} claims {n} entries, which cannot fit in "
                            f"the {self.remaining} bytes left")
        return n


class GGUFFile:
    """The metadata (key -> value) and tensor table of a GGUF file, with its data memory-mapped."""

    def __init__(self, path: Path, check_architecture: Callable[[str], None] = lambda arch: None):
        """`check_architecture` sees general.architecture as soon as it is read (llama.cpp writes it
        first), so an unknown one is refused before the vocabulary and the tensor table are walked."""
        self.path = Path(path)
        name = self.path.name
        with open(self.path, "rb") as f:
            if self.path.stat().st_size < 24:
                raise GGUFError(f"{name} is not a GGUF file (shorter than its header)")
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        cur = _Cursor(self._map, name)
        tensor_count, kv_count = _header(cur)
        if kv_count * MIN_KV_BYTES > cur.remaining:
            raise GGUFError(f"{name} is damaged: it claims {kv_count} metadata entries, which cannot fit in the file")
        self.metadata = _metadata(cur, kv_count, check_architecture)
        if tensor_count > MAX_TENSORS or tensor_count * MIN_TENSOR_BYTES > cur.remaining:
            raise GGUFError(f"{name} is damaged: it claims {tensor_count} tensors, which cannot fit in the file")
        self.tensors = _tensor_table(cur, tensor_count, self._alignment())

    def get(self, key: str, default=None):
        return self.metadata.get(key, default)

    def read(self, name: str) -> np.ndarray:
        """One tensor as a fresh fp32 array in numpy order; only its own pages of the file are touched."""
        from gguf.quants import dequantize

        info = self.tensors[name]
        if not readable(info.ggml_type):
            raise GGUFError(f"tensor {name} is stored as {info.type_name}, which gguf.quants cannot dequantize")
        raw = np.frombuffer(self._map, dtype=np.uint8, count=info.nbytes, offset=info.start)
        out = np.asarray(dequantize(raw, info.ggml_type), dtype=np.float32)
        if not out.flags.writeable:     # F32 "dequantizes" to a view of the map: copy it, not to pin the map
            out = out.copy()
        return out.reshape(info.shape)

    def _alignment(self) -> int:
        alignment = self.metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise GGUFError(f"{self.path.name}: general.alignment {alignment!r} is not a power of two")
        return alignment


def _header(cur: _Cursor) -> tuple[int, int]:
    if bytes(cur.buf[:4]) != b"GGUF":
        raise GGUFError(f"{cur.name} is not a GGUF file (it does not start with 'GGUF')")
    cur.pos = 4
    version = cur.unpack("<I", "the version")
    if version not in VERSIONS:
        swapped = struct.unpack("<I", struct.pack(">I", version))[0]
        hint = " (a big-endian file)" if swapped in VERSIONS else ""
        raise GGUFError(f"{cur.name} is GGUF version {version}{hint}; kiln reads little-endian versions 2 and 3")
    return cur.unpack("<Q", "the tensor count"), cur.unpack("<Q", "the metadata count")


def _metadata(cur: _Cursor, kv_count: int, check_architecture: Callable[[str], None]) -> dict:
    metadata = {}
    for _ in range(kv_count):
        key = cur.string("a metadata key")
        if key in metadata:
            raise GGUFError(f"{cur.name} is damaged: metadata key {key!r} appears twice")
        value_type = cur.unpack("<I", f"the type of {key!r}")
        metadata[key] = _value(cur, value_type, key)
        if key == "general.architecture":
            check_architecture(str(metadata[key]))
    return metadata


def _value(cur: _Cursor, value_type: int, key: str):
    if value_type in SCALARS:
        return cur.unpack(SCALARS[value_type], f"the value of {key!r}")
    if value_type == STRING:
        return cur.string(f"the value of {key!r}")
    if value_type != ARRAY:
        raise GGUFError(f"{cur.name} is damaged: metadata {key!r} has unknown type {value_type}")
    element_type = cur.unpack("<I", f"the element type of {key!r}")
    what = f"the array {key!r}"
    if element_type in NUMPY:
        itemsize = np.dtype(NUMPY[element_type]).itemsize
        n = cur.count(what, itemsize)
        values = np.frombuffer(cur.buf, dtype=NUMPY[element_type], count=n, offset=cur.pos).copy()
        cur.pos += n * itemsize
        return values
    if element_type == STRING:
        return [cur.string(f"an element of {key!r}") for _ in range(cur.count(what, 8))]
    # llama.cpp refuses nested arrays too; no model file has them
    raise GGUFError(f"{cur.name}: metadata {key!r} is an array of type {element_type}, which kiln does not read")


def _tensor_table(cur: _Cursor, count: int, alignment: int) -> dict[str, TensorInfo]:
    entries = [_tensor_entry(cur) for _ in range(count)]
    data_start = -(-cur.pos // alignment) * alignment
    tensors: dict[str, TensorInfo] = {}
    for name, shape, ggml_type, offset, nbytes in entries:
        if name in tensors:
            raise GGUFError(f"{cur.name} is damaged: tensor {name} appears twice")
        if offset % alignment:
            raise GGUFError(f"{cur.name} is damaged: tensor {name}'s offset {offset} is not {alignment}-byte aligned")
        start = data_start + offset
        if start > cur.size:
            raise GGUFError(f"{cur.name} is damaged or truncated: tensor {name} starts past the end of the file")
        if start + nbytes > cur.size:
            raise GGUFError(f"{cur.name} is truncated: tensor {name}'s data runs past the end of the file "
                            f"({start + nbytes - cur.size} bytes missing)")
        tensors[name] = TensorInfo(name, shape, ggml_type, start, nbytes)
    _refuse_overlaps(cur.name, tensors.values())
    return tensors


def _tensor_entry(cur: _Cursor) -> tuple:
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    name = cur.string("a tensor name")
    n_dims = cur.unpack("<I", f"tensor {name}'s dimension count")
    if not 1 <= n_dims <= MAX_DIMS:
        raise GGUFError(f"{cur.name} is damaged: tensor {name} has {n_dims} dimensions (GGUF allows 1 to {MAX_DIMS})")
    ne = [cur.unpack("<Q", f"tensor {name}'s shape") for _ in range(n_dims)]
    ggml_type, offset = cur.unpack("<IQ", f"tensor {name}'s type and offset")
    try:
        block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    except ValueError:
        raise GGUFError(f"{cur.name}: tensor {name} has unknown ggml type {ggml_type}") from None
    if ne[0] % block:
        raise GGUFError(f"{cur.name} is damaged: tensor {name}'s rows ({ne[0]}) are not whole "
                        f"{_type_name(ggml_type)} blocks of {block}")
    # Python ints: a hostile shape cannot overflow; its byte count then fails the bounds check
    nbytes = int(np.prod(ne, dtype=object)) // block * block_bytes
    return name, tuple(reversed(ne)), ggml_type, offset, nbytes


def _refuse_overlaps(file: str, infos) -> None:
    end, last = 0, None
    for info in sorted(infos, key=lambda t: t.start):
        if info.start < end:
            raise GGUFError(f"{file} is damaged: tensors {last} and {info.name} overlap")
        end, last = max(end, info.start + info.nbytes), info.name


def _type_name(ggml_type: int) -> str:
    from gguf.constants import GGMLQuantizationType

    try:
        return GGMLQuantizationType(ggml_type).name
    except ValueError:
        return f"type {ggml_type}"


_READABLE: dict[int, bool] = {}


def readable(ggml_type: int) -> bool:
    """Whether gguf.quants can dequantize this type (probed once on one zero block)."""
    if ggml_type not in _READABLE:
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
        from gguf.quants import dequantize

        qtype = GGMLQuantizationType(ggml_type)
        try:
            dequantize(np.zeros(GGML_QUANT_SIZES[qtype][1], np.uint8), qtype)
            _READABLE[ggml_type] = True
        except NotImplementedError:
            _READABLE[ggml_type] = False
    return _READABLE[ggml_type]
