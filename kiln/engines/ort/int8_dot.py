"""Whether this CPU's integer GEMM can take full-range int8 weights against uint8 activations.

ONNX Runtime's DynamicQuantizeMatMul (kiln's w8a8 linears) multiplies uint8 activations by int8
weights. With VNNI (AVX-512 VNNI, AVX-VNNI, AMX) each product is summed in 32 bits. Without it
(plain AVX2 or AVX-512) the kernel uses pmaddubsw, which adds two u8 x s8 products into a
*saturating* int16: 2 x 255 x 127 = 64,770 does not fit, and the engine's answers turn to noise
(seen on an AVX2 EPYC: top-1 agreement with fp32 collapsed where the same build agrees well with
VNNI; docs/results/2026-12-06-figures-from-code-comments.md). Weights kept within 7 bits ([-63, 63],
ONNX Runtime's own "reduce_range") fit on any CPU: 2 x 255 x 63 = 32,130. The build picks the range
from the build CPU, the engine record says which it took, and the loader refuses full-range weights
where they would saturate.
"""

from __future__ import annotations

from pathlib import Path

from kiln.contract import cpu
from kiln.contract.cpu import CPUINFO, VNNI_FLAGS

FULL_RANGE, REDUCED_RANGE = 127, 63
__all__ = ["FULL_RANGE", "REDUCED_RANGE", "VNNI_FLAGS", "CPUINFO", "cpu_flags", "u8s8_saturates",
           "weight_range_for_this_cpu"]


def cpu_flags(cpuinfo: Path = CPUINFO) -> set[str] | None:
    """The first processor's flags as /proc/cpuinfo lists them (no KILN_MAX_ISA cap), or None where
    the kernel does not say (not Linux). The host's capped flags: kiln.contract.cpu.host()."""
    flags = cpu.read_flags(cpuinfo)
    return None if flags is None else set(flags)


def u8s8_saturates(flags: set[str] | None = None) -> bool | None:
    """True where the CPU has no VNNI (full-range weights would saturate), False where it has,
    None where the flags cannot be read. Default: this host (kiln.contract.cpu.host())."""
    vnni = cpu.host().vnni if flags is None else cpu.describe(frozenset(flags)).vnni
    return None if vnni is None else not vnni


def weight_range_for_this_cpu() -> int:
    """The largest int8 weight magnitude a w8a8 build may use: full range only where VNNI is known."""
    return FULL_RANGE if u8s8_saturates() is False else REDUCED_RANGE
