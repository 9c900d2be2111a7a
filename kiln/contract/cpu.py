"""The host CPU as every kernel choice sees it: one probe of /proc/cpuinfo, read once, with one cap.

KILN_MAX_ISA (scalar | avx2 | avx512 | avx512vnni | amx) hides every instruction set above the one it
names, as oneDNN's ONEDNN_MAX_CPU_ISA does: the build's choices and the C++ kernels' dispatch (the
kernel library reads the same variable, kiln/kernels/isa.h) then act as on a smaller CPU. It can
lower what a CPU does, never raise it.

The machine classes kiln's defaults tell apart (`HostCPU.cpu_class`):
- "amx": AVX-512 with VNNI and AMX tiles (Intel Xeon Sapphire Rapids and later);
- "avx512-vnni": AVX-512 with VNNI, no AMX (AMD EPYC Zen 4 and later, Intel Ice Lake / Cascade Lake);
- "avx512": AVX-512 without VNNI;
- "avx2": AVX2 and FMA, no AVX-512;
- "other": anything else (no x86 vector extensions kiln uses, or flags unknown).
"""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

CPUINFO = Path("/proc/cpuinfo")
MAX_ISA_ENV = "KILN_MAX_ISA"
# Each level's flags, lowest first; a level is present when its flags and every lower level's are.
ISA_LEVELS: dict[str, tuple[str, ...]] = {
    "scalar": (),
    "avx2": ("avx2", "fma", "f16c"),
    "avx512": ("avx512f", "avx512bw", "avx512dq", "avx512vl"),
    "avx512vnni": ("avx512_vnni",),
    "amx": ("amx_tile", "amx_int8", "amx_bf16"),
}
# Flags a cap below their level hides too, though no level requires them.
LEVEL_OF_OPTIONAL = {"avx_vnni": "avx512vnni", "avx512_bf16": "avx512vnni", "amx_fp16": "amx"}
VNNI_FLAGS = ("avx512_vnni", "avx_vnni", "amx_int8")   # a u8 x s8 dot product summed in 32 bits
CPU_CLASS = {"amx": "amx", "avx512vnni": "avx512-vnni", "avx512": "avx512", "avx2": "avx2", "scalar": "other"}


def read_flags(cpuinfo: Path = CPUINFO) -> frozenset[str] | None:
    """The first processor's flags, or None where the kernel does not say (not Linux)."""
    try:
        text = cpuinfo.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.partition(":")[2].split())
    return None


def capped(flags: frozenset[str], max_isa: str | None) -> frozenset[str]:
    """`flags` less every flag of a level above `max_isa` (None or "": no cap)."""
    if not max_isa:
        return flags
    if max_isa not in ISA_LEVELS:
        raise ValueError(f"{MAX_ISA_ENV}={max_isa!r}: expected one of {', '.join(ISA_LEVELS)}")
    names = list(ISA_LEVELS)
    above = set(names[names.index(max_isa) + 1:])
    hidden = {f for level in above for f in ISA_LEVELS[level]}
    hidden |= {f for f, level in LEVEL_OF_OPTIONAL.items() if level in above}
    return flags - hidden


@dataclass(frozen=True)
class HostCPU:
    machine: str                         # platform.machine(), lower case
    flags: frozenset[str] | None         # None: unknown (the defaults then assume nothing)

    def has(self, *names: str) -> bool:
        return self.flags is not None and all(n in self.flags for n in names)

    @property
    def x86(self) -> bool:
        return self.machine in ("x86_64", "amd64", "i686", "x86")

    @property
    def isa(self) -> str:
        """The highest level whose flags (and every lower level's) this CPU has."""
        best = "scalar"
        for level, needed in ISA_LEVELS.items():
            if not self.has(*needed):
                break
            best = level
        return best

    @property
    def cpu_class(self) -> str:
        return CPU_CLASS[self.isa]

    @property
    def vnni(self) -> bool | None:
        """Whether u8 x s8 products sum in 32 bits (no saturating int16); None where unknown."""
        return None if self.flags is None else any(f in self.flags for f in VNNI_FLAGS)


def describe(flags: frozenset[str] | None, machine: str = "x86_64", max_isa: str | None = None) -> HostCPU:
    """A HostCPU from given flags: what the tests and the build's tables use for a CPU class."""
    return HostCPU(machine.lower(), None if flags is None else capped(frozenset(flags), max_isa))


@lru_cache(maxsize=None)
def host() -> HostCPU:
    """This machine, read once per process, with KILN_MAX_ISA applied."""
    return describe(read_flags(), platform.machine(), os.environ.get(MAX_ISA_ENV) or None)
