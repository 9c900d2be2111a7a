"""kiln's ONNX Runtime custom-op library: find it, register it on session options, say what it runs.

The library (built when kiln is installed where g++ is found, or by
`python -m kiln.engines.ort.native.build`) holds the linears `kiln.MatMulQ4Min`, 4-bit codes with a float scale and a float minimum per block of 32
(llama.cpp's Q4_1), and `kiln.MatMulQ8`, 8-bit codes with a float scale per block (Q8_0), and
`kiln.PagedAttention`; their registrations are here, their arithmetic is kiln's kernel library
(kiln/kernels; the layouts in kiln/kernels/formats.h). An engine graph that uses them cannot load
without it.
"""

from __future__ import annotations

import ctypes
from functools import lru_cache
import shlex
import sys
from pathlib import Path

OP_DOMAIN = "kiln"
OP_TYPE = "MatMulQ4Min"       # 4-bit codes, a float scale and minimum per block of 32 (Q4_1)
OP_TYPE_Q8 = "MatMulQ8"       # 8-bit codes, a float scale per block of 32 (Q8_0): the LM head
LIBRARY = Path(__file__).resolve().parent / "_build" / "libkiln_ort_ops.so"
BUILD_COMMAND = "python -m kiln.engines.ort.native.build"


def build_command() -> str:
    """BUILD_COMMAND with this install's own interpreter (a bare `python` may be another environment's).
    It works in any install: the sources ship with the package, and building the package built the
    library already wherever a C++ compiler was found."""
    return f"{shlex.quote(sys.executable)} -m kiln.engines.ort.native.build"


class NativeOpsMissing(RuntimeError):
    """A graph needs kiln's custom-op library and this installation has none."""


def available() -> bool:
    return LIBRARY.is_file()


def require() -> Path:
    if not available():
        raise NativeOpsMissing(f"kiln's ONNX Runtime op library ({OP_DOMAIN}.{OP_TYPE}) is not built here: run "
                               f"`{build_command()}` with a C++ compiler (g++) installed")
    return LIBRARY


_REGISTERED = "kiln.native_ops_registered"     # a session config entry: options remember it themselves


def register(opts) -> bool:
    """Register the library on onnxruntime SessionOptions when it is built (once per options object:
    a second registration fails the session with "Domain already set"); False when it is not built."""
    if not available():
        return False
    try:
        opts.get_session_config_entry(_REGISTERED)
        return True
    except Exception:       # NOTE: onnxruntime raises a bare Fail/RuntimeError for a missing entry
        pass
    opts.register_custom_ops_library(str(LIBRARY))
    opts.add_session_config_entry(_REGISTERED, "1")
    return True


@lru_cache(maxsize=None)
def _library() -> ctypes.CDLL:
    return ctypes.CDLL(str(require()))


def isa() -> str:
    """The instruction-set level the library's kernels run at on this CPU now, KILN_MAX_ISA applied
    (kiln/kernels/isa.h): scalar | avx2 | avx512 | avx512vnni | amx, as kiln.contract.cpu.host().isa."""
    fn = _library().kiln_isa
    fn.restype = ctypes.c_char_p
    return fn().decode()


def uses_native_ops(graph) -> bool:
    """Whether an onnx GraphProto has a node of kiln's op domain."""
    return any(n.domain == OP_DOMAIN for n in graph.node)


def native_op_names(graph) -> list[str]:
    """The kiln-domain ops an onnx GraphProto uses, as "kiln.MatMulQ4Min"."""
    return sorted({f"{n.domain}.{n.op_type}" for n in graph.node if n.domain == OP_DOMAIN})
