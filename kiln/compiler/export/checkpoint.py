"""Read an HF safetensors checkpoint (one file or shards with model.safetensors.index.json).

The safetensors header (8-byte length, then JSON: name -> dtype, shape, data_offsets) is read
directly, so every tensor is checked against the config before any data is read, and each one
is memory-mapped and converted to fp32 on its own: bf16 has no numpy dtype, so its bits are
widened (bf16 is the top half of an fp32). Anything wrong is refused naming the tensor.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Callable

import numpy as np

INDEX = "model.safetensors.index.json"
# safetensors' own reader refuses a header past 100 MB: a length field near 2**64 must not become
# one read of the whole file (or an allocation of it) before anything is checked.
MAX_HEADER_BYTES = 100_000_000
DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}   # BF16 read as raw bits


class CheckpointError(ValueError):
    """The checkpoint is incomplete, damaged, or holds what the config does not describe."""


@dataclass(frozen=True)
class TensorEntry:
    file: Path
    dtype: str
    shape: tuple[int, ...]
    start: int           # absolute byte offsets in the file
    end: int


def read_index(folder: Path) -> dict[str, TensorEntry]:
    """name -> where its bytes are, over all shards; checks shards exist and headers parse."""
    entries: dict[str, TensorEntry] = {}
    for file, names in _shards(folder).items():
        header = _header(file)
        for name in names or header:
            if name not in header:
                raise CheckpointError(f"tensor {name}: the index puts it in {file.name}, which does not hold it")
            entries[name] = header[name]
    return entries


def _shards(folder: Path) -> dict[Path, list[str] | None]:
    """file -> the names the index assigns to it (None: whatever the file holds)."""
    index = folder / INDEX
    if index.is_file():
        weight_map = _weight_map(index)
        shards: dict[Path, list[str]] = {}
        for name, file in weight_map.items():
            shards.setdefault(folder / _shard_name(name, file), []).append(name)
        for file, names in shards.items():
            if not file.is_file():
                raise CheckpointError(f"tensor {names[0]}: its shard {file.name} (from {INDEX}) is missing")
        return shards
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {folder}")
    return {f: None for f in files}


def _weight_map(index: Path) -> dict:
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map") or {}
    except (ValueError, AttributeError):
        raise CheckpointError(f"{INDEX} is not a JSON object with a weight_map") from None
    if not isinstance(weight_map, dict):
        raise CheckpointError(f"{INDEX}: its weight_map is not an object of tensor name -> file")
    return weight_map


def _shard_name(tensor: str, file) -> str:
    """A shard named by the index: a plain file name in the checkpoint's folder, never a path that
    leaves it (an absolute path, `..`, a sub-folder)."""
    if not isinstance(file, str) or not file or Path(file).name != file or file in (".", ".."):
        raise CheckpointError(f"tensor {tensor}: {INDEX} names its shard {file!r}; a shard must be a file "
                              "name in the checkpoint's folder")
    return file


def _header(file: Path) -> dict[str, TensorEntry]:
    size = file.stat().st_size
    with open(file, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise CheckpointError(f"{file.name} is not a safetensors file (shorter than its header)")
        (length,) = struct.unpack("<Q", raw)
        if length > MAX_HEADER_BYTES:
            raise CheckpointError(f"{file.name}: its header claims {length} bytes (safetensors headers "
                                  f"stop at {MAX_HEADER_BYTES}); not a safetensors file")
        if length > size - 8:
            raise CheckpointError(f"{file.name} is truncated (its header runs past the end)")
        try:
            header = json.loads(f.read(length))
        except ValueError:
            raise CheckpointError(f"{file.name} has a damaged safetensors header") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{file.name} has a damaged safetensors header (not a JSON object)")
    header.pop("__metadata__", None)
    base = 8 + length
    return {name: _entry(file, name, e, base, size) for name, e in header.items()}


def _entry(file: Path, name: str, e, base: int, size: int) -> TensorEntry:
    """One header entry, checked for its form and that its bytes lie inside the file's data."""
    try:
        dtype, shape, (start, end) = e["dtype"], tuple(e["shape"]), e["data_offsets"]
        well_formed = (isinstance(dtype, str) and all(isinstance(d, int) and d >= 0 for d in shape)
                       and isinstance(start, int) and isinstance(end, int) and 0 <= start <= end)
    except (TypeError, KeyError, ValueError):
        well_formed = False
    if not well_formed:
        raise CheckpointError(f"tensor {name}: {file.name} has a damaged header entry "
                              "(dtype, shape or data_offsets)")
    if base + end > size:
        raise CheckpointError(f"tensor {name}: {file.name} is truncated (its data runs past the end)")
    return TensorEntry(file, dtype, shape, base + start, base + end)


def check_tensors(entries: dict[str, TensorEntry], expected: dict[str, tuple[int, ...]]) -> None:
    """Refuse a missing tensor, a shape the config does not imply, or a dtype kiln cannot read."""
    for name, shape in expected.items():
        e = entries.get(name)
        if e is None:
            raise CheckpointError(f"incomplete checkpoint: tensor {name} is missing")
        if e.dtype not in DTYPES:
            raise CheckpointError(f"tensor {name} has dtype {e.dtype}; kiln reads {', '.join(DTYPES)}")
        if e.shape != shape:
            raise CheckpointError(f"tensor {name} has shape {list(e.shape)}, the config implies {list(shape)}")
        if e.end - e.start != np.dtype(DTYPES[e.dtype]).itemsize * int(np.prod(shape)):
            raise CheckpointError(f"tensor {name}: its byte range does not match its shape and dtype")


def load_fp32(entry: TensorEntry) -> np.ndarray:
    """One tensor as fp32, read through a memory map (only this tensor's pages are touched)."""
    count = int(np.prod(entry.shape))
    raw = np.memmap(entry.file, dtype=DTYPES[entry.dtype], mode="r", offset=entry.start, shape=(count,))
    if entry.dtype == "BF16":
        out = (raw.astype(np.uint32) << 16).view(np.float32)
    else:
        out = raw.astype(np.float32)
    return out.reshape(entry.shape)


class LazyWeights(Mapping):
    """name -> fp32 array, read from the checkpoint each time it is asked for and not kept.

    NOTE: the build keeps its source alive to the end; a dict of fp32 arrays would hold a second
    copy of the model (beside the graph's) through every pass. This holds none.
    """

    def __init__(self, loaders: dict[str, Callable[[], np.ndarray]]):
        self._loaders = loaders

    def __getitem__(self, name: str) -> np.ndarray:
        return self._loaders[name]()

    def __iter__(self):
        return iter(self._loaders)

    def __len__(self) -> int:
        return len(self._loaders)

    def split(self, source: str, parts: dict[str, slice]) -> None:
        """Replace `source` by row ranges of it (Phi-3's fused projections)."""
        load = self._loaders.pop(source)
        for name, rows in parts.items():
            self._loaders[name] = partial(_rows, load, rows)


def _rows(load: Callable[[], np.ndarray], rows: slice) -> np.ndarray:
    return np.ascontiguousarray(load()[rows])


def load_tensors(folder: Path, expected: dict[str, tuple[int, ...]]) -> LazyWeights:
    entries = read_index(folder)
    check_tensors(entries, expected)
    return LazyWeights({name: partial(load_fp32, entries[name]) for name in expected})
