"""Damaged and hostile GGUF files are refused with a clear error in well under a second.

The files are built byte by byte: the `gguf` package's writer would not write them, and its reader
loops allocating on the first one (a 58-byte file whose metadata array runs past the end).
"""

from __future__ import annotations

import struct
import subprocess
import sys
import time

import pytest

from kiln.compiler.export.gguf_reader import GGUFError, GGUFFile
from kiln.compiler.export.sources import load_source
from kiln.contract.model_spec import UnsupportedModelError

F32, STRING_T, ARRAY_T, U32_T = 0, 8, 9, 4


def s(text: str) -> bytes:
    raw = text.encode()
    return struct.pack("<Q", len(raw)) + raw


def kv_string(key: str, value: str) -> bytes:
    return s(key) + struct.pack("<I", STRING_T) + s(value)


def tensor_info(name: str, ne: list[int], ggml_type: int = F32, offset: int = 0) -> bytes:
    return s(name) + struct.pack(f"<I{len(ne)}QIQ", len(ne), *ne, ggml_type, offset)


def gguf_bytes(kvs: list[bytes], tensors: list[bytes] = (), data: bytes = b"", version: int = 3,
               n_kv: int | None = None, n_tensors: int | None = None) -> bytes:
    head = b"GGUF" + struct.pack("<IQQ", version, len(tensors) if n_tensors is None else n_tensors,
                                 len(kvs) if n_kv is None else n_kv)
    body = head + b"".join(kvs) + b"".join(tensors)
    return body + (b"\0" * (-len(body) % 32) + data if data else b"")


def array_past_the_end() -> bytes:
    """The hardening issue's 58-byte file: one u32 array claiming 2^60 elements (gguf.GGUFReader
    never returns on it)."""
    return gguf_bytes([s("general.ab") + struct.pack("<IIQ", ARRAY_T, U32_T, 1 << 60)])


ARCH = kv_string("general.architecture", "llama")
EMBED = tensor_info("token_embd.weight", [4, 2])          # 8 floats: 32 bytes of data

CASES = {
    "array runs past the end": (array_past_the_end(), "claims 1152921504606846976 entries"),
    "string array runs past the end": (gguf_bytes([s("general.ab") + struct.pack("<IIQ", ARRAY_T, STRING_T, 1 << 40)]),
                                       "claims 1099511627776 entries"),
    "string longer than the file": (gguf_bytes([s("general.ab") + struct.pack("<IQ", STRING_T, 1 << 50)]),
                                    "needs 1125899906842624 bytes"),
    "key longer than the file": (b"GGUF" + struct.pack("<IQQQ", 3, 0, 1, 1 << 62) + b"\0" * 16,
                                 "a metadata key needs 4611686018427387904 bytes"),
    "absurd metadata count": (gguf_bytes([ARCH], n_kv=1 << 62), "metadata entries, which cannot fit"),
    "absurd tensor count": (gguf_bytes([ARCH], [EMBED], b"\0" * 32, n_tensors=1 << 40), "tensors, which cannot fit"),
    "five dimensions": (gguf_bytes([ARCH], [tensor_info("token_embd.weight", [1, 1, 1, 1, 2])], b"\0" * 32),
                        "5 dimensions"),
    "tensor offset past the end": (gguf_bytes([ARCH], [tensor_info("token_embd.weight", [4, 2], offset=1 << 20)],
                                              b"\0" * 32), "starts past the end"),
    "truncated tensor data": (gguf_bytes([ARCH], [EMBED], b"\0" * 16), "truncated: tensor token_embd.weight"),
    "overflowing shape": (gguf_bytes([ARCH], [tensor_info("token_embd.weight", [1 << 40, 1 << 40])], b"\0" * 32),
                          "runs past the end"),
    "unknown tensor type": (gguf_bytes([ARCH], [tensor_info("token_embd.weight", [4, 2], ggml_type=99)]),
                            "unknown ggml type 99"),
    "unknown metadata type": (gguf_bytes([s("general.ab") + struct.pack("<I", 77)]), "unknown type 77"),
    "duplicate key": (gguf_bytes([ARCH, ARCH]), "appears twice"),
    "not a GGUF": (b"GGML" + b"\0" * 60, "not a GGUF file"),
    "shorter than a header": (b"GGUF\3\0", "shorter than its header"),
    "version 1": (gguf_bytes([ARCH], version=1), "version 1"),
    "big-endian": (gguf_bytes([ARCH], version=3 << 24), "big-endian"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_damaged_gguf_refused_fast_with_a_clear_error(tmp_path, case):
    raw, reason = CASES[case]
    path = tmp_path / "hostile.gguf"
    path.write_bytes(raw)
    start = time.perf_counter()
    with pytest.raises(GGUFError, match=reason):
        load_source(str(path))
    assert time.perf_counter() - start < 0.5


def test_the_issue_file_is_58_bytes():
    assert len(array_past_the_end()) == 58


def test_unknown_architecture_refused_before_the_rest_is_read(tmp_path):
    """general.architecture is checked the moment it is read: the hostile array after it is never reached."""
    path = tmp_path / "falcon.gguf"
    path.write_bytes(gguf_bytes([kv_string("general.architecture", "falcon"),
                                 s("general.ab") + struct.pack("<IIQ", ARRAY_T, STRING_T, 1 << 60)]))
    start = time.perf_counter()
    with pytest.raises(UnsupportedModelError, match="unsupported GGUF architecture 'falcon'.*llama.*qwen2.*gemma3"):
        load_source(str(path))
    assert time.perf_counter() - start < 0.5


def test_missing_architecture_refused(tmp_path):
    path = tmp_path / "none.gguf"
    path.write_bytes(gguf_bytes([kv_string("general.name", "x")], [EMBED], b"\0" * 32))
    with pytest.raises(GGUFError, match="no general.architecture"):
        load_source(str(path))


def test_reader_parses_a_well_formed_file(tmp_path):
    """The byte builder above writes valid files too, so the cases fail for their one defect."""
    path = tmp_path / "ok.gguf"
    path.write_bytes(gguf_bytes([ARCH], [EMBED], struct.pack("<8f", *range(8))))
    f = GGUFFile(path)
    assert f.get("general.architecture") == "llama"
    assert f.read("token_embd.weight").tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_kiln_build_refuses_the_58_byte_file_in_one_line(tmp_path):
    path = tmp_path / "hostile.gguf"
    path.write_bytes(array_past_the_end())
    out = tmp_path / "out"
    cli = [sys.executable, "-c", "from kiln.cli import main; main()"]
    result = subprocess.run([*cli, "build", str(path), "--out", str(out)], capture_output=True, text=True, timeout=120)
    lines = [ln for ln in (result.stdout + result.stderr).splitlines() if ln.strip()]
    assert result.returncode == 1
    assert any("error:" in ln and "cannot fit" in ln for ln in lines), lines
    assert not any("Traceback" in ln for ln in lines) and not out.exists()
