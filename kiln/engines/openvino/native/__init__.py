"""kiln's OpenVINO extension library: int8 linears with activations quantized per row, on AVX-512 VNNI
(and on AMX tiles where the CPU has them).

The library (built when kiln is installed with openvino in its build environment, or by
`python -m kiln.engines.openvino.native.build`) holds two operations the CPU plugin runs through evaluate(): `kiln.LinearI8` (y = x W^T) and
`kiln.GateUpI8` (silu(x Wg^T) * x Wu^T, Llama's gated MLP input), each over int8 codes per output
channel (kiln/compiler/backends/openvino/int8_linears.py packs them; the layout is kiln/kernels/formats.h's
I8PerChannel, the arithmetic kiln's kernel library). Each row of x, times its
channels' SmoothQuant factors, is quantized to u8 with its own scale (absmax / 127) as the call runs. Why: the plugin runs an int8-weight linear as a
bf16 product (its int8 path needs a static activation range, and the graph that would compute one per
row costs more than it saves); vpdpbusd does 64 multiply-adds where the bf16 dot product does 32, and
on an AMX CPU an int8 tile product (TDPBUSD) twice a bf16 one's (kiln/kernels/microkernels_amx.cc).
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

DOMAIN = "kiln"
LINEAR = "LinearI8"
GATE_UP = "GateUpI8"
KERNELS = "kiln-int8"          # the engine record's options.kernels when the layers' linears are these
LIBRARY = Path(__file__).resolve().parent / "_build" / "libkiln_ov_ops.so"
BUILD_COMMAND = "python -m kiln.engines.openvino.native.build"


def build_command() -> str:
    """BUILD_COMMAND with this install's own interpreter (a bare `python` may be another environment's).
    It works in any install: the sources ship with the package, and building the package built the
    library already wherever a C++ compiler was found."""
    return f"{shlex.quote(sys.executable)} -m kiln.engines.openvino.native.build"
# The kernel's instructions: AVX-512 with VNNI; AMX tiles, where the CPU has them, on top.
REQUIRED_FLAGS = ("avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512_vnni")
AMX_FLAGS = ("amx_tile", "amx_int8")


class NativeOpsMissing(RuntimeError):
    """An engine needs kiln's OpenVINO op library and this installation has none."""


def available() -> bool:
    return LIBRARY.is_file()


def require() -> Path:
    if not available():
        raise NativeOpsMissing(f"kiln's OpenVINO op library ({DOMAIN}.{LINEAR}) is not built here: run "
                               f"`{build_command()}` with a C++ compiler (g++) installed")
    return LIBRARY


def cpu_flags() -> frozenset[str]:
    """This CPU's flags as every kernel choice reads them (kiln.contract.cpu: KILN_MAX_ISA applied);
    empty where unknown."""
    from kiln.contract.cpu import host

    return host().flags or frozenset()


def cpu_runs_kernels(flags: frozenset[str] | None = None) -> bool:
    """Whether this CPU runs the kernel: AVX-512 with VNNI. On an AMX CPU too: the plugin's linears
    there are bf16 tile products, and kiln's int8 tiles beat them (docs/benchmarks.md has the figures)."""
    flags = cpu_flags() if flags is None else flags
    return all(f in flags for f in REQUIRED_FLAGS)


def kernel_instructions(flags: frozenset[str] | None = None) -> str:
    """What the kernel multiplies on, in words, for a build's reasons: AMX tiles or AVX-512 VNNI."""
    flags = cpu_flags() if flags is None else flags
    return "AMX int8 tiles" if all(f in flags for f in AMX_FLAGS) else "AVX-512 VNNI"


def linear_level() -> str:
    """What the library's int8 linears run on in this process: "amx" (tiles), "avx512vnni", or "none"
    (a CPU, or KILN_MAX_ISA, below AVX-512 VNNI). Loads the library (require() says when it is missing)."""
    return _level("kiln_i8_linear_level")


def attention_level() -> str:
    """What kiln's paged attention computes a prefill's queries on in this process: "amx-bf16" (tiles:
    bf16 products, f32 sums) or "f32" (vectors throughout)."""
    return _level("kiln_kv_attention_level")


def decode_level() -> str:
    """What kiln's paged attention computes a u8 cache's decodes on in this process: "avx512vnni"
    (queries and weights split into two signed bytes each, integer products) or "f32"."""
    return _level("kiln_kv_decode_level")


def _level(entry: str) -> str:
    import ctypes

    fn = getattr(ctypes.CDLL(str(require())), entry)
    fn.restype = ctypes.c_char_p
    return fn().decode()


def usable() -> bool:
    """Whether an openvino int8 build here should take kiln's linears."""
    return available() and cpu_runs_kernels()
