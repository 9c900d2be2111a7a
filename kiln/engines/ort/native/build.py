"""Compile kiln's ONNX Runtime custom-op library (MatMulQ4Min) into _build/ beside this file.

    python -m kiln.engines.ort.native.build          # scripts/setup.sh runs it; idempotent

g++ alone: the library declares the part of ONNX Runtime's C ABI it calls itself (ort_abi.h), so it
needs no ONNX Runtime headers (the onnxruntime wheel ships none). It is built for plain x86-64 and picks
its vector path at run time, so one build serves AVX-512, AVX2 and older CPUs. No compiler or a failed
compile leave no library: kiln then builds int4 without the kernel (MatMulNBits only) and says so;
nothing else needs it.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
SOURCES = ("q4min_kernel.cc", "q8_kernel.cc", "q8_int16_kernel.cc", "q4min_op.cc", "paged_attention.cc", "paged_attention_op.cc")
HEADERS = ("q4min_kernel.h", "ort_abi.h", "op_library.h", "paged_attention.h")
OUT_DIR = HERE / "_build"
LIBRARY = OUT_DIR / "libkiln_ort_ops.so"
STAMP = OUT_DIR / "sources.sha256"
FLAGS = ("-O3", "-std=c++17", "-fPIC", "-shared", "-fvisibility=hidden", "-Wall", "-Wextra")


def sources_hash() -> str:
    h = hashlib.sha256()
    for name in (*SOURCES, *HEADERS):
        h.update((HERE / name).read_bytes())
    h.update(" ".join(FLAGS).encode())
    return h.hexdigest()


def up_to_date() -> bool:
    return LIBRARY.is_file() and STAMP.is_file() and STAMP.read_text(encoding="utf-8").strip() == sources_hash()


def build(compiler: str | None = None, force: bool = False) -> tuple[Path | None, str]:
    """(the library or None, what happened)."""
    if up_to_date() and not force:
        return LIBRARY, f"{LIBRARY} is up to date"
    cxx = compiler or shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
    if cxx is None:
        return None, "no C++ compiler (g++) found: int4 builds use MatMulNBits only"
    OUT_DIR.mkdir(exist_ok=True)
    tmp = LIBRARY.with_suffix(".so.tmp")
    cmd = [cxx, *FLAGS, *(str(HERE / s) for s in SOURCES), "-o", str(tmp)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        tmp.unlink(missing_ok=True)
        return None, f"compiling the MatMulQ4Min library failed (int4 builds use MatMulNBits only):\n{done.stderr}"
    tmp.replace(LIBRARY)       # NOTE: atomic, so a loader never sees half a library
    STAMP.write_text(sources_hash() + "\n")
    return LIBRARY, f"built {LIBRARY}"


def main() -> int:
    library, message = build(force="--force" in sys.argv)
    print(message)
    return 0      # a machine without a compiler keeps today's path: not an install failure


if __name__ == "__main__":
    raise SystemExit(main())
