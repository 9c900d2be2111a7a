"""kiln's OpenVINO extension library: int8 linears with activations quantized per row, on AVX-512 VNNI.

The library (built when kiln is installed with openvino in its build environment, or by
`python -m kiln.engines.openvino.native.build`) holds two operations the CPU plugin runs through evaluate(): `kiln.LinearI8` (y = x W^T) and
`kiln.GateUpI8` (silu(x Wg^T) * x Wu^T, Llama's gated MLP input), each over int8 codes per output
channel (kiln/compiler/backends/openvino/int8_linears.py packs them; the layout is kiln/kernels/formats.h's
I8PerChannel, the arithmetic kiln's kernel library). Each row of x, times its
channels' SmoothQuant factors, is quantized to u8 with its own scale (absmax / 127) as the call runs. Why: the plugin runs an int8-weight linear as a
bf16 product (its int8 path needs a static activation range, and the graph that would compute one per
row costs more than it saves); vpdpbusd does 64 multiply-adds where the bf16 dot product does 32.
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
# The kernel's instructions; AMX parts are left to the plugin, whose AMX tiles are faster still.
REQUIRED_FLAGS = ("avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512_vnni")


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
    """Whether this CPU runs the kernel (AVX-512 with VNNI) and the plugin has nothing faster (no AMX)."""
    flags = cpu_flags() if flags is None else flags
    return all(f in flags for f in REQUIRED_FLAGS) and "amx_tile" not in flags


def usable() -> bool:
    """Whether an openvino int8 build here should take kiln's linears."""
    return available() and cpu_runs_kernels()
