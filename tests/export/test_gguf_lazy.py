"""Reading a GGUF keeps memory bounded: nothing is dequantized when the source is loaded, and the
exporter pulls one tensor at a time, the previous one already released when the next is read.

Checked structurally (which reads happen, which results are still alive), not by timing or RSS.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping

import pytest

from gguf_writing import write_gguf
from kiln.compiler.export.decoder_graph import build_decoder
from kiln.compiler.export.gguf_reader import GGUFFile
from kiln.compiler.export.sources import load_source


@pytest.fixture
def traced_reads(monkeypatch):
    """Every GGUFFile.read: its tensor name, and how many earlier results were still alive then."""
    reads, results = [], []
    original = GGUFFile.read

    def read(self, name):
        # no gc.collect(): a released tensor must be freed by its refcount, not wait for a cycle sweep
        reads.append((name, sum(ref() is not None for ref in results)))
        array = original(self, name)
        results.append(weakref.ref(array))
        return array
    monkeypatch.setattr(GGUFFile, "read", read)
    return reads


@pytest.mark.parametrize("name", ["llama", "gemma3"])       # un-permuted q/k; norms with the 1 taken off
def test_source_is_lazy_and_export_holds_one_tensor_at_a_time(tmp_path, traced_reads, name):
    path = write_gguf(name, tmp_path / "file").path
    src = load_source(str(path))
    assert traced_reads == []                    # loading read the metadata and the tensor table only
    assert isinstance(src.weights, Mapping) and not isinstance(src.weights, dict)
    build_decoder(src.spec, src.weights, tmp_path / "weights")
    names = [n for n, _ in traced_reads]
    assert set(names) == set(GGUFFile(path).tensors)      # every tensor pulled, none before it was needed
    assert max(still_alive for _, still_alive in traced_reads) == 0, traced_reads


def test_a_read_is_a_fresh_array_not_a_view_of_the_map(tmp_path):
    f = GGUFFile(write_gguf("qwen2", tmp_path).path)
    a, b = f.read("blk.0.attn_norm.weight"), f.read("blk.0.attn_norm.weight")    # F32: the map's own bytes
    assert a.flags.writeable and a is not b and (a == b).all()
    a += 1                                       # writing to it leaves the file's values alone
    assert (f.read("blk.0.attn_norm.weight") == b).all()
